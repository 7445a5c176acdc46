"""Learned caches shared through a corpus's Redis store (`SharedLearnedCaches`), on a real redis-server.

Two `SharedLearnedCaches` over two store objects stand for two processes (replicas): each has its own
connection and content-index mirror. What one learns the other reuses on its first sight, under the
same byte bound and LRU, validation and best-effort rule as learned caches on disk.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.reuse.learned import LearnConfig, content_id
from fusionrag_core.reuse.learning import learn_pieces
from fusionrag_core.reuse.shared_learned import SharedLearnedCaches, redis_backend
from fusionrag_core.reuse.sources import ReuseSources
from fusionrag_core.store import DiskKVStore, RedisKVStore, TieredKVStore
from fusionrag_integrations.session import ReuseConfig, ReuseSession
from tests.ingest_worker import tiny_engine
from tests.servers import running_redis_server

pytestmark = [pytest.mark.servers, pytest.mark.usefixtures("one_thread")]

DOCS = [
    "The Corran watchmakers' guild met every Thursday above the old grain exchange, where Oren Tessaly first "
    "showed the escapement he later built into the Lumen lighthouse clock.",
    "Marrow salt was sold in markets all along the coast and was famous for its pale pink colour, which came "
    "from the clay of the pans north of the quay.",
]
SAMPLING = SamplingConfig(max_new_tokens=3)


@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with running_redis_server() as url:
        yield url


@pytest.fixture
def corpus(redis_url: str, request: pytest.FixtureRequest) -> Iterator[RedisKVStore]:
    """An (empty) corpus store of its own per test."""
    with RedisKVStore(redis_url, "c" + str(abs(hash(request.node.nodeid)) % 10**12), "float32") as store:
        yield store


def _replica(corpus: RedisKVStore, engine: FusionEngine, config: LearnConfig | None = None) -> SharedLearnedCaches:
    """What another process opens: its own store object and learned caches over the same server."""
    return SharedLearnedCaches(RedisKVStore(corpus.url, corpus.namespace, corpus.storage_dtype), engine.fingerprint,
                               config)


def _ask(engine: FusionEngine, learned: SharedLearnedCaches, documents: list[str] | None = None, *,
         learning: bool = True) -> tuple[int, int]:
    """(reused tokens, misses) of a request whose system message holds DOCS, learning what it misses
    once it has answered (as `ReuseSession` does: a first-seen piece counts as a miss)."""
    sources = ReuseSources(None, learned, learning=learning)
    messages = [{"role": "system", "content": "Answer from these passages.\n\n" + "\n\n".join(DOCS)},
                {"role": "user", "content": "Where did the guild meet?"}]
    prompt = sources.prompt(engine, messages, documents=documents or [])
    gen = engine.generate(prompt, store=sources, sampling=SAMPLING)
    pending = sources.pending if learning else []
    learn_pieces(engine, learned, pending)
    return gen.reused_tokens, len(gen.cache_misses) + len(pending)


def test_a_document_learned_by_one_process_is_reused_by_another_on_first_sight(
        engine: FusionEngine, corpus: RedisKVStore) -> None:
    a, b = _replica(corpus, engine), _replica(corpus, engine)
    assert _ask(engine, b, learning=False) == (0, 0)  # NOTE: b's mirror is loaded (empty) before a learns
    assert _ask(engine, a, DOCS) == (0, 2) and len(a) == len(b) == 2
    reused, misses = _ask(engine, b)
    assert reused > 0 and misses == 0
    ids = [content_id(d, engine.fingerprint) for d in DOCS]
    assert b.neighbours(ids[1]) == ids[:1] and b.nbytes == a.nbytes > 0


def test_the_byte_bound_and_lru_hold_across_processes(engine: FusionEngine, corpus: RedisKVStore) -> None:
    kv = dataclasses.replace(engine.chunk_cache(DOCS[0]), variant="fused")
    stored = kv.nbytes  # float32 in Redis
    config = LearnConfig(max_bytes=int(2.5 * stored), storage_dtype="float32")
    a, b = _replica(corpus, engine, config), _replica(corpus, engine, config)
    a._put("x0", DOCS[0] + "0", kv, [])
    b._put("x1", DOCS[0] + "1", kv, [])
    a.touch(["x0"])  # NOTE: x0 used after x1: x1 is the least recently used, whoever learned it
    b._put("x2", DOCS[0] + "2", kv, [])
    assert len(a) == 2 and not a.store.has("x1", "fused") and b.store.has("x0", "fused")
    assert stored < a.nbytes <= 2.5 * stored
    assert a.index.find(DOCS[0] + "1\n") == [] and [m.chunk_id for m in a.index.find(DOCS[0] + "0\n")] == ["x0"]


def test_a_corrupt_shared_blob_is_a_reported_miss_and_relearned(engine: FusionEngine, corpus: RedisKVStore) -> None:
    a, b = _replica(corpus, engine), _replica(corpus, engine)
    _ask(engine, a, DOCS)
    raw = redis.Redis.from_url(corpus.url)
    for variant in ("independent", "fused"):  # NOTE: a learned piece keeps both; either alone would serve it
        key = a._redis.blob_key(content_id(DOCS[0], engine.fingerprint), variant)
        raw.setrange(key, raw.strlen(key) - 8, b"\x00garbage")  # NOTE: a flipped tail: its checksum fails
    reused, misses = _ask(engine, b)
    assert misses == 1 and reused > 0  # NOTE: the other document is still reused; the answer is given
    # NOTE: the blobs were set aside when read: the next request holds the piece as a first-seen one
    # (a miss) and learns it again once answered; the one after reuses it
    assert _ask(engine, a)[1] == 1
    assert _ask(engine, b)[1] == 0


def test_a_full_redis_skips_learning_with_one_warning_never_the_answer(
        engine: FusionEngine, corpus: RedisKVStore, caplog: pytest.LogCaptureFixture) -> None:
    learned = _replica(corpus, engine)
    raw = redis.Redis.from_url(corpus.url)
    raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) + 1024)
    try:
        with caplog.at_level(logging.WARNING, logger="fusionrag"):
            assert _ask(engine, learned, DOCS) == (0, 2)
            assert _ask(engine, learned, DOCS) == (0, 2)  # NOTE: nothing was kept, and the answer came
    finally:
        raw.config_set("maxmemory", 0)
    warnings = [r.getMessage() for r in caplog.records if "could not keep learned caches" in r.getMessage()]
    assert len(warnings) == 1 and "(OutOfMemoryError:" in warnings[0] and "maxmemory" in warnings[0], warnings
    assert len(learned) == 0 and learned.store.list_ids() == set() and len(learned.index) == 0


def test_a_session_over_a_redis_store_shares_its_learned_caches(engine: FusionEngine, corpus: RedisKVStore,
                                                                tmp_path: Path) -> None:
    tiered = TieredKVStore(corpus, device="cpu", dtype=engine.decoder.dtype, device_bytes=1 << 20, host_bytes=0)
    assert redis_backend(tiered) is corpus and redis_backend(DiskKVStore(tmp_path / "kv")) is None
    session = ReuseSession(engine, tiered, ReuseConfig(data_dir=tmp_path))
    learned = session.learned()
    assert isinstance(learned, SharedLearnedCaches) and learned is session.learned(create=True)
    local = ReuseSession(engine, corpus, ReuseConfig(data_dir=tmp_path, learned_in_redis=False)).learned(create=True)
    assert local is not None and not isinstance(local, SharedLearnedCaches)
    assert (tmp_path / "learned").is_dir()
    learned.close()
    local.close()
