"""`open_store`: a KV store from a Redis URL or a directory."""

from __future__ import annotations

from pathlib import Path

from fusionrag_core.store.base import KVStore
from fusionrag_core.store.codec import StorageDType
from fusionrag_core.store.disk import DiskKVStore

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_store(
    url_or_path: str | Path,
    *,
    storage_dtype: StorageDType = "float16",
    namespace: str = "fusionrag",
) -> KVStore:
    """Open a KV store: Redis for `redis://`, `rediss://` or `unix://` URLs, else a directory.

    Args:
        url_or_path: Redis URL or directory (created if missing).
        storage_dtype: dtype of stored keys/values.
        namespace: Redis key prefix (disk store ignores it).

    Returns:
        A `RedisKVStore` or `DiskKVStore`.
    """
    if isinstance(url_or_path, str) and url_or_path.startswith(_REDIS_SCHEMES):
        from fusionrag_core.store.redis import RedisKVStore  # NOTE: lazily: `redis` is an optional extra

        return RedisKVStore(url_or_path, namespace=namespace, storage_dtype=storage_dtype)
    return DiskKVStore(Path(url_or_path), storage_dtype=storage_dtype)
