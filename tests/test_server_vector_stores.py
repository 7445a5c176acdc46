"""Vector stores, files and the Responses routes' refusals, over the 1-layer random engine (fast: no
answer here needs to make sense).

What is checked: a server without vector stores says so (400, a code of its own) on every store
route and on file_search; unknown ids are 404s in OpenAI's error shape; a chunking strategy other
than the store's is refused, as is a second vector store per search; vector stores, their files and
uploads survive a restart of the server (they are corpora on disk); `fusionrag serve`'s stores
live under --db; the response object carries every field the Open Responses schema requires.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fusionrag_core.engine import FusionEngine
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_integrations.openai_server import ServerConfig, create_app
from fusionrag_integrations.openai_server.command import vector_stores_for
from fusionrag_integrations.openai_server.vector_stores import VectorStoreConfig, VectorStores
from fusionrag_integrations.session import ReuseConfig, ReuseSession
from tests.http_server import running_app

TEXT = "The Lumen lighthouse was designed by Ada Vell.\n\nAda Vell was born in the port town of Marrow."
OPEN_RESPONSES_REQUIRED = (
    "id", "object", "created_at", "completed_at", "status", "incomplete_details", "model", "previous_response_id",
    "instructions", "output", "error", "tools", "tool_choice", "truncation", "parallel_tool_calls", "text", "top_p",
    "presence_penalty", "frequency_penalty", "top_logprobs", "temperature", "reasoning", "user", "usage",
    "max_output_tokens", "max_tool_calls", "store", "background", "service_tier", "metadata", "safety_identifier",
    "prompt_cache_key")
"""The `required` list of the Open Responses schema's ResponseResource."""


@pytest.fixture(scope="module")
def session(one_layer_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> ReuseSession:
    return ReuseSession(one_layer_engine, None, ReuseConfig(learn=False, data_dir=tmp_path_factory.mktemp("d")))


@pytest.fixture(scope="module")
def bare(session: ReuseSession) -> Iterator[httpx.Client]:
    """A server without vector stores."""
    with running_app(create_app(session, ServerConfig())) as url, httpx.Client(base_url=url, timeout=60) as c:
        yield c


def stores_at(engine: FusionEngine, data_dir: Path) -> VectorStores:
    return VectorStores(engine, VectorStoreConfig(data_dir=data_dir, ingest=IngestConfig(chunk_tokens=32,
                                                                                       neighbours=1)))


@pytest.fixture
def served(session: ReuseSession, tmp_path: Path) -> Iterator[httpx.Client]:
    stores = stores_at(session.engine, tmp_path)
    try:
        with running_app(create_app(session, ServerConfig(), stores)) as url, \
                httpx.Client(base_url=url, timeout=120) as c:
            yield c
    finally:
        stores.close()


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return dict(body["error"])


def upload(client: httpx.Client, name: str = "a.txt", text: str = TEXT) -> str:
    response = client.post("/v1/files", files={"file": (name, text.encode())}, data={"purpose": "assistants"})
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def test_without_vector_stores_the_store_routes_and_file_search_say_so(bare: httpx.Client) -> None:
    for method, path in (("GET", "/v1/vector_stores"), ("GET", "/v1/files"), ("GET", "/v1/vector_stores/vs_1")):
        assert error_of(bare.request(method, path), 400)["code"] == "vector_stores_unavailable"
    body = {"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}
    assert "without a data directory" in error_of(bare.post("/v1/responses", json=body), 400)["message"]


def test_the_response_object_has_every_field_open_responses_requires(bare: httpx.Client) -> None:
    response = bare.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [key for key in OPEN_RESPONSES_REQUIRED if key not in body] == []
    assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
    assert isinstance(body["completed_at"], int) and body["usage"]["input_tokens_details"]["cached_tokens"] >= 0


def test_unknown_ids_are_404s(served: httpx.Client) -> None:
    for method, path in (("GET", "/v1/vector_stores/vs_nope"), ("GET", "/v1/files/file_nope"),
                         ("DELETE", "/v1/vector_stores/vs_nope"), ("GET", "/v1/responses/resp_nope"),
                         ("DELETE", "/v1/responses/resp_nope")):
        assert error_of(served.request(method, path), 404)["code"] == "not_found"
    body = {"input": "hi", "previous_response_id": "resp_nope"}
    assert error_of(served.post("/v1/responses", json=body), 404)["param"] == "previous_response_id"
    missing = served.post("/v1/vector_stores", json={"file_ids": ["file_" + "0" * 32]})
    assert "No file" in error_of(missing, 404)["message"]


def test_a_foreign_chunking_strategy_and_two_stores_per_search_are_400s(served: httpx.Client) -> None:
    store = served.post("/v1/vector_stores", json={"name": "s"}).json()
    static = {"type": "static", "static": {"max_chunk_size_tokens": 800, "chunk_overlap_tokens": 400}}
    added = served.post(f"/v1/vector_stores/{store['id']}/files", json={"file_id": upload(served),
                                                                       "chunking_strategy": static})
    assert "chunk_overlap_tokens" in error_of(added, 400)["message"]
    body = {"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": [store["id"], store["id"]]}]}
    assert "one vector store" in error_of(served.post("/v1/responses", json=body), 400)["message"]


