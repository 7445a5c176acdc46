"""Real OpenAI clients against `fusionrag serve`'s app: the `openai` package, LangChain's
`ChatOpenAI` in a RAG chain, LlamaIndex's `OpenAILike`, and raw HTTP with a hand-parsed SSE stream.

One server per module (uvicorn in a thread on loopback, `tests.http_server.running_app`) over a
`ReuseSession` of a small `FusionIndex` of the packaged SmolLM2-135M-Instruct, so the prompts that
quote a passage hold a stored chunk, found by its content.

What is checked, for each client, streaming and not:
* greedy answers (temperature 0) are token-for-token the in-process answers of the same messages
  and budget (`ReuseSession.answer`, or `ChatFusionRAG` for the LangChain chain): the server adds
  nothing to, and drops nothing from, what the engine generated;
* the reuse reaches the client: `usage.prompt_tokens_details.cached_tokens` (LangChain's
  `input_token_details.cache_read`) is positive and FusionRAG's own statistics arrive under the
  response's extra `fusionrag` field;
* a request forcing a tool gets one parsed call whose arguments are valid under the tool's schema.

NOTE: the module's session learns nothing (`learn=False`): a learned span would make the second of
two identical prompts reuse what the first recomputed, so server and in-process answers, computed
one after the other, could differ for a reason that is no server bug. Learned caches reaching the
client are checked on a second, learning server of their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnablePassthrough
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from pydantic import SecretStr

from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.query.tools import InvalidToolCall, ToolCall, split_calls, tool_request
from fusionrag_integrations.langchain import ChatFusionRAG, FusionRAGRetriever, format_docs
from fusionrag_integrations.openai_server import ServerConfig, create_app
from fusionrag_integrations.request import RequestOptions
from fusionrag_integrations.session import ReuseConfig, ReuseSession
from tests.http_server import running_app

pytestmark = pytest.mark.slow

PASSAGES = [
    "The Lumen lighthouse on Gull Point was designed by the engineer Ada Vell in 1891, after the old light "
    "failed in a winter storm.",
    "Ada Vell was born in the port town of Marrow, where her father repaired ship clocks for the harbour board.",
    "The tower is forty metres tall and built of grey granite quarried on the island of Skerra, two days away "
    "by boat.",
    "Tessaly Instruments built the lighthouse clock; its founder was Oren Tessaly, a watchmaker from Corran.",
]
QUESTION = "Who designed the Lumen lighthouse?"
MAX_TOKENS = 12
WEATHER_TOOL: Any = {  # NOTE: Any: the openai package types its arguments as TypedDicts
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
FORCE_WEATHER: Any = {"type": "function", "function": {"name": "get_weather"}}
TOOL_MAX_TOKENS = 40
WEATHER_QUESTION: Any = {"role": "user", "content": "What is the weather in Paris?"}


def rag_messages(passages: Sequence[str] = PASSAGES[:2], question: str = QUESTION) -> list[dict[str, Any]]:
    """A user message quoting stored passages (each at a line start), then the question."""
    context = "\n\n".join(passages)
    return [{"role": "user", "content": f"Answer from the context.\n\n{context}\n\nQuestion: {question}"}]


def completion_prompt() -> str:
    return f"{PASSAGES[0]}\n\nQuestion: {QUESTION}\nAnswer:"


# ---- fixtures -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus_index(default_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FusionIndex]:
    index = FusionIndex.open(default_engine, tmp_path_factory.mktemp("server-index"),
                             config=IngestConfig(chunk_tokens=64, neighbours=2))
    index.add_texts(PASSAGES)
    yield index
    index.close()


@pytest.fixture(scope="module")
def session(corpus_index: FusionIndex, tmp_path_factory: pytest.TempPathFactory) -> ReuseSession:
    return ReuseSession(corpus_index.engine, corpus_index.store,
                        ReuseConfig(learn=False, data_dir=tmp_path_factory.mktemp("server-data")))


@pytest.fixture(scope="module")
def base_url(session: ReuseSession) -> Iterator[str]:
    with running_app(create_app(session, ServerConfig())) as url:
        yield url


@pytest.fixture(scope="module")
def model_name(session: ReuseSession) -> str:
    return session.engine.name


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


# ---- the in-process answers -----------------------------------------------------------------------------
def _options(max_tokens: int) -> RequestOptions:
    return RequestOptions.from_values({"max_new_tokens": max_tokens, "temperature": 0.0})


def _collect(pieces: Iterator[Any]) -> tuple[str, Generation]:
    text, generation = [], None
    for piece in pieces:
        if isinstance(piece, Generation):
            generation = piece
        elif isinstance(piece, str):
            text.append(piece)
    assert generation is not None
    return "".join(text), generation


def in_process_chat(session: ReuseSession, messages: list[dict[str, Any]],
                    max_tokens: int = MAX_TOKENS) -> tuple[str, Generation]:
    """What the engine answers `messages` in this process (the server's reference)."""
    return _collect(session.answer(messages, _options(max_tokens)))


def in_process_completion(session: ReuseSession, text: str, max_tokens: int = MAX_TOKENS) -> tuple[str, Generation]:
    options = _options(max_tokens)
    sources = session.sources(options)
    return _collect(session.run(session.prompt_from_text(text, sources), options, sources))


@pytest.fixture(scope="module")
def weather_call(session: ReuseSession) -> ToolCall:
    """The call the engine makes in process, forced to call get_weather on WEATHER_QUESTION."""
    tools = tool_request([WEATHER_TOOL], FORCE_WEATHER, None)
    messages = [WEATHER_QUESTION]
    options = RequestOptions.from_values({"max_new_tokens": TOOL_MAX_TOKENS, "temperature": 0.0}, tools=tools)
    calls = [p for p in split_calls(session.answer(messages, options), session.engine.tool_format, tools)
             if isinstance(p, ToolCall)]
    assert len(calls) == 1, calls
    return calls[0]


def assert_reuse_reported(usage: dict[str, Any], stats: dict[str, Any], reference: Generation) -> None:
    """The wire usage and `fusionrag` statistics report the reference generation's reuse: the
    stored chunks' tokens reused, plus (in `cached_tokens`) what the engine's prefix cache served.

    NOTE: the prefix cache is the engine's, shared by the in-process call and the server's, so the
    second of the two may find a prefix the first left: only the chunk reuse must be equal.
    """
    assert usage["prompt_tokens"] == stats["prompt_tokens"] == reference.prompt_tokens
    assert usage["completion_tokens"] == stats["completion_tokens"] == len(reference.token_ids)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == stats["reused_tokens"] + stats["prefix_cached_tokens"]
    assert stats["reused_tokens"] == reference.reused_tokens > 0
    assert stats["cache_misses"] == 0 and set(stats["chunk_found_by"].values()) == {"content"}, stats


def assert_weather_call(name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert name == "get_weather"
    jsonschema.validate(args, WEATHER_TOOL["function"]["parameters"])
    return args


# ---- the openai package ---------------------------------------------------------------------------------
def test_models_list_names_the_served_model(client: openai.OpenAI, model_name: str) -> None:
    assert [m.id for m in client.models.list()] == [model_name]


def test_openai_chat_equals_in_process_and_reports_reuse(client: openai.OpenAI, session: ReuseSession,
                                                         model_name: str) -> None:
    messages: Any = rag_messages()
    expected, reference = in_process_chat(session, messages)
    response = client.chat.completions.create(model=model_name, messages=messages,
                                              max_tokens=MAX_TOKENS, temperature=0)
    choice = response.choices[0]
    assert choice.message.content == expected and expected.strip()
    assert choice.finish_reason == reference.finish_reason
    assert response.usage is not None and response.usage.completion_tokens == len(reference.token_ids)
    assert response.model_extra is not None
    assert_reuse_reported(response.usage.model_dump(), response.model_extra["fusionrag"], reference)


def test_openai_chat_stream_equals_in_process_with_usage(client: openai.OpenAI, session: ReuseSession,
                                                         model_name: str) -> None:
    messages: Any = rag_messages()
    expected, reference = in_process_chat(session, messages)
    stream = client.chat.completions.create(model=model_name, messages=messages,
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [reference.finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.model_extra is not None
    assert_reuse_reported(last.usage.model_dump(), last.model_extra["fusionrag"], reference)


def test_openai_completion_equals_in_process(client: openai.OpenAI, session: ReuseSession,
                                             model_name: str) -> None:
    expected, reference = in_process_completion(session, completion_prompt())
    response = client.completions.create(model=model_name, prompt=completion_prompt(), max_tokens=MAX_TOKENS,
                                         temperature=0)
    assert response.choices[0].text == expected and expected.strip()
    assert response.usage is not None and response.model_extra is not None
    assert_reuse_reported(response.usage.model_dump(), response.model_extra["fusionrag"], reference)
    stream = client.completions.create(model=model_name, prompt=completion_prompt(), max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].model_extra is not None
    assert_reuse_reported(chunks[-1].usage.model_dump(), chunks[-1].model_extra["fusionrag"], reference)


def test_openai_forced_tool_call_is_parsed_and_valid(client: openai.OpenAI, weather_call: ToolCall,
                                                     model_name: str) -> None:
    response = client.chat.completions.create(model=model_name, messages=[WEATHER_QUESTION],
                                              tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER,
                                              max_tokens=TOOL_MAX_TOKENS, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert assert_weather_call(call.function.name, call.function.arguments) == weather_call.arguments
    assert call.id and call.type == "function"
    # NOTE: this prompt holds no stored chunk: only the engine's prefix cache may count as cached.
    assert response.usage is not None and response.model_extra is not None
    stats = response.model_extra["fusionrag"]
    assert stats["reused_tokens"] == 0 and stats["invalid_tool_calls"] == []
    assert response.usage.prompt_tokens_details is not None
    assert response.usage.prompt_tokens_details.cached_tokens == stats["prefix_cached_tokens"]


def test_openai_forced_tool_call_streams_as_delta_tool_calls(client: openai.OpenAI, weather_call: ToolCall,
                                                             model_name: str) -> None:
    stream = client.chat.completions.create(model=model_name, messages=[WEATHER_QUESTION],
                                            tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER,
                                            max_tokens=TOOL_MAX_TOKENS, temperature=0, stream=True)
    deltas = [d for c in stream if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0] * len(deltas) and deltas[0].id
    name = "".join(d.function.name or "" for d in deltas if d.function)
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert assert_weather_call(name, arguments) == weather_call.arguments


def test_openai_tool_round_trip_equals_in_process(client: openai.OpenAI, session: ReuseSession,
                                                  model_name: str) -> None:
    """An agent's second turn: the client sends back its assistant message (tool_calls, no content)
    and the tool's result; the server reads both as the engine does in process."""
    first = client.chat.completions.create(model=model_name, messages=[WEATHER_QUESTION], tools=[WEATHER_TOOL],
                                           tool_choice=FORCE_WEATHER, max_tokens=TOOL_MAX_TOKENS, temperature=0)
    assistant = first.choices[0].message
    assert assistant.tool_calls is not None
    messages: Any = [WEATHER_QUESTION, assistant.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": assistant.tool_calls[0].id, "content": "Sunny, 24 C"}]
    tools = tool_request([WEATHER_TOOL], None, None)
    options = RequestOptions.from_values({"max_new_tokens": MAX_TOKENS, "temperature": 0.0}, tools=tools)
    pieces = list(split_calls(session.answer(messages, options), session.engine.tool_format, tools))
    # NOTE: a call that does not parse is shown as the text the model wrote (and listed under fusionrag).
    expected_text = "".join(p.text if isinstance(p, InvalidToolCall) else p for p in pieces
                            if isinstance(p, (str, InvalidToolCall)))
    expected_calls = [(p.name, p.arguments) for p in pieces if isinstance(p, ToolCall)]
    assert expected_text.strip() or expected_calls
    second = client.chat.completions.create(model=model_name, messages=messages, tools=[WEATHER_TOOL],
                                            max_tokens=MAX_TOKENS, temperature=0)
    message = second.choices[0].message
    assert (message.content or "") == expected_text
    calls = [c for c in message.tool_calls or [] if isinstance(c, ChatCompletionMessageFunctionToolCall)]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected_calls


def test_learned_caches_reach_the_client(corpus_index: FusionIndex, tmp_path: Path) -> None:
    """A learning server: context that no store holds is learned from the first request and reused,
    as `cached_tokens`, by the next request that quotes it."""
    learning = ReuseSession(corpus_index.engine, corpus_index.store, ReuseConfig(learned_dir=tmp_path / "learned"))
    unseen = ("The harbour office of Marrow keeps the tide tables in a blue ledger; the clerk copies them "
              "every Sunday and pins them to the door of the fish market.")
    messages: Any = rag_messages([unseen], "Where are the tide tables pinned?")
    with running_app(create_app(learning, ServerConfig())) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as learner:
        first, second = (learner.chat.completions.create(model=learning.engine.name, messages=messages,
                                                         max_tokens=1, temperature=0) for _ in range(2))
    stats = [r.model_extra["fusionrag"] for r in (first, second) if r.model_extra is not None]
    assert stats[0]["reused_tokens"] == 0 and stats[1]["reused_tokens"] > 0, stats
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= stats[1]["reused_tokens"]


# ---- LangChain: ChatOpenAI in an LCEL RAG chain -----------------------------------------------------------
def _plain_docs(docs: Sequence[Document]) -> str:
    """The RAG tutorial's own `format_docs`: texts joined, no marks (found by content)."""
    return "\n\n".join(doc.page_content for doc in docs)


def _rag_chain(index: FusionIndex, llm: BaseChatModel,
               docs_to_text: Callable[[Sequence[Document]], str]) -> Runnable[str, str]:
    prompt = ChatPromptTemplate.from_messages([("human", "Answer from the context.\n\n{context}\n\nQuestion: "
                                                         "{question}")])
    retriever = FusionRAGRetriever(index=index, k=2)
    return ({"context": retriever | docs_to_text, "question": RunnablePassthrough()}
            | prompt | llm | StrOutputParser())


@pytest.fixture(scope="module")
def chat_openai(base_url: str, model_name: str) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{base_url}/v1", api_key=SecretStr("x"), model=model_name, temperature=0,
                      max_tokens=MAX_TOKENS, max_retries=0, stream_usage=True)  # type: ignore[call-arg]


@pytest.mark.parametrize("docs_to_text", [_plain_docs, format_docs], ids=["plain", "marked"])
def test_langchain_rag_chain_equals_in_process_chain(corpus_index: FusionIndex, chat_openai: ChatOpenAI,
                                                     docs_to_text: Callable[[Sequence[Document]], str]) -> None:
    """The tutorial's chain, and FusionRAG's `format_docs` (whose marks travel in the JSON)."""
    local = ChatFusionRAG(index=corpus_index, temperature=0, max_tokens=MAX_TOKENS, learn=False)
    expected = _rag_chain(corpus_index, local, docs_to_text).invoke(QUESTION)
    assert expected.strip()
    chain = _rag_chain(corpus_index, chat_openai, docs_to_text)
    assert chain.invoke(QUESTION) == expected
    assert "".join(chain.stream(QUESTION)) == expected


def test_langchain_usage_reports_cache_read(chat_openai: ChatOpenAI, session: ReuseSession) -> None:
    messages = rag_messages()
    _, reference = in_process_chat(session, messages)
    message = chat_openai.invoke(messages[0]["content"])
    streamed = [chunk for chunk in chat_openai.stream(messages[0]["content"]) if chunk.usage_metadata]
    assert len(streamed) == 1
    for usage in (message.usage_metadata, streamed[0].usage_metadata):
        assert usage is not None and usage["input_tokens"] == reference.prompt_tokens
        # NOTE: the stored chunks' tokens, plus whatever the engine's prefix cache served (see
        # assert_reuse_reported).
        assert 0 < reference.reused_tokens <= usage["input_token_details"]["cache_read"] < usage["input_tokens"]


def test_langchain_bind_tools_forced_returns_tool_calls(chat_openai: ChatOpenAI) -> None:
    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    llm = chat_openai.bind_tools([get_weather], tool_choice="get_weather")
    message = llm.invoke("What is the weather in Paris?", max_tokens=TOOL_MAX_TOKENS)
    assert isinstance(message, AIMessage) and message.invalid_tool_calls == []
    (call,) = message.tool_calls
    assert_weather_call(call["name"], call["args"])
    assert call["id"]


# ---- LlamaIndex: OpenAILike -------------------------------------------------------------------------------
def _openai_like(base_url: str, model_name: str, *, chat: bool) -> OpenAILike:
    return OpenAILike(api_base=f"{base_url}/v1", api_key="x", model=model_name, is_chat_model=chat,
                      temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=120)


def _fusionrag_field(raw: Any) -> dict[str, Any]:
    """The `fusionrag` statistics of the openai response object a LlamaIndex response keeps as `raw`."""
    assert raw is not None and raw.model_extra is not None
    return dict(raw.model_extra["fusionrag"])


def test_llama_index_chat_and_stream_chat_equal_in_process(base_url: str, model_name: str,
                                                            session: ReuseSession) -> None:
    messages = rag_messages()
    expected, reference = in_process_chat(session, messages)
    llm = _openai_like(base_url, model_name, chat=True)
    question = [ChatMessage(role="user", content=messages[0]["content"])]
    response = llm.chat(question)
    assert response.message.content == expected
    assert _fusionrag_field(response.raw)["reused_tokens"] == reference.reused_tokens > 0
    assert "".join(r.delta or "" for r in llm.stream_chat(question)) == expected


def test_llama_index_complete_equals_in_process(base_url: str, model_name: str, session: ReuseSession) -> None:
    expected, reference = in_process_completion(session, completion_prompt())
    llm = _openai_like(base_url, model_name, chat=False)
    response = llm.complete(completion_prompt())
    assert response.text == expected and expected.strip()
    assert _fusionrag_field(response.raw)["reused_tokens"] == reference.reused_tokens > 0


# ---- raw HTTP ---------------------------------------------------------------------------------------------
def _sse_payloads(lines: Iterator[str]) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE stream, which must end with `data: [DONE]` and hold only data events."""
    payloads: list[dict[str, Any]] = []
    done = False
    for line in lines:
        if not line:
            continue
        assert not done, f"an event after [DONE]: {line!r}"
        assert line.startswith("data: "), line
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
        else:
            payloads.append(json.loads(data))
    assert done, "the stream did not end with data: [DONE]"
    return payloads


def test_raw_http_json_and_sse(base_url: str, session: ReuseSession) -> None:
    messages = rag_messages()
    expected, reference = in_process_chat(session, messages)
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    with httpx.Client(base_url=base_url, timeout=120) as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200 and response.headers["content-type"] == "application/json"
        data = response.json()
        assert data["object"] == "chat.completion" and data["choices"][0]["message"]["content"] == expected
        assert_reuse_reported(data["usage"], data["fusionrag"], reference)
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/chat/completions", json=stream_body) as sse:
            assert sse.status_code == 200 and sse.headers["content-type"].startswith("text/event-stream")
            payloads = _sse_payloads(sse.iter_lines())
    assert all(p["object"] == "chat.completion.chunk" and p["id"] == payloads[0]["id"] for p in payloads)
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads if p["choices"]) == expected
    assert payloads[-1]["choices"] == []
    assert_reuse_reported(payloads[-1]["usage"], payloads[-1]["fusionrag"], reference)
