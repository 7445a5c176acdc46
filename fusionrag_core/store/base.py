"""The `KVStore` interface: where chunk KV caches live between ingest and query.

Backends (`disk.py`, `redis.py`) store the blobs of `codec.py`; `tiered.py` wraps any of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import TYPE_CHECKING, Literal

import torch

from fusionrag_core.runtime.kv import VARIANTS, ChunkKV, Variant
from fusionrag_core.store.codec import StorageDType, storage_torch_dtype

if TYPE_CHECKING:
    from fusionrag_core.store.corpus_index import CorpusIndex

CacheSource = Literal["device", "host", "store", "learned"]
"""Where a loaded cache came from (`KVStore.get_with_source`): a cache tier's device or host LRU, a
blob store, or the caches learned from traffic."""
CACHE_SOURCES: tuple[CacheSource, ...] = ("device", "host", "store", "learned")


class KVStore(ABC):
    """Where chunk KV caches live between ingest and query.

    One entry per `(chunk_id, variant)`. Every `get` validates the blob (checksum, model
    fingerprint, shape); implementations are safe to share between threads.

    NOTE on precision: keys/values are cast to `storage_dtype` on `put`. "float16" (default) halves
    the footprint of float32 caches; its 10-bit mantissa costs ~1e-3 relative error, which is below
    the noise of the fused-cache approximation itself, but its range ends at 65504 (`put` refuses
    caches that would overflow). "bfloat16" keeps the float32 range with ~8e-3 relative error;
    "float32" is exact for float32 models. "int8" and "float8_e4m3fn" store one byte per value
    with an fp32 scale per (layer, head, dim) channel: half of float16's bytes, decoded on the
    device the cache is loaded to. `get` casts back to the dtype the cache was computed in unless
    asked for another.

    Use as a context manager, or call `close()`.
    """

    def __init__(self, storage_dtype: StorageDType = "float16") -> None:
        storage_torch_dtype(storage_dtype)  # NOTE: validate eagerly, before any write.
        self.storage_dtype: StorageDType = storage_dtype

    @property
    def backend(self) -> KVStore:
        """The store that holds the blobs (itself; a cache-tier wrapper's is what it wraps): where
        writer locks, content indexes and Ray workers must go."""
        return self

    def drop_copies(self) -> None:
        """Forget any in-process copies of blobs this object keeps (none here; a cache-tier wrapper's
        tiers), never a blob: after writes that went around this object (Ray workers write to the
        `backend` directly), so no stale copy is served."""
        return None  # NOTE: a blob store itself keeps no copies

    @abstractmethod
    def put(self, chunk_id: str, kv: ChunkKV) -> None:
        """Store `kv` under `(chunk_id, kv.variant)`, atomically replacing any previous entry.

        Raises:
            InvalidRequestError: malformed `chunk_id`, or values that overflow `storage_dtype`.
        """

    @abstractmethod
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
        """Load and validate the cache of `(chunk_id, variant)`.

        Args:
            chunk_id: the chunk's id.
            variant: "independent" or "fused".
            fingerprint: the loaded model's fingerprint; caches of other models are refused.
            shape: the model's `(layers, kv_heads, head_dim)`, checked when given.
            device: where the returned tensors live.
            dtype: keys/values dtype; `None` = the dtype the cache was computed in.

        Raises:
            CacheNotFoundError: nothing is stored for `(chunk_id, variant)`.
            CacheCorruptError: the stored bytes are unreadable, truncated or fail their checksum.
            CacheMismatchError: the cache belongs to another model or has the wrong shape.
        """

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
        """`get`, and where the cache came from: how a request learns which tier served each load
        without knowing which stores wrap which.

        A blob store answers "store" (this default); a cache-tier wrapper "device" or "host" for a
        tier hit; a view over several stores the answer of the part that served it ("learned" for
        caches learned from traffic). A wrapper must override this, else its parts' answers are lost.

        Args:
            chunk_id, variant, fingerprint, shape, device, dtype: as `get`.

        Returns:
            `(cache, source)`.

        Raises:
            CacheNotFoundError, CacheCorruptError, CacheMismatchError: as `get`.
        """
        return self.get(chunk_id, variant, fingerprint=fingerprint, shape=shape, device=device, dtype=dtype), "store"

    @abstractmethod
    def has(self, chunk_id: str, variant: Variant) -> bool:
        """Whether an entry exists for `(chunk_id, variant)` (not whether it is valid)."""

    def has_any(self, chunk_id: str) -> bool:
        """Whether an entry exists for some variant of `chunk_id` (not whether it is valid)."""
        return any(self.has(chunk_id, v) for v in VARIANTS)

    @abstractmethod
    def delete(self, chunk_id: str, variant: Variant | None = None) -> None:
        """Remove `variant` of `chunk_id` (every variant when None); a missing entry is not an error."""

    def quarantine(self, chunk_id: str, variant: Variant) -> str | None:
        """Set the blob of `(chunk_id, variant)` aside (it failed validation): afterwards the store
        holds no such entry, so the next ingest or verify recomputes it; the bytes are kept for a look.

        Returns:
            Where the bytes went, or None when there was no entry (another thread set it aside first).

        Raises:
            NotImplementedError: the backend cannot (the disk and Redis stores can); the blob stays.
            ReadOnlyError: this process cannot write the store (a read-only directory); the blob stays.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot set a bad blob aside")

    @abstractmethod
    def content_index(self) -> CorpusIndex | None:
        """The index of this corpus's chunk texts, by which prompts find its stored chunks by content.

        A part of the corpus its store provides (the disk store keeps one next to its caches, the
        Redis store one in Redis beside its caches); a wrapper gives the one of the store it wraps.
        Every backend answers explicitly: None says it keeps none, and its chunks are then found by
        marks (and learned caches) only.

        Returns:
            The same index at every call of one store object, or None.
        """

    def free_bytes(self) -> int | None:
        """Room left for new blobs, in bytes; None when the backend cannot tell."""
        return None

    def stored_fingerprints(self) -> set[str]:
        """The model fingerprints a few stored blobs record: whose caches the store holds (a store
        holds one model's, as its collection records). Empty when the store is empty, or when the
        backend cannot tell cheaply (a cache-tier wrapper: ask its `backend`)."""
        return set()

    @abstractmethod
    def list_ids(self, variant: Variant | None = None) -> set[str]:
        """Ids that have an entry for `variant` (for any variant when `None`)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections/handles. Idempotent."""

    def __enter__(self) -> KVStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
