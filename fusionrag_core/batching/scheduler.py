"""Continuous batching: which requests run which phase in the next step, decided as plain data.

The scheduler holds the requests that wait and those that run, admits new ones (or refuses them),
and plans each step (`plan` returns a `StepPlan`); the runner executes the plan on the model
(`batching.runner`) and reports what happened (`StepOutput`), which `update` takes in. vLLM v1's
`Scheduler.schedule` / `SchedulerOutput` / `update_from_output` split is the model: the scheduler
never runs the model, the runner never decides.

One step:

1. **admit**: waiting requests, in arrival order, while the running set has room (`max_running`,
   the K/V byte budget; a request with forks, the choices of one prompt, takes a slot and a buffer
   for each) and the step's prompt tokens stay within `prefill_tokens_per_step` (at
   least one request per step, so a long prompt is never starved). The runner takes each of
   them up to its first token: stitch, probe (packed), select, recompute (packed), first token.
   Requests that arrive while those are stitched (their caches load from the store) are admitted
   into the same step within the same limits (`admit_more`), so they share its packed passes.
2. **decode**, when requests were running before the step or none was admitted: one batched
   decode step over every running request (those just admitted included). On an idle engine an
   admitting step ends without it, so a lone request's first token waits for no decode step.
3. **heal an answer**, when no request waits to be admitted: before the decode step (so the token
   it picks reads the healed K/V), one piece of the oldest running request's answer healing
   (`batching.answer_heal`), if one has any left.
4. **heal**, the lowest priority: only in a step planned for it (`plan(heal=True)`, by the loop's
   heal thread) that finds no request waiting or running: one piece of a kept request's healing
   (`batching.heal`), so an arrival waits for one piece at most.

Admission is the one limit of the whole engine: `add` refuses a request with `OverloadedError`
(naming the limit to raise) when `max_waiting` requests already wait, or when its K/V alone exceed
the budget; the HTTP server maps that to 429/503 and sets no limit of its own.

Thread-safe: requests arrive on any thread; one thread at a time plans and updates (the loop's
leader, `batching.loop`). Nothing a request owns is kept once it has left.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

import psutil
import torch

from fusionrag_core.batching.request import Request
from fusionrag_core.errors import InvalidRequestError, OverloadedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the engine's scheduler: the engine's one admission point.

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


def default_kv_budget(config: SchedulerConfig, device: torch.device) -> int:
    """The running requests' KV byte budget: configured, else half the device memory free now."""
    if config.kv_budget_bytes is not None:
        return config.kv_budget_bytes
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    log.info("scheduler KV budget: %.1f GiB (half the %s memory free now; SchedulerConfig.kv_budget_bytes sets it)",
             free / 2 / 2**30, device.type)
    return int(free // 2)


@dataclass(frozen=True)
class StepPlan:
    """One step, as the scheduler decided it.

    Attributes:
        dropped: requests whose consumers stopped reading: they end now, unrun.
        admit: waiting requests to take up to their first token, in arrival order (their running
            slots and K/V bytes are already counted).
        decode: requests that were decoding before this step.
        step: after the admissions, one batched decode step over `decode` and the admitted
            requests that still decode.
        heal: run one piece of healing (nothing else to do in this step).
        heal_answer: before the decode step, run one piece of this request's answer healing.
    """

    dropped: tuple[Request, ...]
    admit: tuple[Request, ...]
    decode: tuple[Request, ...]
    step: bool
    heal: bool = False
    heal_answer: Request | None = None

    @property
    def requests(self) -> tuple[Request, ...]:
        return (*self.dropped, *self.admit, *self.decode)


@dataclass(frozen=True)
class StepOutput:
    """What the runner did with a plan.

    Attributes:
        left: requests that ended in the step (finished, failed or dropped).
        decoded_rows: rows of its batched decode step (0: it ran none).
        packs: requests per last pass it ran (a pass that ran alone after a packed one failed counts 1).
    """

    left: tuple[Request, ...]
    decoded_rows: int = 0
    packs: tuple[int, ...] = ()


class Scheduler:
    """The waiting and running requests, admission, and the plan of each step (see the module doc)."""

    def __init__(self, config: SchedulerConfig, kv_budget_bytes: int) -> None:
        """Args:
            config: limits.
            kv_budget_bytes: the running requests' KV byte budget (`config.kv_budget_bytes` resolved).
        """
        self.config = config
        self.kv_budget_bytes = kv_budget_bytes
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._running_bytes = 0
        self._lock = threading.Lock()  # NOTE: `add` and `load` run on any thread
        self._step_tokens = 0  # NOTE: prompt tokens admitted in the step being run
        self._mean_s = 1.0  # NOTE: a running mean of request durations, for a refusal's retry-after
        self.steps = 0  # decode steps run (a batched step counts once)
        self.batched_rows = 0  # rows over all decode steps: / steps = the mean batch
        self.passes = 0  # last passes of admitted requests run (a packed pass counts once)
        self.packed_requests = 0  # requests over all those passes: / passes = the mean pack

    def add(self, request: Request) -> None:
        """Queue `request` (nothing runs on the caller's thread).

        Raises:
            OverloadedError: `max_waiting` requests already wait, or its K/V alone exceed the budget.
            InvalidRequestError: it and its forks need more running slots than `max_running`.
        """
        if request.slots > self.config.max_running:
            raise InvalidRequestError(
                f"this request decodes {request.slots} choices, each in its own running slot, but the engine runs "
                f"at most {self.config.max_running} requests at once (SchedulerConfig.max_running): ask for fewer")
        if request.group_bytes > self.kv_budget_bytes:
            raise OverloadedError(
                f"this request's KV buffer ({request.group_bytes / 2**20:.1f} MiB: its prompt plus max_new_tokens, "
                "for each of its choices) "
                f"exceeds the scheduler's KV budget ({self.kv_budget_bytes / 2**20:.1f} MiB): raise "
                "SchedulerConfig.kv_budget_bytes, or send a shorter prompt or a lower max_new_tokens",
                limit="kv_budget_bytes",
            )
        with self._lock:
            # NOTE: a request that finds no one waiting and a running slot free takes it at the next
            # step: it never waits behind others, so max_waiting=0 still serves an idle engine
            runs_next = not self._waiting and len(self._running) < self.config.max_running
            if len(self._waiting) >= self.config.max_waiting and not runs_next:
                ahead = len(self._waiting) + len(self._running)
                retry = max(1, math.ceil(ahead * self._mean_s / self.config.max_running))
                raise OverloadedError(
                    f"{len(self._waiting)} requests are already waiting for the engine (max_waiting="
                    f"{self.config.max_waiting}): retry after {retry} s, or raise max_waiting or max_running",
                    limit="max_waiting", retry_after_s=retry,
                )
            self._waiting.append(request)

    def plan(self, *, heal: bool = False) -> StepPlan:
        """The next step: dropped requests, admissions, and whether to decode (see the module doc);
        `heal`: a piece of healing when there is nothing else to do."""
        with self._lock:
            dropped = [r for r in (*self._waiting, *self._running) if r.cancelled]
            for r in dropped:
                self._remove(r)
            decode = tuple(self._running)
            self._step_tokens = 0
            admit = self._admit()
            # NOTE: below admissions: a piece runs only in a step no waiting request could use
            answer = None if self._waiting else next((r for r in decode if r.answer_heal_pending), None)
        idle = not (dropped or admit or decode)
        return StepPlan(dropped=tuple(dropped), admit=admit, decode=decode, step=bool(decode) or not admit,
                        heal=heal and idle, heal_answer=answer)

    def admit_more(self) -> tuple[Request, ...]:
        """Requests that arrived while this step's admissions were being stitched, within what room and
        prompt-token budget the step has left: they join its packed passes instead of waiting a step."""
        with self._lock:
            return self._admit()

    def _admit(self) -> tuple[Request, ...]:
        """Move waiting requests to running, in order, while they fit (the lock is held)."""
        admit: list[Request] = []
        while self._waiting:
            head = self._waiting[0]
            room = (len(self._running) + head.slots <= self.config.max_running
                    and self._running_bytes + head.group_bytes <= self.kv_budget_bytes)
            budget = self.config.prefill_tokens_per_step
            over = self._step_tokens > 0 and self._step_tokens + head.prompt.num_tokens > budget
            if not room or over:
                break
            # NOTE: its forks run from now on (each leaves on its own); only it prefills
            self._running += [self._waiting.popleft(), *head.forks]
            self._running_bytes += head.group_bytes
            self._step_tokens += head.prompt.num_tokens
            admit.append(head)
        return tuple(admit)

    def update(self, output: StepOutput) -> None:
        """Take in what the runner did: requests that ended leave, the counters advance."""
        now = time.perf_counter()
        with self._lock:
            for r in output.left:
                self._remove(r)
                self._mean_s = 0.8 * self._mean_s + 0.2 * (now - r.arrived_at)
        if output.decoded_rows:
            self.steps += 1
            self.batched_rows += output.decoded_rows
        self.passes += len(output.packs)
        self.packed_requests += sum(output.packs)

    def abort(self, request: Request) -> bool:
        """Take `request` out (its consumer stopped reading); returns whether it was here."""
        with self._lock:
            return self._remove(request)

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

    @property
    def load(self) -> dict[str, int]:
        """Requests running and waiting now, and the running ones' KV bytes."""
        with self._lock:
            return {"running": len(self._running), "waiting": len(self._waiting), "kv_bytes": self._running_bytes}

    def stats(self) -> dict[str, int]:
        """Lifetime step totals (decode steps and their rows, packed passes and the requests they
        carried) and the load now (`load`)."""
        load = self.load
        return {"decode_steps": self.steps, "decode_rows": self.batched_rows, "sparse_passes": self.passes,
                "sparse_pass_requests": self.packed_requests, "running": load["running"],
                "waiting": load["waiting"], "running_kv_bytes": load["kv_bytes"]}

    def _remove(self, request: Request) -> bool:
        if request in self._running:
            self._running.remove(request)
            self._running_bytes -= request.kv_bytes
            return True
        if request in self._waiting:
            self._waiting.remove(request)
            return True
        return False


__all__ = ["Scheduler", "SchedulerConfig", "StepOutput", "StepPlan", "default_kv_budget"]
