"""FusionRAGLLM as a LlamaIndex FunctionCallingLLM: chat_with_tools (sync, async, streaming),
get_tool_calls_from_response, predict_and_call, FunctionAgent (a FunctionTool, a QueryEngineTool,
a RetrieverTool) and ReActAgent, with the chunk caches reused in the tool loop.

The model tests run the packaged SmolLM2-135M (greedy); where it would not call a tool on its own,
the call is forced (`tool_required`, `initial_tool_choice`). The FusionIndex of the lighthouse
corpus and the LLMs are built once per module.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.agent.workflow import FunctionAgent, ReActAgent, ToolCallResult
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ImageBlock,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.base.response.schema import Response
from llama_index.core.bridge.pydantic import BaseModel, Field
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMChatStartEvent
from llama_index.core.memory import Memory
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode
from llama_index.core.tools import BaseTool, FunctionTool, QueryEngineTool, RetrieverTool

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.index import FusionIndex, IngestConfig
from fusionrag_core.query.tools import InvalidToolCall, ToolCall
from fusionrag_core.recognise.marks import strip_marks
from fusionrag_core.runtime.compat import tokenize_plain
from fusionrag_integrations.llama_index import FusionRAGLLM, FusionRAGQueryEngine, FusionRAGRetriever
from fusionrag_integrations.llama_index.tools import Reply, chat_kwargs, message_dict, quoted, tool_selections
from tests.lighthouse import TEXTS

ASK = "What is 6 times 7?"
LIGHTHOUSE = "Who designed the Lumen lighthouse?"


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


MULTIPLY = FunctionTool.from_defaults(multiply)


# ---- the conversions, without a model ------------------------------------------------------------
class _OpenAICall(BaseModel):
    """Stands for openai's ChatCompletionMessageToolCall (what older LlamaIndex integrations store)."""

    id: str
    type: str = "function"
    function: dict[str, Any] = Field(default_factory=dict)


def test_history_messages_become_openai_shaped_dicts() -> None:
    blocks = ChatMessage(role=MessageRole.ASSISTANT, blocks=[
        TextBlock(text="Let me multiply."), ToolCallBlock(tool_call_id="c1", tool_name="multiply",
                                                         tool_kwargs={"a": 6, "b": 7})])
    assert message_dict(blocks) == {"role": "assistant", "content": "Let me multiply.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}]}
    legacy = ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs={"tool_calls": [
        _OpenAICall(id="c2", function={"name": "multiply", "arguments": '{"a": 1, "b": 2}'})]})
    assert message_dict(legacy)["tool_calls"] == [
        {"id": "c2", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 1, "b": 2}'}}]
    result = ChatMessage(role=MessageRole.TOOL, content="42", additional_kwargs={"tool_call_id": "c1"})
    assert message_dict(result) == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert message_dict(ChatMessage(role=MessageRole.USER, content="hi")) == {"role": "user", "content": "hi"}

    with pytest.raises(InvalidRequestError, match="text-only"):
        message_dict(ChatMessage(role=MessageRole.TOOL, blocks=[ImageBlock(url="http://example.invalid/x.png")]))
    with pytest.raises(InvalidRequestError, match="not OpenAI-shaped"):
        message_dict(ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs={"tool_calls": [
            {"name": "multiply"}]}))


