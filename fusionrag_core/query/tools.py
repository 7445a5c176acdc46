"""Tool calling: tools shown to the model, calls decoded under a grammar, calls parsed back out.

A request may bind tools (OpenAI function-tool dicts). Three things follow, all here:

* **Prompting.** A chat template that renders `tools` itself (it reads the `tools` variable, as
  Qwen 2.5, Llama 3.1 or Hermes templates do) gets them that way, with assistant tool calls and
  tool results in the shape Hugging Face templates expect; the model's call syntax is read off
  the template by rendering one sentinel call (`ToolCallFormat.from_template`). Any other
  template (SmolLM2's, or none) gets `FALLBACK_FORMAT`: the tool list in the system message,
  calls as `<tool_call>` JSON blocks, results as `<tool_response>` blocks in a user turn.
* **Decoding.** `ToolCallFormat.grammar` is an llguidance grammar: under "auto" the answer is
  free text, or text up to the call opener and then calls whose arguments satisfy their tool's
  JSON schema; "required" or a tool's name forces calls; "none" forbids them.
* **Parsing.** `ToolCallFormat.parse` (whole text) and `ToolCallSplitter` (streamed pieces) split
  the answer into text and calls; a call that is not valid JSON of a bound tool is an
  `InvalidToolCall` carrying its raw text, never an exception.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jinja2
import jinja2.meta
from transformers import PreTrainedTokenizerBase

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.constrained import Grammar, closed_objects

logger = logging.getLogger(__name__)

_Piece = TypeVar("_Piece")

TOOL_CHOICES = ("auto", "required", "none")
"""Tool choices besides a tool's name: the model decides; it must call; it must not."""
DEFAULT_STRING_CHARS = 200
"""The longest string argument a call may hold where its tool's schema sets no `maxLength`
(`EngineConfig.tool_string_chars`): a small model that repeats itself inside a free-text argument
is made to close it there, and its call with it. 200, so that a call of one such argument closes
within 256 tokens even at one token per character (a repeated "_2023" is; 300 ran past 256)."""


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call.

    Attributes:
        name: the function's name (letters, digits, `_`, `-`, `.`; at most 64 characters).
        description: what it does, shown to the model.
        parameters: JSON schema of its arguments object.
    """

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", self.name or ""):
            raise InvalidRequestError(
                f"tool name {self.name!r} is not valid: use 1-64 letters, digits, '_', '-' or '.'")
        if not isinstance(self.parameters, Mapping):
            raise InvalidRequestError(f"tool {self.name!r}: parameters must be a JSON schema object (a dict)")

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> ToolSpec:
        """A tool from OpenAI's `{"type": "function", "function": {"name", "description", "parameters"}}`.

        Raises:
            InvalidRequestError: another shape (the message says which is expected).
        """
        function = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(
                f"not a function tool: {dict(tool)!r}; pass {{'type': 'function', 'function': {{'name': ..., "
                "'description': ..., 'parameters': <JSON schema>}}}")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        return cls(function["name"], str(function.get("description") or ""), parameters)

    def openai(self) -> dict[str, Any]:
        """This tool as an OpenAI function-tool dict (what chat templates read as `tools`)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: a bound tool's name and arguments valid under its schema's grammar."""

    name: str
    arguments: dict[str, Any]
    id: str
    text: str
    """The call as the model wrote it."""

    def openai(self) -> dict[str, Any]:
        """This call in OpenAI's shape: `{"id", "type": "function", "function": {"name", "arguments": <JSON>}}`."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass(frozen=True)
