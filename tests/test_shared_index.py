"""A Redis store's content index (`RedisContentIndex`): in Redis beside the caches, followed by every process.

Real redis-servers on loopback. Two store objects on one namespace stand for two processes (each
keeps its own mirror of the rows). A corpus in Redis is found by content exactly as the same corpus
on disk: the same chunks, the same reuse on the first ask.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import FusionRAGError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.reuse.sources import ReuseSources
from fusionrag_core.store import DiskKVStore, RedisKVStore, TierConfig, TieredKVStore
from fusionrag_core.store import redis_content_index as rci
from fusionrag_core.store.content_index import ContentIndex
from tests.ingest_worker import tiny_engine
from tests.servers import running_redis_server

pytestmark = [pytest.mark.servers, pytest.mark.usefixtures("one_thread")]

TEXTS = [
    "The Lumen lighthouse on Gull Point was designed by the engineer Ada Vell in 1891, after the old light failed.",
    " Ada Vell was born in the port town of Marrow, where her father repaired ship clocks for the harbour board",
    "Marrow lies at the mouth of the river Tell — known for its salt market (est. 1702) and its grey stone quay.",
    "Tessaly Instruments built the lighthouse clock;\nits founder was Oren Tessaly, a watchmaker from Corran.",
    "Short chunk.",
]
PROMPT = "<|im_start|>system\nAnswer.\n" + "".join(f"doc{i}:\n{t}\n\n" for i, t in enumerate(TEXTS[:4])) + "Q: x"
CONFIG = IngestConfig(chunk_tokens=48, neighbours=2)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with running_redis_server() as url:
        yield url


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> str:
    return "n" + str(abs(hash(request.node.nodeid)) % 10**12)


def test_another_process_sees_adds_removes_and_rebuilds_at_its_next_lookup(redis_url: str, namespace: str,
                                                                          tmp_path: Path) -> None:
    with RedisKVStore(redis_url, namespace) as writer, RedisKVStore(redis_url, namespace) as reader:
        follower = reader.content_index()
        assert follower.find(PROMPT) == []  # NOTE: loaded (empty) before the ingest, as a replica started early
        writer.content_index().add((f"c{i}", t) for i, t in enumerate(TEXTS))
        disk = ContentIndex(tmp_path)
        disk.add((f"c{i}", t) for i, t in enumerate(TEXTS))
        assert follower.find(PROMPT) == disk.find(PROMPT) and len(disk.find(PROMPT)) == 4
        assert follower.find(f"  {TEXTS[4]}\n") == disk.find(f"  {TEXTS[4]}\n") != []  # NOTE: a short, whole chunk
        writer.content_index().remove(["c1"])
        assert [m.chunk_id for m in follower.find(PROMPT)] == ["c0", "c2", "c3"]
        assert writer.content_index().rebuild([("c1", TEXTS[1])]) == 1
        assert [m.chunk_id for m in follower.find(PROMPT)] == ["c1"]
        assert follower.chunk_ids() == {"c1"} and len(follower) == 1 and follower.check() is None


def test_a_rebuild_reaches_a_mirror_that_applied_an_entry_as_new_as_the_reset(redis_url: str, namespace: str) -> None:
    with RedisKVStore(redis_url, namespace) as writer, RedisKVStore(redis_url, namespace) as reader:
        writer.content_index().add([("c0", TEXTS[0])])
        # NOTE: an entry stamped far ahead of the clock stands for one written in the rebuild's own
        # millisecond: a log deleted and re-created would give the reset a lower id, unseen by the reader
        raw = redis.Redis.from_url(redis_url)
        raw.xadd(f"{namespace}:content:log", {"remove": '["c9"]'}, id="99999999999999-0")
        assert [m.chunk_id for m in reader.content_index().find(PROMPT)] == ["c0"]
        writer.content_index().rebuild([("c2", TEXTS[2])])
        assert [m.chunk_id for m in reader.content_index().find(PROMPT)] == ["c2"]


def test_a_process_that_finds_the_log_gone_reloads_the_rows(redis_url: str, namespace: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    with RedisKVStore(redis_url, namespace) as writer, RedisKVStore(redis_url, namespace) as reader:
        writer.content_index().add([("c0", TEXTS[0])])
        assert [m.chunk_id for m in reader.content_index().find(PROMPT)] == ["c0"]
        writer.content_index().add([("c2", TEXTS[2])])
        writer.content_index().remove(["c0"])
        raw = redis.Redis.from_url(redis_url)
        raw.delete(f"{namespace}:content:log")  # NOTE: both changes gone before the reader looked
        assert [m.chunk_id for m in reader.content_index().find(PROMPT)] == ["c2"]
        assert "change log" in (writer.content_index().check() or "")  # NOTE: verify rebuilds it
        writer.content_index().add([("c3", TEXTS[3])])
        writer.content_index().remove(["c2"])
        monkeypatch.setattr(rci, "LOG_ENTRIES", 1)
        assert "holds 2 entries" in (writer.content_index().check() or "")  # NOTE: a long log: verify compacts it
        writer.content_index().rebuild([("c3", TEXTS[3])])
        assert writer.content_index().check() is None
        assert [m.chunk_id for m in reader.content_index().find(PROMPT)] == ["c3"]


def test_an_unreachable_server_finds_nothing_with_one_warning_then_recovers(
        namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    with running_redis_server() as url:
        store = RedisKVStore(url, namespace)
        store.content_index().add([("c0", TEXTS[0])])
    # NOTE: the server is gone: a lookup is a miss that says why, never a failed request
    with caplog.at_level(logging.WARNING, logger=rci.__name__):
        assert store.content_index().find(PROMPT) == [] and store.content_index().find(PROMPT) == []
    problem = store.content_index().problem
    assert problem is not None and "cannot be used" in problem
    assert sum("cannot be used" in r.getMessage() for r in caplog.records) == 1
    assert store.content_index().check() == problem
    with pytest.raises(FusionRAGError, match="cannot be used"):
        store.content_index().rebuild([("c0", TEXTS[0])])
    with pytest.raises(FusionRAGError, match="cannot be used"):
        store.content_index().add([("c0", TEXTS[0])], strict=True)
    store.close()


# ---- a corpus in Redis, found as the same corpus on disk ------------------------------------------------
@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


def _messages() -> list[dict[str, str]]:
    context = "\n\n".join(TEXTS[:3])
    return [{"role": "system", "content": f"Answer from these passages.\n\n{context}"},
            {"role": "user", "content": "Where was the designer of the Lumen lighthouse born?"}]


def _first_ask(engine: FusionEngine, sources: ReuseSources) -> dict[str, object]:
    gen = engine.generate(sources.prompt(engine, _messages()), store=sources,
                          sampling=SamplingConfig(max_new_tokens=3))
    return {"reused": gen.reused_tokens, "recomputed": gen.recomputed_tokens, "misses": gen.cache_misses,
            "tokens": gen.token_ids}


def test_first_ask_reuse_over_redis_equals_the_disk_corpus(engine: FusionEngine, redis_url: str,
                                                            tmp_path: Path) -> None:
    with FusionIndex.open(engine, tmp_path / "disk", config=CONFIG) as on_disk, \
            FusionIndex.open(engine, tmp_path / "redis", redis_url=redis_url, config=CONFIG) as in_redis:
        assert isinstance(on_disk.store, DiskKVStore) and isinstance(in_redis.store, RedisKVStore)
        # NOTE: a replica started before the ingest: its own store object, its own mirror (loaded empty)
        early = RedisKVStore(redis_url, in_redis.store.namespace, in_redis.store.storage_dtype)
        early_sources = ReuseSources(early, None, learning=False)
        assert early_sources.find(_messages()[0]["content"]) == []
        for index in (on_disk, in_redis):
            index.add_texts(TEXTS[:4], doc_ids=[f"d{i}" for i in range(4)])
        expected = _first_ask(engine, ReuseSources(on_disk.store, None, learning=False))
        assert expected["reused"] and not expected["misses"]
        assert _first_ask(engine, ReuseSources(in_redis.store, None, learning=False)) == expected
        assert _first_ask(engine, early_sources) == expected  # NOTE: no restart

        # deleted with the caches; repaired by verify
        in_redis.delete(["d2"])
        assert early_sources.find(TEXTS[2]) == []
        assert len(early.content_index()) == len(in_redis.store.list_ids("independent")) == 3
        redis.Redis.from_url(redis_url).delete(f"{early.namespace}:content:rows")  # NOTE: lost behind the log
        report = in_redis.verify(repair=False)
        assert "lacks the text of 3 chunk(s)" in report.content_index
        assert in_redis.verify().content_index_rebuilt == 3
        assert [m.chunk_id for m in early_sources.find(_messages()[0]["content"])] == \
            [m.chunk_id for m in on_disk.store.content_index().find(_messages()[0]["content"])][:2]
        early.close()


def test_tiers_in_front_of_redis_read_a_hot_chunk_from_it_once(engine: FusionEngine, redis_url: str,
                                                               tmp_path: Path) -> None:
    with FusionIndex.open(engine, tmp_path, redis_url=redis_url, config=CONFIG,
                          tiers=TierConfig(device_bytes=8 << 20, host_bytes=8 << 20)) as index:
        assert isinstance(index.store, TieredKVStore) and isinstance(index.store.backend, RedisKVStore)
        index.add_texts(TEXTS[:4], doc_ids=[f"d{i}" for i in range(4)])
        sources = ReuseSources(index.store, None, learning=False)
        tiers = []
        for _ in range(2):
            gen = engine.generate(sources.prompt(engine, _messages()), store=sources,
                                  sampling=SamplingConfig(max_new_tokens=2))
            tiers.append(gen.kv_tiers)
        assert tiers[0]["store_hits"] == 3 and tiers[0]["device_hits"] == 0  # NOTE: three chunks, read from Redis
        assert tiers[1]["store_hits"] == 0 and tiers[1]["device_hits"] == 3  # NOTE: then from this process's tier
