"""One request, as data: what was asked, which phase it is in, what its phases computed, where its
text goes.

A `Request` moves through its phases in one order (`Phase`); each phase is a function of the
request (`batching.phases`) that fills in its part and moves it on (`Request.enter` refuses any
other order). The scheduler plans which requests run which phase in a step (`batching.scheduler`),
the runner executes that plan (`batching.runner`), and the request's consumer reads its text from
`Request.output` on its own thread or event loop.

    waiting ─► stitched ─► probed ─► selected ─► recomputed ─► decoding ─► finished ─► kept
    waiting ─► forked ─► decoding ─► finished          (a fork: another choice of the same prompt)
          (any phase) ─► failed;  (any phase, its consumer gone) ─► finished

A request belongs to one consumer: no two requests share any of its fields, and nothing of it is
kept by the scheduler once it has left.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import queue
import time
from collections.abc import Callable, Collection, Container
from dataclasses import dataclass, field

import torch

from fusionrag_core.batching.answer_heal import AnswerHeal
from fusionrag_core.batching.prefix_cache import KeptPrefix, ReusedRun
from fusionrag_core.errors import AccountingError
from fusionrag_core.query.decoding import Decoding
from fusionrag_core.query.probe import Probe
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.recompute import SparsePass
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.query.select import SelectConfig, Selector
from fusionrag_core.query.stitch import CacheLookup, Stitched
from fusionrag_core.scope import OPERATOR, Scope

# Called once a request's answer is decoded, with its stitched prompt and buffer, when some chunk had
# no usable cache: keeps those chunks' K/V (e.g. `fusionrag_core.reuse.learned.LearnedCaches.learn`).
LearnFn = Callable[[FusionPrompt, Stitched], None]


class Phase(enum.Enum):
    """Where a request is; each phase names what has been computed for it."""

    WAITING = "waiting"  # queued: nothing computed
    STITCHED = "stitched"  # its buffer holds the prefix and the re-rotated chunk caches
    PROBED = "probed"  # its question's attention is read (or its selector needs none)
    SELECTED = "selected"  # the chunk tokens to recompute are chosen: its last pass is ready
    RECOMPUTED = "recomputed"  # its last pass ran: the first generated position's logits are known
    DECODING = "decoding"  # tokens are being generated
    FINISHED = "finished"  # its answer is complete
    KEPT = "kept"  # its K/V are in the prefix cache (when the engine keeps finished requests)
    FORKED = "forked"  # a fork: its parent's computed prompt copied, first logits included
    FAILED = "failed"  # an error ended it; its consumer raises it


_NEXT: dict[Phase, tuple[Phase, ...]] = {
    Phase.WAITING: (Phase.STITCHED, Phase.FORKED),
    Phase.FORKED: (Phase.DECODING, Phase.FINISHED),
    Phase.STITCHED: (Phase.PROBED,),
    Phase.PROBED: (Phase.SELECTED,),
    Phase.SELECTED: (Phase.RECOMPUTED,),
    Phase.RECOMPUTED: (Phase.DECODING, Phase.FINISHED),  # NOTE: the first token may end the answer
    Phase.DECODING: (Phase.FINISHED,),
    Phase.FINISHED: (Phase.KEPT,),
    Phase.KEPT: (),
    Phase.FAILED: (),
}


@dataclass(frozen=True)
class Selection:
    """How a request chooses the chunk tokens it recomputes.

    Attributes:
        name: the selector's name (`query.select.SELECTORS`), or "full_attention".
        fn: the selector.
        config: its ratio and knobs.
    """

    name: str
    fn: Selector
    config: SelectConfig

    @property
    def ratio(self) -> float | None:
        """The ratio this request reports (None for the selectors that take no budget)."""
        return self.config.ratio if self.name not in ("none", "all", "full_attention") else None

    @property
    def recomputes_everything(self) -> bool:
        """Every reused token is recomputed: the answer must equal a plain prefill."""
        return self.name == "all" or self.config.ratio >= 1.0


@dataclass
class TokenAccount:
    """Where each prompt token's K/V came from; the phases fill it in, `check` proves it adds up.

    Attributes:
        prompt: the prompt's tokens.
        reused: chunk tokens whose cached K/V were kept.
        recomputed: reused-chunk tokens the selector chose to compute again.
        prefilled: every other token computed afresh (the question, text without a usable cache,
            the system prefix when it was not memoised).
        system_prefix: system-prefix tokens served from the engine's memo of computed prefixes.
        prefix_cached: tokens continued from a kept request (`batching.prefix_cache`); its reused chunk
            tokens never recomputed count as reused or recomputed instead.
    """

    prompt: int
    reused: int = 0
    recomputed: int = 0
    prefilled: int = 0
    system_prefix: int = 0
    prefix_cached: int = 0

    def check(self) -> None:
        """Raises AccountingError unless the counts sum to the prompt (a defect, never the caller's)."""
        parts = (self.reused, self.recomputed, self.prefilled, self.system_prefix, self.prefix_cached)
        if sum(parts) != self.prompt or min(parts) < 0:
            raise AccountingError(f"token counts {self} account for {sum(parts)} of {self.prompt} prompt tokens")


_DONE = object()  # the end of a request's output
_WAKE = object()  # no event: the consumer is handed the lead (`RequestOutput.wake`)
_ids = itertools.count()


class RequestOutput:
    """A request's text pieces on their way to its consumer, then its end (or the error that ended it).

    The loop puts; the consumer reads from its thread (`pop`, or `wait`, which a put or a `wake`
    ends at once: each consumer is woken for its own pieces, never for another's) or, once
    `attach`ed, awaits them on its event loop (each put is handed to that loop, no thread waits).
    """

    def __init__(self) -> None:
        self._events: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[object] | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[object]:
        """Deliver every later event to an asyncio queue of `loop` (before the request is submitted);
        attached again to the same loop, the same queue."""
        if self._queue is None or self._loop is not loop:
            self._loop, self._queue = loop, asyncio.Queue()
        return self._queue

    def put(self, piece: str) -> None:
        if piece:
            self._push(piece)

    def finish(self) -> None:
        self._push(_DONE)

    def fail(self, error: BaseException) -> None:
        self._push(error)

    def wake(self) -> None:
        """End a `wait` with no event (the loop hands its consumer the lead)."""
        self._events.put(_WAKE)

    def pop(self) -> object | None:
        """The next event (read it with `piece`), or None when there is none yet."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return None
            if event is not _WAKE:
                return event

    def wait(self) -> object | None:
        """Block until the next event (returned) or a `wake` (None)."""
        event = self._events.get()
        return None if event is _WAKE else event

    @staticmethod
    def piece(event: object) -> str | None:
        """What a consumer makes of an event: its text, or None at the end.

        Raises:
            Exception: the error that ended the request.
        """
        if event is _DONE:
            return None
        if isinstance(event, BaseException):
            raise event
        assert isinstance(event, str)
        return event

    def _push(self, event: object) -> None:
        if self._queue is not None and self._loop is not None:
            # NOTE: a closed event loop raises: its consumer is gone, nobody reads this
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        else:
            self._events.put(event)


@dataclass(eq=False)
class Request:
    """One request, from its arrival to its kept K/V (see the module doc for its phases).

    Attributes:
        prompt: what was asked.
        sampling: its decoding settings.
        selection: how it chooses the chunk tokens it recomputes.
        lookup: where its chunk caches come from (a `query.lookup.ChunkLookup`).
        kv_bytes: the bytes its K/V buffer takes (prompt plus `max_new_tokens`).
        full_attention: computed from position 0 with no cache at all (the baseline).
        in_memory: chunk ids whose caches are already in memory (looked up inline, never pooled).
        learn: called once decoded when some chunk had no usable cache.
        audit: also answer it with full attention, once it has streamed.
        eos_ids: tokens that end its answer.
        scope: whose request it is: it continues and keeps conversation K/V, and memoises system
            prefixes, within this scope only.
        id: unique in the process.
        phase: where it is.
        arrived_at: `time.perf_counter()` when it was submitted (its TTFT counts from there).
        output: its pieces, for its consumer.
        account: where its prompt tokens' K/V came from.
        stitched, stitched_prompt: its buffer and the prompt as stitched (its head a kept prefix,
            when one was continued).
        budget: chunk tokens its selector may recompute.
        continued: the kept prefix it continued whole (what it keeps supersedes it).
        continued_runs: the chunk runs of the kept prefix it continued (carried into what it keeps).
        exact_base: leading slots exact before its passes ran (see `continuation.kept_from`).
        healed_head: `[n]` bool: which tokens of the kept head it continued healing made exact
            (`batching.heal`); None: none.
        forced_prefilled: context without a usable cache counts as prefilled (not full attention).
        probe: the probe its selector reads (None: none); run packed with others' by the runner.
        selected: `[K]` the slots its selector chose.
        last_pass: its recompute-and-question pass.
        first_logits: `[V]` fp32 logits of the first generated position.
        decoding: its sampling state and generated tokens.
        error: what ended it, when it failed.
        cancelled: its consumer stopped reading; it leaves at the next step.
        forks: requests that decode this one's prompt again (an OpenAI request's choices 1..n-1):
            admitted with it, never stitched or recomputed themselves; each copies its computed
            prompt once its first logits are known (`phases.fork`) and decodes on with its own sampling.
        forked: it is such a fork: it is neither kept nor learned from (its parent is).
        heal_answer: heal its buffer between its decode steps (`batching.answer_heal`).
        answer_heal: that healing's state, from its first token while its K/V are inexact.
    """

    prompt: FusionPrompt
    sampling: SamplingConfig
    selection: Selection
    lookup: CacheLookup
    kv_bytes: int
    full_attention: bool = False
    in_memory: Container[str] = ()
    learn: LearnFn | None = None
    audit: bool = False
    eos_ids: Collection[int] = ()
    scope: Scope = OPERATOR
    id: int = field(default_factory=lambda: next(_ids))
    phase: Phase = Phase.WAITING
    arrived_at: float = field(default_factory=time.perf_counter)
    output: RequestOutput = field(default_factory=RequestOutput)
    account: TokenAccount = field(init=False)
    stitched: Stitched | None = None
    stitched_prompt: FusionPrompt | None = None
    budget: int = 0
    continued: KeptPrefix | None = None
    continued_runs: tuple[ReusedRun, ...] = ()
    exact_base: int = 0
    healed_head: torch.Tensor | None = None
    forced_prefilled: bool = False
    probe: Probe | None = None
    selected: torch.Tensor | None = None
    last_pass: SparsePass | None = None
    first_logits: torch.Tensor | None = None
    decoding: Decoding | None = None
    error: BaseException | None = None
    cancelled: bool = False
    forks: tuple[Request, ...] = ()
    forked: bool = False
    heal_answer: bool = False
    answer_heal: AnswerHeal | None = None

    def __post_init__(self) -> None:
        self.account = TokenAccount(prompt=self.prompt.num_tokens)

    def relayout(self, prompt: FusionPrompt) -> None:
        """Read `prompt` instead (the same text laid out otherwise, `FusionPrompt.unlearned`), before
        anything is stitched; its token account starts anew."""
        if prompt is self.prompt:
            return
        if self.stitched is not None:
            raise RuntimeError(f"request {self.id}: its prompt cannot change once stitched")
        self.prompt = prompt
        self.account = TokenAccount(prompt=prompt.num_tokens)

    def enter(self, phase: Phase) -> None:
        """Move to `phase`.

        Raises:
            RuntimeError: `phase` does not follow the current one (a defect in the request path).
        """
        # NOTE: a request whose consumer stopped reading ends from whatever phase it was in
        dropped = phase is Phase.FINISHED and self.cancelled and not self.done
        if phase is not Phase.FAILED and phase not in _NEXT[self.phase] and not dropped:
            raise RuntimeError(f"request {self.id}: {self.phase.value} cannot move to {phase.value}")
        self.phase = phase

    def fail(self, error: BaseException) -> None:
        """End it with `error`, which its consumer raises."""
        self.error = error
        self.phase = Phase.FAILED
        self.decoding = None  # NOTE: frees its buffer: nobody will read this answer
        self.output.fail(error)

    def finish(self) -> None:
        """End it: the text held back, then the end. A cancelled request's buffer is freed now."""
        if self.phase is not Phase.FINISHED:
            self.enter(Phase.FINISHED)
        if self.cancelled:
            self.decoding = None  # NOTE: nobody will read this answer
        elif self.decoding is not None:
            self.output.put(self.decoding.flush())
        self.output.finish()

    @property
    def slots(self) -> int:
        """Running slots it takes when admitted: itself and its forks."""
        return 1 + len(self.forks)

    @property
    def group_bytes(self) -> int:
        """K/V bytes it takes when admitted: its buffer and its forks'."""
        return self.kv_bytes + sum(f.kv_bytes for f in self.forks)

    @property
    def answer_heal_pending(self) -> bool:
        """It decodes and its answer healing has slots left to heal."""
        return (self.phase is Phase.DECODING and self.answer_heal is not None and self.stitched is not None
                and self.answer_heal.pending(self.stitched))

    @property
    def done(self) -> bool:
        return self.phase in (Phase.FINISHED, Phase.KEPT, Phase.FAILED)

    def stitched_buffer(self) -> Stitched:
        """Its buffer (a phase after stitching asks for it).

        Raises:
            RuntimeError: it has not been stitched.
        """
        if self.stitched is None:
            raise RuntimeError(f"request {self.id} is {self.phase.value}: it has no buffer yet")
        return self.stitched


__all__ = ["LearnFn", "Phase", "Request", "RequestOutput", "Selection", "TokenAccount"]