class InvalidToolCall:
    """A call that could not be parsed (e.g. `max_tokens` cut it): its raw text and why."""

    text: str
    error: str
    id: str
    name: str | None = None
    arguments: str = ""
    """The arguments as far as the model wrote them (JSON text, cut off where the call was)."""

    def openai(self) -> dict[str, Any]:
        """This call in OpenAI's shape, as OpenAI reports a call cut off by `max_tokens`: the name
        ("" when it was cut before it) and the arguments as written (they do not parse)."""
        function = {"name": self.name or "", "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """The tools one request binds, and whether and which it must call.

    Attributes:
        tools: the functions, in order; names unique.
        choice: "auto" (text or calls), "required" (at least one call), "none" (text only), or
            a tool's name (calls of that tool only).
        parallel: whether several calls may follow one another in one answer (default: one call
            at most; a small model otherwise tends to repeat its call until `max_tokens`).

    Raises:
        InvalidRequestError: no tools, a duplicate name, or a choice that is no tool's name.
    """

    tools: tuple[ToolSpec, ...]
    choice: str = "auto"
    parallel: bool = False

    def __post_init__(self) -> None:
        names = [t.name for t in self.tools]
        if not names:
            raise InvalidRequestError("no tools to bind: pass at least one tool")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise InvalidRequestError(f"different tools share the name(s) {duplicates}: rename one of each")
        if self.choice not in TOOL_CHOICES and self.choice not in names:
            raise InvalidRequestError(
                f"tool_choice {self.choice!r} is neither one of {list(TOOL_CHOICES)} nor a bound tool ({names})")
        for tool in self.tools:
            _check_schema(tool)  # NOTE: here, so a schema the grammar cannot express fails when bound

    def called(self) -> tuple[ToolSpec, ...]:
        """The tools the answer may call (all, or the one named by `choice`; none for "none")."""
        if self.choice == "none":
            return ()
        return tuple(t for t in self.tools if self.choice in ("auto", "required") or t.name == self.choice)

    def openai(self) -> list[dict[str, Any]]:
        """The tools as OpenAI dicts, for a chat template's `tools`."""
        return [t.openai() for t in self.tools]


@dataclass(frozen=True)
class ParsedAnswer:
    """An answer split into its text and its calls."""

    text: str
    calls: tuple[ToolCall, ...] = ()
    invalid: tuple[InvalidToolCall, ...] = ()


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes a call: `opener` + JSON object + `closer`, several joined by `separator`.

    The JSON object holds the tool's name under `name_key` and its arguments object under
    `arguments_key` (`{"name": ..., "arguments": {...}}` for Hermes / Qwen templates).
    """

    opener: str = "<tool_call>\n"
    closer: str = "\n</tool_call>"
    separator: str = "\n"
    name_key: str = "name"
    arguments_key: str = "arguments"

    @property
    def trigger(self) -> str:
        """The opener without surrounding whitespace: the text that starts a call."""
        return self.opener.strip()

    def render(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call as the model writes it."""
        body = json.dumps({self.name_key: name, self.arguments_key: dict(arguments)}, ensure_ascii=False)
        return f"{self.opener}{body}{self.closer}"

    @classmethod
    def from_template(cls, tokenizer: PreTrainedTokenizerBase) -> ToolCallFormat | None:
        """The call syntax a tool-aware chat template renders, read off one sentinel call (None: unreadable)."""
        return _format_from_template(tokenizer)

    # ---- decoding --------------------------------------------------------------------------------
    def grammar(self, request: ToolRequest, max_string_chars: int = DEFAULT_STRING_CHARS) -> Grammar:
        """The llguidance grammar of an answer to `request` (see the module docstring).

        Args:
            request: the tools and the choice.
            max_string_chars: the `maxLength` of every string a tool's schema types "string" and
                leaves unbounded (raised to its `minLength` where that is more).

        Raises:
            InvalidRequestError: a tool's schema the grammar cannot express (named with the construct).
        """
        trigger = self.trigger
        rest = self.opener.lstrip()[len(trigger):]  # NOTE: what follows the trigger in the opener (a newline)
        text = f"TEXT: /(?s:.*)/ & ~/(?s:.*{_regex(trigger)}.*)/" if trigger else "TEXT: /(?s:([^{].*)?)/"
        more = f' ({_literal(self.separator)} call)*' if request.parallel else ""
        lines = ["%llguidance {}"]
        if request.choice == "none":
            lines.append("start: TEXT")
        elif request.choice == "auto" and trigger:
            lines += [f"start: TEXT | trig body{more}", f"trig[lazy]: ANY {_literal(trigger)}", "ANY: /(?s:.*)/"]
        elif request.choice == "auto":
            lines.append(f"start: TEXT | call{more}")
        else:
            lines.append(f"start: call{more}")
        schema = self._call_schema(request.called(), max_string_chars) if request.choice != "none" else None
        if schema is not None:
            lines += [f"call: {_literal(self.opener)} %json {json.dumps(schema)} {_literal(self.closer)}",
                      f"body: {_literal(rest)} %json {json.dumps(schema)} {_literal(self.closer)}"]
        lines.append(text)
        names = ", ".join(t.name for t in request.called()) or "no tool"
        return Grammar.lark("\n".join(lines) + "\n", f"an answer or calls of {names}")

    def _call_schema(self, tools: Sequence[ToolSpec], max_string_chars: int) -> dict[str, Any]:
        # NOTE: a tool's `$ref`s point into its own arguments schema (`#`, `#/$defs/...`): rebased to
        # where that schema sits in the call's
        at = f"properties/{_pointer_part(self.arguments_key)}"
        bases = [f"#/{at}"] if len(tools) == 1 else [f"#/anyOf/{k}/{at}" for k in range(len(tools))]
        arguments = [_rebased(_bounded(_arguments_schema(t), max_string_chars), base) for t, base in zip(tools, bases,
                                                                                                         strict=True)]
        options = [{
            "type": "object",
            "properties": {self.name_key: {"const": t.name}, self.arguments_key: args},
            "required": [self.name_key, self.arguments_key],
            "additionalProperties": False,
        } for t, args in zip(tools, arguments, strict=True)]
        schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
        # NOTE: fixed spacing, json.dumps's (what the fallback prompt shows and templates render):
        # free whitespace lets a small model wander into blank lines, and compact JSON is a spacing
        # it rarely saw (it then picks worse arguments).
        return {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}

    # ---- parsing ---------------------------------------------------------------------------------
    def parse(self, text: str, tools: Iterable[ToolSpec] = ()) -> ParsedAnswer:
        """`text` split into the answer's text and its calls (see `ToolCallSplitter`)."""
        splitter = ToolCallSplitter(self)
        pieces = [*splitter.push(text), *splitter.finish()]
        return self.collect(pieces, tools)

    def collect(self, pieces: Iterable[str | RawCall], tools: Iterable[ToolSpec] = ()) -> ParsedAnswer:
        """The text pieces joined, and each raw call parsed against `tools` (all names, if none given)."""
        names = {t.name for t in tools}
        text: list[str] = []
        calls: list[ToolCall] = []
        invalid: list[InvalidToolCall] = []
        for piece in pieces:
            if isinstance(piece, RawCall):
                call = self.parse_call(piece.text, names)
                (calls if isinstance(call, ToolCall) else invalid).append(call)  # type: ignore[arg-type]
            else:
                text.append(piece)
        return ParsedAnswer("".join(text).strip(), tuple(calls), tuple(invalid))

    def parse_call(self, raw: str, names: set[str] | frozenset[str] = frozenset()) -> ToolCall | InvalidToolCall:
        """One call's text (opener to closer) as a ToolCall, or an InvalidToolCall saying why not."""
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        body = raw.strip()
        body = body[len(self.trigger):] if self.trigger and body.startswith(self.trigger) else body
        closer = self.closer.strip()
        complete = not closer or body.rstrip().endswith(closer)
        body = body.rstrip()[: -len(closer)] if closer and complete else body
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            why = "the call ended before its closing tag (max_tokens?)" if not complete else f"not JSON: {exc}"
            return InvalidToolCall(raw, why, call_id, _name_in(body, self.name_key),
                                   _arguments_in(body, self.arguments_key))
        if not isinstance(value, dict) or not isinstance(value.get(self.name_key), str):
            return InvalidToolCall(raw, f"a call is a JSON object with a string {self.name_key!r}", call_id)
        name, arguments = value[self.name_key], value.get(self.arguments_key, {})
        written = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return InvalidToolCall(raw, f"arguments are not JSON: {exc}", call_id, name, written)
        if not isinstance(arguments, dict):
            return InvalidToolCall(raw, f"{self.arguments_key!r} must be a JSON object", call_id, name, written)
        if names and name not in names:
            return InvalidToolCall(raw, f"no bound tool is named {name!r} (bound: {sorted(names)})", call_id, name,
                                   written)
        return ToolCall(name, arguments, call_id, raw)


FALLBACK_FORMAT = ToolCallFormat()
"""The call syntax for templates that do not render tools (and the one the fallback prompt teaches)."""


@dataclass(frozen=True)
class RawCall:
    """The text of one call (opener through closer, or to the end when cut off), not yet parsed."""

    text: str


class ToolCallSplitter:
    """Splits streamed answer pieces into text and `RawCall`s as they arrive.

    Text that could be the start of a call opener is held back until it is known; a call is
    released when its closer arrives (or at `finish`, cut off). One per request: it holds state.
    """

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self._buffer = ""
        self._in_call = False
        self._after_call = False  # NOTE: whitespace between calls (the separator) is no answer text

    def push(self, piece: str) -> list[str | RawCall]:
        """The text and calls completed by `piece`, in order."""
        self._buffer += piece
        out: list[str | RawCall] = []
        trigger, closer = self.fmt.trigger, self.fmt.closer.strip()
        while self._buffer:
            if self._in_call:
                end = self._buffer.find(closer, self._buffer.find(trigger) + len(trigger)) if closer else -1
                if end < 0:
                    break
                out.append(RawCall(self._buffer[: end + len(closer)]))
                self._buffer, self._in_call, self._after_call = self._buffer[end + len(closer):], False, True
                continue
            start = self._buffer.find(trigger) if trigger else (0 if self._buffer.lstrip().startswith("{") else -1)
            if start >= 0:
                out += self._text(self._buffer[:start])
                self._buffer, self._in_call = self._buffer[start:], True
                continue
            keep = _partial_suffix(self._buffer, trigger)
            out += self._text(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        return out

    def _text(self, text: str) -> list[str | RawCall]:
        if not text or (self._after_call and not text.strip()):
            return []
        self._after_call = False
        return [text]

    def finish(self) -> list[str | RawCall]:
        """What is still held: a cut-off call, or text that turned out not to open one."""
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            return [RawCall(rest)]
        return self._text(rest)


def split_calls(pieces: Iterable[_Piece], fmt: ToolCallFormat, request: ToolRequest
                ) -> Iterator[str | _Piece | ToolCall | InvalidToolCall]:
    """A streamed answer's text pieces with its calls parsed out as they complete.

    Text pieces come out as text (less what belongs to calls); each call as a ToolCall or an
    InvalidToolCall; any other piece (e.g. the final `Generation`) passes through, after what
    was still held back (a cut-off call, or text that opened no call).
    """
    splitter = ToolCallSplitter(fmt)
    names = frozenset(t.name for t in request.called())
    for piece in pieces:
        found = splitter.push(piece) if isinstance(piece, str) else [*splitter.finish(), piece]
        for item in found:
            yield fmt.parse_call(item.text, names) if isinstance(item, RawCall) else item
    for item in splitter.finish():
        yield fmt.parse_call(item.text, names) if isinstance(item, RawCall) else item


async def asplit_calls(pieces: AsyncIterable[_Piece], fmt: ToolCallFormat, request: ToolRequest
                       ) -> AsyncGenerator[str | _Piece | ToolCall | InvalidToolCall, None]:
    """`split_calls` over an asynchronous stream of pieces."""
    splitter = ToolCallSplitter(fmt)
    names = frozenset(t.name for t in request.called())
    async for piece in pieces:
        found = splitter.push(piece) if isinstance(piece, str) else [*splitter.finish(), piece]
        for item in found:
            yield fmt.parse_call(item.text, names) if isinstance(item, RawCall) else item
    for item in splitter.finish():
        yield fmt.parse_call(item.text, names) if isinstance(item, RawCall) else item


# ---- prompting --------------------------------------------------------------------------------------
class ChatTools:
    """How one tokenizer's chat template shows tools, tool calls and tool results.

    `native`: the template renders `tools` itself; calls are written in the `format` it renders.
    Otherwise (or when its call syntax cannot be read off) `FALLBACK_FORMAT` is used and said
    once, with a warning.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        derived = ToolCallFormat.from_template(tokenizer) if template_renders_tools(tokenizer) else None
        self.native = derived is not None
        self.format = derived or FALLBACK_FORMAT
        self._warned = False

    def adapt(self, messages: Sequence[Mapping[str, Any]],
              tools: ToolRequest | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """`(messages, tools)` for `apply_chat_template`: OpenAI-shaped messages (assistant
        `tool_calls`, `tool` results) in the shape this template reads.

        Raises:
            InvalidRequestError: a malformed `tool_calls` (`check_tool_calls`).
        """
        check_tool_calls(messages)
        if self.native:
            return [_hf_message(m) for m in messages], tools.openai() if tools is not None else None
        if tools is not None and not self._warned:
            self._warned = True  # NOTE: a benign race may warn twice; never zero times
            logger.warning("the chat template of this model does not render tools: they are shown with FusionRAG's "
                           "fallback format (<tools> in the system message, <tool_call> JSON blocks; see "
                           "docs/integrations.md)")
        return _fallback_messages(messages, tools, self.format), None


_CALL_SHAPE = "{'id': <string>, 'type': 'function', 'function': {'name': <string>, 'arguments': <JSON string>}}"


def check_tool_calls(messages: Sequence[Mapping[str, Any]]) -> None:
    """Refuse a message's `tool_calls` unless it is OpenAI's list of function calls on an assistant message.

    Each call is `{"id", "type": "function", "function": {"name", "arguments"}}`; `id` and `type`
    may be left out (in-process callers often do), `arguments` is the JSON text of an object (in
    process, the object itself), and no other field is taken.

    Raises:
        InvalidRequestError: the first malformed call, named by message index and field
            (`messages[1].tool_calls[0].function.name ...`).
    """
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is None or (isinstance(calls, list) and not calls):
            continue
        where = f"messages[{i}].tool_calls"
        if message.get("role") != "assistant":
            raise InvalidRequestError(f"{where}: only assistant messages carry tool_calls")
        if not isinstance(calls, list):
            raise InvalidRequestError(f"{where} must be a list of calls {_CALL_SHAPE}, got {type(calls).__name__}")
        for j, call in enumerate(calls):
            _check_call(f"{where}[{j}]", call)


def _check_call(where: str, call: Any) -> None:
    if not isinstance(call, Mapping):
        raise InvalidRequestError(f"{where} must be an object {_CALL_SHAPE}, got {type(call).__name__}")
    unknown = sorted(set(call) - {"id", "type", "function"})
    if unknown:
        raise InvalidRequestError(f"{where} has unsupported field(s) {unknown}: a call is {_CALL_SHAPE}")
    if call.get("type", "function") != "function":
        raise InvalidRequestError(f"{where}.type must be 'function', got {call.get('type')!r}")
    if not isinstance(call.get("id"), str | None):
        raise InvalidRequestError(f"{where}.id must be a string, got {type(call.get('id')).__name__}")
    function = call.get("function")
    if not isinstance(function, Mapping):
        raise InvalidRequestError(f"{where}.function must be an object {{'name': <string>, 'arguments': "
                                  f"<JSON string>}}, got {type(function).__name__}")
    unknown = sorted(set(function) - {"name", "arguments"})
    if unknown:
        raise InvalidRequestError(f"{where}.function has unsupported field(s) {unknown}: it holds 'name' and "
                                  "'arguments'")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequestError(f"{where}.function.name must be the called tool's name (a non-empty string)")
    _arguments_of(function.get("arguments"), f"{where}.function.arguments")


def _arguments_of(arguments: Any, where: str) -> dict[str, Any]:
    """A call's arguments as a dict: JSON text of an object (empty: no arguments), or the object."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{where} is not JSON ({exc}): pass the JSON text of an object") from exc
    if not isinstance(arguments, Mapping):
        raise InvalidRequestError(f"{where} must be the JSON text of an object, got {type(arguments).__name__}")
    return dict(arguments)


def template_renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template reads a `tools` variable."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return False
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


def fallback_system_text(tools: ToolRequest, fmt: ToolCallFormat = FALLBACK_FORMAT) -> str:
    """The tool list and call instructions the fallback adds to the system message."""
    signatures = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools.tools)
    example = fmt.render("<tool name>", {}).replace("{}", "<arguments object>")
    return (f"You may call functions. Their signatures, one JSON object per line:\n<tools>\n{signatures}\n</tools>\n"
            f"To call one, write a JSON object with its name and arguments between tags:\n{example}")


def _fallback_messages(messages: Sequence[Mapping[str, Any]], tools: ToolRequest | None,
                       fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """Messages whose tool parts are plain text: the tool list in the system message, calls in the
    assistant's content, results as `<tool_response>` blocks in user turns (consecutive ones merged)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], str(message.get("content") or "")
        if role == "assistant" and message.get("tool_calls"):
            calls = fmt.separator.join(fmt.render(*_call_parts(c)) for c in message["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content.strip() else calls})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += f"\n{block}"
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for message in out:
        message.pop("tool_results", None)
    if tools is not None:
        block = fallback_system_text(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"].strip() else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _hf_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped message as Hugging Face templates read it (call arguments as dicts)."""
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = str(message.get("content") or "")
    if message.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "id": c.get("id"),
                              "function": dict(zip(("name", "arguments"), _call_parts(c), strict=True))}
                             for c in message["tool_calls"]]
    return out


