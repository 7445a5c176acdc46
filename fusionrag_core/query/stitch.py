"""Stitch a request's KV buffer: prefix cache, then chunk caches re-rotated to consecutive positions.

After stitching, every prompt token has a slot and `slot == position`. Chunk tokens with a cache
are valid keys; plain text, chunks without a usable cache, and the question hold reserved but
invalid slots: they are computed by the recompute pass, never attended to before.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from fusionrag_core.query.drift import prompt_drift
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.runtime import threads
from fusionrag_core.runtime.decoder import Decoder
from fusionrag_core.runtime.kv import ChunkKV, KVBuffer
from fusionrag_core.runtime.rope import shift_keys


@dataclass(frozen=True)
class CacheMiss:
    """A lookup's answer when a chunk has no usable cache: why (reported in `Stitched.misses`)."""

    reason: str


NO_CACHE = CacheMiss("no cache stored for this chunk id")

# Looks up a chunk's cache by id, told whether the chunk comes first (right after the prefix, where
# its independent cache is exact); returns None or a CacheMiss when there is none (the chunk is
# then prefilled).
CacheLookup = Callable[[str, bool], ChunkKV | CacheMiss | None]


def prefetch(prompt: FusionPrompt, lookup: CacheLookup, pool: Executor, *,
             inline: Container[str] = (), after: int = 0) -> CacheLookup:
    """Start the lookups of the prompt's chunks at once on `pool`; the returned lookup waits for each.

    NOTE: a store lookup is file or network I/O, a checksum pass and a host-to-device copy, which
    all release the GIL, so a prompt's chunks load concurrently instead of one after another.
    Chunks in `inline` (already in memory) are looked up on the caller's thread when asked for:
    handing a few microseconds of work to a pool costs more (GIL hand-offs) than it saves.
    Errors surface when `stitch` asks for that chunk, in prompt order, as without prefetching.
    Chunks that end within the first `after` prompt tokens (a kept head continued exactly holds
    them) are not started: looked up on the caller's thread if asked for after all, never loaded
    for nothing beside the model's work.
    """
    futures: dict[tuple[str, bool], Future[ChunkKV | CacheMiss | None]] = {}
    # NOTE: a lookup's torch ops leave an OpenMP pool in its thread, which slows every parallel op of
    # the thread running the model (`runtime.threads`): each pooled lookup hands it back
    pooled = threads.releasing(lookup)
    end = int(prompt.prefix.shape[0])
    for i, seg in enumerate(prompt.segments):
        end += seg.num_tokens
        key = (seg.chunk_id or "", i == 0)
        if seg.chunk_id and seg.chunk_id not in inline and key not in futures and end > after:
            futures[key] = pool.submit(pooled, *key)

    def wait(chunk_id: str, first: bool) -> ChunkKV | CacheMiss | None:
        future = futures.get((chunk_id, first))
        return future.result() if future is not None else lookup(chunk_id, first)

    return wait


@dataclass
class Stitched:
    """A request's buffer right after stitching, and where everything sits in it.

    Attributes:
        decoder: the model pass.
        buf: the KV buffer (capacity includes the generation budget).
        slot_tokens: `[S]` token id in each slot (prompt tokens only).
        chunk_slots: per reused chunk, its slots `[T_c]` (cached, valid).
        forced_slots: `[F]` context slots with no usable cache: always recomputed.
        question_slots: `[Q]` slots of the question, computed last.
        kv_bytes_loaded: bytes of chunk K/V read from caches.
        misses: chunk ids whose cache was missing or did not match, with the reason.
        variants: how many reused chunks came from each cache variant ("fused", "independent").
        missed: `(segment index, its slots [T])` of each chunk segment computed afresh (no usable
            cache): after the recompute pass its K/V there is what a cache of it would hold.
        exact_slots: `[E]` reused slots whose cached K/V are what full attention computes there
            (the first chunk's independent cache right after the prefix it was computed after):
            recomputing them changes nothing, so a selector can spend its budget elsewhere.
        chunk_drift: per reused chunk (aligned with `chunk_slots`), its cache's fusion drift `[T_c]`
            (`ChunkKV.drift`) or None when the cache carries none.
        chunk_sources: per reused chunk (aligned with `chunk_slots`), `(chunk id, variant,
            fused_after)` of the cache it came from; None for K/V continued from a kept prefix.
        settled_slots: `[S]` reusable slots continued from a kept prefix whose K/V an earlier
            request already recomputed (`serve.continuation.reopen`): a selector ranks them like
            any, and a partial recompute does not compute them again.
        probed: masses of probes already run for this request (`query.probe.run_probes`, packed
            with other requests' by a scheduler), by probe key (`Probe.key`); a selector takes
            its own out instead of running it.
    """

    decoder: Decoder
    buf: KVBuffer
    slot_tokens: torch.Tensor
    chunk_slots: list[torch.Tensor]
    forced_slots: torch.Tensor
    question_slots: torch.Tensor
    kv_bytes_loaded: int = 0
    misses: dict[str, str] = field(default_factory=dict)
    variants: dict[str, int] = field(default_factory=dict)
    missed: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    exact_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    chunk_drift: list[torch.Tensor | None] = field(default_factory=list)
    chunk_sources: list[tuple[str, str, str] | None] = field(default_factory=list)
    settled_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    probed: dict[tuple[tuple[int, ...], float | None], dict[int, torch.Tensor]] = field(default_factory=dict)

    @property
    def reusable_slots(self) -> torch.Tensor:
        if not self.chunk_slots:
            return torch.empty(0, dtype=torch.int64, device=self.buf.keys.device)
        return torch.cat(self.chunk_slots)

    @property
    def num_reused_tokens(self) -> int:
        return sum(int(s.shape[0]) for s in self.chunk_slots)

    @property
    def question_ids(self) -> torch.Tensor:
        return self.slot_tokens[self.question_slots]

    @property
    def chunks_without_drift(self) -> int:
        """Reused chunks whose cache carries no fusion drift (see `drift.prompt_drift`), not counting
        an exactly cached one (its tokens are never recomputed, so its drift is never read)."""
        exact = self.exact_slots
        return sum(d is None and not (s.shape == exact.shape and torch.equal(s, exact.to(s.device)))
                   for d, s in zip(self.chunk_drift, self.chunk_slots, strict=True))

    def drift(self) -> torch.Tensor:
        """`[R]` fp32 fusion drift of every reusable slot, aligned with `reusable_slots`
        (a chunk without drift gets the mean of the others: `drift.prompt_drift`)."""
        return prompt_drift(self.chunk_drift, [int(s.shape[0]) for s in self.chunk_slots], self.buf.keys.device)


