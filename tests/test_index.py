"""FusionIndex: open (embedded, Chroma server, Redis), model and settings checks, search and answer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import CacheMismatchError, CacheNotFoundError, InvalidRequestError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.chroma import all_ids
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.store import DiskKVStore, TierConfig, TieredKVStore
from tests.ingest_worker import tiny_engine
from tests.servers import running_chroma_server, running_redis_server

LIGHTHOUSE = "The Lumen lighthouse on the northern cape was designed by the engineer Ada Vell in 1871."
BIRTH = "Ada Vell was born in the fishing village of Marrow, where her father repaired nets."
SALT = "Marrow salt was sold in markets all along the coast and was famous for its pale pink colour."
CONFIG = IngestConfig(chunk_tokens=48, neighbours=2)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with running_redis_server() as url:
        yield url


@pytest.fixture(scope="module")
def chroma_url() -> Iterator[str]:
    with running_chroma_server() as url:
        yield url


def _answer_round_trip(index: FusionIndex) -> None:
    """Ingest, answer from stored caches, delete: the path every backend must support."""
    report = index.add_texts([LIGHTHOUSE, BIRTH, SALT], doc_ids=["lamp", "birth", "salt"])
    assert report.new_chunks == 3 and len(index) == 3
    assert not hasattr(index.engine, "store")  # the index passes its store with each request

    generation, hits = index.answer("Who designed the Lumen lighthouse?", k=2,
                                    sampling=SamplingConfig(max_new_tokens=3))
    assert [h.chunk_id for h in hits] == [h.chunk_id for h in index.search("Who designed the Lumen lighthouse?", 2)]
    assert hits[0].text == LIGHTHOUSE and hits[0].metadata["doc_id"] == "lamp"
    assert generation.cache_misses == {}
    chunk_tokens = sum(index.engine.layout.chunk_ids(h.text).numel() for h in hits)
    assert 0.8 * chunk_tokens <= generation.reused_tokens < chunk_tokens, "~15% recomputed, the rest reused"
    assert generation.kv_bytes_loaded > 0 and len(generation.token_ids) >= 1

    assert index.delete(["lamp", "birth", "salt"]) == 3
    assert len(index) == 0 and index.store.list_ids() == set()


def test_open_embedded_answers_from_stored_caches(engine: FusionEngine, tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path, config=CONFIG)
    assert isinstance(index.store, DiskKVStore)
    assert index.store.root == tmp_path / "kv" / "fusionrag" and (tmp_path / "chroma").is_dir()
    prompt = index.prompt_for("Who?", index.search("lighthouse", 1) or [])
    assert prompt.segments == ()
    with pytest.raises(InvalidRequestError, match="add_texts first"):
        index.answer("Who designed the Lumen lighthouse?")
    _answer_round_trip(index)


def test_prompt_for_tags_chunks_with_their_ids(engine: FusionEngine, tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path, config=CONFIG)
    index.add_texts([LIGHTHOUSE, BIRTH])
    hits = index.search("Where was Ada Vell born?", 2)
    prompt = index.prompt_for("Where was Ada Vell born?", hits)
    assert [s.chunk_id for s in prompt.segments] == [h.chunk_id for h in hits]
    for segment, hit in zip(prompt.segments, hits, strict=True):
        stored = index.store.get(hit.chunk_id, "fused", fingerprint=engine.fingerprint)
        assert torch.equal(stored.token_ids, segment.token_ids), "the prompt must hit the cache by id and tokens"


def test_reopen_refuses_another_model_and_other_settings(
    engine: FusionEngine, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    FusionIndex.open(engine, tmp_path, config=CONFIG).add_texts([LIGHTHOUSE])
    other = tiny_engine(tokenizer, seed=1)
    with pytest.raises(CacheMismatchError) as err:
        FusionIndex.open(other, tmp_path)
    assert engine.name in str(err.value) and other.name in str(err.value) and "another collection" in str(err.value)

    with pytest.raises(InvalidRequestError, match="ingest settings"):
        FusionIndex.open(engine, tmp_path, config=replace(CONFIG, neighbours=CONFIG.neighbours + 1))
    reopened = FusionIndex.open(engine, tmp_path)
    assert reopened.config.identity() == CONFIG.identity() and len(reopened) == 1
    # the same directory holds other corpora side by side, each with its own store
    fresh = FusionIndex.open(other, tmp_path, collection_name="other-model", config=CONFIG)
    assert len(fresh) == 0 and fresh.store.list_ids() == set()


def test_collections_keep_the_settings_format_they_recorded() -> None:
    # NOTE: identity() is what collections hold as JSON; these are the keys and values they were written with.
    recorded = {"chunk_tokens": 48, "chunk_overlap": 0, "neighbors": 2, "fuse": True, "neighbour_order": "similar_last"}
    assert CONFIG.identity() == recorded
    assert IngestConfig.from_identity(recorded) == CONFIG
    assert IngestConfig.from_identity({"chunk_tokens": 48, "neighbors": 2}) == CONFIG  # older, shorter records
    with pytest.raises(InvalidRequestError, match="similar_first"):
        IngestConfig.from_identity({**recorded, "neighbour_order": "similar_first"})
    with pytest.raises(InvalidRequestError, match="unknown ingest settings"):
        IngestConfig.from_identity({**recorded, "stride": 3})


def test_wrong_model_blob_is_a_miss_at_query_and_repaired_by_verify(engine: FusionEngine, tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path, config=CONFIG)
    index.add_texts([LIGHTHOUSE, BIRTH])
    (victim,) = [h.chunk_id for h in index.search("lighthouse designed", 1)]
    # NOTE: a one-chunk answer reads the chunk's independent cache (exact right after the prefix), then
    # its fused one: both are made another model's.
    for variant in ("independent", "fused"):
        good = index.store.get(victim, variant, fingerprint=engine.fingerprint)
        index.store.put(victim, replace(good, fingerprint="f" * 32))
    # another model's blob is never used: the chunk is prefilled, and the miss says why and what to do
    missed, _ = index.answer("Who designed the Lumen lighthouse?", k=1, sampling=SamplingConfig(max_new_tokens=1))
    assert set(missed.cache_misses) == {victim} and "re-ingest" in missed.cache_misses[victim]
    assert missed.reused_tokens == 0
    report = index.verify()
    assert report.mismatched == 2 and report.repaired and report.recomputed == 2
    generation, _ = index.answer("Who designed the Lumen lighthouse?", k=1, sampling=SamplingConfig(max_new_tokens=1))
    assert generation.cache_misses == {}
    assert all_ids(index.collection) == index.store.list_ids("fused")


@pytest.mark.servers
def test_open_with_redis_store(engine: FusionEngine, tmp_path: Path, redis_url: str) -> None:
    index = FusionIndex.open(engine, tmp_path, redis_url=redis_url, collection_name="redis-corpus", config=CONFIG)
    assert type(index.store).__name__ == "RedisKVStore" and not (tmp_path / "kv").exists()
    _answer_round_trip(index)


@pytest.mark.servers
def test_open_with_chroma_server(engine: FusionEngine, tmp_path: Path, chroma_url: str) -> None:
    index = FusionIndex.open(engine, tmp_path, chroma_url=chroma_url, config=CONFIG)
    assert not (tmp_path / "chroma").exists()
    _answer_round_trip(index)


def test_open_with_cache_tiers_serves_repeat_chunks_from_them(engine: FusionEngine, tmp_path: Path) -> None:
    tiers = TierConfig(device_bytes=1 << 20, host_bytes=1 << 20)
    index = FusionIndex.open(engine, tmp_path, config=CONFIG, tiers=tiers)
    assert isinstance(index.store, TieredKVStore) and isinstance(index.store.backend, DiskKVStore)
    index.add_texts([LIGHTHOUSE, BIRTH, SALT], doc_ids=["lamp", "birth", "salt"])  # the disk store's writer lock
    question, one = "Who designed the Lumen lighthouse?", SamplingConfig(max_new_tokens=2)
    gen, hits = index.answer(question, k=2, sampling=one)
    first = gen.stats()
    again = index.answer(question, k=2, sampling=one)[0].stats()
    assert first["kv_store_hits"] == 2 and first["kv_device_hits"] == 0
    assert again["kv_device_hits"] == 2 and again["kv_store_hits"] == 0 and again["kv_device_bytes"] > 0
    assert again["reused_tokens"] == first["reused_tokens"] > 0
    # a write through the index drops the tiers' copies: a deleted chunk is not served from them
    lamp = next(h.chunk_id for h in hits if h.metadata["doc_id"] == "lamp")
    index.delete(["lamp"])
    with pytest.raises(CacheNotFoundError):
        index.store.get(lamp, "fused", fingerprint=engine.fingerprint)
    with pytest.raises(ValueError, match="tier budgets"):
        TierConfig(host_bytes=-1)
