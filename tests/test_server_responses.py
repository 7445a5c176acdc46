"""The Responses API, files and vector stores, through the `openai` package against a real server
(uvicorn on loopback, `tests.http_server.running_app`) of the packaged SmolLM2-135M-Instruct.

What is checked:
* `responses.create` answers greedy text token for token as the chat path does in process, whole
  and streamed (the spec's semantic events, in order, deltas adding up to the text);
* function tools (forced: a parsed `function_call` item), `function_call_output` round trips,
  `text.format` JSON schema, refusals (image input, reasoning) as 400s naming the field;
* `store` + `previous_response_id`: GET/DELETE, and a follow-up whose cached tokens cover the whole
  first prompt (the engine continued the kept K/V);
* files and vector stores: upload, create with files (ingested: chunked, cached, fused, indexed),
  list, retrieve, search, delete;
* file_search: forced, and called by the model (a forced tool choice of its function); the output's
  `file_search_call` item with its results, `file_citation` annotations, and the retrieved chunks
  found by mark (chunk id) with their caches: >= 0.8 of their tokens reused on the first ask.

The module's session learns nothing (`learn=False`), so the in-process reference and the server
read the same caches.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from fusionrag_core.engine import FusionEngine
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_integrations.openai_server import ServerConfig, create_app
from fusionrag_integrations.openai_server.vector_stores import VectorStoreConfig, VectorStores
from fusionrag_integrations.session import ReuseConfig, ReuseSession
from tests.http_server import running_app
from tests.test_server_clients import PASSAGES, QUESTION, WEATHER_QUESTION, in_process_chat

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
WEATHER: Any = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
DOCUMENTS = {"lighthouse.txt": "\n\n".join(PASSAGES[:2]), "tower.txt": "\n\n".join(PASSAGES[2:])}


@pytest.fixture(scope="module")
def stores(default_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VectorStores]:
    config = VectorStoreConfig(data_dir=tmp_path_factory.mktemp("vector-stores"),
                               ingest=IngestConfig(chunk_tokens=48, neighbours=2))
    stores = VectorStores(default_engine, config)
    yield stores
    stores.close()


@pytest.fixture(scope="module")
def session(default_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> ReuseSession:
    return ReuseSession(default_engine, None, ReuseConfig(learn=False, data_dir=tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def base_url(session: ReuseSession, stores: VectorStores) -> Iterator[str]:
    with running_app(create_app(session, ServerConfig(), stores)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def vector_store(client: openai.OpenAI, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A vector store of the two DOCUMENTS, uploaded and added through the SDK."""
    folder = tmp_path_factory.mktemp("uploads")
    ids = []
    for name, text in DOCUMENTS.items():
        (folder / name).write_text(text)
        with open(folder / name, "rb") as f:
            ids.append(client.files.create(file=f, purpose="assistants").id)
    store = client.vector_stores.create(name="lighthouse", file_ids=ids[:1])
    added = client.vector_stores.files.create_and_poll(vector_store_id=store.id, file_id=ids[1])
    assert added.status == "completed", added.last_error
    return client.vector_stores.retrieve(store.id)


