"""Helper threads hand back the OpenMP pools their torch ops leave (`runtime.threads`).

Workers are counted as OS threads of this process, never by timing; the engine's wiring is
checked by who calls `release_pool`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.runtime import threads
from tests.ingest_worker import tiny_engine

T = TypeVar("T")

needs_libgomp = pytest.mark.skipif(threads._libgomp() is None, reason="needs torch's libgomp (Linux)")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_op() -> None:
    torch.ones(4_000_000).mul_(2)  # far above ATen's grain size: one OpenMP parallel region


def settled(expected: int, timeout_s: float = 2.0) -> int:
    """The OS thread count once it reaches `expected` (exiting workers leave shortly after release)."""
    deadline = time.monotonic() + timeout_s
    while (n := os_threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def in_thread(fn: Callable[[], T]) -> T:
    out: list[T] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@needs_libgomp
def test_a_thread_keeps_its_workers_until_it_releases_them() -> None:
    def work() -> tuple[int, int, int]:
        torch.set_num_threads(2)  # NOTE: a test worker may run on one thread; restored below
        before = os_threads()
        parallel_op()
        kept = os_threads() - before
        assert threads.release_pool()
        released = settled(before) - before
        parallel_op()  # the next parallel op starts a pool again
        again = os_threads() - before
        threads.release_pool()
        return kept, released, again

    threads_before = torch.get_num_threads()
    try:
        kept, released, again = in_thread(work)
    finally:
        torch.set_num_threads(threads_before)  # NOTE: the setting is also the default of later threads
    assert kept >= 1, "a parallel op left no OpenMP worker: nothing to test on this build"
    assert released == 0
    assert again == kept


def test_releasing_releases_after_every_call_and_on_errors(pool_releases: list[str]) -> None:
    def lookup(x: int) -> int:
        if x < 0:
            raise ValueError("negative")
        return 2 * x

    wrapped = threads.releasing(lookup)
    assert wrapped(3) == 6
    with pytest.raises(ValueError, match="negative"):
        wrapped(-1)
    assert pool_releases == [threading.current_thread().name] * 2
    assert wrapped.__name__ == "lookup"


def test_chunk_caches_loaded_on_helper_threads_hand_their_pools_back(
        tokenizer: PreTrainedTokenizerBase, tmp_path: Path, pool_releases: list[str]) -> None:
    engine = tiny_engine(tokenizer)
    index = FusionIndex.open(engine, tmp_path / "db", config=IngestConfig(chunk_tokens=40, neighbours=2))
    index.add_texts(["The Lumen lighthouse on the northern cape was designed by the engineer Ada Vell in 1871.",
                     "Ada Vell was born in Marrow, where her father repaired nets and sold salt.",
                     "Marrow salt was famous for its pale pink colour and sold along the coast."])
    question = "Who designed the Lumen lighthouse?"
    prompt = index.prompt_for(question, index.search(question, 3))
    g = engine.generate(prompt, store=index.store, sampling=SamplingConfig(max_new_tokens=2))
    assert g.reused_tokens > 0  # the caches were loaded from the store
    loaders = [name for name in pool_releases if name.startswith("fusionrag-load")]
    assert len(loaders) == len([s for s in prompt.segments if s.chunk_id]), pool_releases


def test_the_thread_that_builds_an_engine_hands_its_pool_back(
        tokenizer: PreTrainedTokenizerBase, pool_releases: list[str]) -> None:
    tiny_engine(tokenizer)
    assert pool_releases == [threading.current_thread().name]


def test_the_blob_writer_hands_its_pool_back_after_each_put(
        tokenizer: PreTrainedTokenizerBase, tmp_path: Path, pool_releases: list[str]) -> None:
    config = IngestConfig(chunk_tokens=40, neighbours=2)
    index = FusionIndex.open(tiny_engine(tokenizer), tmp_path / "db", config=config)
    pool_releases.clear()
    index.add_texts(["The Lumen lighthouse on the northern cape was designed by the engineer Ada Vell in 1871.",
                     "Marrow salt was famous for its pale pink colour and sold along the coast."])
    puts = [name for name in pool_releases if name == "fusionrag-blob-writer"]
    assert len(puts) >= len(index.store.list_ids())  # one per blob written (fused and independent)
