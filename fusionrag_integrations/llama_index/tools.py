"""Tool calling for `FusionRAGLLM`: LlamaIndex tools and tool messages in, tool calls out.

LlamaIndex's `FunctionCallingLLM` contract, which `FunctionAgent`, `predict_and_call` and
`FunctionCallingProgram` rely on, translated to the engine's OpenAI-shaped tool requests
(`fusionrag_core.query.tools`):

* **In.** `chat_kwargs` turns `chat_with_tools`' arguments into `chat` keyword arguments: the
  tools as OpenAI function-tool dicts, `tool_choice` ("required" when `tool_required`, else
  "auto", unless a choice is given) and `parallel_tool_calls`. `message_dict` turns each history
  message into an OpenAI-shaped dict: an assistant message's calls (`ToolCallBlock`s, or
  OpenAI-shaped `additional_kwargs["tool_calls"]`) become its `tool_calls`, a `tool` message keeps
  its `additional_kwargs["tool_call_id"]`.
* **Out.** The answer decodes under the tool grammar and its calls are parsed out of the text.
  `Reply` puts them where LlamaIndex's own integrations do: `ToolCallBlock`s after the text
  block, and OpenAI-shaped dicts in `message.additional_kwargs["tool_calls"]`. A call that does
  not parse (cut off by `max_new_tokens`) goes to `additional_kwargs["invalid_tool_calls"]` with
  its raw text and the reason; it never raises. `tool_selections` reads the calls back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.llms.llm import ToolSelection

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.tools import InvalidToolCall, ToolCall

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

TOOL_CALLS = "tool_calls"
"""`ChatMessage.additional_kwargs` key of an assistant message's calls (OpenAI-shaped dicts)."""
INVALID_TOOL_CALLS = "invalid_tool_calls"
"""`ChatMessage.additional_kwargs` key of the calls that did not parse: `{"id", "name", "text", "error"}`."""
TOOL_CALL_ID = "tool_call_id"
"""`ChatMessage.additional_kwargs` key of the call a `tool` message answers."""