# ---- plain answers ----------------------------------------------------------------------------------------
def test_text_equals_the_chat_path_in_process(client: openai.OpenAI, session: ReuseSession) -> None:
    expected, reference = in_process_chat(session, [{"role": "system", "content": "Answer briefly."},
                                                    {"role": "user", "content": QUESTION}], MAX_TOKENS)
    response = client.responses.create(model=session.engine.name, instructions="Answer briefly.", input=QUESTION,
                                       max_output_tokens=MAX_TOKENS, temperature=0)
    assert response.output_text == expected and expected.strip()
    assert response.status == ("incomplete" if reference.finish_reason == "length" else "completed")
    assert response.usage is not None
    assert response.usage.input_tokens == reference.prompt_tokens
    assert response.usage.output_tokens == len(reference.token_ids)
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    items = client.responses.create(input=[{"role": "system", "content": "Answer briefly."},
                                           {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
                                    max_output_tokens=MAX_TOKENS, temperature=0)
    assert items.output_text == expected


def test_stream_sends_the_semantic_events_in_order(client: openai.OpenAI) -> None:
    whole = client.responses.create(input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0)
    events = list(client.responses.create(input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage is not None


def test_forced_function_call_then_its_output_round_trips(client: openai.OpenAI) -> None:
    first = client.responses.create(input=WEATHER_QUESTION["content"], tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=40, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = client.responses.create(previous_response_id=first.id, tools=[WEATHER], max_output_tokens=MAX_TOKENS,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 24 C"}], temperature=0)
    assert second.status in ("completed", "incomplete") and second.output
    streamed = list(client.responses.create(input=WEATHER_QUESTION["content"], tools=[WEATHER], tool_choice="required",
                                            max_output_tokens=40, temperature=0, stream=True))
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in streamed if e.type == "response.function_call_arguments.done")
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])


def test_text_format_json_schema_constrains_the_answer(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"designer": {"type": "string", "maxLength": 20}},
              "required": ["designer"], "additionalProperties": False}
    response = client.responses.create(input=QUESTION, max_output_tokens=30, temperature=0, text={
        "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)


def test_previous_response_id_continues_the_kept_kv(client: openai.OpenAI) -> None:
    first = client.responses.create(input=f"{PASSAGES[0]}\n\n{QUESTION}", max_output_tokens=MAX_TOKENS,
                                    temperature=0)
    follow = client.responses.create(previous_response_id=first.id, input="Where was she born?",
                                     max_output_tokens=MAX_TOKENS, temperature=0)
    assert first.usage is not None and follow.usage is not None
    assert follow.usage.input_tokens > first.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(previous_response_id=first.id, input="Again?")


@pytest.mark.parametrize(("body", "says"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "text only"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
])
def test_what_is_not_done_is_a_400_naming_it(base_url: str, body: dict[str, Any], says: str) -> None:
    response = httpx.post(f"{base_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"]


# ---- files and vector stores --------------------------------------------------------------------------------
def test_vector_store_lifecycle_and_search(client: openai.OpenAI, vector_store: Any, tmp_path: Path) -> None:
    assert vector_store.file_counts.completed == 2 and vector_store.status == "completed"
    assert vector_store.id in [s.id for s in client.vector_stores.list()]
    files = client.vector_stores.files.list(vector_store_id=vector_store.id)
    assert sorted(f.status for f in files) == ["completed", "completed"]
    page = client.vector_stores.search(vector_store_id=vector_store.id, query="Who designed the lighthouse?",
                                       max_num_results=2)
    hits = list(page)
    assert hits and hits[0].filename == "lighthouse.txt" and "Ada Vell" in hits[0].content[0].text
    (tmp_path / "extra.txt").write_text("The keeper's cat is called Pilot.")
    with open(tmp_path / "extra.txt", "rb") as f:
        extra = client.files.create(file=f, purpose="assistants")
    other = client.vector_stores.create(name="extra", file_ids=[extra.id])
    assert client.vector_stores.retrieve(other.id).file_counts.completed == 1
    assert client.vector_stores.delete(other.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.vector_stores.retrieve(other.id)
    assert client.files.delete(extra.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(extra.id)


def test_a_binary_upload_is_a_400(base_url: str) -> None:
    response = httpx.post(f"{base_url}/v1/files", files={"file": ("a.pdf", b"%PDF-1.7\n\xff\xfe\x00")},
                          data={"purpose": "assistants"}, timeout=60)
    assert response.status_code == 400 and "UTF-8" in response.json()["error"]["message"]


# ---- file_search ---------------------------------------------------------------------------------------------
def assert_cited_and_reused(response: Any) -> None:
    """A file_search_call with results, the answer citing their files, their chunks found by mark
    with >= 0.8 of their tokens read from caches."""
    (search,) = [item for item in response.output if item.type == "file_search_call"]
    assert search.status == "completed" and search.results and search.queries
    message = next(item for item in response.output if item.type == "message")
    cited = {a.file_id for a in message.content[0].annotations if a.type == "file_citation"}
    assert cited == {r.file_id for r in search.results}
    stats = response.model_extra["fusionrag"]
    assert set(stats["chunk_found_by"].values()) == {"mark"} and stats["cache_misses"] == 0, stats
    share = stats["reused_tokens"] / (stats["reused_tokens"] + stats["recomputed_tokens"])
    assert share >= 0.8, stats
    assert stats["fused_chunks"] >= 1 and stats["fused_chunks"] + stats["independent_chunks"] == len(
        stats["chunk_found_by"]), stats


def test_forced_file_search_reads_the_hits_from_their_caches(client: openai.OpenAI, vector_store: Any) -> None:
    response = client.responses.create(
        input=QUESTION, tools=[{"type": "file_search", "vector_store_ids": [vector_store.id], "max_num_results": 3}],
        tool_choice={"type": "file_search"}, max_output_tokens=MAX_TOKENS, temperature=0)
    assert_cited_and_reused(response)
    assert response.output[0].type == "file_search_call" and response.output[0].queries == [QUESTION]
    follow = client.responses.create(previous_response_id=response.id, input="Where was she born?",
                                     max_output_tokens=MAX_TOKENS, temperature=0)
    assert response.usage is not None and follow.usage is not None
    assert follow.usage.input_tokens_details.cached_tokens >= response.usage.input_tokens


def test_file_search_the_model_calls_runs_on_the_server(client: openai.OpenAI, vector_store: Any) -> None:
    tools: Any = [{"type": "file_search", "vector_store_ids": [vector_store.id], "max_num_results": 2}]
    events = list(client.responses.create(input=QUESTION, tools=tools, tool_choice="required",
                                          max_output_tokens=60, temperature=0, stream=True))
    kinds = [e.type for e in events]
    searching = [k for k in kinds if k.startswith("response.file_search_call")]
    assert searching == ["response.file_search_call.in_progress", "response.file_search_call.searching",
                         "response.file_search_call.completed"]
    assert "response.output_text.annotation.added" in kinds
    assert_cited_and_reused(events[-1].response)


# ---- the OpenAI Agents SDK ----------------------------------------------------------------------------------
class Answer(BaseModel):
    designer: str = Field(max_length=24)


@pytest.mark.parametrize("streamed", [False, True])
def test_agents_sdk_file_search_tool_answers_with_citations(base_url: str, vector_store: Any,
                                                            session: ReuseSession, streamed: bool) -> None:
    """An Agents SDK agent with `FileSearchTool` on the SDK's default Responses model: the search ran
    on the server, the answer cites the file, and the retrieved chunks were read from caches."""
    agents = pytest.importorskip("agents")
    from agents.models.openai_provider import OpenAIProvider

    agents.set_tracing_disabled(True)  # NOTE: the SDK would export its traces to OpenAI's servers
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=300)
    agent = agents.Agent(
        name="librarian", instructions="Answer from the files.", model=session.engine.name,
        tools=[agents.FileSearchTool(vector_store_ids=[vector_store.id], max_num_results=3,
                                     include_search_results=True)],
        # NOTE: a short schema-bound answer, so it ends within its budget: the SDK fails a stream that
        # ends incomplete
        output_type=Answer, model_settings=agents.ModelSettings(tool_choice="file_search", max_tokens=40,
                                                                temperature=0))
    run_config = agents.RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True))

    async def run() -> Any:
        if not streamed:
            return await agents.Runner.run(agent, QUESTION, run_config=run_config)
        result = agents.Runner.run_streamed(agent, QUESTION, run_config=run_config)
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds
        return result
    result = asyncio.run(run())
    (search,) = [i.raw_item for i in result.new_items if getattr(i.raw_item, "type", "") == "file_search_call"]
    assert search.results and search.queries == [QUESTION]
    (message,) = [i.raw_item for i in result.new_items if getattr(i.raw_item, "type", "") == "message"]
    citations = [a for a in message.content[0].annotations if a.type == "file_citation"]
    assert {a.filename for a in citations} >= {"lighthouse.txt"} and result.final_output
    assert isinstance(result.final_output, Answer)
    (response,) = result.raw_responses
    assert response.usage.input_tokens_details.cached_tokens > 0
