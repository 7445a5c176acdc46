"""Where one request's chunk caches come from: the caller's in-memory caches, then a KV store.

A `ChunkLookup` is built per request (it records that request's loads and fallbacks) and called
by `stitch` (through `prefetch`, from the loader threads) with each chunk id of the prompt.

The variant order: a fused cache is preferred; the independent one is the next best thing, and
the best one for the first chunk when the prompt's prefix is the one chunk caches are computed
after (`exact_first`): there the independent cache is exactly what full attention computes.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fusionrag_core.errors import CacheCorruptError, CacheMismatchError, CacheNotFoundError
from fusionrag_core.query.bad_blobs import BadBlobs
from fusionrag_core.query.stitch import CacheMiss
from fusionrag_core.runtime.kv import ChunkKV, Variant
from fusionrag_core.store.base import CACHE_SOURCES
from fusionrag_core.store.codec import is_storable_chunk_id
from fusionrag_core.store.tiered import TierStats

if TYPE_CHECKING:
    from fusionrag_core.store.base import KVStore


@dataclass(frozen=True)
class ModelKV:
    """What a loaded cache must match: the model's fingerprint and K/V shape, and where it goes.

    Attributes:
        fingerprint: the weights' fingerprint (`loading.fingerprint`).
        shape: `(L, H_kv, D)`.
        device, dtype: where and how loaded caches are placed.
    """

    fingerprint: str
    shape: tuple[int, int, int]
    device: torch.device
    dtype: torch.dtype


class ChunkLookup:
    """Chunk id -> cache for one request: `caches` first, then `store` in the variant order.

    Called as a `stitch.CacheLookup` (`lookup(chunk_id, first)`), from several loader threads at
    once. After the request has stitched, `tiers` holds its loads per source, as the store says
    (`KVStore.get_with_source`: device / host tier of a `TieredKVStore`, "store", or "learned"
    caches), and `fallbacks` chunk id -> why another variant than the preferred one was reused.
    """

    def __init__(self, model: ModelKV, *, caches: Mapping[str, ChunkKV] | None, store: KVStore | None,
                 variant: Variant, exact_first: bool, bad_blobs: BadBlobs) -> None:
        self.model = model
        self.caches = caches
        self.store = store
        self.variant = variant
        self.exact_first = exact_first
        self.bad_blobs = bad_blobs
        self.tiers = TierStats.of(CACHE_SOURCES)
        self.fallbacks: dict[str, str] = {}
        self.origins: dict[str, str] = {}  # NOTE: chunk id -> "corpus" / "learned" / "caller" (`ORIGINS`)
        self._lock = threading.Lock()  # NOTE: the loader threads record into `tiers` and `fallbacks`

    def __call__(self, chunk_id: str, first: bool) -> ChunkKV | CacheMiss | None:
        if self.caches is not None and chunk_id in self.caches:
            kv = self.caches[chunk_id]
            kv.validate(fingerprint=self.model.fingerprint, shape=self.model.shape)
            with self._lock:
                self.origins[chunk_id] = "caller"
            return kv
        if self.store is None or not is_storable_chunk_id(chunk_id):
            return None  # NOTE: an id no store can hold has no cache: stitch reports it as a miss
        order = self._order(first)
        miss: CacheMiss | None = None
        passed_over = ""  # NOTE: why the preferred variant was not reused
        for v in order:
            try:
                kv = self._load(self.store, chunk_id, v)
            except CacheNotFoundError:
                # NOTE: a delete withdraws the fused caches built on the chunk it deletes.
                why = " (not fused yet, or withdrawn until re-fused: a neighbour is gone)" if v == "fused" else ""
                passed_over = passed_over or f"no {v} cache stored{why}"
                continue
            except (CacheCorruptError, CacheMismatchError) as e:
                # NOTE: a bad blob is an absent blob (next variant, else prefill), never a failed query.
                reported = self.bad_blobs.miss(self.store, chunk_id, v, e)
                miss = miss or reported
                passed_over = passed_over or reported.reason
                continue
            if v != order[0]:
                with self._lock:
                    self.fallbacks[chunk_id] = f"{passed_over}: reused the {v} cache"
            return kv
        return miss

    def _order(self, first: bool) -> tuple[Variant, ...]:
        if self.variant != "fused":
            return (self.variant,)
        return ("independent", "fused") if first and self.exact_first else ("fused", "independent")

    def _load(self, store: KVStore, chunk_id: str, variant: Variant) -> ChunkKV:
        m = self.model
        # NOTE: asked of the store, never of its type: a tier hit behind a wrapper (ReuseSources) is still one.
        kv, tier = store.get_with_source(chunk_id, variant, fingerprint=m.fingerprint, shape=m.shape,
                                         device=m.device, dtype=m.dtype)
        with self._lock:
            self.tiers.add(tier, kv.nbytes)
            self.origins[chunk_id] = "learned" if tier == "learned" else "corpus"
        return kv


def no_caches(_chunk_id: str, _first: bool) -> None:
    """The lookup of full attention: no chunk has a cache."""
    return None


__all__ = ["ChunkLookup", "ModelKV", "no_caches"]
