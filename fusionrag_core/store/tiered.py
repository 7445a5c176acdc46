"""Cache tiers in front of any `KVStore`: a device-resident LRU and a (pinned) host-memory LRU.

    get(id, variant) -> device tier (hit: ready to stitch)
                     -> host tier   (hit: one host-to-device copy; promoted to the device tier)
                     -> the store   (read, checksum, decode; kept in both tiers)

Tiers hold *validated, decoded* caches in the engine's dtype, so a hit skips I/O, checksum and
dequantisation. The tiers are inclusive (a device entry is normally also on the host), budgets
are in bytes of K/V, and an entry larger than a tier's budget simply bypasses that tier. On a
CPU-only machine the "device" is host memory too: the code is the same, the copy is a no-op.

Writes go through to the store and drop the tiers' copies, so a tier never serves a stale cache.
Many threads share one tiered store: each `get` reports which tier served it (`get_with_source`,
the `KVStore` interface, so a request learns it through any store wrapping this one), so
per-request statistics live with the request, not here; `stats()` gives lifetime totals.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from fusionrag_core.runtime.kv import ChunkKV, Variant
from fusionrag_core.store.base import CacheSource, KVStore
from fusionrag_core.store.corpus_index import CorpusIndex

TIERS: tuple[CacheSource, ...] = ("device", "host", "store")


@dataclass(frozen=True)
class TierConfig:
    """Byte budgets of the cache tiers in front of a corpus's store (`FusionIndex.open(tiers=...)`).

    Attributes:
        device_bytes: K/V bytes kept on the engine's device (GPU; on a CPU-only machine, RAM).
        host_bytes: K/V bytes kept in (pinned, with CUDA) host memory.
    """

    device_bytes: int = 0
    host_bytes: int = 0

    def __post_init__(self) -> None:
        if self.device_bytes < 0 or self.host_bytes < 0:
            raise ValueError(f"tier budgets must be >= 0 bytes, got device {self.device_bytes}, "
                             f"host {self.host_bytes}")

    def wrap(self, store: KVStore, *, device: torch.device | str, dtype: torch.dtype) -> TieredKVStore:
        """`store` behind tiers of these budgets, holding caches on `device` in `dtype` (the engine's)."""
        return TieredKVStore(store, device=device, dtype=dtype, device_bytes=self.device_bytes,
                             host_bytes=self.host_bytes)


@dataclass
class TierStats:
    """Hits and K/V bytes served per tier ("device", "host", "store"; a request's also "learned",
    see `of`)."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    @classmethod
    def of(cls, sources: Iterable[CacheSource]) -> TierStats:
        """Zero counts for each of `sources` (every one is reported, counted or not)."""
        names = tuple(sources)
        return cls(dict.fromkeys(names, 0), dict.fromkeys(names, 0))

    def add(self, tier: str, nbytes: int) -> None:
        """Count one load of `nbytes` K/V bytes from `tier` (a tier not counted before starts at 0)."""
        self.hits[tier] = self.hits.get(tier, 0) + 1
        self.bytes[tier] = self.bytes.get(tier, 0) + nbytes

    def as_dict(self) -> dict[str, int]:
        return {**{f"{t}_hits": n for t, n in self.hits.items()}, **{f"{t}_bytes": n for t, n in self.bytes.items()}}


class _LRU:
    """An LRU of caches bounded by bytes (not thread-safe: the tiered store holds the lock)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self.entries: OrderedDict[tuple[str, Variant], ChunkKV] = OrderedDict()

    def get(self, key: tuple[str, Variant]) -> ChunkKV | None:
        kv = self.entries.get(key)
        if kv is not None:
            self.entries.move_to_end(key)
        return kv

    def put(self, key: tuple[str, Variant], kv: ChunkKV) -> None:
        if kv.nbytes > self.budget:
            return  # NOTE: would evict everything and still not fit
        self.drop(key)
        self.entries[key] = kv
        self.used += kv.nbytes
        while self.used > self.budget:
            _, old = self.entries.popitem(last=False)
            self.used -= old.nbytes

    def drop(self, key: tuple[str, Variant]) -> None:
        old = self.entries.pop(key, None)
        if old is not None:
            self.used -= old.nbytes


def _pin(kv: ChunkKV) -> ChunkKV:
    """`kv` in page-locked host memory when CUDA is present (async host-to-device copies)."""
    if not torch.cuda.is_available():
        return kv
    # NOTE: `replace` keeps every other field (the fusion drift, the neighbours digest) as it was.
    return replace(kv, keys=kv.keys.pin_memory(), values=kv.values.pin_memory())


class TieredKVStore(KVStore):
    """A device LRU and a host LRU in front of `inner` (any `KVStore`).

    Args:
        inner: where caches live (disk, Redis, ...); every miss and every write goes there.
        device: the device of the device tier (the engine's).
        dtype: the dtype tiers keep caches in (the engine's).
        device_bytes: K/V byte budget of the device tier (0 turns it off).
        host_bytes: K/V byte budget of the host tier (0 turns it off).

    Example:
        >>> tiered = TieredKVStore(open_store("./kv"), device=engine.device, dtype=engine.decoder.dtype,
        ...                        device_bytes=8 << 30, host_bytes=64 << 30)
        >>> engine.generate(prompt, store=tiered).stats()["kv_device_hits"]
    """

    def __init__(self, inner: KVStore, *, device: torch.device | str, dtype: torch.dtype, device_bytes: int,
                 host_bytes: int) -> None:
        budgets = TierConfig(device_bytes, host_bytes)  # NOTE: validates the budgets
        super().__init__(inner.storage_dtype)
        self.inner = inner
        self.device = torch.device(device)
        self.dtype = dtype
        self._device = _LRU(budgets.device_bytes)
        self._host = _LRU(budgets.host_bytes)
        self._lock = threading.Lock()
        self._stats = TierStats()

    def get_with_source(
        self,
        chunk_id: str,
        variant: Variant,
        *,
        fingerprint: str,
        shape: tuple[int, int, int] | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> tuple[ChunkKV, CacheSource]:
        """`get`, and which tier served it: "device" or "host", else the inner store's answer
        ("store" for a blob store)."""
        key = (chunk_id, variant)
        tier: CacheSource
        with self._lock:
            kv, tier = self._device.get(key), "device"
            if kv is None:
                kv, tier = self._host.get(key), "host"
        if kv is None:
            # NOTE: the slow path runs outside the lock; two threads missing the same chunk both load it.
            # The inner store says where its copy came from ("store" for a blob store).
            loaded, tier = self.inner.get_with_source(chunk_id, variant, fingerprint=fingerprint, shape=shape,
                                                      device="cpu", dtype=self.dtype)
            kv = _pin(loaded)
            with self._lock:
                self._host.put(key, kv)
        kv.validate(fingerprint=fingerprint, shape=shape)  # NOTE: a tier is shared by every model's engine
        if tier != "device":
            kv = kv.to(self.device, self.dtype)  # non-blocking from pinned memory
            with self._lock:
                self._device.put(key, kv)
        with self._lock:
            self._stats.add(tier, kv.nbytes)
        target = torch.device(device)
        if target != self.device or (dtype is not None and dtype != self.dtype):
            kv = kv.to(target, dtype or self.dtype)
        return kv, tier

    def get(
        self,
        chunk_id: str,
        variant: Variant,
        *,
        fingerprint: str,
        shape: tuple[int, int, int] | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> ChunkKV:
        return self.get_with_source(chunk_id, variant, fingerprint=fingerprint, shape=shape, device=device,
                                    dtype=dtype)[0]

    @property
    def backend(self) -> KVStore:
        return self.inner.backend

    def drop_copies(self) -> None:
        """Drop every tiered copy (after writes that bypassed this wrapper, e.g. Ray workers')."""
        with self._lock:
            self._device = _LRU(self._device.budget)
            self._host = _LRU(self._host.budget)

    def stats(self) -> dict[str, int]:
        """Lifetime hits and bytes per tier, and each tier's bytes in use."""
        with self._lock:
            return {**self._stats.as_dict(), "device_used_bytes": self._device.used,
                    "host_used_bytes": self._host.used}

    def _forget(self, chunk_id: str, variants: tuple[Variant, ...] = ("independent", "fused")) -> None:
        with self._lock:
            for v in variants:
                self._device.drop((chunk_id, v))
                self._host.drop((chunk_id, v))

    def put(self, chunk_id: str, kv: ChunkKV) -> None:
        self._forget(chunk_id, (kv.variant,))
        self.inner.put(chunk_id, kv)

    def has(self, chunk_id: str, variant: Variant) -> bool:
        return self.inner.has(chunk_id, variant)

    def delete(self, chunk_id: str, variant: Variant | None = None) -> None:
        self._forget(chunk_id, ("independent", "fused") if variant is None else (variant,))
        self.inner.delete(chunk_id, variant)

    def quarantine(self, chunk_id: str, variant: Variant) -> str | None:
        self._forget(chunk_id, (variant,))
        return self.inner.quarantine(chunk_id, variant)

    def content_index(self) -> CorpusIndex | None:
        """The inner store's: the tiers hold caches, never chunk texts."""
        return self.inner.content_index()

    def free_bytes(self) -> int | None:
        return self.inner.free_bytes()

    def list_ids(self, variant: Variant | None = None) -> set[str]:
        return self.inner.list_ids(variant)

    def close(self) -> None:
        self.drop_copies()
        self.inner.close()

    def __repr__(self) -> str:
        return (f"TieredKVStore({self.inner!r}, device_bytes={self._device.budget}, "
                f"host_bytes={self._host.budget})")