def append_shifted(decoder: Decoder, buf: KVBuffer, kv: ChunkKV, *, start_position: int | None = None) -> torch.Tensor:
    """Append `kv` in the next slots of `buf` at consecutive positions from `start_position` (default:
    the slot index, as in every single-sequence buffer), its keys re-rotated to them; returns its slots `[T]`."""
    start = buf.length if start_position is None else start_position
    new_positions = torch.arange(start, start + kv.num_tokens, device=kv.keys.device)
    a = buf.length
    slots = buf.put(kv, None, start)
    b = buf.length
    # NOTE: rotated straight into the buffer's slots (consecutive): no re-rotated copy of the cache
    shift_keys(kv.keys, new_positions - kv.positions.to(kv.keys.device), decoder.rope, out=buf.keys[:, :, a:b])
    return slots


def stitch(
    decoder: Decoder,
    prompt: FusionPrompt,
    prefix: ChunkKV | None,
    lookup: CacheLookup,
    *,
    extra_capacity: int,
    exact_prefix: bool = False,
) -> Stitched:
    """Lay out `prompt` in a fresh buffer: prefix cache, shifted chunk caches, reserved slots.

    Args:
        decoder: the model pass (gives buffer shape, RoPE tables, dtype, device).
        prompt: the request.
        prefix: the prefix's exact cache at positions `0..P-1` (None when the prompt has no prefix).
        lookup: (chunk id, comes first) -> cache or None.
        extra_capacity: slots to leave for generated tokens.
        exact_prefix: `prefix` is the one independent chunk caches are computed after, so an
            independent cache of the first segment, at the positions it was computed at, is exact
            (recorded in `Stitched.exact_slots`).
    """
    device = decoder.device
    buf = decoder.new_buffer(prompt.num_tokens + extra_capacity)
    slot_tokens = prompt.token_ids().to(device)
    if prefix is not None:
        buf.put(prefix, prefix.keys, 0)
    chunk_slots: list[torch.Tensor] = []
    drifts: list[torch.Tensor | None] = []
    sources: list[tuple[str, str, str] | None] = []
    forced: list[torch.Tensor] = []
    loaded = 0
    misses: dict[str, str] = {}
    variants: dict[str, int] = {}
    missed: list[tuple[int, torch.Tensor]] = []
    exact = torch.empty(0, dtype=torch.int64, device=device)
    for i, seg in enumerate(prompt.segments):
        start = buf.length
        found = lookup(seg.chunk_id, i == 0) if seg.chunk_id else None
        kv = found if isinstance(found, ChunkKV) else None
        reused = _shared_head(kv.token_ids, seg.token_ids) if kv is not None else 0
        if kv is not None and reused == 0:
            misses[seg.chunk_id or ""] = "cached token ids differ from the prompt's text"
        elif seg.chunk_id and kv is None:
            misses[seg.chunk_id] = (found if isinstance(found, CacheMiss) else NO_CACHE).reason
        if kv is None or reused == 0:
            slots = buf.reserve(torch.arange(start, start + seg.num_tokens, device=device), valid=False)
            forced.append(slots)
            if seg.chunk_id:
                missed.append((i, slots))
            continue
        kv = kv.head(reused)
        chunk_slots.append(append_shifted(decoder, buf, kv))
        drifts.append(kv.drift)
        sources.append((seg.chunk_id or "", kv.variant, kv.fused_after))
        if exact_prefix and i == 0 and kv.variant == "independent" and int(kv.positions[0]) == start:
            exact = chunk_slots[-1]
        if reused < seg.num_tokens:  # e.g. a separator the cache was computed without
            forced.append(buf.reserve(torch.arange(buf.length, start + seg.num_tokens, device=device), valid=False))
        loaded += kv.nbytes
        variants[kv.variant] = variants.get(kv.variant, 0) + 1
    q_len = int(prompt.question.shape[0])
    question_slots = buf.reserve(torch.arange(buf.length, buf.length + q_len, device=device), valid=False)
    forced_slots = torch.cat(forced) if forced else torch.empty(0, dtype=torch.int64, device=device)
    return Stitched(decoder, buf, slot_tokens, chunk_slots, forced_slots, question_slots, loaded, misses, variants,
                    missed, exact, drifts, sources)


def _shared_head(cached: torch.Tensor, prompt: torch.Tensor) -> int:
    """How many leading prompt tokens a cache covers: all of the shorter of the two when it is a
    prefix of the longer (a chunk with or without its trailing separator), else 0."""
    n = min(int(cached.shape[0]), int(prompt.shape[0]))
    return n if n > 0 and torch.equal(cached[:n].cpu(), prompt[:n].cpu()) else 0
