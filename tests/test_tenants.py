"""Caches that keep tenants apart (issue 44): a request never hits a cache another tenant's traffic filled.

A server with a key file (two tenants) over a 2-layer random Llama with the real SmolLM2 tokenizer
and chat template (spans and conversations are cut as they are in production); for each cache that
traffic fills (learned spans, the conversation cache, the memo of system prefixes), the owner hits
it and the other tenant, or the owner under another `cache_salt`, misses it, in `cached_tokens`,
the `fusionrag` statistics and `chunk_found_by`. The operator's ingested corpus stays shared.
Learned retrieved documents, which only in-process integrations see, are tested through the session.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import PreTrainedTokenizerBase

from fusionrag_core.cli import build_parser, main
from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.reuse import learned
from fusionrag_core.reuse.learned import content_id
from fusionrag_core.scope import Scope
from fusionrag_core.store import DiskKVStore
from fusionrag_integrations.openai_server import ServerConfig, create_app
from fusionrag_integrations.openai_server import command as serve_command
from fusionrag_integrations.request import RequestOptions
from fusionrag_integrations.session import ReuseConfig, ReuseSession
from tests.http_server import running_app
from tests.ingest_worker import tiny_engine, tiny_engine_at

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789ab"}
RECORD = ("Patient record 4471: Mara Quill, born 12 March 1961, admitted on 3 May with a fractured left wrist after "
          "a fall on the harbour steps; treated with a cast and discharged two days later with follow-up in six "
          "weeks at the Gull Point clinic.")
CORPUS = ("The Lumen lighthouse on Gull Point was designed by the engineer Ada Vell in 1891, after the old light "
          "failed; its lamp was made by Tessaly Instruments of Corran.")


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer)


@pytest.fixture(scope="module")
def corpus(engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> DiskKVStore:
    """The operator's corpus: one ingested chunk, found by content."""
    store = DiskKVStore(tmp_path_factory.mktemp("corpus"))
    cid = content_id(CORPUS, engine.fingerprint)
    store.put(cid, engine.chunk_cache(CORPUS))
    store.content_index().add([(cid, CORPUS)])
    return store


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text("# tenant key\n" + "".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    return path


@pytest.fixture(scope="module")
def base_url(engine: FusionEngine, corpus: DiskKVStore, key_file: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    session = ReuseSession(engine, corpus, ReuseConfig(learned_dir=tmp_path_factory.mktemp("learned")))
    with running_app(create_app(session, ServerConfig(api_key_file=str(key_file)))) as url:
        yield url


def chat(base_url: str, tenant: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    response = httpx.post(f"{base_url}/v1/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {KEYS.get(tenant, tenant)}"},
                          json={"messages": messages, "max_tokens": 3, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return dict(response.json())


def cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def context(paragraph: str, question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": f"Answer from the record.\n\n{paragraph}\n\nBe brief."},
            {"role": "user", "content": question}]


# ---- learned spans --------------------------------------------------------------------------------
def test_a_learned_span_is_hit_by_its_tenant_and_missed_by_another(base_url: str) -> None:
    """Defect: client B's `cached_tokens` (78 vs 18) and `chunk_found_by` ("content" vs "span") told
    whether client A had sent a paragraph."""
    chat(base_url, "alice", context(RECORD, "When was she admitted?"))
    own = chat(base_url, "alice", context(RECORD, "Which wrist was it?"))
    assert own["fusionrag"]["reused_tokens"] > 0 and "content" in own["fusionrag"]["chunk_found_by"].values()
    assert set(own["fusionrag"]["chunk_reused_from"].values()) == {"learned"}
    assert own["fusionrag"]["approximate_cached_tokens"] == own["fusionrag"]["reused_tokens"]
    other = chat(base_url, "bob", context(RECORD, "Which wrist was it?"))
    assert cached(other) == 0
    assert other["fusionrag"]["reused_tokens"] == other["fusionrag"]["prefix_cached_tokens"] == 0
    assert other["fusionrag"]["chunk_found_by"] == other["fusionrag"]["chunk_reused_from"] == {}
    salted = chat(base_url, "alice", context(RECORD, "Which wrist was it?"), cache_salt="ward-7")
    assert cached(salted) == 0 and salted["fusionrag"]["chunk_found_by"] == {}


# ---- the conversation cache -----------------------------------------------------------------------
def test_a_conversation_is_continued_by_its_tenant_only(base_url: str) -> None:
    """Defect: replaying a guess of another client's message as an earlier turn got 40 of 54 tokens
    cached when the guess was right, 0 when it was not."""
    said = [{"role": "user", "content": "My locker code is 4471 and my badge is number 9."}]
    first = chat(base_url, "alice", said)
    replay = [*said, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
              {"role": "user", "content": "What is my locker code?"}]
    other = chat(base_url, "bob", replay)
    assert cached(other) == 0 and other["fusionrag"]["kept_prefix_tokens"] == 0
    own = chat(base_url, "alice", replay)
    assert cached(own) > 0 and own["fusionrag"]["kept_prefix_tokens"] > 0
    assert own["fusionrag"]["exact_cached_tokens"] == own["fusionrag"]["prefix_cached_tokens"] > 0


# ---- the memo of system prefixes ------------------------------------------------------------------
def test_a_system_prompt_memoised_for_a_tenant_is_not_served_to_another(base_url: str) -> None:
    """A prompt that starts with another tenant's system prompt (before a corpus chunk) computes it afresh."""
    secret = "You are the triage assistant of ward 7; never mention patient 4471."
    messages = [{"role": "system", "content": f"{secret}\n\n{CORPUS}\n\nBe brief."},
                {"role": "user", "content": "Who designed it?"}]
    chat(base_url, "alice", messages)
    own = chat(base_url, "alice", messages)
    assert own["fusionrag"]["prefix_cached_tokens"] > 0
    other = chat(base_url, "bob", messages)
    assert other["fusionrag"]["system_prefix_tokens"] == other["fusionrag"]["kept_prefix_tokens"] == 0


# ---- the operator's corpus ------------------------------------------------------------------------
def test_the_ingested_corpus_is_shared_by_every_tenant(base_url: str) -> None:
    for tenant in KEYS:
        body = chat(base_url, tenant, context(CORPUS, "Who made the lamp?"), cache_salt=f"fresh-{tenant}")
        assert "content" in body["fusionrag"]["chunk_found_by"].values(), tenant
        assert set(body["fusionrag"]["chunk_reused_from"].values()) == {"corpus"}
        assert body["fusionrag"]["reused_tokens"] > 0


# ---- keys ------------------------------------------------------------------------------------------
def test_the_key_file_is_read_again_when_it_changes(base_url: str, key_file: Path) -> None:
    before = key_file.read_text()
    try:
        key_file.write_text(before + "carol carol-key-0123456789\n")
        time.sleep(0.01)
        assert chat(base_url, "carol-key-0123456789", [{"role": "user", "content": "Hello?"}])["choices"]
        key_file.write_text(before)  # NOTE: revoked
        response = httpx.post(f"{base_url}/v1/chat/completions", timeout=60,
                              headers={"Authorization": "Bearer carol-key-0123456789"},
                              json={"messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 1})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    finally:
        key_file.write_text(before)


def test_a_salt_that_is_too_long_is_refused_with_the_limit(base_url: str) -> None:
    response = httpx.post(f"{base_url}/v1/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {KEYS['alice']}"},
                          json={"messages": [{"role": "user", "content": "Hi"}], "cache_salt": "x" * 2000})
    assert response.status_code == 400
    assert "cache_salt" in response.json()["error"]["message"]


# ---- learned retrieved documents (in-process) ---------------------------------------------------------
def _asking_the_record(engine: FusionEngine, learned_dir: Path) -> Callable[[Scope], Generation]:
    """Ask about RECORD, retrieved for the request, in a scope (in-process, learning on)."""
    session = ReuseSession(engine, None, ReuseConfig(learned_dir=learned_dir))
    options = RequestOptions(SamplingConfig(max_new_tokens=2))

    def ask(scope: Scope) -> Generation:
        *_, generation = session.answer(context(RECORD, "Which wrist?"), options, [RECORD], scope)
        assert isinstance(generation, Generation)
        return generation
    return ask


def test_a_learned_retrieved_document_is_hit_only_in_its_scope(engine: FusionEngine, tmp_path: Path) -> None:
    ask = _asking_the_record(engine, tmp_path)
    ask(Scope("alice"))
    assert ask(Scope("alice")).reused_tokens > 0
    for scope in (Scope("bob"), Scope("alice", "other-salt"), Scope()):
        missed = ask(scope)
        assert missed.reused_tokens == missed.prefix_cached_tokens == 0 and missed.found_by == {}, scope


def test_a_process_keeps_a_bounded_number_of_scopes_open_and_reopens_one_that_comes_back(
        engine: FusionEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every (tenant, salt) opens a learned-cache directory: a stream of new salts must not hold
    each one's databases open for the life of the process."""
    monkeypatch.setattr(learned, "OPEN_LIMIT", 2)
    ask = _asking_the_record(engine, tmp_path)
    ask(Scope("alice"))
    for salt in ("s1", "s2", "s3"):
        ask(Scope("bob", salt))
    opened = [root for root in learned._open if tmp_path.resolve() in root.parents]
    assert len(opened) == 2, opened
    # NOTE: alice's directory was let go; its caches and their LRU rows are on disk, found again
    assert ask(Scope("alice")).reused_tokens > 0


# ---- operators see and control it ---------------------------------------------------------------------
@pytest.mark.parametrize(("flag", "learn", "shared"), [("off", False, False), ("tenant", True, False),
                                                     ("shared", True, True)])
def test_learn_reaches_every_ray_replica(flag: str, learn: bool, shared: bool, tmp_path: Path) -> None:
    """Defect: a `--ray` replica learned per tenant whatever `--learn` said."""
    args = build_parser(plugins=[serve_command.COMMAND]).parse_args(
        ["--db", str(tmp_path), "serve", "--ray", "local", "--port", "8123", "--learn", flag])
    spec = serve_command.replica_spec(args, lambda: tiny_engine_at("unused"), serve_command.server_config(args))
    assert (spec.reuse.learn, spec.reuse.share_learned) == (learn, shared)


def test_learned_lists_verifies_and_purges_a_tenants_caches(engine: FusionEngine, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Defect: `fusionrag verify` said "no index in ..." of a learned-only data directory, and nothing
    listed or purged learned caches."""
    session = ReuseSession(engine, None, ReuseConfig(data_dir=tmp_path))
    options = RequestOptions(SamplingConfig(max_new_tokens=1))
    for scope in (Scope("alice"), Scope("bob", "s1")):
        list(session.answer(context(RECORD, "Which wrist?"), options, [RECORD], scope))
    assert main(["--db", str(tmp_path), "learned"]) == 0
    listed = capsys.readouterr().out
    assert "tenant 'alice': 1 cache(s)" in listed and "tenant 'bob' salt" in listed
    assert main(["--db", str(tmp_path), "verify", "--no-repair"]) == 0
    assert "learned caches only" in capsys.readouterr().out
    blob = next((tmp_path / "learned").rglob("*.safetensors"))
    blob.write_bytes(blob.read_bytes()[:100])  # NOTE: a torn write
    assert main(["--db", str(tmp_path), "verify", "--no-repair"]) == 1
    assert "1 corrupt" in capsys.readouterr().out
    assert main(["--db", str(tmp_path), "verify"]) == 0
    assert main(["--db", str(tmp_path), "verify", "--no-repair"]) == 0
    capsys.readouterr()
    assert main(["--db", str(tmp_path), "learned", "--purge", "--tenant", "bob"]) == 0
    assert "removed 1 folder(s) of tenant 'bob'" in capsys.readouterr().out
    assert main(["--db", str(tmp_path), "learned"]) == 0
    left = capsys.readouterr().out
    assert "bob" not in left and "tenant 'alice': 1 cache(s)" in left


# ---- uploaded files and vector stores -------------------------------------------------------------
@pytest.fixture
def stores_url(engine: FusionEngine, key_file: Path, tmp_path: Path) -> Iterator[str]:
    """A server with vector stores under `tmp_path` and the two tenants' keys."""
    from fusionrag_core.ingest.config import IngestConfig
    from fusionrag_integrations.openai_server.vector_stores import VectorStoreConfig, VectorStores

    session = ReuseSession(engine, None, ReuseConfig(learn=False, data_dir=tmp_path / "d"))
    stores = VectorStores(engine, VectorStoreConfig(data_dir=tmp_path / "d",
                                                    ingest=IngestConfig(chunk_tokens=32, neighbours=1)))
    try:
        with running_app(create_app(session, ServerConfig(api_key_file=str(key_file)), stores)) as url:
            yield url
    finally:
        stores.close()


def test_a_tenants_files_and_vector_stores_are_no_one_elses(stores_url: str) -> None:
    """Defect: files and vector stores were the server's, not a tenant's: any key listed them, read an
    uploaded file's text, searched a store and answered from its caches (file_search), which another
    tenant's upload filled. Another tenant's id is now a 404 on every route, and lists are the
    tenant's own."""
    def client(tenant: str) -> httpx.Client:
        return httpx.Client(base_url=stores_url, timeout=120, headers={"Authorization": f"Bearer {KEYS[tenant]}"})

    with client("alice") as alice, client("bob") as bob:
        upload = alice.post("/v1/files", files={"file": ("record.txt", RECORD.encode())},
                            data={"purpose": "assistants"})
        file_id = upload.json()["id"]
        store = alice.post("/v1/vector_stores", json={"name": "records", "file_ids": [file_id]}).json()
        vs = store["id"]
        assert store["file_counts"]["completed"] == 1, store
        search = {"query": "When was Mara Quill admitted?"}
        assert alice.post(f"/v1/vector_stores/{vs}/search", json=search).json()["data"]
        assert [f["id"] for f in alice.get("/v1/files").json()["data"]] == [file_id]
        assert [s["id"] for s in alice.get("/v1/vector_stores").json()["data"]] == [vs]

        assert bob.get("/v1/files").json()["data"] == [] and bob.get("/v1/vector_stores").json()["data"] == []
        for method, path, body in (
                ("GET", f"/v1/files/{file_id}", None), ("GET", f"/v1/files/{file_id}/content", None),
                ("DELETE", f"/v1/files/{file_id}", None), ("GET", f"/v1/vector_stores/{vs}", None),
                ("GET", f"/v1/vector_stores/{vs}/files", None),
                ("GET", f"/v1/vector_stores/{vs}/files/{file_id}", None),
                ("POST", f"/v1/vector_stores/{vs}/search", search), ("DELETE", f"/v1/vector_stores/{vs}", None)):
            response = bob.request(method, path, json=body)
            assert response.status_code == 404, (method, path, response.text)
        own = bob.post("/v1/vector_stores", json={"name": "mine"}).json()["id"]
        added = bob.post(f"/v1/vector_stores/{own}/files", json={"file_id": file_id})
        assert added.status_code == 404, added.text  # NOTE: alice's file is no file of bob's
        assert bob.post("/v1/vector_stores", json={"file_ids": [file_id]}).status_code == 404
        responses = {"input": "When was Mara Quill admitted?", "max_output_tokens": 3,
                     "tools": [{"type": "file_search", "vector_store_ids": [vs]}],
                     "tool_choice": {"type": "file_search"}}
        assert bob.post("/v1/responses", json=responses).status_code == 404
        answered = alice.post("/v1/responses", json=responses)
        assert answered.status_code == 200, answered.text
        assert alice.get(f"/v1/files/{file_id}/content").content == RECORD.encode()  # NOTE: bob's tries left it whole
