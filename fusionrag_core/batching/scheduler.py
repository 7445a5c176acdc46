"""Continuous batching: requests from any number of threads share one loop that runs the model.

A request is computed in stages the loop runs for every request it admits in a round: `prepare`
stitches it (`Staged`: the probe its selector reads, if any), `Staged.select` selects up to its last
pass (`Pending`: the `SparsePass` of the recomputed tokens and the question), and `Pending.start`
turns that pass's logits into the consumer's value and the request's `Decoding`. One round:

1. **admit**: waiting requests are stitched in arrival order while the running set has room
   (`max_running`, the KV byte budget) and this round's prompt tokens stay within
   `prefill_tokens_per_step` (at least one request per round, so a long prompt is never starved);
   their probes run as one pass (`run_probes`: one per set of probe layers), then each selects,
   then their last passes run as one pass (`run_passes`): the rows share every product, which at
   a few dozen rows per request is far from the cores' rate (`benchmarks/pass_packing.py`); each
   request picks its first token. A packed pass that fails is logged, and its requests run their
   passes alone (a request's failure stays its own).
   On an idle engine the round ends there, so its TTFT waits for no decode step;
2. **step**, when requests were running before the round or none was admitted: one
   `Decoder.decode_batch` over every running request: the rows share one read of the weights,
   which is what a decode step mostly costs; each request picks its own token (its own sampling,
   stop strings, grammar) and streams its own text;
3. requests that finished, failed, or whose consumer stopped reading leave; their buffers are freed.

There is no thread of its own: the consumers run the loop. A consumer with nothing to read takes
the lead if no one holds it and runs one round (for every request, not only its own); the
others wait for their pieces. A request served alone thus runs on its caller's thread exactly as
without the scheduler.

NOTE: why not a dedicated loop thread: OpenMP (libgomp) keeps a worker pool per thread that ever
ran a parallel region, and once the pools hold more threads than there are cores it stops
spinning between regions; a decode step is hundreds of short regions, and on a 2-core machine a
dedicated thread's step took 1.6x the caller's (`benchmarks/serving.py` measures the scheduler
against the engine without it). Leading from the caller keeps one user as fast as before. With
several consumers the lead moves between threads, so a leader that others may follow hands its
pool back after its round, and every reader hands its pool back when it stops reading
(`runtime.threads`): one pool at a time, whoever leads.

Nothing a request owns is kept in the scheduler once it leaves.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from fusionrag_core.errors import InvalidRequestError, OverloadedError
from fusionrag_core.query.decoding import Decoding
from fusionrag_core.query.probe import Probe, run_probes
from fusionrag_core.query.recompute import SparsePass, run_passes
from fusionrag_core.runtime import threads
from fusionrag_core.runtime.decoder import Decoder

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Pending(Generic[T]):
    """A request computed up to its last pass.

    Attributes:
        last_pass: the pass that yields its first generated position's logits.
        start: turns those logits `[V]` into what its consumer keeps and its decoding (not yet started).
    """

    last_pass: SparsePass
    start: Callable[[torch.Tensor], tuple[T, Decoding]]


@dataclass(frozen=True)
class Staged(Generic[T]):
    """A request stitched, before its selection.

    Attributes:
        probe: the probe its selector reads (None: it runs none); run before `select`, packed with
            other requests' (`run_probes`), its masses wait in the request's `Stitched.probed`.
        select: selects, up to the request's last pass.
    """

    probe: Probe | None
    select: Callable[[], Pending[T]]


# Stitches a request.
Prepare = Callable[[], Staged[T]]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the engine's scheduler.

    Attributes:
        max_running: requests decoded together (one batched step); more wait.
        max_waiting: requests queued behind them; one more is refused with `OverloadedError` (a
            request that finds no one waiting and a running slot free is not queued behind anyone).
        kv_budget_bytes: bytes of KV buffers the running requests may hold together (each holds
            its prompt plus `max_new_tokens`); a request that would exceed it waits; one that
            exceeds it alone is refused. None: half the device memory free when the engine starts.
        prefill_tokens_per_step: prompt tokens prepared between two decode steps (at least one
            request): a burst of arrivals delays the running requests' next token by at most
            about this much prefill.
    """

    max_running: int = 32
    max_waiting: int = 256
    kv_budget_bytes: int | None = None
    prefill_tokens_per_step: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_running", "prefill_tokens_per_step"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise InvalidRequestError(f"SchedulerConfig.max_waiting must be >= 0, got {self.max_waiting}")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes < 1:
            raise InvalidRequestError(f"SchedulerConfig.kv_budget_bytes must be >= 1, got {self.kv_budget_bytes}")


