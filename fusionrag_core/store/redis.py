"""`RedisKVStore`: the same safetensors blobs as the disk store, kept in Redis.

Keys (with `ns` the namespace):

* `ns:kv:<variant>:<chunk_id>` → blob bytes (see `fusionrag_core.store.codec`);
* `ns:ids:<variant>` → set of chunk ids that have a blob of that variant (for `list_ids`,
  so listing never SCANs the keyspace);
* `ns:content:*` → the content index of the chunk texts (`redis_content_index.RedisContentIndex`),
  shared by every process and replica that opens the store.

Blob and index entry are written/removed together in one MULTI/EXEC transaction.

NOTE: the index assumes keys are never evicted or expired behind the store's back; run Redis with
`maxmemory-policy noeviction` (the default) when it holds caches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import torch

try:
    import redis
except ModuleNotFoundError as e:  # pragma: no cover - depends on the installed extras
    raise ModuleNotFoundError(
        "the Redis KV store needs the `redis` package: pip install 'fusionrag[redis]' (or use a directory path)"
    ) from e

from fusionrag_core.errors import CacheNotFoundError, FusionRAGError, InvalidRequestError
from fusionrag_core.runtime.kv import VARIANTS, ChunkKV, Variant
from fusionrag_core.store.base import KVStore
from fusionrag_core.store.codec import (
    StorageDType,
    decode_blob,
    encode_blob,
    header_bytes,
    is_valid_namespace,
    recorded_fingerprint_in,
    validate_chunk_id,
    validate_variant,
)
from fusionrag_core.store.redis_content_index import RedisContentIndex

_QUARANTINE_TTL_S = 7 * 24 * 3600


def _redact(url: str) -> str:
    """`url` without its password, for error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else "***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