def _call_parts(call: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, arguments dict) of an OpenAI-shaped call `check_tool_calls` let through."""
    function = call["function"]
    return str(function["name"]), _arguments_of(function.get("arguments"), "arguments")


_SENTINEL_NAME, _SENTINEL_KEY, _SENTINEL_VALUE, _SENTINEL_TEXT = "\ue020", "\ue021", "\ue022", "\ue023"


def _format_from_template(tokenizer: PreTrainedTokenizerBase) -> ToolCallFormat | None:
    """Render one sentinel call and one sentinel text answer; what differs is the call syntax."""
    user = {"role": "user", "content": "x"}
    tool = ToolSpec("f", "", {"type": "object", "properties": {_SENTINEL_KEY: {"type": "string"}}}).openai()

    def render(messages: list[dict[str, Any]], generation: bool) -> str:
        return str(tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False,
                                                 add_generation_prompt=generation))
    try:
        header = render([user], True)
        text = render([user, {"role": "assistant", "content": _SENTINEL_TEXT}], False)
        call = {"type": "function", "function": {"name": _SENTINEL_NAME, "arguments": {_SENTINEL_KEY: _SENTINEL_VALUE}}}
        called = render([user, {"role": "assistant", "content": "", "tool_calls": [call]}], False)
    except Exception:  # NOTE: any template error means: not readable, use the fallback
        return None
    turn_end = text.partition(_SENTINEL_TEXT)[2]
    if not (text.startswith(header) and called.startswith(header) and called.endswith(turn_end)):
        return None
    rendered = called[len(header): len(called) - len(turn_end)]
    for start in (i for i, ch in enumerate(rendered) if ch == "{"):
        try:
            value, end = json.JSONDecoder().raw_decode(rendered, start)
        except json.JSONDecodeError:
            continue
        keys = {v if isinstance(v, str) else json.dumps(v): k for k, v in value.items()} if isinstance(value, dict) \
            else {}
        name_key = keys.get(_SENTINEL_NAME)
        args_key = next((k for k, v in value.items() if v == {_SENTINEL_KEY: _SENTINEL_VALUE}), None)
        if name_key and args_key:
            return ToolCallFormat(rendered[:start], rendered[end:], "\n", name_key, args_key)
    return None


# ---- grammar helpers --------------------------------------------------------------------------------
def _arguments_schema(tool: ToolSpec) -> dict[str, Any]:
    schema = closed_objects(dict(tool.parameters))
    schema.pop("title", None)
    schema.setdefault("type", "object")
    return schema


def _bounded(schema: Any, max_chars: int) -> Any:
    """`schema` with `maxLength` on every subschema typed "string" that has none (nor an enum or const)."""
    if isinstance(schema, list):
        return [_bounded(s, max_chars) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _bounded(v, max_chars) for k, v in schema.items()}
    types = out.get("type")
    typed = types == "string" or (isinstance(types, list) and "string" in types)
    if typed and not {"maxLength", "enum", "const"} & set(out):
        least = out.get("minLength")
        out["maxLength"] = max(max_chars, least if isinstance(least, int) else 0)
    return out


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with each local `$ref` (`#...`) moved under the JSON pointer `base` (`#/...`)."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _rebased(v, base) for k, v in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


def _pointer_part(key: str) -> str:
    """`key` as one segment of a JSON pointer."""
    return key.replace("~", "~0").replace("/", "~1")


def _check_schema(tool: ToolSpec) -> None:
    """Compile one tool's schema alone, so an error names the tool."""
    try:
        Grammar.json_schema(_arguments_schema(tool))
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"tool {tool.name!r}: its parameters schema cannot be enforced: {exc}") from exc


