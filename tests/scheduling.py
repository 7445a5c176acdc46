"""Helpers for the scheduler tests: engines sharing one model's weights, concurrent and
interleaved runs, and the comparison of an answer with its serial counterpart."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import pytest
import torch

from fusionrag_core.batching.scheduler import Scheduler, SchedulerConfig
from fusionrag_core.engine import EngineConfig, FusionEngine, Generation, GenerationStream
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.runtime.kv import ChunkKV, KVBuffer

T = TypeVar("T")
R = TypeVar("R")
# NOTE: a bound on waiting for the other workers at the start line, so a broken run fails instead of hanging.
BARRIER_S = 120.0
# first-token logits of a request whose last pass was packed with others vs alone: float rounding only
LOGIT_ATOL = 1e-4


@dataclass(frozen=True)
class Request:
    """One call of `FusionEngine.generate`, replayable on any engine sharing the model."""

    prompt_args: tuple[str, tuple[str | tuple[str, str], ...]]  # (question, chunks) for `engine.prompt`
    sampling: SamplingConfig
    caches: Mapping[str, ChunkKV] | None = None

    def stream(self, engine: FusionEngine) -> GenerationStream:
        """The request's stream on `engine` (lazy: nothing runs until it is read)."""
        question, chunks = self.prompt_args
        return engine.stream(engine.prompt(question, chunks), sampling=self.sampling, caches=self.caches)

    def answer(self, engine: FusionEngine) -> Generation:
        """The request's finished answer on `engine`."""
        return self.stream(engine).collect()


def reference_config(config: EngineConfig, scheduler: SchedulerConfig | None) -> EngineConfig:
    """`config` with `scheduler`, and without the engine's cache of finished requests' K/V.

    NOTE: an engine that keeps finished requests' K/V for later prompts (`EngineConfig.prefix_cache`)
    answers a prompt depending on which requests it finished before (a prompt sharing a head with one
    continues from its K/V), and concurrency changes that order. The comparisons here need answers
    that depend on the request alone; the kept-prefix cache is off where the engine has one.
    """
    changes: dict[str, object] = {"scheduler": scheduler}
    if any(f.name == "prefix_cache" for f in dataclasses.fields(config)):
        changes["prefix_cache"] = None
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]


def engine_like(engine: FusionEngine, scheduler: SchedulerConfig | None) -> FusionEngine:
    """An engine over `engine`'s model and tokenizer (the same weights) with `scheduler` (None: the
    serial engine, each request alone on its caller's thread) and `reference_config`'s settings."""
    config = reference_config(engine.config, scheduler)
    return FusionEngine(engine.model, engine.tokenizer, name=engine.name, config=config)


def use_scheduler(engine: FusionEngine, config: SchedulerConfig, monkeypatch: pytest.MonkeyPatch) -> Scheduler:
    """Give `engine` a fresh scheduler with `config` for this test (its KV budget: `config`'s, else the
    engine's current one); cheaper than a second engine, which packs its own copy of the weights."""
    assert engine.scheduler is not None
    budget = config.kv_budget_bytes if config.kv_budget_bytes is not None else engine.scheduler.kv_budget_bytes
    scheduler = Scheduler(engine.decoder, config, budget)
    monkeypatch.setattr(engine, "scheduler", scheduler)
    return scheduler


def assert_same_answer(got: Generation, want: Generation, label: str = "", *, exact: bool = False) -> None:
    """`got` is `want` token for token, with first-token logits within float rounding (`exact`: bit
    for bit, what a request prepared alone in its round gets)."""
    assert got.token_ids == want.token_ids, f"{label}: {got.text!r} != serial {want.text!r}"
    assert got.text == want.text and got.finish_reason == want.finish_reason, label
    if exact:  # NOTE: alone, its last pass is `Decoder.prefill` itself, as without the scheduler
        assert torch.equal(got.first_token_logits, want.first_token_logits), label
    else:  # NOTE: packed with others, its rows went through products of more rows (another blocking)
        torch.testing.assert_close(got.first_token_logits, want.first_token_logits, rtol=0, atol=LOGIT_ATOL,
                                   msg=lambda m: f"{label}: {m}")


