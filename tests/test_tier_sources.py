"""Where a request's chunk caches came from, as its statistics say, whatever wraps the store (issue 41, item 5).

A request reads a `ReuseSources` (the integrations' store: the index's store, then learned caches)
around a `TieredKVStore`; a device-tier hit must still be counted as one, in `Generation.kv_tiers`,
in every integration's response statistics and in the server's /metrics, and a learned cache's
load as "learned". The tiers are warmed before each request (every chunk cache loaded once), so
each load of the request is a device hit, whatever the engine's own prefix cache kept.

A tiny random Llama over the real SmolLM2 tokenizer (answers are nonsense; the counts are checked).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from langchain_core.messages import HumanMessage, SystemMessage
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex, IngestConfig
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.reuse.learned import LearnedCaches
from fusionrag_core.reuse.sources import ReuseSources
from fusionrag_core.store import DiskKVStore, KVStore
from fusionrag_core.store.tiered import TierConfig, TieredKVStore
from fusionrag_integrations.langchain import ChatFusionRAG
from fusionrag_integrations.llama_index import FusionRAGLLM, FusionRAGQueryEngine
from fusionrag_integrations.openai_server import ServerConfig, create_app
from fusionrag_integrations.session import ReuseConfig, ReuseSession
from tests.http_server import running_app
from tests.ingest_worker import tiny_engine
from tests.lighthouse import QUESTION, TEXTS
from tests.test_server_limits import metric

BIG = TierConfig(device_bytes=1 << 30, host_bytes=1 << 30)
ONE = SamplingConfig(max_new_tokens=1)


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer)


@pytest.fixture(scope="module")
def index(engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FusionIndex]:
    """A corpus behind device and host tiers (`index.store` is a `TieredKVStore`)."""
    index = FusionIndex.open(engine, tmp_path_factory.mktemp("tiered-index"), tiers=BIG,
                             config=IngestConfig(chunk_tokens=48, neighbours=2))
    index.add_texts(TEXTS)
    yield index
    index.close()


def warm(store: KVStore, engine: FusionEngine) -> None:
    """Load every cache of `store` once: the tiers hold them all, so the next loads are device hits."""
    for cid in store.list_ids():
        for variant in ("independent", "fused"):
            if store.has(cid, variant):
                store.get(cid, variant, fingerprint=engine.fingerprint, device=engine.device,
                          dtype=engine.decoder.dtype)


def assert_device_hits_only(stats: Mapping[str, Any]) -> None:
    assert stats["kv_device_hits"] > 0, stats
    assert stats["kv_store_hits"] == stats["kv_host_hits"] == stats["kv_learned_hits"] == 0, stats
    assert stats["kv_device_bytes"] > 0 and stats["kv_store_bytes"] == 0, stats


def context_messages() -> list[dict[str, str]]:
    """The corpus's documents in a system message (found by content), then the question."""
    return [{"role": "system", "content": "Use the following context.\n\n" + "\n\n".join(TEXTS)},
            {"role": "user", "content": QUESTION}]


# ---- the engine, through the integrations' store ------------------------------------------------------
def _two_chunks(engine: FusionEngine, store: KVStore) -> Any:
    chunks = [(f"t{i}", text) for i, text in enumerate(TEXTS[:2])]
    for cid, text in chunks:
        store.put(cid, engine.chunk_cache(text))
    return engine.prompt(QUESTION, chunks=chunks)


def test_a_tier_hit_behind_reuse_sources_is_a_tier_hit(engine: FusionEngine, tmp_path: Path) -> None:
    inner = DiskKVStore(tmp_path / "kv", storage_dtype="float32")
    prompt = _two_chunks(engine, inner)
    tiered = TieredKVStore(inner, device=engine.device, dtype=engine.decoder.dtype, device_bytes=1 << 30,
                           host_bytes=1 << 30)
    sources = ReuseSources(tiered, None)
    cold = engine.generate(prompt, store=sources, variant="independent", sampling=ONE)
    warm_ = engine.generate(prompt, store=sources, variant="independent", sampling=ONE)
    assert cold.stats()["kv_store_hits"] == 2 and cold.stats()["kv_device_hits"] == 0
    assert_device_hits_only(warm_.stats())
    torch.testing.assert_close(warm_.first_token_logits, cold.first_token_logits)


def test_a_learned_cache_is_reported_as_learned(engine: FusionEngine, tmp_path: Path) -> None:
    learned = LearnedCaches(tmp_path / "learned", engine.fingerprint)
    prompt = _two_chunks(engine, learned.store)  # NOTE: as `learn` would keep them (one blob store of their own)
    stats = engine.generate(prompt, store=ReuseSources(None, learned), variant="independent", sampling=ONE).stats()
    assert stats["kv_learned_hits"] == 2 and stats["kv_store_hits"] == stats["kv_device_hits"] == 0
    assert stats["kv_learned_bytes"] == stats["kv_bytes_loaded"] > 0


# ---- every integration -------------------------------------------------------------------------------
def test_langchain_chat_model_reports_tier_hits(engine: FusionEngine, index: FusionIndex) -> None:
    llm = ChatFusionRAG(index=index, max_tokens=1, learn=False)
    warm(index.store, engine)
    messages = context_messages()
    answer = llm.invoke([SystemMessage(messages[0]["content"]), HumanMessage(messages[1]["content"])])
    assert_device_hits_only(answer.response_metadata)


def test_llama_index_query_engine_reports_tier_hits(engine: FusionEngine, index: FusionIndex) -> None:
    llm = FusionRAGLLM(engine=engine, kv_store=index.store, max_new_tokens=1, learn=False)
    warm(index.store, engine)
    response = FusionRAGQueryEngine.from_index(index, llm=llm, similarity_top_k=3,
                                               response_mode="simple_summarize").query(QUESTION)
    assert response.metadata is not None
    assert_device_hits_only(response.metadata)


def test_server_reports_tier_hits_in_responses_and_metrics(engine: FusionEngine, index: FusionIndex,
                                                           tmp_path: Path) -> None:
    session = ReuseSession(engine, index.store, ReuseConfig(learn=False, data_dir=tmp_path))
    with running_app(create_app(session, ServerConfig())) as url, httpx.Client(base_url=url, timeout=120) as client:
        warm(index.store, engine)
        response = client.post("/v1/chat/completions",
                               json={"messages": context_messages(), "max_tokens": 1, "temperature": 0})
        assert response.status_code == 200, response.text
        stats = response.json()["fusionrag"]
        assert_device_hits_only(stats)
        assert metric(client, "fusionrag_kv_cache_hits_total", tier="device") == stats["kv_device_hits"]
        assert metric(client, "fusionrag_kv_cache_hits_total", tier="store") == 0
        assert metric(client, "fusionrag_kv_cache_bytes_total", tier="device") == stats["kv_device_bytes"]