def test_chat_with_tools_arguments_and_the_reply_round_trip() -> None:
    history = [ChatMessage(role=MessageRole.USER, content="earlier")]
    kwargs = chat_kwargs([MULTIPLY], ASK, history, allow_parallel_tool_calls=False, tool_required=True,
                         tool_choice=None, kwargs={"max_new_tokens": 9})
    assert len(history) == 1  # NOTE: the caller's history is not extended in place
    assert [m.content for m in kwargs["messages"]] == ["earlier", ASK]
    assert kwargs["tools"] == [MULTIPLY.metadata.to_openai_tool()]
    assert (kwargs["tool_choice"], kwargs["parallel_tool_calls"], kwargs["max_new_tokens"]) == ("required", False, 9)
    named = chat_kwargs([MULTIPLY], None, None, allow_parallel_tool_calls=True, tool_required=True,
                        tool_choice="multiply", kwargs={})
    assert named["tool_choice"] == "multiply" and named["messages"] == []
    assert "tools" not in chat_kwargs([], ASK, None, allow_parallel_tool_calls=True, tool_required=False,
                                      tool_choice=None, kwargs={})

    reply = Reply()
    pieces: list[str | ToolCall | InvalidToolCall] = [
        "Sure. ", ToolCall("multiply", {"a": 6, "b": 7}, "c1", "<tool_call>..."),
        InvalidToolCall('<tool_call>\n{"name": "multiply", "argu', "cut off", "c2", "multiply")]
    for piece in pieces:
        reply.add(piece)
    response = ChatResponse(message=reply.message())
    assert response.message.content == "Sure. "
    assert response.message.additional_kwargs["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}]
    assert response.message.additional_kwargs["invalid_tool_calls"] == [
        {"id": "c2", "name": "multiply", "text": '<tool_call>\n{"name": "multiply", "argu', "error": "cut off"}]
    [selection] = tool_selections(response)
    assert (selection.tool_id, selection.tool_name, selection.tool_kwargs) == ("c1", "multiply", {"a": 6, "b": 7})
    assert message_dict(response.message)["tool_calls"] == response.message.additional_kwargs["tool_calls"]
    # NOTE: a message of another integration, with its calls in additional_kwargs only
    legacy = ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs={
        "tool_calls": response.message.additional_kwargs["tool_calls"]}))
    assert tool_selections(legacy) == [selection]

    cut = Reply()
    cut.add(InvalidToolCall("<tool_call>\n{", "the call ended before its closing tag (max_tokens?)", "c3"))
    assert tool_selections(ChatResponse(message=cut.message()), error_on_no_tool_call=False) == []
    with pytest.raises(InvalidRequestError, match="closing tag"):
        tool_selections(ChatResponse(message=cut.message()))
    assert quoted(["in it", "elsewhere"], [{"role": "tool", "content": "text in it"}]) == ["in it"]


# ---- the packaged model ----------------------------------------------------------------------------
class _Calls(BaseEventHandler):
    """Every LLM chat call: the messages and keyword arguments it got, and its response."""

    calls: list[tuple[list[ChatMessage], dict[str, Any], ChatResponse]] = Field(default_factory=list)
    starts: list[tuple[list[ChatMessage], dict[str, Any]]] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "tool_test_calls"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, LLMChatStartEvent):
            self.starts.append((list(event.messages), dict(event.additional_kwargs)))
        elif isinstance(event, LLMChatEndEvent) and event.response is not None:
            messages, call_kwargs = self.starts.pop(0) if self.starts else ([], {})
            self.calls.append((messages, call_kwargs, event.response))


@pytest.fixture
def calls() -> Iterator[_Calls]:
    handler = _Calls()
    get_dispatcher().add_event_handler(handler)
    yield handler
    get_dispatcher().event_handlers.remove(handler)


