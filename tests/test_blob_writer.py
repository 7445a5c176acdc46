"""The blob writer thread of ingest: order, bounded queue, errors surface, and a failed write never
leaves a Chroma entry without its blobs (the ingest stops; its rerun finishes the corpus)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.data import sample_corpus_dir
from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InsufficientSpaceError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.chroma import all_ids
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.writer import BlobWriter
from fusionrag_core.runtime.kv import ChunkKV
from tests.ingest_worker import tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = IngestConfig(chunk_tokens=40, neighbours=2, batch_size=4, prefill_batch=2)


def _kv(i: int) -> ChunkKV:
    keys = torch.full((1, 1, 2, 4), float(i))
    return ChunkKV(torch.tensor([1, 2]), keys, keys.clone(), torch.arange(2), "fp", "independent")


class RecordingStore:
    """A store stand-in: records `(thread name, chunk id)` per put; fails the put of `fail_at`;
    each put waits for `gate` (set: no waiting)."""

    def __init__(self, fail_at: str | None = None) -> None:
        self.puts: list[tuple[str, str]] = []
        self.fail_at = fail_at
        self.gate = threading.Event()
        self.gate.set()

    def put(self, chunk_id: str, kv: ChunkKV) -> None:
        assert self.gate.wait(10)
        if chunk_id == self.fail_at:
            raise OSError(28, "No space left on device")
        self.puts.append((threading.current_thread().name, chunk_id))


def test_blobs_are_stored_in_order_on_the_writer_thread() -> None:
    store = RecordingStore()
    with BlobWriter(store, depth=2) as writer:  # type: ignore[arg-type]
        for i in range(6):
            writer.put(f"c{i}", _kv(i))
        writer.flush()
        assert [cid for _, cid in store.puts] == [f"c{i}" for i in range(6)], "flush waits for every queued blob"
    assert {name for name, _ in store.puts} == {"fusionrag-blob-writer"}


def test_a_failed_write_is_raised_and_nothing_after_it_is_written() -> None:
    store = RecordingStore(fail_at="c2")
    store.gate.clear()  # NOTE: all five are queued before the first is written (else put raises early)
    writer = BlobWriter(store)  # type: ignore[arg-type]
    for i in range(5):
        writer.put(f"c{i}", _kv(i))
    store.gate.set()
    with pytest.raises(OSError, match="No space left"):
        writer.flush()
    assert [cid for _, cid in store.puts] == ["c0", "c1"], "the blobs queued after the failure are dropped"
    with pytest.raises(OSError, match="No space left"):
        writer.put("c9", _kv(9))  # NOTE: a failed writer refuses more work until it is closed
    with pytest.raises(OSError, match="No space left"):
        writer.close()
    writer.put("c9", _kv(9))  # NOTE: once closed (and reported), it starts afresh
    writer.close()
    assert store.puts[-1][1] == "c9"


def test_the_queue_is_bounded() -> None:
    store = RecordingStore()
    store.gate.clear()  # NOTE: the disk stalls: the thread holds one blob, the queue `depth` more
    writer = BlobWriter(store, depth=2)  # type: ignore[arg-type]
    producer = threading.Thread(target=lambda: [writer.put(f"c{i}", _kv(i)) for i in range(5)])
    producer.start()
    producer.join(0.5)
    assert producer.is_alive(), "put blocks while `depth` blobs wait"
    store.gate.set()
    producer.join(10)
    writer.close()
    assert [cid for _, cid in store.puts] == [f"c{i}" for i in range(5)]


def test_a_caller_error_wins_and_queued_blobs_are_still_stored() -> None:
    store = RecordingStore()
    with pytest.raises(KeyError), BlobWriter(store) as writer:  # type: ignore[arg-type]
        writer.put("c0", _kv(0))
        raise KeyError("the caller failed")
    assert [cid for _, cid in store.puts] == ["c0"], "a stored blob is reused by the resumed ingest"


# ---- the ingest ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted(sample_corpus_dir().glob("*.md"))[:3]]


@contextlib.contextmanager
def _failing_put(index: FusionIndex, variant: str, nth: int) -> Iterator[None]:
    """The store's `put` raises on the `nth` blob of `variant` (a full disk)."""
    put, count = index.store.put, 0

    def put_or_fail(chunk_id: str, kv: ChunkKV) -> None:
        nonlocal count
        if kv.variant == variant:
            count += 1
            if count == nth:
                raise OSError(28, "No space left on device")
        put(chunk_id, kv)

    index.store.put = put_or_fail  # type: ignore[method-assign]
    try:
        yield
    finally:
        del index.store.put