def test_vector_stores_and_uploads_survive_a_restart(session: ReuseSession, tmp_path: Path) -> None:
    stores = stores_at(session.engine, tmp_path)
    try:
        with running_app(create_app(session, ServerConfig(), stores)) as url, httpx.Client(base_url=url,
                                                                                         timeout=120) as c:
            file_id = upload(c)
            store = c.post("/v1/vector_stores", json={"name": "kept", "metadata": {"k": "v"},
                                                      "file_ids": [file_id]}).json()
            assert store["file_counts"]["completed"] == 1, store
    finally:
        stores.close()
    again = stores_at(session.engine, tmp_path)
    try:
        (kept,) = again.list_stores("")
        assert (kept["id"], kept["name"], kept["metadata"]) == (store["id"], "kept", {"k": "v"})
        assert [f["id"] for f in again.list_files(store["id"], "")] == [file_id]
        assert again.files.text(file_id, "") == TEXT
        hits = again.search(store["id"], "", "Who designed the lighthouse?", 1)
        assert hits and hits[0].metadata["file_id"] == file_id
        again.delete_file(store["id"], file_id, "")
        assert again.list_files(store["id"], "") == [] and not again.search(store["id"], "", "lighthouse", 1)
    finally:
        again.close()


def test_fusionrag_serve_keeps_its_vector_stores_under_db(one_layer_engine: FusionEngine, tmp_path: Path) -> None:
    args = argparse.Namespace(db=str(tmp_path), chroma_url=None, redis_url=None)
    stores = vector_stores_for(args, one_layer_engine)
    try:
        assert stores.files.root == tmp_path / "files" and (tmp_path / "chroma").is_dir()
    finally:
        stores.close()


def test_a_conversation_outlives_its_deleted_vector_store(served: httpx.Client,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    store = served.post("/v1/vector_stores", json={"file_ids": [upload(served)]}).json()
    tools = [{"type": "file_search", "vector_store_ids": [store["id"]], "max_num_results": 2}]
    first = served.post("/v1/responses", json={"input": "Who designed it?", "tools": tools, "max_output_tokens": 3,
                                               "tool_choice": {"type": "file_search"}, "temperature": 0})
    assert first.status_code == 200, first.text
    assert first.json()["output"][0]["type"] == "file_search_call" and first.json()["output"][0]["results"]
    assert served.delete(f"/v1/vector_stores/{store['id']}").json()["deleted"] is True
    follow = served.post("/v1/responses", json={"input": "And then?", "previous_response_id": first.json()["id"],
                                                "max_output_tokens": 3, "temperature": 0})
    assert follow.status_code == 200, follow.text
    assert f"vector store {store['id']} of a continued conversation was deleted" in caplog.text
