"""ChatFusionRAG.bind_tools: every tool form LangChain accepts, every tool choice, calls in
`tool_calls` / `tool_call_chunks` / `invalid_tool_calls`, tool turns in the history, and chunk
reuse inside a tool loop. A tiny random Llama over the real SmolLM2 tokenizer: its answers are
nonsense, yet forced calls are valid ones (the grammar makes them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field
from transformers import PreTrainedTokenizerBase
from typing_extensions import TypedDict

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.index import FusionIndex, IngestConfig
from fusionrag_integrations.langchain import ChatFusionRAG
from fusionrag_integrations.session import PENDING_REASON
from tests.ingest_worker import tiny_engine
from tests.lighthouse import TEXTS


@tool
def forecast(unit: Literal["C", "F"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
    """The weather forecast for the next days."""
    return f"sunny for {days} days ({unit})"


class Lookup(BaseModel):
    """Look a word up."""

    word: Literal["lighthouse", "clock"]


class Count(TypedDict):
    """Count to a number."""

    n: Annotated[Literal[1, 2, 3], ..., "how far"]


BOOLEAN_SCHEMA = {"title": "flag", "description": "Raise a flag.", "type": "object",
                  "properties": {"up": {"type": "boolean"}}, "required": ["up"]}
OPENAI_TOOL = {"type": "function", "function": {"name": "ping", "description": "Ping.",
                                                "parameters": {"type": "object", "properties": {}}}}
EVERY_FORM = [forecast, Lookup, Count, BOOLEAN_SCHEMA, OPENAI_TOOL]
NAMES = ["forecast", "Lookup", "Count", "flag", "ping"]


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer)


@pytest.fixture(scope="module")
def index(engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FusionIndex]:
    index = FusionIndex.open(engine, tmp_path_factory.mktemp("index"), config=IngestConfig(chunk_tokens=48,
                                                                                          neighbours=2))
    index.add_texts(TEXTS)
    yield index


@pytest.fixture(scope="module")
def chat(index: FusionIndex, tmp_path_factory: pytest.TempPathFactory) -> ChatFusionRAG:
    return ChatFusionRAG(index=index, data_dir=str(tmp_path_factory.mktemp("data")), max_tokens=48)


def _args_valid(call: dict[str, Any]) -> bool:
    args = call["args"]
    return {
        "forecast": lambda: args["unit"] in ("C", "F") and 1 <= args["days"] <= 7,
        "Lookup": lambda: args["word"] in ("lighthouse", "clock"),
        "Count": lambda: args["n"] in (1, 2, 3),
        "flag": lambda: isinstance(args["up"], bool),
        "ping": lambda: args == {},
    }[call["name"]]()


def test_every_tool_form_binds_as_an_openai_tool(chat: ChatFusionRAG) -> None:
    bound = chat.bind_tools(EVERY_FORM, tool_choice="any")
    kwargs = bound.kwargs  # type: ignore[attr-defined]
    assert [t["function"]["name"] for t in kwargs["tools"]] == NAMES
    assert kwargs["tool_choice"] == "required" and "parallel_tool_calls" not in kwargs


@pytest.mark.parametrize("name", NAMES)
def test_a_named_tool_is_called_with_schema_valid_arguments(chat: ChatFusionRAG, name: str) -> None:
    message = chat.bind_tools(EVERY_FORM, tool_choice=name).invoke("Go.")
    assert isinstance(message, AIMessage) and message.content == "" and not message.invalid_tool_calls
    assert [c["name"] for c in message.tool_calls] == [name] and _args_valid(message.tool_calls[0])
    assert message.tool_calls[0]["id"].startswith("call_")
    assert message.response_metadata["finish_reason"] == "stop"


def test_streamed_calls_arrive_as_tool_call_chunks(chat: ChatFusionRAG) -> None:
    chunks = list(chat.bind_tools([forecast], tool_choice=True).stream("Weather?"))
    with_calls = [c for c in chunks if c.tool_call_chunks]
    assert len(with_calls) == 1 and with_calls[0].tool_call_chunks[0]["index"] == 0
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert isinstance(total, AIMessageChunk)
    assert [c["name"] for c in total.tool_calls] == ["forecast"] and _args_valid(total.tool_calls[0])
    assert total.usage_metadata is not None and total.usage_metadata["input_tokens"] > 0


def test_parallel_calls_when_asked(chat: ChatFusionRAG) -> None:
    message = chat.bind_tools([Count], tool_choice="required", parallel_tool_calls=True).invoke("Count.",
                                                                                                  max_tokens=120)
    assert message.tool_calls and all(_args_valid(c) for c in message.tool_calls)
    single = chat.bind_tools([Count], tool_choice="required").invoke("Count.", max_tokens=120)
    assert len(single.tool_calls) == 1


def test_none_forbids_calls_and_auto_leaves_text_as_text(chat: ChatFusionRAG) -> None:
    message = chat.bind_tools([forecast], tool_choice="none").invoke("Weather?", max_tokens=12)
    assert not message.tool_calls and not message.invalid_tool_calls
    auto = chat.bind_tools([forecast]).invoke("Weather?", max_tokens=12)
    assert isinstance(auto.content, str) and all(_args_valid(c) for c in auto.tool_calls)


def test_a_call_cut_by_max_tokens_is_an_invalid_call_not_an_exception(chat: ChatFusionRAG) -> None:
    message = chat.bind_tools([forecast], tool_choice="any").invoke("Weather?", max_tokens=6)
    assert not message.tool_calls and len(message.invalid_tool_calls) == 1
    invalid = message.invalid_tool_calls[0]
    assert invalid["args"] and invalid["args"].startswith("<tool_call>") and "max_tokens" in (invalid["error"] or "")
    streamed = list(chat.bind_tools([forecast], tool_choice="any").stream("Weather?", max_tokens=6))
    total = streamed[0]
    for chunk in streamed[1:]:
        total += chunk
    assert isinstance(total, AIMessageChunk) and not total.tool_calls and total.invalid_tool_calls


def test_a_tool_loop_history_is_rendered_and_answered(chat: ChatFusionRAG) -> None:
    call = chat.bind_tools([forecast], tool_choice="any").invoke("Weather?")
    result = forecast.invoke(call.tool_calls[0])
    assert isinstance(result, ToolMessage) and result.tool_call_id == call.tool_calls[0]["id"]
    history = [HumanMessage("Weather?"), call, result]
    prompt = chat.fusion_prompt(history, tools=None)
    text = chat.fusion_engine().tokenizer.decode(prompt.token_ids())
    assert json.dumps({"name": "forecast", "arguments": call.tool_calls[0]["args"]}) in text
    assert f"<tool_response>\n{result.content}\n</tool_response>" in text
    answer = chat.bind_tools([forecast]).invoke(history, max_tokens=8)
    assert isinstance(answer, AIMessage)


def test_stored_chunks_in_tool_results_are_reused_and_artifacts_learned(chat: ChatFusionRAG, index: FusionIndex
                                                                       ) -> None:
    stored = TEXTS[0]
    unseen = "The harbour master of Kestrel Bay keeps a ledger of every ship that anchored there since 1802."
    for artifact in ([Document(page_content=stored)], [Document(page_content=unseen)]):
        history = [HumanMessage("Who designed it?"),
                   AIMessage("", tool_calls=[{"name": "search", "args": {"q": "x"}, "id": "c1"}]),
                   ToolMessage(f"Source: doc\nContent: {artifact[0].page_content}", tool_call_id="c1",
                               artifact=artifact)]
        message = chat.bind_tools([OPENAI_TOOL]).invoke(history, max_tokens=2)
        meta = message.response_metadata
        assert sum(meta[k] for k in ("reused_tokens", "recomputed_tokens", "prefilled_tokens",
                                     "prefix_cached_tokens")) == meta["prompt_tokens"]
        if artifact[0].page_content == stored:
            assert meta["reused_tokens"] > 0 and "content" in meta["chunk_found_by"].values()
        else:
            # NOTE: a document without a cache stays plain text in the prompt (this request is a plain
            # prefill of it), and is learned once the answer has streamed
            assert meta["chunk_found_by"] == {} and list(meta["cache_miss_reasons"].values()) == [PENDING_REASON]
    again = chat.bind_tools([OPENAI_TOOL]).invoke(history, max_tokens=2)
    assert again.response_metadata["reused_tokens"] > 0  # NOTE: the artifact learned on the call before


@pytest.mark.parametrize(("tools", "kwargs", "message"), [
    ([{"title": "f", "type": "object", "properties": {"a": {"not": {"type": "string"}}}}], {}, r"(?s)tool 'f'.*not"),
    ([forecast], {"tool_choice": "Lookup"}, "neither one of"),
    ([forecast, Count], {"tool_choice": True}, "forces the one bound tool"),
])
def test_bad_tools_fail_when_bound(chat: ChatFusionRAG, tools: list[Any], kwargs: dict[str, Any],
                                   message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        chat.bind_tools(tools, **kwargs)


def test_tools_with_documents_or_response_format_are_refused(chat: ChatFusionRAG) -> None:
    bound = chat.bind_tools([forecast])
    with pytest.raises(InvalidRequestError, match="canonical prompt"):
        bound.invoke("Weather?", documents=[Document(page_content=TEXTS[0])])
    with pytest.raises(InvalidRequestError, match="either tools or a response_format"):
        bound.invoke("Weather?", response_format={"type": "json_object"})
    with pytest.raises(InvalidRequestError, match="without tools"):
        chat.invoke("Weather?", tool_choice="required")