def _assert_every_entry_has_its_blobs(index: FusionIndex) -> set[str]:
    entries = all_ids(index.collection)
    assert entries <= index.store.list_ids("independent") and entries <= index.store.list_ids("fused")
    return entries


@pytest.mark.parametrize(("variant", "nth", "indexed"), [("fused", 6, 4), ("independent", 3, 0)])
def test_a_failed_blob_write_stops_the_ingest_before_its_chunks_are_indexed(
    engine: FusionEngine, texts: list[str], tmp_path: Path, variant: str, nth: int, indexed: int
) -> None:
    index = FusionIndex.open(engine, tmp_path / "db", config=CONFIG)
    # NOTE: the full disk is named as such (issue 45), with the OSError it came from
    with _failing_put(index, variant, nth), pytest.raises(InsufficientSpaceError, match="No space left") as stopped:
        index.add_texts(texts)
    assert isinstance(stopped.value.__cause__, OSError)
    # NOTE: batches of 4: with the 6th fused blob failing, batch 1 is indexed, batch 2 is not.
    assert len(_assert_every_entry_has_its_blobs(index)) == indexed
    if variant == "fused":
        assert len(index.store.list_ids("fused")) == nth - 1, "the blobs after the failed one are not written"

    resumed = index.add_texts(texts)  # NOTE: the disk has room again: the rerun finishes the corpus
    assert resumed.new_chunks + resumed.skipped_chunks == len(_assert_every_entry_has_its_blobs(index))
    if variant == "fused":
        assert resumed.prefills == resumed.new_chunks + resumed.skipped_chunks - (nth - 1), "stored blobs are reused"
    assert index.verify(repair=False).ok


def test_embeddings_run_alongside_the_independent_prefills_with_the_same_result(
    engine: FusionEngine, texts: list[str], tmp_path: Path
) -> None:
    def opened(name: str) -> tuple[FusionIndex, list[str]]:
        index = FusionIndex.open(engine, tmp_path / name, config=CONFIG)
        ef: Callable[..., Any] = index.ingestor.embedding_function
        threads: list[str] = []

        def embed(texts: list[str]) -> Any:
            threads.append(threading.current_thread().name)
            return ef(texts)

        index.ingestor.embedding_function = embed  # type: ignore[assignment]
        return index, threads

    alongside, threads = opened("alongside")
    alongside.add_texts(texts)
    assert threads and all(t.startswith("fusionrag-embed") for t in threads), threads
    sequential, _ = opened("sequential")
    sequential.ingestor._embed_alongside_prefills = False
    sequential.add_texts(texts)
    got, want = (ix.collection.get(include=["metadatas", "embeddings"]) for ix in (alongside, sequential))
    assert got["ids"] == want["ids"] and got["metadatas"] == want["metadatas"], "the same neighbours, same entries"
    assert (got["embeddings"] == want["embeddings"]).all()


def test_an_embedding_failure_is_raised_and_indexes_nothing(
    engine: FusionEngine, texts: list[str], tmp_path: Path
) -> None:
    index = FusionIndex.open(engine, tmp_path / "db", config=CONFIG)

    def broken(texts: list[str]) -> Any:
        raise RuntimeError("embedding model crashed")

    index.ingestor.embedding_function = broken  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="embedding model crashed"):
        index.add_texts(texts)
    assert not all_ids(index.collection)