def run_concurrently(fn: Callable[[T], R], items: Sequence[T], concurrency: int) -> list[R]:
    """`fn` over `items` on `concurrency` threads (1: sequentially on this thread), results in order.

    The first `concurrency` calls start together (a barrier), so they really overlap.
    """
    if concurrency == 1:
        return [fn(item) for item in items]
    barrier = threading.Barrier(min(concurrency, len(items)), timeout=BARRIER_S)

    def task(i: int, item: T) -> R:
        if i < barrier.parties:  # NOTE: the pool's threads each take one of these first
            barrier.wait()
        return fn(item)

    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(task, i, item) for i, item in enumerate(items)]
        return [f.result() for f in futures]


def interleave(streams: Sequence[GenerationStream]) -> list[Generation]:
    """Read `streams` round-robin, one piece at a time, on this thread; their finished answers.

    Deterministic batching without threads: a stream's first read submits its request and leads
    the loop until its first piece, so every later stream's request joins the running ones, and
    their decode steps are shared.
    """
    readers = [iter(s) for s in streams]
    live = list(range(len(readers)))
    while live:
        for i in list(live):
            if next(readers[i], None) is None:
                live.remove(i)
    results = [s.result for s in streams]
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


@dataclass
class BatchLog:
    """Per batched decode step (in order): its rows, and the requests waiting when it ran."""

    rows: list[int] = dataclasses.field(default_factory=list)
    waiting: list[int] = dataclasses.field(default_factory=list)


def record_batches(engine: FusionEngine, monkeypatch: pytest.MonkeyPatch) -> BatchLog:
    """The batched decode steps `engine`'s scheduler runs from now on (for this test)."""
    scheduler = engine.scheduler
    assert scheduler is not None
    log = BatchLog()
    decode_batch = engine.decoder.decode_batch

    def recorded(bufs: Sequence[KVBuffer], token_ids: torch.Tensor, slots: Sequence[torch.Tensor]) -> torch.Tensor:
        log.rows.append(len(bufs))
        log.waiting.append(scheduler.load["waiting"])
        return decode_batch(bufs, token_ids, slots)

    monkeypatch.setattr(engine.decoder, "decode_batch", recorded)
    return log


@dataclass
class StepCounter:
    """Decode steps and rows, and last passes and the requests they carried, that an engine's
    scheduler ran since this counter was made."""

    engine: FusionEngine
    steps0: int = 0
    rows0: int = 0
    passes0: int = 0
    packed0: int = 0

    def __post_init__(self) -> None:
        s = self.engine.scheduler
        assert s is not None
        self.steps0, self.rows0, self.passes0, self.packed0 = s.steps, s.batched_rows, s.passes, s.packed_requests

    @property
    def steps(self) -> int:
        assert self.engine.scheduler is not None
        return self.engine.scheduler.steps - self.steps0

    @property
    def rows(self) -> int:
        assert self.engine.scheduler is not None
        return self.engine.scheduler.batched_rows - self.rows0

    @property
    def mean_batch(self) -> float:
        return self.rows / self.steps if self.steps else 0.0

    @property
    def mean_pack(self) -> float:
        """Requests per last pass (1.0: every request's last pass ran alone)."""
        s = self.engine.scheduler
        assert s is not None
        passes = s.passes - self.passes0
        return (s.packed_requests - self.packed0) / passes if passes else 0.0


def idle(engine: FusionEngine) -> bool:
    """Nothing runs or waits in `engine`'s scheduler, and no KV is counted against its budget."""
    assert engine.scheduler is not None
    return engine.scheduler.load == {"running": 0, "waiting": 0, "kv_bytes": 0}
