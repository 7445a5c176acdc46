"""The Responses API's wire format (`POST /v1/responses`): its request in, translated to the chat
path's values; its `response` object and output items out.

A Responses request becomes what a chat request becomes: OpenAI-shaped chat messages, a
`ToolRequest`, a `response_format` and sampling values; the engine path is the chat one
(`responses.py`). What the Responses API has and this server does not do (image or file input,
reasoning, background runs, `truncation: "auto"`, ...) is a 400 naming the field; nothing is
dropped. Shapes follow the `openai` package's `openai.types.responses`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from fusionrag_core.engine import Generation
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.tools import InvalidToolCall, ToolCall
from fusionrag_integrations.response_format import json_schema_format

FILE_SEARCH = "file_search"
"""The hosted tool's name, also the name of the function the model calls to search."""
FILE_SEARCH_RESULTS = "file_search_call.results"
"""The `include` value that asks for a file_search_call's results (always sent here)."""
_INCLUDABLE = {FILE_SEARCH_RESULTS, "message.output_text.logprobs"}
_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}


def new_id(prefix: str) -> str:
    """A fresh id in OpenAI's style (`resp_...`, `msg_...`, `fc_...`, `fs_...`, `call_...`)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class FileSearchSpec(BaseModel):
    """A `{"type": "file_search"}` tool: which vector stores, how many results."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["file_search"]
    vector_store_ids: list[str] = Field(min_length=1)
    max_num_results: int = Field(default=10, ge=1, le=50)
    filters: dict[str, Any] | None = None
    ranking_options: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Raises InvalidRequestError for search options this server does not do."""
        if self.filters is not None:
            raise InvalidRequestError("tools[].filters is not supported for file_search: every chunk of the vector "
                                      "stores is searched; drop filters")
        ranking = {k: v for k, v in (self.ranking_options or {}).items() if v is not None}
        if set(ranking) - {"ranker", "score_threshold"} or ranking.get("ranker", "auto") != "auto":
            raise InvalidRequestError("tools[].ranking_options supports only score_threshold (and ranker 'auto'): "
                                      "the ranking is the embedding's cosine similarity")


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    user: str | None = None
    """Accepted as OpenAI does: an end-user id for the caller's records; it changes no answer."""
    truncation: Literal["disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    """Accepted: this server keys its prompt cache by the prompt's tokens, so any key is the same."""

    @field_validator(*_RANGES)
    @classmethod
    def _in_range(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is None:
            return None
        low, high = _RANGES[info.field_name or ""]
        if not low <= value <= high or (info.field_name == "top_p" and value == 0):
            raise ValueError(f"must be a number in {'(' if info.field_name == 'top_p' else '['}{low:g}, {high:g}], "
                             f"got {value}")
        return value

    def check_supported(self) -> None:
        """Refuse what is set but not done here.

        Raises:
            InvalidRequestError: reasoning, background, logprobs, an `include` or `service_tier`
                this server has no such thing for.
        """
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise InvalidRequestError("reasoning is not supported: this model does not reason before it answers; "
                                      "drop reasoning")
        if self.background:
            raise InvalidRequestError("background=true is not supported: responses run while the request waits")
        if self.top_logprobs:
            raise InvalidRequestError("top_logprobs is not supported by /v1/responses")
        unknown = sorted(set(self.include or ()) - _INCLUDABLE)
        if unknown:
            raise InvalidRequestError(f"include {unknown} is not supported; this server can include "
                                      f"{sorted(_INCLUDABLE)}")
        if "message.output_text.logprobs" in (self.include or ()):
            raise InvalidRequestError("include 'message.output_text.logprobs' is not supported by /v1/responses")
        if self.service_tier not in (None, "auto", "default"):
            raise InvalidRequestError(f"service_tier {self.service_tier!r} is not supported; use 'auto' or 'default'")

    def sampling_values(self, default_max_tokens: int) -> dict[str, Any]:
        """The request's sampling as `RequestOptions.from_values` values."""
        values: dict[str, Any] = {"max_new_tokens": self.max_output_tokens or default_max_tokens,
                                  "temperature": 1.0 if self.temperature is None else self.temperature}
        if self.top_p is not None:
            values["top_p"] = self.top_p
        return values

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as a chat `response_format` (None for plain text).

        Raises:
            InvalidRequestError: a format or `text` field this server does not do.
        """
        text = dict(self.text or {})
        unknown = sorted(set(text) - {"format", "verbosity"})
        if unknown:
            raise InvalidRequestError(f"text has unsupported field(s) {unknown}; use text.format")
        if text.get("verbosity") not in (None, "medium"):
            raise InvalidRequestError("text.verbosity is not supported (only 'medium'): the answer's length is "
                                      "max_output_tokens'")
        fmt = text.get("format") or {"type": "text"}
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
            strict = fmt.get("strict")
            if strict not in (None, True, False):
                raise InvalidRequestError(f"text.format.strict must be a boolean, got {strict!r}")
            return json_schema_format({"title": fmt.get("name", "output"), **fmt["schema"]}, strict=strict)
        raise InvalidRequestError(f"unsupported text.format {fmt!r}; use {{'type': 'text'}}, {{'type': 'json_object'}} "
                                  "or {'type': 'json_schema', 'name': ..., 'schema': <JSON schema>}")

    def split_tools(self) -> tuple[list[dict[str, Any]], FileSearchSpec | None]:
        """The function tools in chat shape, and the file_search tool (None if not bound).

        Raises:
            InvalidRequestError: a hosted tool other than file_search, two file_search tools, or a
                malformed function tool.
        """
        functions: list[dict[str, Any]] = []
        search: FileSearchSpec | None = None
        for i, tool in enumerate(self.tools or ()):
            kind = tool.get("type")
            if kind == "function":
                functions.append(_chat_tool(i, tool))
            elif kind == FILE_SEARCH:
                if search is not None:
                    raise InvalidRequestError("bind one file_search tool (it searches all its vector_store_ids)")
                search = FileSearchSpec.model_validate(tool)
                search.check_supported()
            else:
                raise InvalidRequestError(f"tools[{i}].type {kind!r} is not supported; this server runs 'function' "
                                          "tools (the client's) and 'file_search' (over its vector stores)")
        if search is not None and any(f["function"]["name"] == FILE_SEARCH for f in functions):
            raise InvalidRequestError(f"a function tool may not be named {FILE_SEARCH!r} beside the file_search tool")
        return functions, search

    def chat_tool_choice(self) -> tuple[str | dict[str, Any] | None, bool]:
        """`tool_choice` in chat shape, and whether it forces the file search.

        Raises:
            InvalidRequestError: a choice this server does not do (allowed_tools, a hosted tool but
                file_search, ...).
        """
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice, False
        kind = choice.get("type")
        if kind == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}, False
        if kind == FILE_SEARCH:
            return "none", True
        raise InvalidRequestError(f"unsupported tool_choice {choice!r}; use 'auto', 'none', 'required', "
                                  "{'type': 'function', 'name': ...} or {'type': 'file_search'}")

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as OpenAI-shaped chat messages (what the chat path takes).

        Raises:
            InvalidRequestError: an item this server cannot read (image or file input, an item
                reference, reasoning), or a malformed one; the message names it.
        """
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            if not isinstance(item, dict):
                raise InvalidRequestError(f"input[{i}] must be an object (a message or an item)")
            _add_item(messages, i, item)
        if not messages:
            raise InvalidRequestError("input is empty: send a string or at least one message")
        return messages


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool (`{"type", "name", "description", "parameters", "strict"}`) in chat shape.

    NOTE: `strict` is honoured whatever its value: a call is decoded under its schema's grammar.
    """
    unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise InvalidRequestError(f"tools[{i}] has unsupported field(s) {unknown}")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidRequestError(f"tools[{i}].name must be the function's name (a non-empty string)")
    function = {"name": tool["name"], "description": tool.get("description") or "",
                "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    return {"type": "function", "function": function}


_INPUT_ROLES = {"user", "system", "developer", "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text", "refusal"}


def _add_item(messages: list[dict[str, Any]], i: int, item: dict[str, Any]) -> None:
    """Append `input[i]` to `messages` as chat messages."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _INPUT_ROLES:
            raise InvalidRequestError(f"input[{i}].role {role!r} is not one of {sorted(_INPUT_ROLES)}")
        messages.append({"role": "system" if role == "developer" else role, "content": _text(i, item.get("content"))})
    elif kind == "function_call":
        call = {"id": _string(i, item, "call_id"), "type": "function",
                "function": {"name": _string(i, item, "name"), "arguments": _string(i, item, "arguments")}}
        _assistant_calls(messages).append(call)
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text(i, output)
        messages.append({"role": "tool", "tool_call_id": _string(i, item, "call_id"), "content": text})
    elif kind == "file_search_call":
        call_id = str(item.get("id") or new_id("fs"))
        arguments = {"query": " ".join(str(q) for q in item.get("queries") or ())}
        _assistant_calls(messages).append({"id": call_id, "type": "function", "function": {
            "name": FILE_SEARCH, "arguments": json.dumps(arguments, ensure_ascii=False)}})
        results = [r for r in item.get("results") or () if isinstance(r, dict)]
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": "\n\n".join(str(r.get("text") or "") for r in results)})
    else:
        raise InvalidRequestError(f"input[{i}].type {kind!r} is not supported; send messages, function_call, "
                                  "function_call_output or file_search_call items (this model reads text only)")


def _assistant_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool calls of the assistant message that ends `messages` (one is opened if needed)."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    calls: list[dict[str, Any]] = messages[-1].setdefault("tool_calls", [])
    return calls


def _string(i: int, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise InvalidRequestError(f"input[{i}].{key} must be a non-empty string, got {value!r}")
    return value


def _text(i: int, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS for p in content):
        return "".join(str(p.get("text", p.get("refusal", ""))) for p in content)
    raise InvalidRequestError(f"input[{i}].content must be text (a string or input_text parts); this model reads "
                              "text only: image and file inputs are not supported")


# ---- the response ---------------------------------------------------------------------------------------
def usage(generation: Generation | None, earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Responses API's usage of a generation (plus `earlier`, a first pass's usage, when the
    response took two: a file search the model called, then its answer)."""
    if generation is None:
        return dict(earlier or {})
    before = earlier or {"input_tokens": 0, "output_tokens": 0, "input_tokens_details": {"cached_tokens": 0}}
    inputs = generation.prompt_tokens + int(before["input_tokens"])
    outputs = len(generation.token_ids) + int(before["output_tokens"])
    cached = (generation.reused_tokens + generation.prefix_cached_tokens
              + int(before["input_tokens_details"]["cached_tokens"]))
    return {"input_tokens": inputs, "output_tokens": outputs, "total_tokens": inputs + outputs,
            "input_tokens_details": {"cached_tokens": cached}, "output_tokens_details": {"reasoning_tokens": 0}}


def message_item(text: str, annotations: list[dict[str, Any]], status: str = "completed",
                 item_id: str | None = None) -> dict[str, Any]:
    """An assistant `message` output item holding one `output_text` part."""
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [output_text(text, annotations)]}


def output_text(text: str, annotations: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": annotations, "logprobs": []}


def function_call_item(call: ToolCall | InvalidToolCall) -> dict[str, Any]:
    """A `function_call` output item (a call cut off by max_output_tokens: its arguments as written,
    status "incomplete")."""
    function = call.openai()["function"]
    return {"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": function["name"],
            "arguments": function["arguments"],
            "status": "completed" if isinstance(call, ToolCall) else "incomplete"}


def file_search_item(item_id: str, queries: list[str], results: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "file_search_call", "id": item_id, "status": "completed", "queries": queries,
            "results": results}


def response_object(body: ResponsesRequest, response_id: str, created: int, model: str, status: str,
                    output: list[dict[str, Any]], usage_: dict[str, Any] | None,
                    incomplete: str | None = None) -> dict[str, Any]:
    """The `response` object (what create, retrieve and the stream's lifecycle events carry)."""
    return {
        "id": response_id, "object": "response", "created_at": created,
        "completed_at": now() if status in ("completed", "incomplete") else None, "status": status, "model": model,
        "output": output, "instructions": body.instructions, "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": bool(body.parallel_tool_calls),
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "top_logprobs": 0, "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
        "previous_response_id": body.previous_response_id, "store": body.store, "background": False,
        "service_tier": "default", "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled",
        "metadata": body.metadata or {}, "usage": usage_, "error": None, "user": body.user,
        "safety_identifier": None, "prompt_cache_key": body.prompt_cache_key,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "reasoning": {"effort": None, "summary": None},
    }


def now() -> int:
    return int(time.time())


__all__ = ["FILE_SEARCH", "FileSearchSpec", "ResponsesRequest", "file_search_item", "function_call_item",
           "message_item", "new_id", "now", "output_text", "response_object", "usage"]
