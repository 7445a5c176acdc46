"""The loop: plan a step, run it, take in what happened; and who runs it.

    Scheduler.plan() ─► StepPlan ─► Runner.run(plan) ─► StepOutput ─► Scheduler.update(output)

One thread at a time runs a step (the leader). A request read on a thread (`pieces`) is its
consumer's to lead: a consumer with nothing to read leads when no one does and there is work, and
runs one step for every request, not only its own; the others sleep until a step ends or their
piece arrives (a condition, never a poll). A request served alone thus runs on its caller's thread
as without a scheduler. A request read on an asyncio event loop (`apieces`) cannot lead there
(a step would block the event loop): the loop's own thread leads while such requests exist, and
each piece reaches the event loop as it is put, with no thread hop per token.

NOTE: why consumers lead rather than one dedicated thread: OpenMP (libgomp) keeps a worker pool per
thread that ever ran a parallel region, and once the pools hold more threads than there are cores
it stops spinning between regions; a decode step is hundreds of short regions, and on a 2-core
machine a dedicated thread's step took 1.6x the caller's. Leading from the caller keeps one user
as fast as before. With several consumers the lead moves between threads, so a leader that others
may follow hands its pool back after its step, and every reader hands its pool back when it stops
reading (`runtime.threads`): one pool at a time, whoever leads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Iterator

from fusionrag_core.batching.request import Request, RequestOutput
from fusionrag_core.batching.runner import Runner
from fusionrag_core.batching.scheduler import Scheduler, StepOutput
from fusionrag_core.runtime import threads

log = logging.getLogger(__name__)


class BatchLoop:
    """Runs `scheduler`'s plans on `runner` for every request submitted (see the module doc)."""

    def __init__(self, scheduler: Scheduler, runner: Runner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self._changed = threading.Condition()  # NOTE: a step ended, or work arrived
        self._leading = False
        self._driver: threading.Thread | None = None

    # ---- consumers on threads ----------------------------------------------------------------------------
    def pieces(self, request: Request) -> Iterator[str]:
        """Submit `request` and yield its text pieces, leading steps while no one else does.

        Raises:
            OverloadedError: the scheduler refused it.
            Exception: what failed the request.
        """
        self.submit(request)
        try:
            while (piece := RequestOutput.piece(self._next_event(request))) is not None:
                yield piece
        finally:
            self.cancel(request)  # NOTE: a consumer that stops reading: a no-op once it has ended
            # NOTE: this thread leads no more steps for this request; a pool left here would slow
            # whoever leads next (`runtime.threads`)
            threads.release_pool()

    def _next_event(self, request: Request) -> object:
        while True:
            with self._changed:
                event = request.output.pop()
                if event is not None:
                    return event
                if self._leading or not self.scheduler.has_work:
                    self._changed.wait()
                    continue
                self._leading = True
            self._step()

    # ---- consumers on an event loop ------------------------------------------------------------------------
    async def apieces(self, request: Request) -> AsyncIterator[str]:
        """`pieces` for a consumer on an asyncio event loop: the loop's thread leads the steps, and
        each piece is handed to the event loop as it is put.

        Raises:
            OverloadedError: the scheduler refused it (before anything ran).
            Exception: what failed the request.
        """
        queue = request.output.attach(asyncio.get_running_loop())
        self.submit(request)
        self._start_driver()
        try:
            while (piece := RequestOutput.piece(await queue.get())) is not None:
                yield piece
        finally:
            self.cancel(request)

    def _start_driver(self) -> None:
        with self._changed:
            if self._driver is None:
                self._driver = threading.Thread(target=self._drive, name="fusionrag-loop", daemon=True)
                self._driver.start()

    def _drive(self) -> None:
        """The loop's own thread: leads whenever there is work and no consumer leads."""
        while True:
            with self._changed:
                while self._leading or not self.scheduler.has_work:
                    self._changed.wait()
                self._leading = True
            self._step()

    # ---- both --------------------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue `request` and wake whoever may lead.

        Raises:
            OverloadedError: the scheduler refused it.
        """
        self.scheduler.add(request)
        with self._changed:
            self._changed.notify_all()

    def cancel(self, request: Request) -> None:
        """Its consumer stopped reading: it ends now when no one leads, else at the next step."""
        if request.done:
            return
        request.cancelled = True
        with self._changed:
            if self._leading:
                return  # NOTE: the leader's next plan drops it
            self._leading = True
        try:
            if self.scheduler.abort(request):
                request.finish()
        finally:
            self._release()

    def _step(self) -> None:
        """One step, by the thread holding the lead; releases the lead."""
        try:
            plan = self.scheduler.plan()
            more: list[Request] = []  # NOTE: admitted while the plan's admissions were stitched

            def admit_more() -> tuple[Request, ...]:
                admitted = self.scheduler.admit_more()
                more.extend(admitted)
                return admitted

            try:
                output = self.runner.run(plan, admit_more)
            except Exception as e:  # NOTE: a defect of the runner itself: its requests fail, the loop goes on
                failed = (*plan.requests, *more)
                log.exception("a step of %d requests failed: they fail with it", len(failed))
                for r in failed:
                    if not r.done:
                        r.fail(e)
                output = StepOutput(left=failed)
            self.scheduler.update(output)
            load = self.scheduler.load
        finally:
            self._release()
        if load["running"] + load["waiting"] > 1:
            # NOTE: another consumer may lead next: one OpenMP pool per leader would slow them all
            threads.release_pool()

    def _release(self) -> None:
        with self._changed:
            self._leading = False
            self._changed.notify_all()


__all__ = ["BatchLoop"]