def _literal(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text)


def _regex(text: str) -> str:
    """`text` escaped for a Lark `/regex/`."""
    return re.escape(text).replace("/", "\\/")


def _partial_suffix(text: str, trigger: str) -> int:
    """Length of the longest end of `text` that is a proper start of `trigger`."""
    for n in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-n:]):
            return n
    return 0


def _name_in(body: str, name_key: str) -> str | None:
    match = re.search(rf'"{re.escape(name_key)}"\s*:\s*"([^"]+)"', body)
    return match.group(1) if match else None


def _arguments_in(body: str, arguments_key: str) -> str:
    """What follows `"arguments": ` in a call's text that is not JSON (a cut-off call: all of it)."""
    match = re.search(rf'"{re.escape(arguments_key)}"\s*:\s*', body)
    return body[match.end():] if match else ""


def tool_request(tools: Sequence[Mapping[str, Any] | ToolSpec], choice: Any = None,
                 parallel: bool | None = None) -> ToolRequest:
    """A ToolRequest from OpenAI tool dicts (or ToolSpecs) and an OpenAI- or LangChain-shaped choice.

    Args:
        tools: the tools.
        choice: None, False or "auto" (the model decides); "required", "any" or True (it must
            call; True as LangChain means it: the one bound tool); "none" (it must not); a tool's
            name, or `{"type": "function", "function": {"name": ...}}` (that tool).
        parallel: several calls in one answer (None/False: one call at most).

    Raises:
        InvalidRequestError: a malformed tool or choice (the message says what is accepted).
    """
    specs: list[ToolSpec] = []
    for tool in tools:
        spec = tool if isinstance(tool, ToolSpec) else ToolSpec.from_openai(tool)
        # NOTE: one tool bound twice (e.g. a Pydantic class and its JSON schema, which differ only in
        # titles) is one tool.
        if not any(_same_tool(spec, seen) for seen in specs):
            specs.append(spec)
    return ToolRequest(tuple(specs), _choice(choice, specs), bool(parallel))


