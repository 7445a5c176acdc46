"""Healing: a kept request's inexact K/V made exact while the engine is idle.

A FusionRAG request reuses chunk caches that never saw its prompt, so its kept entry
(`batching.prefix_cache`) is exact only up to its first inexact token; every token after it (the
rest of the chunks, the question, the answer) attended to approximations. A follow-up that
continues it inherits them. Healing recomputes every token from the first inexact one onward,
causal by position over the exact head, and puts the healed entry where the inexact one was: a
later turn then continues exact K/V, as full attention's does, and has nothing left to select.

Healing is the lowest-priority phase of the scheduler (`Scheduler.plan(heal=True)` plans it only
when no request waits or runs) and runs in pieces of `HealConfig.piece_tokens` tokens, one piece
per step, so a request that arrives mid-heal waits for one piece at most. Each piece is exact on
its own: its tokens attend to the healed head before them, and the stale K/V after them sit at
later positions, which causal attention masks. So after every piece the entry is consistent (its
exact head grew by the piece) and is published at once: a follow-up arriving mid-heal continues
the head healed so far and recomputes among the rest with its own question, as without healing.

The pieces rewrite the entry's K/V in place: it holds the only copy (a follow-up copies the head
it continues into its own buffer while stitching, on the same leading thread as healing).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from fusionrag_core.batching.prefix_cache import KeptPrefix, PrefixCache
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.runtime.decoder import Decoder
from fusionrag_core.runtime.kv import KVBuffer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealConfig:
    """Healing of kept requests (`EngineConfig.heal`; needs a prefix cache and a scheduler).

    Attributes:
        piece_tokens: tokens recomputed per piece: the longest a request arriving mid-heal waits
            is one piece's pass (one chunk prefill of this many tokens over the kept K/V).
        answers: also heal each request's answer in flight (`batching.answer_heal`): a piece of its
            own buffer between its decode steps, so the rest of its answer decodes over exact K/V;
            a request's `heal_answer` overrides it. Each piece delays the running requests' next
            token by one piece's pass.
    """

    piece_tokens: int = 64
    answers: bool = False

    def __post_init__(self) -> None:
        if self.piece_tokens < 1:
            raise InvalidRequestError(f"HealConfig.piece_tokens must be >= 1, got {self.piece_tokens}")


def needs_healing(entry: KeptPrefix) -> bool:
    """Whether some of `entry`'s tokens are past its exact head."""
    return entry.exact_tokens < entry.num_tokens


def heal_piece(decoder: Decoder, entry: KeptPrefix, piece_tokens: int) -> KeptPrefix:
    """Recompute the next `piece_tokens` tokens after `entry`'s exact head, in place in its K/V;
    returns the entry with its exact head grown by them.

    Args:
        decoder: the model passes (the entry's K/V are on its device).
        entry: a kept prefix with tokens past its exact head.
        piece_tokens: at most this many tokens.
    """
    E = entry.exact_tokens
    end = min(entry.num_tokens, E + piece_tokens)
    assert end > E, "heal_piece of an entry that is exact already"
    device = entry.keys.device
    # NOTE: the whole entry is the buffer: the piece's queries see the healed head before them and,
    # masked by position, nothing of the stale K/V after them
    buf = KVBuffer.over(entry.keys, entry.values)
    decoder.fill(buf, entry.token_ids[E:end].to(device), torch.arange(E, end, device=device))
    inexact, drift = entry.inexact.clone(), entry.drift.clone()  # [T] each
    inexact[E:end] = False
    drift[E:end] = 0.0
    healed = torch.zeros(entry.num_tokens, dtype=torch.bool) if entry.healed is None else entry.healed.clone()
    healed[E:end] = True
    return dataclasses.replace(entry, inexact=inexact, drift=drift, exact_tokens=end, healed=healed)


def healed_head(entry: KeptPrefix, n: int) -> torch.Tensor | None:
    """`[n]` bool: which of the first `n` tokens of `entry` healing made exact (None: none)."""
    if entry.healed is None or not bool(entry.healed[:n].any()):
        return None
    return entry.healed[:n].clone()


