"""The OpenAI wire format: request bodies in (validated, nothing ignored), response bodies out.

A request field we do not honour is an error that names it (`extra="forbid"`, and the checks in
`check_supported`); a field we honour becomes a `RequestOptions` value. Responses follow OpenAI's
shapes (`chat.completion`, `chat.completion.chunk`, `text_completion`), with `usage` counting the
prompt tokens served from a cache as `prompt_tokens_details.cached_tokens` and FusionRAG's own
statistics under `fusionrag`.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from fusionrag_core.engine import Generation
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.logprobs import MAX_TOP_LOGPROBS
from fusionrag_core.query.tools import InvalidToolCall, ToolCall
from fusionrag_integrations.request import generation_stats


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


_RANGES = {"temperature": (0.0, 2.0, "[]"), "top_p": (0.0, 1.0, "(]"), "frequency_penalty": (-2.0, 2.0, "[]"),
           "presence_penalty": (-2.0, 2.0, "[]"), "min_p": (0.0, 1.0, "[]"), "repetition_penalty": (0.0, 2.0, "(]")}
"""OpenAI's range of each sampling number (vLLM's for its extra fields `min_p` and `repetition_penalty`):
low, high, and whether each end is in it ("[" in, "(" out).
NOTE: top_p 0 would be greedy; here it is refused (the core's `SamplingConfig` takes (0, 1])."""
MAX_CHOICES = 128
"""Most choices (`n`) one request may ask for: OpenAI's limit (the engine's `max_running` may be lower)."""
MAX_COMPLETION_LOGPROBS = 5
"""Most alternatives per token `/v1/completions` reports (`logprobs`): OpenAI's limit."""


class _Request(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    """Choices: one prompt prepared once and decoded n times (the engine's `max_running` at most)."""
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: str | None = None
    """Accepted as OpenAI does: an end-user id for the caller's own records; it changes no answer."""
    top_k: int | None = None
    """vLLM's extra field: sample among the k most likely tokens (-1 or 0: all)."""
    min_p: float | None = None
    """vLLM's extra field: drop tokens below min_p x the most likely token's probability."""
    repetition_penalty: float | None = None
    """vLLM's extra field: CTRL's penalty on tokens already in the prompt or the answer (1: off)."""

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError(f"must be -1 or 0 (all tokens) or a positive number of tokens, got {value}")
        return value
    cache_salt: str | None = None
    """vLLM's field: requests share caches only with requests of the same tenant and salt."""

    @field_validator(*_RANGES)
    @classmethod
    def _in_range(cls, value: float | None, info: ValidationInfo) -> float | None:
        """Each sampling number in OpenAI's range (NaN fails every comparison, so it is refused too)."""
        if value is None:
            return None
        low, high, bounds = _RANGES[info.field_name or ""]
        above_low = low < value if bounds[0] == "(" else low <= value
        if not (above_low and value <= high):
            raise ValueError(f"must be a number in {bounds[0]}{low:g}, {high:g}{bounds[1]}, got {value}")
        return value

    def check_supported(self) -> None:
        """Refuse what is set but not done here.

        Raises:
            InvalidRequestError: OpenAI's penalties (vLLM's `repetition_penalty` is done).
        """
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise InvalidRequestError(f"{name} is not supported (only 0); use repetition_penalty (vLLM's "
                                          "extra field, > 1 penalises tokens already in the prompt or the answer)")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream=true")

    def sampling_values(self, default_max_tokens: int) -> dict[str, Any]:
        """The request's sampling as `RequestOptions.from_values` values."""
        values: dict[str, Any] = {"max_new_tokens": self.budget() or default_max_tokens,
                                  "temperature": 1.0 if self.temperature is None else self.temperature}
        if self.top_p is not None:
            values["top_p"] = self.top_p
        if self.seed is not None:
            values["seed"] = self.seed
        if self.stop is not None:
            values["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.top_k is not None:
            values["top_k"] = max(self.top_k, 0)  # NOTE: vLLM's -1 (all tokens) is the core's 0
        for name in ("min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return {**values, **self.logprob_values()}

    def logprob_values(self) -> dict[str, Any]:
        """The request's logprobs settings as `SamplingConfig` values (`logprobs`, `top_logprobs`)."""
        return {}

    def budget(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_Request):
    """`POST /v1/chat/completions`."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def parallel_calls(self) -> bool | None:
        """`parallel_tool_calls`, defaulting as OpenAI's does: several calls may follow one another
        when tools are bound and the request does not say, except under a `tool_choice` naming one
        function, which forces one call of it (as OpenAI answers it); None without tools. A value
        the request gives is always honoured."""
        if self.parallel_tool_calls is None and self.tools:
            return not isinstance(self.tool_choice, dict)
        return self.parallel_tool_calls

    def logprob_values(self) -> dict[str, Any]:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true: set logprobs too, or drop top_logprobs")
        return {"logprobs": bool(self.logprobs), "top_logprobs": self.top_logprobs or 0}

    def budget(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidRequestError("pass max_tokens or max_completion_tokens, not both")
        return self.max_completion_tokens or self.max_tokens

    def response_format_value(self) -> dict[str, Any] | None:
        """`response_format`, with `{"type": "text"}` (OpenAI's default) as None."""
        if self.response_format is not None and self.response_format.get("type") == "text":
            return None
        return self.response_format

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as the engine takes them (OpenAI-shaped, text content only).

        Raises:
            InvalidRequestError: an unknown role, non-text content, or a malformed message.
        """
        messages = [_chat_message(i, m) for i, m in enumerate(self.messages)]
        return [_named(i, m, self.messages[i].get("name"), messages[:i]) for i, m in enumerate(messages)]


class CompletionRequest(_Request):
    """`POST /v1/completions`: a raw text prompt, continued (no chat template)."""

    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequestError("echo is not supported: the prompt is never repeated in the answer")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported (no fill-in-the-middle)")
        if self.best_of not in (None, 1):
            raise InvalidRequestError(f"best_of={self.best_of} is not supported (1 only)")

    def logprob_values(self) -> dict[str, Any]:
        """Completions' `logprobs` is a count: the sampled token's logprob and that many alternatives."""
        return {"logprobs": self.logprobs is not None, "top_logprobs": self.logprobs or 0}

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise InvalidRequestError(f"a prompt list must hold one prompt, got {len(self.prompt)}; send one "
                                          "request per prompt")
            return self.prompt[0]
        return self.prompt


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}


def _chat_message(i: int, message: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(message) - _MESSAGE_KEYS)
    if unknown:
        raise InvalidRequestError(f"messages[{i}] has unsupported field(s) {unknown}")
    role = _ROLES.get(str(message.get("role")))
    if role is None:
        raise InvalidRequestError(f"messages[{i}].role {message.get('role')!r} is not one of {sorted(_ROLES)}")
    out: dict[str, Any] = {"role": role, "content": _text(i, message.get("content"))}
    if message.get("tool_calls"):
        if role != "assistant":
            raise InvalidRequestError(f"messages[{i}]: only assistant messages carry tool_calls")
        out["tool_calls"] = message["tool_calls"]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequestError(f"messages[{i}].tool_call_id must be the id of the call this tool message "
                                      f"answers (a non-empty string), got {call_id!r}")
        out["tool_call_id"] = call_id
    return out


_NAME = re.compile(r"[^\s<|\\/>]{1,64}")
"""A participant's name as OpenAI takes it: no whitespace and none of `<|\\/>` (so no special-token
string can be written in one), at most 64 characters."""


def _named(i: int, message: dict[str, Any], name: Any, earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """`message` with its participant's `name` honoured: written before a system, user or assistant
    message's text as `name: text` (escaped like any text, so never a control token; chat templates
    drop a `name` field); a tool message's must name the function of the call it answers.

    Raises:
        InvalidRequestError: a name that is not a string of OpenAI's pattern, one with nothing to
            be shown with, or a tool message's name that is not its call's function.
    """
    if name is None:
        return message
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(f"messages[{i}].name {name!r} is not a valid name: use 1-64 characters with no "
                                  "whitespace and none of < | \\ / >")
    if message["role"] == "tool":
        called = {c.get("id"): c.get("function", {}).get("name") for m in earlier for c in m.get("tool_calls") or ()
                  if isinstance(c, dict)}
        if called.get(message["tool_call_id"]) != name:
            raise InvalidRequestError(
                f"messages[{i}].name {name!r} is not the function of the call it answers ({message['tool_call_id']!r}"
                f" calls {called.get(message['tool_call_id'])!r}): send the called function's name, or no name")
        return message
    if not message["content"]:
        raise InvalidRequestError(f"messages[{i}].name {name!r} is given on a message with no text: the name is "
                                  "shown before the text ('name: text'); drop the name or add the text")
    return {**message, "content": f"{name}: {message['content']}"}


def _text(i: int, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise InvalidRequestError(f"messages[{i}].content must be text (a string or text parts); this model reads "
                              "text only")


# ---- responses --------------------------------------------------------------------------------------
def usage(generations: Sequence[Generation]) -> dict[str, Any]:
    """OpenAI's usage of a request's choices (their one prompt counted once, every choice's tokens
    generated), with the prompt tokens served from a cache (reused chunk tokens and the prefix cache)
    as `prompt_tokens_details.cached_tokens`."""
    prompt = generations[0]
    completion = sum(len(g.token_ids) for g in generations)
    return {"prompt_tokens": prompt.prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": prompt.reused_tokens + prompt.prefix_cached_tokens}}


def fusionrag_stats(generation: Generation, invalid: list[InvalidToolCall]) -> dict[str, Any]:
    """FusionRAG's statistics of a generation (JSON only), and the tool calls that did not parse."""
    stats = generation_stats(generation)
    stats["invalid_tool_calls"] = [{"text": c.text, "error": c.error, "name": c.name} for c in invalid]
    return stats


def tool_call_dict(call: ToolCall | InvalidToolCall, index: int | None = None) -> dict[str, Any]:
    """A call in OpenAI's shape (arguments as a JSON string; a call that did not parse, e.g. cut off
    by max_tokens, with its arguments as written); with `index` for a stream's delta."""
    return call.openai() if index is None else {"index": index, **call.openai()}


def finish_reason(generation: Generation, calls: list[ToolCall],
                  invalid: list[InvalidToolCall] | None = None) -> Literal["stop", "length", "tool_calls"]:
    """"length" when max_tokens ended the answer in a call (as OpenAI reports it), "tool_calls"
    when it holds calls, else the generation's own."""
    if invalid and generation.finish_reason == "length":
        return "length"
    if calls or invalid:
        return "tool_calls"
    return generation.finish_reason


class Envelope:
    """The id, creation time and model name every chunk of one response repeats."""

    def __init__(self, prefix: str, model: str) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def wrap(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


__all__ = ["ChatCompletionRequest", "CompletionRequest", "Envelope", "finish_reason", "fusionrag_stats", "sse",
           "tool_call_dict", "usage"]
