"""Request K/V memory is reused once nothing views it, never while anything does (`runtime.memory`)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.runtime import compat
from fusionrag_core.runtime.kv import KVBuffer
from fusionrag_core.runtime.memory import KVMemory
from tests.ingest_worker import tiny_engine

MB = 1 << 20


def span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range `t`'s elements occupy."""
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def test_memory_is_reused_only_once_no_view_of_it_lives() -> None:
    memory = KVMemory(64 * MB, granule=1024)
    first = memory.take(10_000, torch.float32)
    kept = first[:100].view(10, 10)  # NOTE: like a kept prefix entry's view of a finished buffer
    start = first.data_ptr()
    del first
    second = memory.take(10_000, torch.float32)
    assert not overlaps(second, kept), "memory still viewed was handed out again"
    del kept
    third = memory.take(9_000, torch.float32)
    assert third.data_ptr() == start and third.numel() == 9_000
    assert memory.stats()["reused"] == 1 and memory.stats()["allocated"] == 2


def test_a_piece_is_reused_only_for_a_request_of_half_its_size_or_more() -> None:
    memory = KVMemory(64 * MB, granule=1000)
    big = memory.take(100_000, torch.float32)
    start = big.data_ptr()
    del big
    small = memory.take(40_000, torch.float32)  # NOTE: would pin 2.5x its size
    assert small.data_ptr() != start
    assert memory.take(60_000, torch.float32).data_ptr() == start
    assert memory.take(200, torch.float64).numel() == 200  # other dtypes never share a piece


def test_idle_memory_beyond_the_bound_is_handed_back() -> None:
    memory = KVMemory(idle_bytes=0, granule=1)
    pieces = [memory.take(1000, torch.float32) for _ in range(3)]
    assert memory.stats()["pieces"] == 3
    del pieces
    memory.take(10, torch.float32)  # NOTE: trimming happens when memory is taken
    assert memory.stats() == {"pieces": 1, "bytes": 40, "reused": 0, "allocated": 4}


def test_without_a_storage_use_count_memory_is_never_reused(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(compat, "_USE_COUNT", None)
    monkeypatch.setattr(compat, "_warned_use_count", threading.Event())
    memory = KVMemory(64 * MB, granule=1)
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        for _ in range(3):
            memory.take(1000, torch.float32)
    assert memory.stats() == {"pieces": 0, "bytes": 0, "reused": 0, "allocated": 3}  # NOTE: nothing kept
    assert sum("not reused" in r.getMessage() for r in caplog.records) == 1


def test_a_copied_buffer_owns_its_tensors_and_shares_the_pool() -> None:
    memory = KVMemory(64 * MB, granule=64)
    buf = KVBuffer(2, 2, 30, 8, dtype=torch.float32, device=torch.device("cpu"), memory=memory)
    buf.keys.fill_(1.0)
    copied = copy.deepcopy(buf)
    buf.keys.fill_(2.0)
    assert bool((copied.keys == 1.0).all()) and not overlaps(copied.keys, buf.keys)
    assert copied._memory is memory


def test_threads_never_share_live_memory() -> None:
    """Buffers taken, written and dropped by many threads at once never overlap while alive."""
    memory = KVMemory(256 * MB, granule=64)
    live: list[tuple[int, torch.Tensor]] = []
    lock = threading.Lock()
    errors: list[str] = []

    def work(worker: int) -> None:
        for i in range(200):
            buf = KVBuffer(2, 2, 50 + (worker * 7 + i) % 40, 8, dtype=torch.float32, device=torch.device("cpu"),
                           memory=memory)
            buf.keys.fill_(worker)
            buf.values.fill_(-worker)
            with lock:
                for other, keys in live:
                    if overlaps(keys, buf.keys) or overlaps(keys, buf.values):
                        errors.append(f"worker {worker} got memory worker {other} still holds")
                live.append((worker, buf.keys))
            if not (bool((buf.keys == worker).all()) and bool((buf.values == -worker).all())):
                errors.append(f"worker {worker}'s buffer was written by another thread")
            with lock:
                live.remove(next(entry for entry in live if entry[1] is buf.keys))

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert memory.stats()["reused"] > 0


def test_engine_answers_equal_with_memory_reused_or_not(tokenizer: PreTrainedTokenizerBase,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy answers and first-token logits are the same whether buffers come from reused memory
    or from fresh memory, and a kept prefix's memory is not handed to the next request. Every piece
    taken is filled with NaN first: a slot read before a pass wrote it would poison the logits."""
    take = KVMemory.take

    def poisoned(self: KVMemory, numel: int, dtype: torch.dtype, *, most: float = 2.0) -> torch.Tensor:
        return take(self, numel, dtype, most=most).fill_(float("nan"))

    monkeypatch.setattr(KVMemory, "take", poisoned)
    engine = tiny_engine(tokenizer)
    fresh = FusionEngine(engine.model, tokenizer, config=dataclasses.replace(engine.config, idle_kv_bytes=0))
    sampling = SamplingConfig(max_new_tokens=6)
    prompts = [engine.prompt(f"question {i}?", [f"passage {i} about rivers and towns", "a second passage"])
               for i in range(4)]
    for prompt in prompts:
        reused, plain = engine.generate(prompt, sampling=sampling), fresh.generate(prompt, sampling=sampling)
        assert reused.token_ids == plain.token_ids
        torch.testing.assert_close(reused.first_token_logits, plain.first_token_logits, rtol=0, atol=0)
    assert engine.decoder.memory is not None and engine.decoder.memory.stats()["reused"] > 0
    assert fresh.decoder.memory is None  # NOTE: idle_kv_bytes=0: every buffer allocated afresh
    kept = engine.prefix_cache
    assert kept is not None and kept.stats()["prefix_entries"] > 0
    entries = list(kept._device.values())
    buf = engine.decoder.new_buffer(64)
    assert not any(overlaps(buf.keys, e.keys) or overlaps(buf.values, e.values) for e in entries)