@pytest.fixture(scope="module")
def index(default_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> FusionIndex:
    """The lighthouse corpus, one chunk per text, with fused caches."""
    index = FusionIndex.open(default_engine, tmp_path_factory.mktemp("tools-index"), collection_name="tools",
                             config=IngestConfig(chunk_tokens=64, neighbours=1))
    index.add_texts(TEXTS)
    return index


@pytest.fixture(scope="module")
def llm(index: FusionIndex, tmp_path_factory: pytest.TempPathFactory) -> FusionRAGLLM:
    """Reads the index's caches (found by content in tool results, by mark in the query engine's prompts)."""
    return FusionRAGLLM(engine=index.engine, kv_store=index.store, max_new_tokens=64,
                        learned_dir=str(tmp_path_factory.mktemp("tools-learned")))


def _valid(selection: Any, tool: BaseTool) -> dict[str, Any]:
    """The call's arguments, checked against the tool's JSON schema."""
    jsonschema.validate(selection.tool_kwargs, tool.metadata.to_openai_tool()["function"]["parameters"])
    return dict(selection.tool_kwargs)


def _stats(response: ChatResponse) -> dict[str, Any]:
    meta = response.additional_kwargs
    assert meta["prompt_tokens"] > 0 and meta["prefilled_tokens"] > 0
    assert {"reused_tokens", "recomputed_tokens", "ttft_s"} <= set(meta) and response.raw == meta
    return meta


def _chunk_tokens(engine: FusionEngine, texts: list[str]) -> int:
    return sum(len(tokenize_plain(engine.tokenizer, strip_marks(t))) for t in texts)


@pytest.mark.slow
def test_chat_with_tools_required_returns_a_schema_valid_call(llm: FusionRAGLLM) -> None:
    assert llm.metadata.is_function_calling_model
    response = llm.chat_with_tools([MULTIPLY], user_msg=ASK, tool_required=True)
    [selection] = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "multiply" and _valid(selection, MULTIPLY)
    [call] = response.message.additional_kwargs["tool_calls"]
    assert call == {"id": selection.tool_id, "type": "function",
                    "function": {"name": "multiply", "arguments": json.dumps(selection.tool_kwargs)}}
    assert [b.tool_name for b in response.message.blocks if isinstance(b, ToolCallBlock)] == ["multiply"]
    assert _stats(response)["finish_reason"] == "stop"

    streamed = list(llm.stream_chat_with_tools([MULTIPLY], user_msg=ASK, tool_required=True))
    assert llm.get_tool_calls_from_response(streamed[-1])[0].tool_kwargs == selection.tool_kwargs
    assert streamed[-1].message.content == "".join(r.delta or "" for r in streamed)
    assert _stats(streamed[-1])["completion_tokens"] == response.additional_kwargs["completion_tokens"]
    assert all(not r.additional_kwargs for r in streamed[:-1])  # NOTE: the statistics come once, at the end


@pytest.mark.slow
def test_async_chat_with_tools_and_a_call_by_name(llm: FusionRAGLLM) -> None:
    async def both() -> tuple[ChatResponse, list[ChatResponse]]:
        response = await llm.achat_with_tools([MULTIPLY], user_msg=ASK, tool_choice="multiply")
        stream = await llm.astream_chat_with_tools([MULTIPLY], user_msg=ASK, tool_required=True)
        return response, [r async for r in stream]

    response, streamed = asyncio.run(both())
    [selection] = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "multiply" and _valid(selection, MULTIPLY)
    assert llm.get_tool_calls_from_response(streamed[-1]) and _stats(streamed[-1]) and _stats(response)


@pytest.mark.slow
def test_predict_and_call_runs_the_tool(llm: FusionRAGLLM) -> None:
    output = llm.predict_and_call([MULTIPLY], user_msg=ASK, tool_required=True)
    [source] = output.sources
    arguments = source.raw_input["kwargs"]
    assert output.response == str(multiply(**arguments)) and not source.is_error


@pytest.mark.slow
def test_a_cut_off_call_is_reported_never_raised(llm: FusionRAGLLM) -> None:
    response = llm.chat_with_tools([MULTIPLY], user_msg=ASK, tool_required=True, max_new_tokens=6)
    [invalid] = response.message.additional_kwargs["invalid_tool_calls"]
    assert invalid["text"].startswith("<tool_call>") and "closing tag" in invalid["error"]
    assert "tool_calls" not in response.message.additional_kwargs
    assert _stats(response)["finish_reason"] == "length"
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(InvalidRequestError, match="raise max_new_tokens"):
        llm.get_tool_calls_from_response(response)
    streamed = list(llm.stream_chat_with_tools([MULTIPLY], user_msg=ASK, tool_required=True, max_new_tokens=6))
    assert streamed[-1].message.additional_kwargs["invalid_tool_calls"][0]["text"] == invalid["text"]
    with pytest.raises(InvalidRequestError, match="chat options"):
        llm.complete(ASK, tools=[MULTIPLY.metadata.to_openai_tool()])
    with pytest.raises(InvalidRequestError, match="without tools"):
        llm.chat_with_tools([], user_msg=ASK, tool_required=True)


def _run(agent: Any, question: str, memory: Memory | None = None) -> tuple[Any, list[ToolCallResult]]:
    """The agent's final output, and the tool results streamed on the way."""
    async def go() -> tuple[Any, list[ToolCallResult]]:
        handler = agent.run(question, memory=memory, max_iterations=4)
        results = [e async for e in handler.stream_events() if isinstance(e, ToolCallResult)]
        return await handler, results

    return asyncio.run(go())


def _last_agent_call(calls: _Calls) -> tuple[list[ChatMessage], dict[str, Any], ChatResponse]:
    """The agent's last LLM call (the one that answered with tools bound)."""
    return [c for c in calls.calls if c[1].get("tools")][-1]


def _flowed_back(messages: list[ChatMessage], result: ToolCallResult) -> None:
    """The final call's history holds the call and its result, under the call's id."""
    [called] = [m for m in messages if any(isinstance(b, ToolCallBlock) and b.tool_call_id == result.tool_id
                                           for b in m.blocks)]
    [answered] = [m for m in messages if m.role == MessageRole.TOOL
                  and m.additional_kwargs.get("tool_call_id") == result.tool_id]
    assert called.role == MessageRole.ASSISTANT and answered.content == result.tool_output.content


def _report(name: str, meta: dict[str, Any], chunk_tokens: int | None = None) -> None:
    share = f", {meta['reused_tokens'] / chunk_tokens:.0%} of {chunk_tokens} chunk tokens" if chunk_tokens else ""
    print(f"\n{name}: prompt {meta['prompt_tokens']}, reused {meta['reused_tokens']}, recomputed "
          f"{meta['recomputed_tokens']}, prefilled {meta['prefilled_tokens']}, misses {meta['cache_misses']}{share}")


@pytest.mark.slow
def test_function_agent_calls_a_function_tool_and_answers(llm: FusionRAGLLM, calls: _Calls) -> None:
    agent = FunctionAgent(tools=[MULTIPLY], llm=llm, initial_tool_choice="multiply", allow_parallel_tool_calls=False)
    memory = Memory.from_defaults(session_id="tools-test", token_limit=4000)
    output, results = _run(agent, ASK, memory)
    [result] = results
    arguments = _valid(result, MULTIPLY)
    assert result.tool_output.content == str(multiply(**arguments)) and not result.tool_output.is_error
    messages, _, final = _last_agent_call(calls)
    _flowed_back(messages, result)
    assert output.response.content and output.response.content == final.message.content
    _report("FunctionAgent + FunctionTool, final call", _stats(final))

    # NOTE: a second turn: the memory's assistant message with its ToolCallBlock is rendered back
    again, more = _run(agent, "And 2 times 3?", memory)
    assert more and again.response.content
    history, _, _ = _last_agent_call(calls)
    assert any(m.role == MessageRole.TOOL and m.content == result.tool_output.content for m in history)


@pytest.mark.slow
def test_function_agent_with_a_query_engine_tool_reuses_the_retrieved_chunks(
        llm: FusionRAGLLM, index: FusionIndex, calls: _Calls) -> None:
    engine_tool = QueryEngineTool.from_defaults(
        FusionRAGQueryEngine.from_index(index, llm=llm, similarity_top_k=2), name="lighthouse_docs",
        description="Answers questions about the Lumen lighthouse and its designer.")
    # NOTE: FunctionAgent's default, parallel calls: the small model repeats its call until max_new_tokens
    # (a cut-off call, reported in invalid_tool_calls); the first, complete one runs.
    agent = FunctionAgent(tools=[engine_tool], llm=llm, initial_tool_choice="lighthouse_docs")
    output, [result] = _run(agent, LIGHTHOUSE)
    assert isinstance(_valid(result, engine_tool)["input"], str)
    answer = result.tool_output.raw_output
    assert isinstance(answer, Response) and answer.metadata and len(answer.source_nodes) == 2
    messages, _, final = _last_agent_call(calls)
    _flowed_back(messages, result)
    assert output.response.content
    # NOTE: a QueryEngineTool returns its answer, not its nodes: the LLM call that holds the retrieved
    # chunks is the query engine's own, inside the tool call.
    chunks = _chunk_tokens(index.engine, [n.node.get_content(metadata_mode=MetadataMode.NONE)
                                          for n in answer.source_nodes])
    assert answer.metadata["reused_tokens"] >= 0.7 * chunks and answer.metadata["cache_misses"] == 0
    _report("FunctionAgent + QueryEngineTool, the query engine's call", answer.metadata, chunks)
    _report("FunctionAgent + QueryEngineTool, the agent's final call", _stats(final))


@pytest.mark.slow
def test_function_agent_with_a_retriever_tool_reuses_the_chunks_it_returns(
        llm: FusionRAGLLM, index: FusionIndex, calls: _Calls) -> None:
    search = RetrieverTool.from_defaults(FusionRAGRetriever.from_index(index, similarity_top_k=2),
                                         name="search_docs", description="Finds passages about a topic.")
    agent = FunctionAgent(tools=[search], llm=llm, initial_tool_choice="search_docs", allow_parallel_tool_calls=False)
    output, [result] = _run(agent, LIGHTHOUSE)
    _valid(result, search)
    messages, _, final = _last_agent_call(calls)
    _flowed_back(messages, result)
    assert output.response.content
    nodes: list[NodeWithScore] = result.tool_output.raw_output
    chunks = _chunk_tokens(index.engine, [n.node.get_content(metadata_mode=MetadataMode.NONE) for n in nodes])
    meta = _stats(final)
    assert meta["reused_tokens"] >= 0.7 * chunks and meta["cache_misses"] == 0
    assert set(meta["chunk_found_by"].values()) == {"content"}
    _report("FunctionAgent + RetrieverTool (ingested), final call", meta, chunks)


@pytest.mark.slow
def test_nodes_a_tool_returns_are_learned_then_reused(default_engine: FusionEngine, tmp_path: Path,
                                                       calls: _Calls) -> None:
    # NOTE: MockEmbedding embeds every query alike; the first two nodes are nearest it, the others one-hot.
    nodes = [TextNode(text=t, embedding=[1.0] * 4 if i < 2 else [float(i == j) for j in range(4)])
             for i, t in enumerate(TEXTS)]
    retriever = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=4)).as_retriever(similarity_top_k=2)
    search = RetrieverTool.from_defaults(retriever, name="search_docs", description="Finds passages about a topic.")
    llm = FusionRAGLLM(engine=default_engine, max_new_tokens=64, learned_dir=str(tmp_path / "learned"))
    found = []
    for _ in range(2):
        agent = FunctionAgent(tools=[search], llm=llm, initial_tool_choice="search_docs",
                              allow_parallel_tool_calls=False)
        _, [result] = _run(agent, LIGHTHOUSE)
        found.append((_stats(_last_agent_call(calls)[2]), result.tool_output.raw_output))
    (first, nodes_first), (second, nodes_second) = found
    assert first["cache_misses"] == len(nodes_first) == 2 and first["reused_tokens"] == 0  # learned here
    chunks = _chunk_tokens(default_engine, [n.node.get_content(metadata_mode=MetadataMode.NONE)
                                            for n in nodes_second])
    assert second["reused_tokens"] >= 0.7 * chunks and second["cache_misses"] == 0
    _report("FunctionAgent + RetrieverTool (not ingested), first run's final call", first, chunks)
    _report("FunctionAgent + RetrieverTool (not ingested), second run's final call", second, chunks)


@pytest.mark.slow
def test_react_agent_answers(llm: FusionRAGLLM, calls: _Calls) -> None:
    # NOTE: ReAct parses text; an answer in no ReAct format is taken as the final answer, and
    # "generate" ends a run that reaches max_iterations with one more LLM call instead of an error.
    agent = ReActAgent(tools=[MULTIPLY], llm=llm, early_stopping_method="generate")
    output, _ = _run(agent, ASK)
    assert output.response.content and calls.calls
    assert not any(c[1].get("tools") for c in calls.calls)  # NOTE: ReAct binds no tools: it reads text
    _report("ReActAgent, final call", _stats(calls.calls[-1][2]))
