"""The runner: executes a `StepPlan` on the model, one phase at a time, and reports a `StepOutput`.

    dropped ─► end
    admit   ─► stitch each ─► probe (one pass) ─► select each ─► recompute (one pass) ─► forks copied
            ─► first token each (forks included)
    heal an answer ─► a piece of one answer's healing (before the decode: its token reads it)
    decode  ─► one batched decode step ─► next token each
    heal    ─► one piece of a kept request's healing (an idle step only)

A request's failure stays its own: a phase that fails for one request fails that request alone,
and a packed pass that fails (say out of memory) is logged and its requests run it one at a time.

`run_alone` is the same phases for one request without a scheduler, on its caller's thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

from fusionrag_core.batching import phases
from fusionrag_core.batching.answer_heal import heal_answer_piece
from fusionrag_core.batching.heal import Healer
from fusionrag_core.batching.phases import Shared
from fusionrag_core.batching.request import Phase, Request
from fusionrag_core.batching.scheduler import StepOutput, StepPlan

log = logging.getLogger(__name__)


class Runner:
    """Runs the scheduler's plans on `shared.decoder`; holds no request between two steps."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def run(self, plan: StepPlan, admit_more: Callable[[], Sequence[Request]] = tuple) -> StepOutput:
        """Execute `plan`; every request that ended in it is in the output's `left`.

        Args:
            plan: the step.
            admit_more: the scheduler's admissions of requests that arrived while the planned ones
                were stitched (`Scheduler.admit_more`): stitched too, they share the step's passes.
        """
        left: list[Request] = []
        healer, cache = self.shared.healer, self.shared.prefix_cache
        if healer is not None and (plan.admit or plan.decode):
            healer.preempt()  # NOTE: counted when healing paused mid-entry for these requests
        for r in plan.dropped:
            r.finish()
            left.append(r)
            self._end_forks(r, left)
        started, packs = self._admit(plan.admit, admit_more, left)
        # NOTE: before the decode: the token this step picks already reads what the piece healed (the
        # first piece runs before the second token is picked, not after)
        if plan.heal_answer is not None and plan.heal_answer.answer_heal_pending and healer is not None:
            self._heal_answer(plan.heal_answer, healer)
        rows = 0
        if plan.step:
            rows = self._decode([r for r in (*plan.decode, *started) if r.phase is Phase.DECODING], left)
        if plan.heal and healer is not None and cache is not None:
            healer.run_piece(self.shared.decoder, cache)
        return StepOutput(left=tuple(left), decoded_rows=rows, packs=tuple(packs))

    # ---- admissions --------------------------------------------------------------------------------------
    def _admit(self, admit: Sequence[Request], admit_more: Callable[[], Sequence[Request]],
               left: list[Request]) -> tuple[list[Request], list[int]]:
        """Take the admitted requests up to their first token; returns those decoding on, and the
        sizes of the last passes run."""
        stitch = functools.partial(phases.stitch_request, shared=self.shared)
        stitched = [r for r in admit if self._try(stitch, r, left)]
        admitted = list(admit)
        while admit and (more := admit_more()):
            admitted += more
            stitched += [r for r in more if self._try(stitch, r, left)]
        self._probe(stitched)
        selected = [r for r in stitched if self._try(phases.select, r, left)]
        packs = self._recompute(selected, left)
        forked = self._fork(selected, left)
        start = functools.partial(phases.start_decoding, shared=self.shared)
        started: list[Request] = []
        for r in (*selected, *forked):
            if r.phase in (Phase.RECOMPUTED, Phase.FORKED) and self._try(start, r, left):
                if r.phase is Phase.FINISHED:
                    r.finish()
                    left.append(r)
                else:
                    started.append(r)
        for r in admitted:
            self._end_forks(r, left)
        return started, packs

    def _fork(self, requests: list[Request], left: list[Request]) -> list[Request]:
        """Copy each recomputed request's prompt into its forks whose consumers still read; returns them."""
        forked = []
        for r in requests:
            if r.phase is Phase.RECOMPUTED:
                fork = functools.partial(phases.fork, parent=r, shared=self.shared)
                forked += [f for f in r.forks if not f.cancelled and self._try(fork, f, left)]
        return forked

    @staticmethod
    def _end_forks(request: Request, left: list[Request]) -> None:
        """End the forks of `request` that were never forked (it failed or was dropped before its first
        token, or their own consumers left): with its error, or finished when nobody reads them."""
        for f in request.forks:
            if f.phase is not Phase.WAITING:
                continue
            if f.cancelled:
                f.finish()
            else:
                f.fail(request.error or RuntimeError(f"request {request.id}, whose prompt this choice decodes, was "
                                                     "cancelled before its first token"))
            left.append(f)

    def _probe(self, requests: list[Request]) -> None:
        try:
            phases.probe(requests)
        except Exception:
            # NOTE: one request's failure must stay its own: each selector then runs its own probe
            log.exception("a packed probe pass of %d requests failed: they probe one at a time", len(requests))
            for r in requests:
                if r.phase is Phase.STITCHED:
                    phases.skip_probe(r)

    def _recompute(self, requests: list[Request], left: list[Request]) -> list[int]:
        """Run the last passes as one; on failure, one at a time. Returns the sizes of the passes run."""
        if not requests:
            return []
        try:
            phases.recompute(requests, self.shared.decoder)
        except Exception as e:
            if len(requests) == 1:
                self._fail(requests[0], e, left)
                return []
            log.exception("a packed last pass of %d requests failed: they run one at a time", len(requests))
            return [n for r in requests for n in self._recompute([r], left)]
        return [len(requests)]

    # ---- decoding ----------------------------------------------------------------------------------------
    def _decode(self, requests: list[Request], left: list[Request]) -> int:
        """One batched decode step over `requests`; returns its rows."""
        if not requests:
            return 0
        try:
            logits = phases.decode_step(requests, self.shared.decoder)  # [B, V]
        except Exception as e:
            log.exception("a batched decode step failed: its %d requests fail with it", len(requests))
            for r in requests:
                self._fail(r, e, left)
            return 0
        for b, r in enumerate(requests):
            try:
                phases.advance(r, logits[b])
            except Exception as e:
                self._fail(r, e, left)
                continue
            if r.phase is Phase.FINISHED:
                r.finish()
                left.append(r)
        return len(requests)

    def _heal_answer(self, request: Request, healer: Healer) -> None:
        """One piece of `request`'s answer healing. A piece that fails is logged and counted; the request
        decodes on over its K/V as they are (still correct, still approximate) and is not healed again."""
        heal, decoding = request.answer_heal, request.decoding
        assert heal is not None and decoding is not None
        start = time.perf_counter()
        try:
            tokens = heal_answer_piece(self.shared.decoder, request.stitched_buffer(), decoding.ids, heal)
        except Exception:
            log.exception("healing request %d's answer failed at slot %d: it decodes on approximate",
                          request.id, heal.exact)
            heal.failed = True  # NOTE: its exact head stands: the piece wrote only slots past it
            healer.record_answer_piece(0, time.perf_counter() - start, caught_up=False, failed=True)
            return
        healer.record_answer_piece(tokens, time.perf_counter() - start, caught_up=heal.healed_at_token is not None)

    @staticmethod
    def _try(phase: Callable[[Request], None], request: Request, left: list[Request]) -> bool:
        """Run one request's phase; a failure ends that request alone. Returns whether it ran."""
        try:
            phase(request)
        except Exception as e:  # NOTE: the request's failure is its consumer's, never the loop's
            Runner._fail(request, e, left)
            return False
        return True

    @staticmethod
    def _fail(request: Request, error: Exception, left: list[Request]) -> None:
        request.fail(error)
        left.append(request)


