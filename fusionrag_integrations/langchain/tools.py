"""Tool calling for ChatFusionRAG: LangChain's tool forms in, `AIMessage.tool_calls` out.

`bind_tools` accepts every form LangChain converts (`@tool` functions, `BaseTool`s, Pydantic
classes, TypedDicts, JSON schemas, OpenAI tool dicts) through `convert_to_openai_tool`, checks them
against the grammar now (a schema it cannot enforce fails at bind time, naming the tool), and binds
them as call options; the engine shows them to the model and decodes the answer under their
grammar (`fusionrag_core.query.tools`). The answer's calls become LangChain's `tool_calls` (with
ids), `tool_call_chunks` when streamed, and `invalid_tool_calls` with the raw text when one cannot
be parsed: a malformed call never raises out of `invoke`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import BaseMessage, ToolMessage
from langchain_core.messages.tool import (
    InvalidToolCall as LCInvalidToolCall,
)
from langchain_core.messages.tool import (
    ToolCall as LCToolCall,
)
from langchain_core.messages.tool import (
    ToolCallChunk,
    invalid_tool_call,
    tool_call,
    tool_call_chunk,
)
from langchain_core.utils.function_calling import convert_to_openai_tool

from fusionrag_core.query.tools import InvalidToolCall, ToolCall, tool_request


def openai_tools(tools: Sequence[Any], *, strict: bool | None = None) -> list[dict[str, Any]]:
    """`tools` in any form LangChain accepts, as OpenAI function-tool dicts."""
    return [convert_to_openai_tool(tool, strict=strict) for tool in tools]


def tool_options(tools: Sequence[Any], tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                 strict: bool | None = None) -> dict[str, Any]:
    """The call options `bind_tools` binds, checked now (names, choice, every schema's grammar).

    Raises:
        InvalidRequestError: an unknown tool choice, duplicate names, or a schema the grammar
            cannot enforce (named with its tool and the construct).
    """
    formatted = openai_tools(tools, strict=strict)
    request = tool_request(formatted, tool_choice, parallel_tool_calls)
    options: dict[str, Any] = {"tools": formatted}
    if request.choice != "auto":
        options["tool_choice"] = request.choice  # NOTE: normalised: "any"/True/dict become "required"/a name
    if parallel_tool_calls is not None:
        options["parallel_tool_calls"] = parallel_tool_calls
    return options


def artifact_texts(messages: Iterable[BaseMessage]) -> list[str]:
    """Texts of the Documents tool messages carry as artifacts (`response_format="content_and_artifact"`):
    documents a retrieval tool returned, learnable where they occur in the prompt."""
    texts: list[str] = []
    for message in messages:
        if isinstance(message, ToolMessage):
            artifact = message.artifact
            items = artifact if isinstance(artifact, list | tuple) else [artifact]
            texts += [item.page_content for item in items if isinstance(item, Document)]
    return texts


def langchain_call(call: ToolCall) -> LCToolCall:
    """A parsed call as LangChain's `ToolCall`."""
    return tool_call(name=call.name, args=call.arguments, id=call.id)


def langchain_invalid_call(call: InvalidToolCall) -> LCInvalidToolCall:
    """A call that could not be parsed as LangChain's `InvalidToolCall` (raw text as `args`)."""
    return invalid_tool_call(name=call.name, args=call.text, id=call.id, error=call.error)


def call_chunk(call: ToolCall | InvalidToolCall, index: int) -> ToolCallChunk:
    """One whole call as a streamed `tool_call_chunk` (a call is released once complete).

    NOTE: an invalid call's raw text is not JSON, so LangChain's chunk aggregation lists it under
    `invalid_tool_calls`, as it does for any provider.
    """
    if isinstance(call, ToolCall):
        return tool_call_chunk(name=call.name, args=json.dumps(call.arguments), id=call.id, index=index)
    return tool_call_chunk(name=call.name, args=call.text, id=call.id, index=index)


__all__ = ["artifact_texts", "call_chunk", "langchain_call", "langchain_invalid_call", "openai_tools", "tool_options"]
