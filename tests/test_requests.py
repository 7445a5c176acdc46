"""Requests as data: a `Request` moves through its phases in one order and accounts for every prompt
token; the scheduler's plan is plain data within its limits; asyncio consumers get the serial
engine's answers with no thread hop per token; the server's limits are the scheduler's.

The 1-layer random engine answers (the weights do not matter for the request path).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest

from fusionrag_core.batching.request import Phase, Request, TokenAccount
from fusionrag_core.batching.scheduler import Scheduler, SchedulerConfig, StepOutput
from fusionrag_core.cli import build_parser
from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.errors import AccountingError, OverloadedError
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.scope import OPERATOR
from fusionrag_integrations.openai_server import command as serve_command
from tests.scheduling import assert_same_answer, engine_like, idle, use_scheduler

CHUNKS = [("a", "The Lumen lighthouse stands on the northern cape."), ("b", "Ada Vell designed it in 1881.")]
QUESTIONS = ["Who designed the lighthouse?", "Where does it stand?", "When was it built?", "What is its name?"]
SAMPLING = SamplingConfig(max_new_tokens=6)
WAIT_S = 30.0
"""Deadline of a condition the engine reaches by itself (never an expected duration)."""


@pytest.fixture
def engine(one_layer_engine: FusionEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[FusionEngine]:
    """The 1-layer engine with a fresh default scheduler for this test."""
    use_scheduler(one_layer_engine, SchedulerConfig(), monkeypatch)
    yield one_layer_engine
    assert idle(one_layer_engine)


def _caches(engine: FusionEngine) -> dict[str, Any]:
    return {cid: engine.chunk_cache(text) for cid, text in CHUNKS}


# ---- the request's phases ---------------------------------------------------------------------------------
def test_a_request_goes_through_every_phase_in_order(engine: FusionEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Phase] = []
    enter = Request.enter

    def recorded(self: Request, phase: Phase) -> None:
        enter(self, phase)
        seen.append(phase)

    monkeypatch.setattr(Request, "enter", recorded)
    prompt = engine.prompt(QUESTIONS[0], CHUNKS)
    engine.generate(prompt, sampling=dataclasses.replace(SAMPLING, max_new_tokens=3), caches=_caches(engine))
    assert seen == [Phase.STITCHED, Phase.PROBED, Phase.SELECTED, Phase.RECOMPUTED, Phase.DECODING, Phase.FINISHED,
                    Phase.KEPT]


def test_a_phase_out_of_order_is_refused(engine: FusionEngine) -> None:
    stream = engine.stream(engine.prompt(QUESTIONS[0], CHUNKS))  # NOTE: built, never read: nothing ran
    request = _request_of(engine, QUESTIONS[0])
    with pytest.raises(RuntimeError, match="waiting cannot move to selected"):
        request.enter(Phase.SELECTED)
    request.enter(Phase.STITCHED)
    with pytest.raises(RuntimeError, match="stitched cannot move to decoding"):
        request.enter(Phase.DECODING)
    with pytest.raises(RuntimeError, match="has no buffer yet"):
        _request_of(engine, QUESTIONS[1]).stitched_buffer()
    del stream


def test_the_token_account_raises_when_it_does_not_add_up() -> None:
    account = TokenAccount(prompt=10, reused=4, recomputed=1, prefilled=3, system_prefix=2)
    account.check()
    account.prefilled = 2
    with pytest.raises(AccountingError, match="9 of 10"):
        account.check()
    account.prefilled, account.reused = 4, -1  # NOTE: the right sum from a negative count is no account
    with pytest.raises(AccountingError):
        account.check()


# ---- the scheduler's plan --------------------------------------------------------------------------------
def _request_of(engine: FusionEngine, question: str) -> Request:
    return engine._request(engine.prompt(question, CHUNKS), SAMPLING, None, None, None, None, None, None, OPERATOR)


def test_the_plan_admits_within_max_running_and_steps_only_once_requests_run(engine: FusionEngine) -> None:
    scheduler = Scheduler(SchedulerConfig(max_running=2, max_waiting=3), kv_budget_bytes=1 << 40)
    requests = [_request_of(engine, q) for q in QUESTIONS[:3]]
    for r in requests:
        scheduler.add(r)
    with pytest.raises(OverloadedError, match="max_waiting=3") as refused:
        scheduler.add(_request_of(engine, QUESTIONS[3]))
    assert refused.value.limit == "max_waiting" and (refused.value.retry_after_s or 0) >= 1
    first = scheduler.plan()
    assert (first.admit, first.decode, first.step) == (tuple(requests[:2]), (), False)  # NOTE: idle: no step
    assert scheduler.load == {"running": 2, "waiting": 1, "kv_bytes": requests[0].kv_bytes + requests[1].kv_bytes}
    second = scheduler.plan()
    assert (second.admit, second.decode, second.step) == ((), tuple(requests[:2]), True)  # NOTE: full
    scheduler.update(StepOutput(left=(requests[0],), decoded_rows=2))
    requests[2].cancelled = True
    third = scheduler.plan()
    assert (third.dropped, third.admit, third.decode) == ((requests[2],), (), (requests[1],))
    assert (scheduler.steps, scheduler.batched_rows) == (1, 2)


def test_a_request_over_the_kv_budget_is_refused_with_its_limit(engine: FusionEngine) -> None:
    request = _request_of(engine, QUESTIONS[0])
    scheduler = Scheduler(SchedulerConfig(), kv_budget_bytes=request.kv_bytes - 1)
    with pytest.raises(OverloadedError, match="kv_budget_bytes") as refused:
        scheduler.add(request)
    assert refused.value.limit == "kv_budget_bytes" and refused.value.retry_after_s is None


def test_a_step_that_fails_fails_its_requests_and_the_loop_goes_on(
        engine: FusionEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine.loop is not None
    run = engine.loop.runner.run
    calls: list[int] = []

    def broken_once(plan: Any, *args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a defect in the runner (test)")
        return run(plan, *args)

    monkeypatch.setattr(engine.loop.runner, "run", broken_once)
    prompt = engine.prompt(QUESTIONS[0], CHUNKS)
    with pytest.raises(RuntimeError, match="defect in the runner"):
        engine.generate(prompt, sampling=SAMPLING)
    assert idle(engine)
    assert engine.generate(prompt, sampling=SAMPLING).token_ids


# ---- asyncio consumers ------------------------------------------------------------------------------------
def test_asyncio_consumers_get_the_serial_answers_with_no_thread_hop_per_token(
        engine: FusionEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    serial = engine_like(engine, None)
    caches = _caches(engine)
    prompts = [engine.prompt(q, CHUNKS) for q in QUESTIONS]
    want = [serial.generate(p, sampling=SAMPLING, caches=caches) for p in prompts]
    hops: list[str] = []
    to_thread = asyncio.to_thread

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(fn, "__name__", repr(fn)))
        return await to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counted)

    async def answer(prompt: Any) -> tuple[Generation, int]:
        stream = engine.astream(prompt, sampling=SAMPLING, caches=caches)
        pieces = [piece async for piece in stream]
        assert stream.result is not None and "".join(pieces) == stream.result.text
        return stream.result, len(pieces)

    async def all_of() -> list[tuple[Generation, int]]:
        return await asyncio.gather(*(answer(p) for p in prompts))

    got = asyncio.run(all_of())
    for i, ((generation, _), reference) in enumerate(zip(got, want, strict=True)):
        assert_same_answer(generation, reference, f"asyncio request {i}")
    assert sum(n for _, n in got) > len(prompts)  # NOTE: several pieces each: a hop per piece would show
    assert len(hops) == len(prompts), hops  # NOTE: one per request: its bookkeeping once it has streamed


def test_an_asyncio_consumer_that_stops_early_frees_its_slot(engine: FusionEngine) -> None:
    prompt = engine.prompt(QUESTIONS[0], CHUNKS)

    async def first_piece_only() -> None:
        stream = engine.astream(prompt, sampling=SamplingConfig(max_new_tokens=200))
        pieces = stream.__aiter__()
        assert await anext(pieces)
        await pieces.aclose()

    asyncio.run(first_piece_only())
    # NOTE: the loop's thread may be mid-step when the reader leaves: it drops the request at its next plan
    deadline = time.monotonic() + WAIT_S
    while not idle(engine):
        assert time.monotonic() < deadline, "the abandoned request never left the scheduler"
        time.sleep(0.01)
    assert engine.scheduler is not None and engine.scheduler.batched_rows < 199  # NOTE: it did not decode on


# ---- one admission point -----------------------------------------------------------------------------------
def test_serve_limits_are_the_engines_scheduler_limits(one_layer_engine: FusionEngine) -> None:
    args = build_parser().parse_args(["serve", "--max-running", "64", "--max-waiting", "7"])
    limits = serve_command.scheduler_limits(args)
    served = one_layer_engine.with_limits(limits)
    assert served.scheduler is not None
    assert (served.scheduler.config.max_running, served.scheduler.config.max_waiting) == (64, 7)
    assert served.decoder is one_layer_engine.decoder  # NOTE: the same weights, not a second model
    assert served.with_limits(limits) is served
    assert not hasattr(serve_command.server_config(args), "max_running")  # NOTE: no second limit in the server


def test_a_generation_counts_its_two_prefix_caches_apart(one_layer_engine: FusionEngine) -> None:
    """The system prefix served from the memo and the head continued from the prefix cache are two
    counts; together they are `prefix_cached_tokens`."""
    engine = engine_like(one_layer_engine, SchedulerConfig())
    engine = engine.with_config(dataclasses.replace(engine.config, prefix_cache=one_layer_engine.config.prefix_cache))
    caches = _caches(engine)
    prompt = engine.prompt(QUESTIONS[0], CHUNKS)
    first = engine.generate(prompt, sampling=SAMPLING, caches=caches)  # NOTE: `_caches` memoised the prefix
    turn = [{"role": "user", "content": QUESTIONS[0]}]
    one = engine.prompt_from_messages(turn)
    engine.generate(one, sampling=SAMPLING)
    two = engine.prompt_from_messages([*turn, {"role": "assistant", "content": "Ada Vell."},
                                       {"role": "user", "content": QUESTIONS[1]}])
    continued = engine.generate(two, sampling=SAMPLING)
    assert first.system_prefix_tokens == int(prompt.prefix.shape[0]) > 0 and first.kept_prefix_tokens == 0
    assert continued.kept_prefix_tokens > 0 and continued.system_prefix_tokens == 0
    for g in (first, continued):
        assert g.system_prefix_tokens + g.kept_prefix_tokens == g.prefix_cached_tokens
        g.token_partition()