def run_alone(request: Request, shared: Shared) -> Iterator[str]:
    """The request's phases on the caller's thread, without a scheduler: its text pieces as decoded.

    Its selector runs its own probe, and each token is one cached step of this request alone.
    """
    phases.stitch_request(request, shared)
    phases.skip_probe(request)
    phases.select(request)
    phases.recompute([request], shared.decoder)
    phases.start_decoding(request, shared)
    while request.phase is Phase.DECODING:
        yield from _drain(request)
        decoding = request.decoding
        assert decoding is not None
        token, slot = decoding.next_input()
        phases.advance(request, shared.decoder.decode_step(decoding.buf, token, slot))
    request.finish()
    yield from _drain(request)


async def arun_alone(request: Request, shared: Shared) -> AsyncIterator[str]:
    """`run_alone` for an asyncio consumer: the request's passes run on a worker thread, never on the
    event loop (a hop per piece: only an engine without a scheduler takes this path)."""
    pieces = run_alone(request, shared)
    while (piece := await asyncio.to_thread(_next_or_none, pieces)) is not None:
        yield piece


def _next_or_none(pieces: Iterator[str]) -> str | None:
    return next(pieces, None)


def _drain(request: Request) -> Iterator[str]:
    """The text pieces in the request's output now."""
    while (event := request.output.pop()) is not None:
        if isinstance(event, str):
            yield event


__all__ = ["Runner", "arun_alone", "run_alone"]
