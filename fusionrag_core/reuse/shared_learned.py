"""Learned caches in a shared Redis store: a document learned by one process is reused by every other.

When a corpus's caches live in Redis, every server and replica that opens it reaches the same
server, so their learned caches live there too (`SharedLearnedCaches`), not in each node's
`data_dir`. The rules are `LearnedCaches`'s: the same blobs (fingerprint, checksum and token ids
validated at every load), found by content through a content index, bounded in bytes with the
least recently used evicted first, and learned best-effort (a full or unreachable Redis skips the
cache with one warning per cause, never the answer).

Keys, with `L` = `learned.<model fingerprint[:16]>.<digest of the corpus's namespace>` (one per
corpus and model, as `<data_dir>/learned/<model>` is on disk):

* `L:kv:*`, `L:ids:*` → the blobs (a `RedisKVStore` of their own);
* `L:content:*` → their content index (`RedisContentIndex`);
* `L:lru` → sorted set chunk id → last use time; `L:nbytes` → hash chunk id → blob bytes;
  `L:neighbours` → hash chunk id → JSON list of the ids before it; `L:bytes` → their total.

The accounting is kept by server-side scripts, so several processes learning at once keep one
total and one LRU order; eviction pops the oldest entries atomically, so each is evicted once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from fusionrag_core.errors import CacheMismatchError, FusionRAGError, InvalidRequestError
from fusionrag_core.reuse.learned import OPEN_LIMIT, STORAGE_ERRORS, LearnConfig, LearnedCaches, SkippedLearning
from fusionrag_core.runtime.kv import VARIANTS, ChunkKV
from fusionrag_core.scope import OPERATOR, Scope
from fusionrag_core.store.base import KVStore

if TYPE_CHECKING:
    from fusionrag_core.store.redis import RedisKVStore

logger = logging.getLogger("fusionrag")

# KEYS: lru, nbytes, neighbours, total, then the entry's blobs (every variant). ARGV: chunk id, use
# time, neighbours (JSON).
_RECORD = """
local n = 0
for i = 5, #KEYS do n = n + redis.call('STRLEN', KEYS[i]) end
local old = redis.call('HGET', KEYS[2], ARGV[1])
if old then redis.call('DECRBY', KEYS[4], old) end
redis.call('HSET', KEYS[2], ARGV[1], n)
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return redis.call('INCRBY', KEYS[4], n)
"""
# KEYS: lru, nbytes, neighbours, total. ARGV: the byte bound. Returns the evicted ids.
_EVICT = """
local total = tonumber(redis.call('GET', KEYS[4]) or '0')
local victims = {}
while total > tonumber(ARGV[1]) do
  local v = redis.call('ZPOPMIN', KEYS[1])
  if #v == 0 then break end
  local n = redis.call('HGET', KEYS[2], v[1])
  redis.call('HDEL', KEYS[2], v[1])
  redis.call('HDEL', KEYS[3], v[1])
  if n then total = redis.call('DECRBY', KEYS[4], n) end
  victims[#victims + 1] = v[1]
end
return victims
"""
# KEYS: lru, nbytes, neighbours, total. ARGV: chunk ids to drop from the accounting.
_DROP = """
for _, id in ipairs(ARGV) do
  local n = redis.call('HGET', KEYS[2], id)
  if n then redis.call('DECRBY', KEYS[4], n) end
  redis.call('HDEL', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('ZREM', KEYS[1], id)
end
return 0
"""


class SkippedSharedLearning(SkippedLearning):
    """Warns once per cause (the Redis error's kind: out of memory, unreachable) that learned caches
    could not be kept in, or read from, Redis."""

    ADVICE = ("check the server, give it memory (maxmemory), or keep learned caches on each node "
              "(learned_in_redis=False) or turn learning off (learn=False)")

    @staticmethod
    def cause(error: Exception) -> str:
        return type(error.__cause__ or error).__name__  # NOTE: the Redis error a FusionRAGError wraps


def shared_namespace(corpus_namespace: str, fingerprint: str, scope: Scope = OPERATOR) -> str:
    """The Redis namespace of the caches the model `fingerprint` learns beside the corpus
    `corpus_namespace` for requests of `scope` (a digest: a tenant's or client's text never names a key)."""
    corpus = hashlib.sha256(corpus_namespace.encode()).hexdigest()[:12]
    base = f"learned.{fingerprint[:16]}.{corpus}"
    return base if scope.is_operator else f"{base}.{scope.digest.hex()}"


def redis_backend(store: KVStore | None) -> RedisKVStore | None:
    """The `RedisKVStore` holding `store`'s blobs, or None (no store, or another backend)."""
    # NOTE: a RedisKVStore exists only once its module was imported: the optional `redis` package
    # is never imported for a disk store.
    module = sys.modules.get("fusionrag_core.store.redis")
    if store is None or module is None:
        return None
    backend = store.backend
    return backend if isinstance(backend, module.RedisKVStore) else None


class SharedLearnedCaches(LearnedCaches):
    """Learned caches of one model in the Redis server of a corpus's store, shared by every process.

    Args:
        corpus: the corpus's Redis store (its server and namespace say where learned caches go).
        fingerprint: the model's fingerprint; caches of other models are never stored here.
        config: bound and dtype.
        scope: whose requests read and teach them (`shared_namespace`: a namespace per scope).

    Raises:
        FusionRAGError: the server cannot be reached.
        CacheMismatchError: the namespace holds caches another model learned.
    """

    def __init__(self, corpus: RedisKVStore, fingerprint: str, config: LearnConfig | None = None,
                 scope: Scope = OPERATOR) -> None:
        import redis

        from fusionrag_core.store.redis import RedisKVStore

        self.fingerprint = fingerprint
        self.config = config or LearnConfig()
        self.storage_errors = (*STORAGE_ERRORS, FusionRAGError, redis.exceptions.RedisError)
        namespace = shared_namespace(corpus.namespace, fingerprint, scope)
        self._redis = RedisKVStore(corpus.url, namespace, self.config.storage_dtype)
        self.store = self._redis
        found = self._redis.stored_fingerprints()
        if found and fingerprint not in found:
            self._redis.close()
            raise CacheMismatchError(
                f"learned caches in {self.location} were learned by another model (fingerprint {min(found)[:12]}), "
                f"not by this one ({fingerprint[:12]}); delete the keys {namespace}:*"
            )
        self.index = self._redis.content_index()
        # NOTE: learned texts are in no collection: rows the index cannot keep are learned again.
        self.index.fix = "learned caches it cannot find are learned again from the next prompts that hold them"
        self.skipped = SkippedSharedLearning()
        self._keys = [f"{namespace}:{k}" for k in ("lru", "nbytes", "neighbours", "bytes")]
        client = self._redis.client
        self._record, self._evict_oldest, self._drop = (client.register_script(s) for s in (_RECORD, _EVICT, _DROP))

    @property
    def location(self) -> str:
        """The Redis namespace and server, for messages."""
        return f"Redis namespace {self._redis.namespace} at {self._redis!r}"

    def _put(self, chunk_id: str, text: str, kv: ChunkKV, neighbours: Sequence[str]) -> None:
        """Store one cache with its content-index row and LRU entry; when any of the three fails, none stays."""
        self.store.put(chunk_id, kv)
        try:
            self.index.add([(chunk_id, text)], strict=True)  # NOTE: a blob no prompt can find is not kept
            # NOTE: the entry's bytes are all its variants' (a learned piece keeps its independent cache too)
            self._record(keys=[*self._keys, *(self._redis.blob_key(chunk_id, v) for v in VARIANTS)],
                         args=[chunk_id, time.time(), json.dumps(list(neighbours))])
        except BaseException:
            self._forget(chunk_id)
            raise
        self._evict()

    def _forget(self, chunk_id: str) -> None:
        """Drop what a failed `_put` may have written of `chunk_id` (the blob first). Best-effort."""
        for drop in (self.store.delete, lambda c: self.index.remove([c]), self._delete_row):
            try:
                drop(chunk_id)
            except self.storage_errors:
                continue

    def _delete_row(self, chunk_id: str) -> None:
        self._drop(keys=self._keys, args=[chunk_id])

    def _evict(self) -> None:
        """Drop least recently used caches until the total fits `max_bytes` (each victim popped by one process)."""
        victims = [v.decode() if isinstance(v, bytes) else str(v)
                   for v in self._evict_oldest(keys=self._keys, args=[self.config.max_bytes])]
        if victims:
            self.index.remove(victims)
            for cid in victims:
                self.store.delete(cid)

    def touch(self, chunk_ids: Iterable[str]) -> None:
        """Mark caches as just used (evicted last); best-effort, as in `LearnedCaches.touch`."""
        now = time.time()
        try:
            self._redis.client.zadd(self._keys[0], dict.fromkeys(chunk_ids, now), xx=True)
        except self.storage_errors as e:
            self.skipped.report(self.location, e)

    def neighbours(self, chunk_id: str) -> list[str]:
        """The chunk ids that came before this document in the prompt it was learned from."""
        raw = self._redis.client.hget(self._keys[2], chunk_id)
        return list(json.loads(raw)) if raw else []

    def __len__(self) -> int:
        return int(self._redis.client.zcard(self._keys[0]))

    @property
    def nbytes(self) -> int:
        """Bytes of learned caches: their blobs' sizes."""
        return int(self._redis.client.get(self._keys[3]) or 0)

    def close(self) -> None:
        """Close the connection; `open_shared_learned` opens the caches anew after this."""
        with _open_lock:
            for key, learned in list(_open.items()):
                if learned is self:
                    del _open[key]
        self._redis.close()


# NOTE: bounded as `learned.OPEN_LIMIT` bounds the directories: one entry per scope
_open: OrderedDict[tuple[str, str, str, Scope], SharedLearnedCaches] = OrderedDict()
_open_lock = threading.Lock()


def open_shared_learned(corpus: RedisKVStore, fingerprint: str, config: LearnConfig | None = None,
                        scope: Scope = OPERATOR) -> SharedLearnedCaches:
    """The process's one `SharedLearnedCaches` of a corpus's Redis store, a model and a scope.

    Raises:
        FusionRAGError: the server cannot be reached (the next call tries again).
        InvalidRequestError: they are already open with another bound.
        CacheMismatchError: the namespace holds another model's learned caches.
    """
    key = (corpus.url, corpus.namespace, fingerprint, scope)
    with _open_lock:
        learned = _open.get(key)
        if learned is None:
            learned = _open[key] = SharedLearnedCaches(corpus, fingerprint, config, scope)
            while len(_open) > OPEN_LIMIT:
                _open.popitem(last=False)
        elif config is not None and learned.config != config:
            raise InvalidRequestError(
                f"the learned caches in {learned.location} are already open with other settings ({learned.config}); "
                "give every session of one corpus and model the same bound"
            )
        _open.move_to_end(key)
        return learned


__all__ = ["SharedLearnedCaches", "SkippedSharedLearning", "open_shared_learned", "redis_backend", "shared_namespace"]
