"""Exact prefix reuse across requests: the K/V a finished request computed, found again by its tokens.

A conversation (or an agent loop) sends the whole growing prompt on every call, and a RAG service
sees the same system prompt and documents again with new questions. Each finished request keeps its
buffer's K/V (prompt and answer) here; a later prompt that starts with the same tokens continues
from them, as vLLM's hashed blocks and SGLang's radix tree do (how far, and what its selection then
reads: `FusionEngine._kept_head`).

Lookup hashes the prompt in blocks of `block_tokens`, each block's hash chained on the previous
one's, and follows the chain as far as it is known; the entry the last known block points to is
compared token by token (a hash never decides alone) and the match extended past the last full
block.

Entries live in two tiers, as chunk caches do (`store.tiered`): on the engine's device within
`max_bytes`, then in (pinned, with CUDA) host memory within `host_bytes`. The least recently used
device entry moves to the host tier rather than being dropped; a match on a host entry copies it
back to the device. On a CPU-only machine both tiers are RAM and the copy is a no-op.

A kept prefix is only as exact as the request that computed it: chunk tokens reused from caches
and not recomputed are approximations of full attention. An entry records which of its tokens are
such (`inexact`, with their fusion drift) and which stored cache each reused chunk came from
(`ReusedRun`), so that a request continuing it can (a) recompute among those tokens with its own
question, as a fresh FusionRAG request would, (b) use only the exact head where exactness is
required (full attention), and (c) stop the match before a chunk whose stored cache changed since
(a corpus update never serves a stale prefix).

Entries are kept per `Scope` (tenant, cache salt): the block chain of an entry is seeded with its
scope's digest and a match is made only within the asking request's scope, so a conversation is
never continued, nor its tokens counted as cached, for a request of another scope.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import xxhash

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.runtime.kv import storage_bytes
from fusionrag_core.scope import OPERATOR, Scope


@dataclass(frozen=True)
class PrefixCacheConfig:
    """The engine's cache of finished requests' K/V (`EngineConfig.prefix_cache`).

    Attributes:
        max_bytes: K/V bytes kept on the engine's device; beyond it the least recently used entries
            move to the host tier (or are dropped when it has no room).
        block_tokens: tokens per hashed block (the lookup's step; a match may end inside a block).
        min_tokens: shorter matches are not used (continuing costs a copy of the kept K/V).
        shared_documents: also continue a kept request for a prompt that is not its later turn: the
            same system prompt and documents with another question (up to that question), or the
            same prompt again (answered from the kept K/V as they are), when both requests use the
            same selector and ratio. Off: such a prompt is answered afresh, from the KV store.
        host_bytes: K/V bytes kept in host memory for entries the device tier evicted (0: none; on a
            CPU-only machine it adds to `max_bytes` in RAM).
    """

    max_bytes: int = 1 << 30
    block_tokens: int = 16
    min_tokens: int = 16
    shared_documents: bool = False
    host_bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.host_bytes < 0:
            raise InvalidRequestError(f"PrefixCacheConfig.max_bytes and host_bytes must be >= 0, got "
                                      f"{self.max_bytes} and {self.host_bytes}")
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
        healed: `[T]` bool: tokens made exact by healing (`batching.heal`), all within the exact
            head; None: none.
        scope: whose request computed it; only requests of the same scope continue it.
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
    healed: torch.Tensor | None = None
    scope: Scope = OPERATOR

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        """The memory its K/V hold: their storages, which may be a little larger than `[L, H, T, D]`
        (a finished request's buffer handed over with its unused tail, keys and values in one piece
        of `KVMemory`)."""
        return storage_bytes(self.keys, self.values)

    def to(self, device: torch.device, *, pin: bool = False) -> KeptPrefix:
        """This entry with its K/V on `device` (pinned host memory when `pin`); the same when there."""
        here = self.keys.device
        if here.type == device.type and device.index in (None, here.index) and not pin:
            return self
        if pin:  # NOTE: one copy, straight into page-locked memory
            keys = torch.empty_like(self.keys, device=device, pin_memory=True).copy_(self.keys)
            values = torch.empty_like(self.values, device=device, pin_memory=True).copy_(self.values)
            return replace(self, keys=keys, values=values)
        return replace(self, keys=self.keys.to(device), values=self.values.to(device))


class PrefixCache:
    """Kept prefixes by token blocks, LRU within byte budgets per tier; shared by every thread of an engine.

    Args:
        config: budgets and lookup settings.
        fingerprint: the model's; an entry of another model is refused.
        device: the engine's device, where device-tier entries live (a host entry comes back there).
    """

    def __init__(self, config: PrefixCacheConfig, fingerprint: str, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._device: OrderedDict[int, KeptPrefix] = OrderedDict()  # entry id -> entry, LRU first
        self._host: OrderedDict[int, KeptPrefix] = OrderedDict()  # entries the device tier evicted
        self._blocks: dict[bytes, int] = {}  # chained block hash -> the newest entry holding that chain
        self._bytes = {"device": 0, "host": 0}
        self._next_id = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.hit_tokens = self.evictions = 0
        self.promotions = self.demotions = 0

    def match(self, token_ids: torch.Tensor, limit: int, scope: Scope = OPERATOR) -> tuple[KeptPrefix, int] | None:
        """The kept entry of `scope` sharing the longest head with `token_ids` `[T]`, and that head's
        length (at most `limit`); None when it is shorter than `min_tokens`. A host-tier entry comes back
        to the device tier. Counts no hit or miss: the caller says what it served (`served`), once
        it has checked the head."""
        ids = token_ids.cpu()
        with self._lock:
            key: int | None = None
            for digest, _ in _chain(ids[:limit], self.config.block_tokens, scope):
                known = self._blocks.get(digest)
                if known is None:
                    break
                key = known
            entry = self._promote(key) if key is not None else None
        if entry is None or entry.scope != scope:  # NOTE: a hash never decides alone
            return None
        n = _shared_head(entry.token_ids, ids, limit)
        return (entry, n) if n >= self.config.min_tokens else None

    def keep(self, entry: KeptPrefix, *, replaces: KeptPrefix | None = None) -> None:
        """Keep `entry` in the device tier (moving the least recently used beyond its budget to the
        host tier); `replaces`: an entry it continues, dropped now (its tokens are a head of the new one's).

        NOTE: an entry a GPU's device tier evicted while its continuation ran is a host copy by then;
        it is not found as `replaces` and stays in the host tier until evicted (a duplicate, bounded).
        """
        if entry.fingerprint != self.fingerprint:
            raise InvalidRequestError("a kept prefix of another model cannot join this engine's prefix cache")
        if entry.num_tokens < self.config.block_tokens or entry.nbytes > max(self.config.max_bytes,
                                                                              self.config.host_bytes):
            return
        with self._lock:
            if replaces is not None:
                for tier in ("device", "host"):
                    for key, kept in list(self._tier(tier).items()):
                        if kept is replaces or kept.keys is replaces.keys:  # NOTE: or its healed successor
                            self._drop(tier, key)
            key = self._next_id
            self._next_id += 1
            for digest, _ in _chain(entry.token_ids, self.config.block_tokens, entry.scope):
                self._blocks[digest] = key
            self._admit(key, entry.to(self.device))

    def update(self, old: KeptPrefix, new: KeptPrefix) -> bool:
        """Put `new` (the same tokens, its K/V healed further: `batching.heal`) where `old` is, in the
        device tier; returns False when `old` is no longer there (replaced, evicted or demoted)."""
        with self._lock:
            for key, kept in self._device.items():
                if kept is old:
                    self._device[key] = new
                    return True
            return False

    def most_recent(self, wanted: Callable[[KeptPrefix], bool]) -> KeptPrefix | None:
        """The most recently used device-tier entry that is `wanted` (its recency unchanged), or None."""
        with self._lock:
            return next((kept for kept in reversed(self._device.values()) if wanted(kept)), None)

    def clear(self) -> None:
        with self._lock:
            self._device.clear()
            self._host.clear()
            self._blocks.clear()
            self._bytes = {"device": 0, "host": 0}

    def stats(self) -> dict[str, int]:
        """Lifetime hits, misses, tokens served, evictions (entries dropped), demotions (entries put
        in the host tier) and promotions (host entries a match copied back to the device); entries
        and bytes held now in each tier."""
        with self._lock:
            return {"prefix_hits": self.hits, "prefix_misses": self.misses, "prefix_hit_tokens": self.hit_tokens,
                    "prefix_demotions": self.demotions, "prefix_promotions": self.promotions,
                    "prefix_evictions": self.evictions, "prefix_entries": len(self._device),
                    "prefix_bytes": self._bytes["device"], "prefix_host_entries": len(self._host),
                    "prefix_host_bytes": self._bytes["host"]}

    def served(self, tokens: int) -> None:
        """Count one lookup: a hit that served `tokens` kept tokens, or a miss when 0."""
        with self._lock:
            if tokens:
                self.hits += 1
                self.hit_tokens += tokens
            else:
                self.misses += 1

    def _promote(self, key: int) -> KeptPrefix | None:
        """The entry `key`, now the most recently used of its tier; a host entry is copied to the
        device and moves to the device tier (stays on the host when larger than the device tier)."""
        if key in self._device:
            self._device.move_to_end(key)
            return self._device[key]
        entry = self._host.get(key)
        if entry is None:
            return None
        self.promotions += 1
        on_device = entry.to(self.device)
        if entry.nbytes > self.config.max_bytes:  # NOTE: no room on the device: it stays a host entry
            self._host.move_to_end(key)
        else:
            del self._host[key]
            self._bytes["host"] -= entry.nbytes
            self._admit(key, on_device)
        return on_device

    def _admit(self, key: int, entry: KeptPrefix) -> None:
        """Put `entry` in the device tier, or straight in the host tier when larger than the device
        tier's budget; the device tier's least recently used entries beyond it move to the host tier."""
        if entry.nbytes > self.config.max_bytes:
            self._to_host(key, entry)
            return
        self._device[key] = entry
        self._bytes["device"] += entry.nbytes
        while self._bytes["device"] > self.config.max_bytes:
            old_key, old = self._device.popitem(last=False)
            self._bytes["device"] -= old.nbytes
            self._to_host(old_key, old)

    def _to_host(self, key: int, entry: KeptPrefix) -> None:
        """Keep `entry` as the most recently used host entry, dropping the least recently used beyond
        the host budget (`entry` itself when larger than it)."""
        if entry.nbytes > self.config.host_bytes:
            self._forget(key, entry)
            return
        self.demotions += 1
        host = entry.to(torch.device("cpu"), pin=self._pin)  # NOTE: a copy is compact: count what it holds
        self._host[key] = host
        self._bytes["host"] += host.nbytes
        while self._bytes["host"] > self.config.host_bytes:
            old_key, old = self._host.popitem(last=False)
            self._bytes["host"] -= old.nbytes
            self._forget(old_key, old)

    def _tier(self, tier: str) -> OrderedDict[int, KeptPrefix]:
        return self._device if tier == "device" else self._host

    def _drop(self, tier: str, key: int) -> None:
        entry = self._tier(tier).pop(key)
        self._bytes[tier] -= entry.nbytes
        self._unlink(key, entry)

    def _forget(self, key: int, entry: KeptPrefix) -> None:
        """Drop an entry already taken out of its tier (an eviction)."""
        self.evictions += 1
        self._unlink(key, entry)

    def _unlink(self, key: int, entry: KeptPrefix) -> None:
        for digest, _ in _chain(entry.token_ids, self.config.block_tokens, entry.scope):
            if self._blocks.get(digest) == key:
                del self._blocks[digest]


def _chain(ids: torch.Tensor, block: int, scope: Scope) -> Iterator[tuple[bytes, int]]:
    """(hash of `scope` and every block up to this one, the tokens they cover) for each full block of `ids`."""
    h = scope.digest
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