def chat_kwargs(tools: Sequence[BaseTool], user_msg: str | ChatMessage | None,
                chat_history: Sequence[ChatMessage] | None, *, allow_parallel_tool_calls: bool,
                tool_required: bool, tool_choice: str | dict[str, Any] | None,
                kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`chat` keyword arguments for `chat_with_tools`: the messages, the tools and the tool choice.

    Args:
        tools: the tools the model may call.
        user_msg: appended to the history (a string is a user message).
        chat_history: the conversation so far (not modified).
        allow_parallel_tool_calls: several calls in one answer.
        tool_required: the answer must call a tool (when `tool_choice` is None).
        tool_choice: "auto", "required", "none", a tool's name or an OpenAI tool-choice dict;
            None: from `tool_required`.
        kwargs: other `chat` keyword arguments (per-call options), passed through.
    """
    messages = list(chat_history or [])
    if user_msg is not None:
        messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                        else user_msg)
    choice = tool_choice if tool_choice is not None else ("required" if tool_required else "auto")
    out: dict[str, Any] = {**kwargs, "messages": messages}
    if tools:
        # NOTE: OpenAI's 1024-character limit on descriptions is no limit of a local model's prompt.
        out.update(tools=[t.metadata.to_openai_tool(skip_length_check=True) for t in tools],
                   tool_choice=choice, parallel_tool_calls=allow_parallel_tool_calls)
    elif choice not in ("auto", "none"):
        out["tool_choice"] = choice  # NOTE: no tools to call: the request is refused, with the reason
    return out


# ---- messages in ------------------------------------------------------------------------------------
def message_dict(message: ChatMessage) -> dict[str, Any]:
    """A ChatMessage as the OpenAI-shaped dict the engine renders with the chat template.

    Text blocks are joined as `content`; an assistant message's calls (its `ToolCallBlock`s, else
    `additional_kwargs["tool_calls"]`) become `tool_calls`; a `tool` message keeps its
    `additional_kwargs["tool_call_id"]`. Its `invalid_tool_calls` are not shown back: no tool ran
    for them, so no result answers them.

    Raises:
        InvalidRequestError: a block that is neither text nor a tool call (images, audio...), or
            a call that is not OpenAI-shaped.
    """
    others = sorted({type(b).__name__ for b in message.blocks if not isinstance(b, TextBlock | ToolCallBlock)})
    if others:
        raise InvalidRequestError(
            f"a {message.role.value} message holds {', '.join(others)} blocks; FusionRAGLLM is text-only: "
            "send text content (and tool calls)"
        )
    out: dict[str, Any] = {"role": message.role.value, "content": message.content or ""}
    calls = _message_calls(message)
    if calls:
        out[TOOL_CALLS] = calls
    call_id = message.additional_kwargs.get(TOOL_CALL_ID)
    if message.role == MessageRole.TOOL and call_id is not None:
        out[TOOL_CALL_ID] = str(call_id)
    return out


def _message_calls(message: ChatMessage) -> list[dict[str, Any]]:
    """The message's calls as OpenAI dicts: its ToolCallBlocks (LlamaIndex 0.14's place), else
    `additional_kwargs["tool_calls"]` (older integrations'; OpenAI's objects or dicts)."""
    blocks = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
    if blocks:
        return [_openai_call(b.tool_call_id or "", b.tool_name, b.tool_kwargs) for b in blocks]
    calls = message.additional_kwargs.get(TOOL_CALLS) or []
    return [_call_dict(c) for c in calls]


def _call_dict(call: Any) -> dict[str, Any]:
    """One OpenAI-shaped call (a dict, or an object such as openai's `ChatCompletionMessageToolCall`)."""
    value = call.model_dump() if hasattr(call, "model_dump") else call
    function = value.get("function") if isinstance(value, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(
            f"a tool call in additional_kwargs['tool_calls'] is not OpenAI-shaped: {call!r}; pass "
            "{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': <JSON string>}}"
        )
    return _openai_call(str(value.get("id") or ""), function["name"], function.get("arguments") or {})


def _openai_call(call_id: str, name: str, arguments: Mapping[str, Any] | str) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(dict(arguments), ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def quoted(retrieved: Sequence[str], messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The `retrieved` texts that occur verbatim in the messages' content.

    NOTE: in a tool loop, the texts retrieved under the agent's run are every node a tool's
    retriever read so far. A tool may return them (RetrieverTool: learnable where they occur), or
    an answer made from them (QueryEngineTool: its own LLM call reused them); the latter are not
    this prompt's documents, and the no-reuse warning would blame the prompt for changing them.
    """
    contents = [str(m.get("content") or "") for m in messages]
    return [t for t in retrieved if any(t in c for c in contents)]


# ---- calls out --------------------------------------------------------------------------------------
class Reply:
    """One answer's text and calls as they arrive (one per request: it holds state)."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[ToolCall] = []
        self.invalid: list[InvalidToolCall] = []

    def add(self, piece: str | ToolCall | InvalidToolCall) -> str:
        """Take one piece of `split_calls`' stream; returns the new text (a call adds none)."""
        if isinstance(piece, ToolCall):
            self.calls.append(piece)
        elif isinstance(piece, InvalidToolCall):
            self.invalid.append(piece)
        else:
            self.text += piece
            return piece
        return ""

    def message(self) -> ChatMessage:
        """The assistant message so far: the text block, then a ToolCallBlock per call; the calls
        also as OpenAI dicts in `additional_kwargs["tool_calls"]`, the invalid ones in
        `additional_kwargs["invalid_tool_calls"]`."""
        blocks: list[Any] = [TextBlock(text=self.text)]
        blocks += [ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=dict(c.arguments))
                   for c in self.calls]
        extra: dict[str, Any] = {}
        if self.calls:
            extra[TOOL_CALLS] = [c.openai() for c in self.calls]
        if self.invalid:
            extra[INVALID_TOOL_CALLS] = [{"id": c.id, "name": c.name, "text": c.text, "error": c.error}
                                         for c in self.invalid]
        return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)


def tool_selections(response: ChatResponse, error_on_no_tool_call: bool = True) -> list[ToolSelection]:
    """The calls of `response`'s message as ToolSelections (its ToolCallBlocks, else its
    `additional_kwargs["tool_calls"]`).

    Raises:
        InvalidRequestError: no call, and `error_on_no_tool_call` (the message names the calls
            that did not parse, if any). It is a ValueError, as LlamaIndex's integrations raise.
    """
    calls = [c for c in _message_calls(response.message) if c["function"]["name"]]
    if not calls and error_on_no_tool_call:
        invalid = response.message.additional_kwargs.get(INVALID_TOOL_CALLS) or []
        why = "; ".join(f"{c.get('text')!r}: {c.get('error')}" for c in invalid)
        raise InvalidRequestError(
            "expected at least one tool call, but the answer made none"
            + (f" that parsed ({why}); raise max_new_tokens if it was cut off" if why else
               "; pass tool_required=True (or tool_choice=<tool name>) to force one"))
    return [ToolSelection(tool_id=c["id"], tool_name=c["function"]["name"], tool_kwargs=_arguments(c))
            for c in calls]


def _arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    arguments = call["function"]["arguments"]
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"the arguments of call {call['function']['name']!r} are not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidRequestError(f"the arguments of call {call['function']['name']!r} must be a JSON object")
    return value


__all__ = ["INVALID_TOOL_CALLS", "TOOL_CALLS", "TOOL_CALL_ID", "Reply", "chat_kwargs", "message_dict", "quoted",
           "tool_selections"]
