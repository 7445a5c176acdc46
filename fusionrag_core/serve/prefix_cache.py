"""Exact prefix reuse across requests: the K/V a finished request computed, found again by its tokens.

A conversation (or an agent loop) sends the whole growing prompt on every call, and a RAG service
sees the same system prompt and documents again with new questions. Each finished request keeps its
buffer's K/V (prompt and answer) here; a later prompt that starts with the same tokens continues
from them, as vLLM's hashed blocks and SGLang's radix tree do (how far, and what its selection then
reads: `FusionEngine._kept_head`).

Lookup hashes the prompt in blocks of `block_tokens`, each block's hash chained on the previous
one's, and follows the chain as far as it is known; the entry the last known block points to is
compared token by token (a hash never decides alone) and the match extended past the last full
block. Entries are evicted least recently used beyond a byte budget.

A kept prefix is only as exact as the request that computed it: chunk tokens reused from caches
and not recomputed are approximations of full attention. An entry records which of its tokens are
such (`inexact`, with their fusion drift) and which stored cache each reused chunk came from
(`ReusedRun`), so that a request continuing it can (a) recompute among those tokens with its own
question, as a fresh FusionRAG request would, (b) use only the exact head where exactness is
required (full attention), and (c) stop the match before a chunk whose stored cache changed since
(a corpus update never serves a stale prefix).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import xxhash

from fusionrag_core.errors import InvalidRequestError


@dataclass(frozen=True)
class PrefixCacheConfig:
    """The engine's cache of finished requests' K/V (`EngineConfig.prefix_cache`).

    Attributes:
        max_bytes: K/V bytes kept in all; the least recently used entries go first.
        block_tokens: tokens per hashed block (the lookup's step; a match may end inside a block).
        min_tokens: shorter matches are not used (continuing costs a copy of the kept K/V).
        shared_documents: also continue a kept request for a prompt that is not its later turn: the
            same system prompt and documents with another question (up to that question), or the
            same prompt again (answered from the kept K/V as they are), when both requests use the
            same selector and ratio. Off: such a prompt is answered afresh, from the KV store.
    """

    max_bytes: int = 1 << 30
    block_tokens: int = 16
    min_tokens: int = 16
    shared_documents: bool = False

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise InvalidRequestError(f"PrefixCacheConfig.max_bytes must be >= 0, got {self.max_bytes}")
        if self.block_tokens < 1 or self.min_tokens < 1:
            raise InvalidRequestError("PrefixCacheConfig.block_tokens and min_tokens must be >= 1")


@dataclass(frozen=True)
class ReusedRun:
    """A chunk's tokens in a kept prefix whose K/V came from a stored cache.

    Attributes:
        start, end: its token range `[start, end)` in the prefix.
        chunk_id: the chunk.
        variant / fused_after: which stored cache (a re-fused or deleted chunk's no longer matches).
    """

    start: int
    end: int
    chunk_id: str
    variant: str
    fused_after: str


@dataclass(frozen=True)
class KeptPrefix:
    """A finished request's K/V, kept for the prompts that start with its tokens.

    Attributes:
        token_ids: `[T]` int64 (cpu): its prompt, then the answer tokens fed back (all but the last).
        keys, values: `[L, H, T, D]` at positions `0..T-1`.
        inexact: `[T]` bool: reused from a chunk cache and never recomputed.
        drift: `[T]` fp32: each inexact token's fusion drift (0 elsewhere; NaN for a chunk whose
            cache carried none).
        runs: the chunks reused from stored caches, in order.
        fingerprint: the model's.
        prompt_tokens: how many of `token_ids` were its prompt (the rest, its answer).
        exact_tokens: how many leading tokens hold exactly what full attention computes. A token is
            exact only if every token before it was exact when it was computed (attention is
            causal), so exactness is a head; a token recomputed later is no longer `inexact` (a
            selection candidate) but stays approximate if an earlier token was when it ran.
        selector, ratio: the selection its request ran (a repeat of its prompt with the same one is
            answered from its K/V as they are).
    """

    token_ids: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    inexact: torch.Tensor
    drift: torch.Tensor
    runs: tuple[ReusedRun, ...]
    fingerprint: str
    prompt_tokens: int
    exact_tokens: int
    selector: str
    ratio: float | None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class PrefixCache:
    """Kept prefixes by token blocks, LRU within a byte budget; shared by every thread of an engine."""

    def __init__(self, config: PrefixCacheConfig, fingerprint: str) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self._entries: OrderedDict[int, KeptPrefix] = OrderedDict()  # entry id -> entry, LRU first
        self._blocks: dict[bytes, int] = {}  # chained block hash -> the newest entry holding that chain
        self._bytes = 0
        self._next_id = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.hit_tokens = self.evictions = 0

    def match(self, token_ids: torch.Tensor, limit: int) -> tuple[KeptPrefix, int] | None:
        """The kept entry sharing the longest head with `token_ids` `[T]`, and that head's length
        (at most `limit`); None when it is shorter than `min_tokens`. Counts nothing: the caller
        says what it served (`served`), once it has checked the head."""
        ids = token_ids.cpu()
        best: tuple[int, int] | None = None  # (entry id, matched blocks' tokens)
        with self._lock:
            for digest, end in _chain(ids[:limit], self.config.block_tokens):
                entry_id = self._blocks.get(digest)
                if entry_id is None:
                    break
                best = (entry_id, end)
            entry = self._entries.get(best[0]) if best is not None else None
            if entry is not None:
                self._entries.move_to_end(best[0])  # type: ignore[index]
        if entry is None:
            return None
        n = _shared_head(entry.token_ids, ids, limit)
        return (entry, n) if n >= self.config.min_tokens else None

    def keep(self, entry: KeptPrefix, *, replaces: KeptPrefix | None = None) -> None:
        """Keep `entry` (evicting the least recently used beyond the budget); `replaces`: an entry it
        continues, dropped now (its tokens are a head of the new one's)."""
        if entry.fingerprint != self.fingerprint:
            raise InvalidRequestError("a kept prefix of another model cannot join this engine's prefix cache")
        if entry.nbytes > self.config.max_bytes or entry.num_tokens < self.config.block_tokens:
            return
        with self._lock:
            if replaces is not None:
                for key, kept in list(self._entries.items()):
                    if kept is replaces:
                        self._drop(key)
            key = self._next_id
            self._next_id += 1
            self._entries[key] = entry
            self._bytes += entry.nbytes
            for digest, _ in _chain(entry.token_ids, self.config.block_tokens):
                self._blocks[digest] = key
            while self._bytes > self.config.max_bytes:
                self._drop(next(iter(self._entries)))
                self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._blocks.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        """Lifetime hits, misses, tokens served, evictions; entries and bytes held now."""
        with self._lock:
            return {"prefix_hits": self.hits, "prefix_misses": self.misses, "prefix_hit_tokens": self.hit_tokens,
                    "prefix_evictions": self.evictions, "prefix_entries": len(self._entries),
                    "prefix_bytes": self._bytes}

    def served(self, tokens: int) -> None:
        """Count one lookup: a hit that served `tokens` kept tokens, or a miss when 0."""
        with self._lock:
            if tokens:
                self.hits += 1
                self.hit_tokens += tokens
            else:
                self.misses += 1

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        for digest, _ in _chain(entry.token_ids, self.config.block_tokens):
            if self._blocks.get(digest) == key:
                del self._blocks[digest]


def _chain(ids: torch.Tensor, block: int) -> Iterator[tuple[bytes, int]]:
    """(hash of every block up to this one, the tokens they cover) for each full block of `ids`."""
    h = b""
    data = ids.to(torch.int64).numpy().tobytes()
    for end in range(block, int(ids.shape[0]) + 1, block):
        h = xxhash.xxh3_128_digest(h + data[(end - block) * 8 : end * 8])
        yield h, end


def _shared_head(a: torch.Tensor, b: torch.Tensor, limit: int) -> int:
    """Length of the common head of `a` and `b`, at most `limit`."""
    n = min(int(a.shape[0]), int(b.shape[0]), limit)
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0, 0]) if differ.numel() else n


__all__ = ["KeptPrefix", "PrefixCache", "PrefixCacheConfig", "ReusedRun"]
