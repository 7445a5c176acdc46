"""Chunk KV cache storage: the `KVStore` interface, a disk and a Redis backend, cache tiers.

`open_store("./fusionrag-data/kv")` gives a `DiskKVStore`; `open_store("redis://host:6379/0")` a
`RedisKVStore` (needs the `redis` extra). Both store the same checksummed safetensors blobs.
`TierConfig(device_bytes, host_bytes).wrap(store, ...)` (or `FusionIndex.open(tiers=...)`) puts a
device and a host LRU of decoded caches in front of any of them (`TieredKVStore`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fusionrag_core.store.base import CACHE_SOURCES, CacheSource, KVStore
from fusionrag_core.store.codec import (
    FORMAT_VERSION,
    STORAGE_DTYPES,
    StorageDType,
    decode_blob,
    decode_file,
    encode_blob,
    validate_chunk_id,
)
from fusionrag_core.store.disk import DiskKVStore
from fusionrag_core.store.factory import open_store
from fusionrag_core.store.tiered import TierConfig, TieredKVStore

if TYPE_CHECKING:
    from fusionrag_core.store.redis import RedisKVStore

__all__ = [
    "CACHE_SOURCES",
    "FORMAT_VERSION",
    "STORAGE_DTYPES",
    "CacheSource",
    "DiskKVStore",
    "KVStore",
    "RedisKVStore",
    "StorageDType",
    "TierConfig",
    "TieredKVStore",
    "decode_blob",
    "decode_file",
    "encode_blob",
    "open_store",
    "validate_chunk_id",
]


def __getattr__(name: str) -> Any:
    # NOTE: imported lazily so the disk store works without the optional `redis` package.
    if name == "RedisKVStore":
        from fusionrag_core.store.redis import RedisKVStore

        return RedisKVStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
