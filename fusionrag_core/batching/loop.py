"""The loop: plan a step, run it, take in what happened; and who runs it.

    Scheduler.plan() ─► StepPlan ─► Runner.run(plan) ─► StepOutput ─► Scheduler.update(output)

One thread at a time runs a step (the leader). A request read on a thread (`pieces`) is its
consumer's to lead: a consumer with nothing to read leads when no one does and there is work, and
runs one step for every request, not only its own; the others sleep until a step ends or their
piece arrives (a condition, never a poll). A request served alone thus runs on its caller's thread
as without a scheduler. A request read on an asyncio event loop (`apieces`) cannot lead there
(a step would block the event loop): the loop's own thread leads while such requests exist, and
each piece reaches the event loop as it is put, with no thread hop per token.

Healing (`batching.heal`) has a thread of its own, `fusionrag-heal`, started with the first kept
request that needs it: woken when the engine goes idle or keeps a request, it leads one heal step
at a time (`Scheduler.plan(heal=True)`) while no request waits or runs and an entry needs healing,
handing its OpenMP pool back after each. A request that arrives meanwhile waits for that one step,
then is handed the lead as usual. At interpreter exit healing stops after the step in flight
(`stop_healing`).

Each consumer is woken for its own pieces as they are put (its first token reaches it before the
step's decode pass ends), and when a step ends the oldest idle consumer, if any, is woken to lead
the next one: one wake-up per step, never one per consumer. A consumer that leaves hands on a lead
it was given and will not take.

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
import atexit
import logging
import threading
import weakref
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
        self._lock = threading.Lock()  # NOTE: guards `_leading` and `_idle`
        self._leading = False
        # NOTE: the outputs of consumers blocked with nothing to read, oldest first; one of them is
        # woken to lead when a step ends, so a step never wakes every consumer
        self._idle: dict[int, RequestOutput] = {}
        self._driver: threading.Thread | None = None
        self._driver_wake = RequestOutput()  # NOTE: the driver's own wake-ups; it never carries events
        self._healing: threading.Thread | None = None
        self._heal_wake = threading.Event()
        self._heal_stopped = False  # NOTE: set once, at interpreter exit or by `close` (`stop_healing`)
        self._heal_ended = False  # NOTE: set once, by `close`: the heal thread exits
        self._heal_step_done = threading.Event()  # NOTE: clear while a heal step runs
        self._heal_step_done.set()

    # ---- consumers on threads ----------------------------------------------------------------------------
    def pieces(self, request: Request) -> Iterator[str]:
        """Submit `request` and yield its text pieces, leading steps while no one else does.

        Raises:
            OverloadedError: the scheduler refused it.
            Exception: what failed the request.
        """
        self.submit(request)
        try:
            while (piece := RequestOutput.piece(self._next_event(request.output))) is not None:
                yield piece
        finally:
            self.cancel(request)  # NOTE: a consumer that stops reading: a no-op once it has ended
            self._hand_over()  # NOTE: it may have been handed the lead it will not take now
            # NOTE: this thread leads no more steps for this request; a pool left here would slow
            # whoever leads next (`runtime.threads`)
            threads.release_pool()

    def _next_event(self, output: RequestOutput) -> object:
        while True:
            event = output.pop()
            if event is not None:
                return event
            if self._lead_or_idle(output):
                self._step()
                continue
            event = output.wait()  # NOTE: its own piece, or the lead handed to it
            with self._lock:
                handed = self._idle.pop(id(output), None) is None  # NOTE: `_hand_over` took it out
            if event is not None:
                if handed:  # NOTE: a lead handed to a consumer busy with its piece would wait for it
                    self._hand_over()
                return event

    # ---- consumers on an event loop ------------------------------------------------------------------------
    async def apieces(self, request: Request, *, submit: bool = True) -> AsyncIterator[str]:
        """`pieces` for a consumer on an asyncio event loop: the loop's thread leads the steps, and
        each piece is handed to the event loop as it is put.

        Args:
            request: the request.
            submit: False for a fork (`Request.forks`): it is admitted with the request it forks
                from, whose consumer submits it; its output must be attached before that.

        Raises:
            OverloadedError: the scheduler refused it (before anything ran).
            Exception: what failed the request.
        """
        queue = request.output.attach(asyncio.get_running_loop())
        self._start_driver()
        if submit:
            self.submit(request)
        try:
            while (piece := RequestOutput.piece(await queue.get())) is not None:
                yield piece
        finally:
            self.cancel(request)

    def _start_driver(self) -> None:
        with self._lock:
            if self._driver is None:
                self._driver = threading.Thread(target=self._drive, name="fusionrag-loop", daemon=True)
                self._driver.start()

    def _drive(self) -> None:
        """The loop's own thread: leads whenever it is woken and no consumer leads."""
        while True:
            if self._lead_or_idle(self._driver_wake):
                self._step()
            else:
                self._driver_wake.wait()

    # ---- healing ---------------------------------------------------------------------------------------
    def heal_soon(self) -> None:
        """A kept request may need healing: wake the heal thread (started on first use); a no-op when
        the engine does not heal."""
        if self.runner.shared.healer is None or self.runner.shared.prefix_cache is None:
            return
        with self._lock:
            if self._healing is None:
                self._healing = threading.Thread(target=self._heal, name="fusionrag-heal", daemon=True)
                self._healing.start()
                atexit.register(_stop_healing, weakref.ref(self))
        self._heal_wake.set()

    def stop_healing(self, timeout_s: float = 60.0, *, end_thread: bool = False) -> bool:
        """Start no heal step again, and wait up to `timeout_s` for the one running to end; returns
        whether none runs. Called at interpreter exit (a daemon thread still inside torch when the
        interpreter finalizes aborts the process: "terminate called without an active exception")
        and, with `end_thread`, by `FusionEngine.close`: the heal thread then exits too, so a dropped
        engine is not kept alive by it.

        NOTE: at interpreter exit the thread is left blocked on its wake-up event: a thread that
        ends while the interpreter finalizes aborts the process the same way."""
        with self._lock:
            self._heal_stopped = True
            self._heal_ended = self._heal_ended or end_thread
        if end_thread:
            self._heal_wake.set()
        return self._heal_step_done.wait(timeout_s)

    def _heal(self) -> None:
        """The heal thread: one heal step at a time while the engine is idle and an entry needs it."""
        while not self._heal_ended:
            self._heal_wake.wait()
            self._heal_wake.clear()
            while self._lead_heal():
                try:
                    self._step(heal=True)
                    threads.release_pool()  # NOTE: whoever leads next must not share the cores with its pool
                finally:
                    self._heal_step_done.set()

    def _lead_heal(self) -> bool:
        """Take the lead for a heal step if no one holds it, no request waits or runs, and an entry
        needs healing. Returns whether it was taken."""
        healer, cache = self.runner.shared.healer, self.runner.shared.prefix_cache
        with self._lock:
            if (self._heal_stopped or self._leading or self.scheduler.has_work or healer is None or cache is None
                    or not healer.pending(cache)):
                return False
            self._leading = True
            self._heal_step_done.clear()
            return True

    # ---- both --------------------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue `request` and wake an idle consumer (or the loop's thread) to lead, if no one does.

        Raises:
            OverloadedError: the scheduler refused it.
        """
        self.scheduler.add(request)
        self._hand_over()

    def cancel(self, request: Request) -> None:
        """Its consumer stopped reading: it ends now when no one leads, else at the next step."""
        if request.done:
            return
        request.cancelled = True
        with self._lock:
            if self._leading:
                return  # NOTE: the leader's next plan drops it
            self._leading = True
        try:
            if self.scheduler.abort(request):
                request.finish()
        finally:
            self._release()

    def _lead_or_idle(self, output: RequestOutput) -> bool:
        """Take the lead if no one holds it and there is work; else register `output` as idle (its
        consumer then waits on it). Returns whether the lead was taken."""
        with self._lock:
            if not self._leading and self.scheduler.has_work:
                self._leading = True
                return True
            self._idle[id(output)] = output
            return False

    def _hand_over(self) -> None:
        """Wake the oldest idle consumer to lead, when no one leads and there is work."""
        with self._lock:
            if self._leading or not self._idle or not self.scheduler.has_work:
                return
            waiter = self._idle.pop(next(iter(self._idle)))
        waiter.wake()

    def _step(self, *, heal: bool = False) -> None:
        """One step, by the thread holding the lead (`heal`: the heal thread); releases the lead."""
        try:
            plan = self.scheduler.plan(heal=heal)
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
        with self._lock:
            self._leading = False
        self._hand_over()
        if self._healing is not None and not self.scheduler.has_work:
            self._heal_wake.set()  # NOTE: idle: healing may go on


def _stop_healing(loop: weakref.ref[BatchLoop]) -> None:
    """At interpreter exit: no heal step of a loop still alive is left running (`BatchLoop.stop_healing`)."""
    alive = loop()
    if alive is not None and not alive.stop_healing():
        log.warning("a heal step was still running at exit after 60 s; the process may abort")


__all__ = ["BatchLoop"]