_DONE = object()
_WAKE = object()  # tells a waiting consumer that the lead is free
# NOTE: a waiting consumer checks the lead this often even when not woken (a leader whose own
# consumer is slow between two pieces leaves the loop idle that long at most).
_HANDOVER_S = 0.02


class Ticket(Generic[T]):
    """A submitted request as its consumer sees it: iterate for the text pieces, then read `value`
    and `decoding`. Closing the iteration early (or `cancel()`) frees its slot at the next step.

    A failure of the request (in `prepare` or decoding) is raised by the iteration.
    """

    def __init__(self, scheduler: Scheduler, prepare: Prepare[T], kv_bytes: int, prompt_tokens: int) -> None:
        self.prepare = prepare
        self.kv_bytes = kv_bytes
        self.prompt_tokens = prompt_tokens
        self.value: T | None = None
        self.decoding: Decoding | None = None
        self.cancelled = False
        self._scheduler = scheduler
        self._events: queue.SimpleQueue[object] = queue.SimpleQueue()

    def __iter__(self) -> Iterator[str]:
        try:
            while True:
                event = self._next_event()
                if event is _WAKE:
                    continue
                if event is _DONE:
                    return
                if isinstance(event, Exception):
                    raise event
                assert isinstance(event, str)
                yield event
        finally:
            self.cancel()  # NOTE: a consumer that stops reading: no-op once finished
            self._scheduler.hand_over(self)
            # NOTE: this thread leads no more rounds for this request; a pool left here (a warm-up or a
            # request served alone) would slow whoever leads next (`runtime.threads`)
            threads.release_pool()

    def _next_event(self) -> object:
        """This request's next event; runs loop iterations while there is none and no one leads."""
        while True:
            try:
                return self._events.get_nowait()
            except queue.Empty:
                pass
            if self._scheduler.lead():
                continue
            try:
                return self._events.get(timeout=_HANDOVER_S)
            except queue.Empty:
                continue

    def cancel(self) -> None:
        """Stop generating for this request (it leaves the batch at the next step)."""
        self.cancelled = True

    # ---- the loop's side -------------------------------------------------------------------------
    def put(self, piece: str) -> None:
        if piece:
            self._events.put(piece)

    def finish(self) -> None:
        self._events.put(_DONE)

    def fail(self, error: Exception) -> None:
        self._events.put(error)

    def wake(self) -> None:
        self._events.put(_WAKE)