class RedisKVStore(KVStore):
    """KV caches in a Redis server.

    Thread-safe: redis-py's client keeps a connection pool.

    Args:
        url: e.g. `redis://127.0.0.1:6379/0` (also `rediss://`, `unix://`).
        namespace: prefix of every key, so several corpora can share one Redis database.
        storage_dtype: dtype keys/values are stored in (see `KVStore` for the trade-off).
        connect_timeout_s: how long to wait for the server when connecting.

    Raises:
        InvalidRequestError: malformed namespace.
        FusionRAGError: the server cannot be reached (the message says how to start it).
    """

    def __init__(
        self,
        url: str,
        namespace: str = "fusionrag",
        storage_dtype: StorageDType = "float16",
        *,
        connect_timeout_s: float = 5.0,
    ) -> None:
        super().__init__(storage_dtype)
        if not is_valid_namespace(namespace):
            raise InvalidRequestError(
                f"invalid Redis namespace {namespace!r}: use 1-64 characters from [A-Za-z0-9_.-]"
            )
        self.url = url
        self.namespace = namespace
        try:
            self._client: redis.Redis = redis.Redis.from_url(
                url, socket_connect_timeout=connect_timeout_s, decode_responses=False
            )
        except ValueError as e:  # NOTE: redis-py raises ValueError for unparsable URLs.
            raise InvalidRequestError(
                f"invalid Redis URL {_redact(url)!r} ({e}); expected e.g. redis://127.0.0.1:6379/0"
            ) from e
        with self._errors("connect to"):
            self._client.ping()
        self._content = RedisContentIndex(self._client, namespace, _redact(url))

    @contextlib.contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        """Turn redis-py errors into a FusionRAGError that says what to check."""
        try:
            yield
        except redis.exceptions.RedisError as e:
            raise FusionRAGError(
                f"could not {action} Redis at {_redact(self.url)} ({type(e).__name__}: {e}); "
                "check that redis-server is running and the URL (host, port, db, password) is right"
            ) from e

    def blob_key(self, chunk_id: str, variant: Variant) -> str:
        """The key of the blob of `(chunk_id, variant)` (whether or not it exists)."""
        return self._key(chunk_id, variant)

    @property
    def client(self) -> redis.Redis:
        """The Redis client (its connection pool): for what keeps state beside the blobs."""
        return self._client

    def _key(self, chunk_id: str, variant: Variant) -> str:
        validate_chunk_id(chunk_id)
        validate_variant(variant)
        return f"{self.namespace}:kv:{variant}:{chunk_id}"

    def _index(self, variant: Variant) -> str:
        return f"{self.namespace}:ids:{variant}"

    def put(self, chunk_id: str, kv: ChunkKV) -> None:
        key = self._key(chunk_id, kv.variant)
        blob = encode_blob(chunk_id, kv, self.storage_dtype)
        with self._errors("write to"):
            pipe = self._client.pipeline(transaction=True)
            pipe.set(key, blob)
            pipe.sadd(self._index(kv.variant), chunk_id)
            pipe.execute()

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
        key = self._key(chunk_id, variant)
        with self._errors("read from"):
            blob = self._client.get(key)
        if blob is None:
            raise CacheNotFoundError(
                f"no {variant} KV cache for chunk {chunk_id} in Redis {_redact(self.url)} (key {key}); "
                "run ingest for its document, or check the URL and namespace"
            )
        assert isinstance(blob, bytes)  # NOTE: decode_responses=False, so GET returns bytes.
        return decode_blob(
            blob,
            source=f"Redis key {key} at {_redact(self.url)}",
            chunk_id=chunk_id,
            variant=variant,
            fingerprint=fingerprint,
            shape=shape,
            device=device,
            dtype=dtype,
        )

    def has(self, chunk_id: str, variant: Variant) -> bool:
        key = self._key(chunk_id, variant)
        with self._errors("read from"):
            return bool(self._client.exists(key))

    def delete(self, chunk_id: str, variant: Variant | None = None) -> None:
        variants = VARIANTS if variant is None else (validate_variant(variant),)
        keys = [self._key(chunk_id, v) for v in variants]
        with self._errors("delete from"):
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(*keys)
            for v in variants:
                pipe.srem(self._index(v), chunk_id)
            pipe.execute()

    def quarantine(self, chunk_id: str, variant: Variant) -> str | None:
        """Rename the blob to `ns:quarantine:<variant>:<chunk_id>` (kept a week), out of the index."""
        key = self._key(chunk_id, variant)
        target = f"{self.namespace}:quarantine:{variant}:{chunk_id}"
        with self._errors("write to"):
            pipe = self._client.pipeline(transaction=True)
            pipe.rename(key, target)
            pipe.expire(target, _QUARANTINE_TTL_S)
            pipe.srem(self._index(variant), chunk_id)
            try:
                pipe.execute()
            except redis.exceptions.ResponseError as e:
                if "no such key" in str(e).lower():
                    return None  # NOTE: another client set it aside first.
                raise
        return f"Redis key {target}"

    def free_bytes(self) -> int | None:
        """`maxmemory - used_memory` when Redis has a limit, else the host's memory not in use by
        Redis (`total_system_memory - used_memory`); None when the server reports neither."""
        with self._errors("read from"):
            info = self._client.info("memory")
        used = int(info.get("used_memory", 0))
        limit = int(info.get("maxmemory", 0)) or int(info.get("total_system_memory", 0))
        return max(0, limit - used) if limit else None

    def list_ids(self, variant: Variant | None = None) -> set[str]:
        indexes = [self._index(v) for v in (VARIANTS if variant is None else (validate_variant(variant),))]
        with self._errors("read from"):
            members = self._client.sunion(indexes)
        return {m.decode() if isinstance(m, bytes) else str(m) for m in members}

    def stored_fingerprints(self, sample: int = 3) -> set[str]:
        """The fingerprints recorded in the headers of up to `sample` stored blobs (only their headers
        are read, by GETRANGE), as `DiskKVStore.stored_fingerprints`: a model refuses another's store."""
        with self._errors("read from"):
            ids = [(v, m.decode() if isinstance(m, bytes) else str(m))
                   for v in VARIANTS for m in self._client.srandmember(self._index(v), sample) or []][:sample]
            found: set[str] = set()
            for variant, chunk_id in ids:
                key = self._key(chunk_id, variant)
                first = self._client.getrange(key, 0, 7)
                assert isinstance(first, bytes)  # NOTE: decode_responses=False, so GETRANGE returns bytes.
                size = header_bytes(first)
                head = self._client.getrange(key, 0, size - 1) if size else b""
                assert isinstance(head, bytes)
                fingerprint = recorded_fingerprint_in(head)
                if fingerprint is not None:
                    found.add(fingerprint)
        return found

    def content_index(self) -> RedisContentIndex:
        """The index of the chunk texts, kept in Redis beside the caches (`ns:content:*`): every
        process that opens the store finds its chunks by content, and sees chunks another one
        ingests at its next lookup."""
        return self._content

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return (
            f"RedisKVStore(url={_redact(self.url)!r}, namespace={self.namespace!r}, "
            f"storage_dtype={self.storage_dtype!r})"
        )