def _same_tool(a: ToolSpec, b: ToolSpec) -> bool:
    """Whether two specs are one tool: same name and description, schemas equal but for titles."""
    return (a.name, a.description) == (b.name, b.description) and _untitled(a.parameters) == _untitled(b.parameters)


def _untitled(schema: Any, in_properties: bool = False) -> Any:
    """`schema` without its `title` annotations (a property named "title" stays)."""
    if isinstance(schema, list):
        return [_untitled(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    return {k: _untitled(v, k == "properties" and not in_properties) for k, v in schema.items()
            if in_properties or not (k == "title" and isinstance(v, str))}


def _choice(choice: Any, tools: Sequence[ToolSpec]) -> str:
    if choice is None or choice is False or choice == "auto":
        return "auto"
    if choice is True:
        if len(tools) != 1:
            raise InvalidRequestError(f"tool_choice=True forces the one bound tool, but {len(tools)} are bound; "
                                      "pass a tool's name or 'required'")
        return tools[0].name
    if choice == "any":
        return "required"
    if isinstance(choice, Mapping):
        function = choice.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return function["name"]
        if isinstance(choice.get("name"), str):
            return str(choice["name"])
        raise InvalidRequestError(f"tool_choice {dict(choice)!r}: pass {{'type': 'function', 'function': "
                                  "{'name': <tool name>}}")
    if isinstance(choice, str):
        return choice
    raise InvalidRequestError(f"tool_choice {choice!r}: pass 'auto', 'required', 'none' or a tool's name")


__all__ = [
    "DEFAULT_STRING_CHARS",
    "FALLBACK_FORMAT",
    "TOOL_CHOICES",
    "ChatTools",
    "InvalidToolCall",
    "ParsedAnswer",
    "RawCall",
    "ToolCall",
    "ToolCallFormat",
    "ToolCallSplitter",
    "ToolRequest",
    "ToolSpec",
    "check_tool_calls",
    "fallback_system_text",
    "split_calls",
    "template_renders_tools",
    "tool_request",
]