class Scheduler:
    """One loop thread running the model for every request submitted to it (see the module doc)."""

    def __init__(self, decoder: Decoder, config: SchedulerConfig, kv_budget_bytes: int) -> None:
        """Args:
            decoder: the model passes.
            config: limits.
            kv_budget_bytes: the running requests' KV byte budget (`config.kv_budget_bytes` resolved).
        """
        self.decoder = decoder
        self.config = config
        self.kv_budget_bytes = kv_budget_bytes
        self._waiting: deque[Ticket[object]] = deque()
        self._running: list[Ticket[object]] = []
        self._running_bytes = 0
        self._wake = threading.Lock()  # guards the queues and counts (submit runs on any thread)
        self._lead = threading.Lock()  # held by the consumer running an iteration
        self.steps = 0  # decode steps run (a batched step counts once)
        self.batched_rows = 0  # rows over all decode steps: / steps = the mean batch
        self.passes = 0  # last passes of admitted requests run (a packed pass counts once)
        self.packed_requests = 0  # requests over all those passes: / passes = the mean pack

    def submit(self, prepare: Prepare[T], *, kv_bytes: int, prompt_tokens: int) -> Ticket[T]:
        """Queue a request; returns its ticket at once (nothing runs on the caller's thread).

        Args:
            prepare: run by the loop when the request is admitted: stitches it (`Staged`); the value
                its `Pending.start` returns is handed to the consumer (`Ticket.value`).
            kv_bytes: the bytes its KV buffer takes (counted against the budget while it runs).
            prompt_tokens: its prompt's length (counted against `prefill_tokens_per_step`).

        Raises:
            OverloadedError: the waiting queue is full, or `kv_bytes` alone exceed the budget.
        """
        if kv_bytes > self.kv_budget_bytes:
            raise OverloadedError(
                f"this request's KV buffer ({kv_bytes / 2**20:.1f} MiB: its prompt plus max_new_tokens) exceeds the "
                f"scheduler's KV budget ({self.kv_budget_bytes / 2**20:.1f} MiB): raise "
                "SchedulerConfig.kv_budget_bytes, or send a shorter prompt or a lower max_new_tokens"
            )
        ticket: Ticket[T] = Ticket(self, prepare, kv_bytes, prompt_tokens)
        with self._wake:
            # NOTE: a request that finds no one waiting and a running slot free takes it at the next
            # round: it never waits behind others, so max_waiting=0 still serves an idle engine
            runs_next = not self._waiting and len(self._running) < self.config.max_running
            if len(self._waiting) >= self.config.max_waiting and not runs_next:
                raise OverloadedError(
                    f"{len(self._waiting)} requests are already waiting for the engine (SchedulerConfig.max_waiting="
                    f"{self.config.max_waiting}): retry later, or raise max_waiting or max_running"
                )
            self._waiting.append(ticket)  # type: ignore[arg-type]
        return ticket

    @property
    def load(self) -> dict[str, int]:
        """Requests running and waiting now, and the running ones' KV bytes."""
        with self._wake:
            return {"running": len(self._running), "waiting": len(self._waiting), "kv_bytes": self._running_bytes}

    # ---- the loop --------------------------------------------------------------------------------
    def lead(self) -> bool:
        """Run one iteration (admit, then one batched step) unless another consumer is; returns
        whether this call ran it."""
        if not self._lead.acquire(blocking=False):
            return False
        try:
            # NOTE: on an idle engine, a round that admitted a request ends there, so its first token
            # reaches its reader without waiting for a decode step; with requests running, they step
            # after every admission (`prefill_tokens_per_step` bounds how long they wait)
            busy = bool(self._running)
            if not self._admit() or busy:
                self._step()
        finally:
            self._lead.release()
        with self._wake:
            shared = len(self._running) + len(self._waiting) > 1
        if shared:  # NOTE: another consumer may lead next: one OpenMP pool per leader would slow them all
            threads.release_pool()
        return True

    def hand_over(self, leaving: Ticket[Any]) -> None:
        """A consumer stops reading: drop it now if no one leads, and wake a waiting consumer to lead."""
        if self._lead.acquire(blocking=False):
            try:
                for t in [t for t in self._running if t.cancelled]:
                    self._leave(t)
            finally:
                self._lead.release()
        with self._wake:
            others = [t for t in (*self._running, *self._waiting) if t is not leaving]
        if others:
            others[0].wake()

    def _admit(self) -> bool:
        """Stitch waiting requests while the running set has room (see the module doc), then probe,
        select and start them; returns whether any was admitted."""
        tokens = 0
        staged: list[tuple[Ticket[object], Staged[object]]] = []
        while True:
            with self._wake:
                while self._waiting and self._waiting[0].cancelled:
                    self._waiting.popleft().finish()
                head = self._waiting[0] if self._waiting else None
                room = head is not None and (len(self._running) + len(staged) < self.config.max_running
                                             and self._running_bytes + head.kv_bytes <= self.kv_budget_bytes)
                if head is None or not room or (tokens and tokens + head.prompt_tokens
                                                > self.config.prefill_tokens_per_step):
                    break
                self._waiting.popleft()
                self._running_bytes += head.kv_bytes
            tokens += head.prompt_tokens
            try:
                staged.append((head, head.prepare()))
            except Exception as e:  # NOTE: the request's failure is its consumer's, never the loop's
                self._leave(head, error=e)
        self._start(self._select(staged))
        return tokens > 0

    def _select(self, staged: list[tuple[Ticket[object], Staged[object]]]) -> list[tuple[Ticket[object],
                                                                                        Pending[object]]]:
        """Run the stitched requests' probes as one pass, then select each up to its last pass."""
        probes = [s.probe for _, s in staged if s.probe is not None]
        try:
            run_probes(probes)
        except Exception:
            # NOTE: one request's failure must stay its own: each selector then runs its own probe
            log.exception("a packed probe pass of %d requests failed: they probe one at a time", len(probes))
        pending: list[tuple[Ticket[object], Pending[object]]] = []
        for ticket, s in staged:
            try:
                pending.append((ticket, s.select()))
            except Exception as e:
                self._leave(ticket, error=e)
        return pending

    def _start(self, pending: list[tuple[Ticket[object], Pending[object]]]) -> None:
        """Run the prepared requests' last passes as one, pick each one's first token; those not done
        join the running set."""
        if not pending:
            return
        for (ticket, p), first_logits in zip(pending, self._last_passes(pending), strict=True):
            if first_logits is None:
                continue  # NOTE: its pass failed: it has left
            try:
                ticket.value, decoding = p.start(first_logits)
                ticket.decoding = decoding
                ticket.put(decoding.start(first_logits))
            except Exception as e:
                self._leave(ticket, error=e)
                continue
            if decoding.finished:
                self._leave(ticket)
                continue
            with self._wake:
                self._running.append(ticket)

    def _last_passes(self, pending: list[tuple[Ticket[object], Pending[object]]]) -> list[torch.Tensor | None]:
        """Each request's first logits `[V]` from its last pass, the passes run as one; None for a
        request whose pass failed (it has left, with the error)."""
        try:
            logits: list[torch.Tensor | None] = list(run_passes(self.decoder, [p.last_pass for _, p in pending]))
        except Exception as e:
            if len(pending) == 1:
                self._leave(pending[0][0], error=e)
                return [None]
            # NOTE: one request's failure must stay its own: each runs its pass alone
            log.exception("a packed last pass of %d requests failed: they run one at a time", len(pending))
            return [self._last_passes([one])[0] for one in pending]
        self.passes += 1
        self.packed_requests += len(pending)
        return logits

    def _step(self) -> None:
        """One batched decode step over the running requests."""
        for t in [t for t in self._running if t.cancelled]:
            self._leave(t)
        if not self._running:
            return
        running = list(self._running)
        decodings = [t.decoding for t in running]
        assert all(d is not None for d in decodings)
        try:
            inputs = [d.next_input() for d in decodings if d is not None]
            tokens = torch.tensor([tok for tok, _ in inputs], device=self.decoder.device)  # [B]
            logits = self.decoder.decode_batch([d.buf for d in decodings if d is not None], tokens,
                                               [slot for _, slot in inputs])  # [B, V]
        except Exception as e:
            log.exception("a batched decode step failed: its %d requests fail with it", len(running))
            for t in running:
                self._leave(t, error=e)
            return
        self.steps += 1
        self.batched_rows += len(running)
        for b, t in enumerate(running):
            d = t.decoding
            assert d is not None
            try:
                t.put(d.advance(logits[b]))
            except Exception as e:
                self._leave(t, error=e)
                continue
            if d.finished:
                self._leave(t)

    def _leave(self, ticket: Ticket[object], error: Exception | None = None) -> None:
        with self._wake:
            if ticket in self._running:
                self._running.remove(ticket)
            self._running_bytes -= ticket.kv_bytes
        # NOTE: read before the last event: once its reader sees it, the reader cancels (a no-op for
        # a finished request) and reads `decoding`, which must then still be there
        abandoned = ticket.cancelled
        if abandoned:
            ticket.decoding = None  # NOTE: frees the buffer: nobody will read this answer
        if error is not None:
            ticket.fail(error)
        else:
            if ticket.decoding is not None:
                ticket.put(ticket.decoding.flush())
            ticket.finish()


__all__ = ["Pending", "Prepare", "Scheduler", "SchedulerConfig", "Staged", "Ticket"]