class Healer:
    """The engine's healing: which kept entry is healed next, one piece at a time, and the totals.

    Shared by the threads of an engine: the loop's heal thread runs the pieces, any thread reads
    `stats` or waits (`wait`).
    """

    def __init__(self, config: HealConfig) -> None:
        self.config = config
        self._lock = threading.Condition()
        # NOTE: the keys of entries whose healing failed, by id (a healed successor shares them)
        self._failed: dict[int, weakref.ref[torch.Tensor]] = {}
        self._unfinished = False  # NOTE: the last piece left its entry partly healed
        self.heals = self.pieces = self.healed_tokens = self.preempted = self.failures = 0
        self.seconds = 0.0
        self.answer_heals = self.answer_pieces = self.answer_tokens = self.answer_failures = 0
        self.answer_seconds = 0.0

    def pending(self, cache: PrefixCache) -> bool:
        """Whether a device-tier entry of `cache` still has tokens to heal."""
        return self._next(cache) is not None

    def run_piece(self, decoder: Decoder, cache: PrefixCache) -> None:
        """Heal one piece of the most recently used entry that needs it, and publish the result.

        A piece that fails (say out of memory) is logged and counted; its entry is not healed again
        (it stays as kept: still correct, still approximate).
        """
        entry = self._next(cache)
        if entry is None:
            return
        start = time.perf_counter()
        try:
            healed = heal_piece(decoder, entry, self.config.piece_tokens)
        except Exception:
            log.exception("healing a kept request of %d tokens failed at token %d: it stays approximate",
                          entry.num_tokens, entry.exact_tokens)
            with self._lock:
                self.failures += 1
                self._failed[id(entry.keys)] = weakref.ref(entry.keys)
                self._unfinished = False
                self._lock.notify_all()
            return
        published = cache.update(entry, healed)
        with self._lock:
            self.pieces += 1
            self.healed_tokens += healed.exact_tokens - entry.exact_tokens
            self.seconds += time.perf_counter() - start
            self.heals += int(published and not needs_healing(healed))
            self._unfinished = published and needs_healing(healed)
            self._lock.notify_all()

    def preempt(self) -> None:
        """A request arrived: healing stops after the piece that ran; counted when it left an entry
        partly healed (it resumes once the engine is idle again)."""
        with self._lock:
            self.preempted += int(self._unfinished)
            self._unfinished = False

    def record_answer_piece(self, tokens: int, seconds: float, *, caught_up: bool, failed: bool = False) -> None:
        """Count a piece of an answer's healing (`batching.answer_heal`): the slots it made exact, its
        time, whether the answer's K/V are exact now, whether it failed (the answer stays approximate)."""
        with self._lock:
            self.answer_pieces += int(not failed)
            self.answer_failures += int(failed)
            self.answer_tokens += tokens
            self.answer_seconds += seconds
            self.answer_heals += int(caught_up)

    def wait(self, cache: PrefixCache, timeout_s: float | None) -> bool:
        """Block until no entry of `cache` has tokens to heal (or `timeout_s` passed); returns whether
        none has."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self.pending(cache):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                # NOTE: woken after every piece; an entry evicted or replaced without one is seen
                # at the next look, at most a second later
                self._lock.wait(1.0 if left is None else min(left, 1.0))
            return True

    def stats(self) -> dict[str, int]:
        """Lifetime totals: entries healed whole, pieces run, tokens healed, preemptions (a request
        arrived with an entry partly healed), failed pieces, and the time pieces took (ms); the same
        for answers healed in flight (`answer_heal*`: answers whose K/V caught up)."""
        with self._lock:
            return {"heals": self.heals, "heal_pieces": self.pieces, "healed_tokens": self.healed_tokens,
                    "heal_preempted": self.preempted, "heal_failures": self.failures,
                    "heal_ms": round(self.seconds * 1000), "answer_heals": self.answer_heals,
                    "answer_heal_pieces": self.answer_pieces, "answer_healed_tokens": self.answer_tokens,
                    "answer_heal_failures": self.answer_failures, "answer_heal_ms": round(self.answer_seconds * 1000)}

    def _next(self, cache: PrefixCache) -> KeptPrefix | None:
        return cache.most_recent(lambda kept: needs_healing(kept) and not self._has_failed(kept))

    def _has_failed(self, entry: KeptPrefix) -> bool:
        ref = self._failed.get(id(entry.keys))
        return ref is not None and ref() is entry.keys


__all__ = ["HealConfig", "Healer", "heal_piece", "healed_head", "needs_healing"]
