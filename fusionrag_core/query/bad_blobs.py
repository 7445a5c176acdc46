"""What a query does with a stored cache that fails validation: it becomes a miss, never an error.

A truncated, bit-rotted or misplaced blob (CacheCorruptError) is set aside by the store
(`KVStore.quarantine`): the chunk is prefilled at its position, so the answer is what it would be
without that cache, the request reports the miss with its reason, the log names the blob and the
fix once (the blob is gone after the first request sets it aside), and the next ingest or verify
recomputes it. A store that cannot set it aside (a backend without `quarantine`, a read-only
directory, a Redis replica) leaves it in place: the reason says so, and it is logged once.

A blob of another model, shape or format version (CacheMismatchError) is a miss too, but stays:
it is a valid cache for whatever wrote it, and a reader with the wrong model must not destroy a
corpus. It is logged once per engine and blob.

A blob is known by the error's text, which names it (its file, or its Redis key): the integrations
hand the engine a new view of their stores with every request (`reuse.ReuseSources`), and the
same blob read through each of them is still one blob, logged once.
"""

from __future__ import annotations

import logging
import threading

from fusionrag_core.errors import CacheCorruptError, CacheMismatchError, FusionRAGError
from fusionrag_core.query.stitch import CacheMiss
from fusionrag_core.runtime.kv import Variant
from fusionrag_core.store.base import KVStore

log = logging.getLogger(__name__)

_MAX_REMEMBERED = 4096


class BadBlobs:
    """Turns a failed load into a CacheMiss, sets corrupt blobs aside and logs each blob once.

    Thread-safe; shared by every request of an engine (it holds no per-request state).
    """

    def __init__(self) -> None:
        self._logged: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()

    def miss(self, store: KVStore, chunk_id: str, variant: Variant,
             error: CacheCorruptError | CacheMismatchError) -> CacheMiss:
        """The miss to report for `error`, after setting a corrupt blob aside (when the store can)."""
        if isinstance(error, CacheCorruptError):
            try:
                moved = store.quarantine(chunk_id, variant)
            except NotImplementedError as e:  # NOTE: its text names the store that cannot
                return self._left(chunk_id, variant, error, str(e) or f"{type(store).__name__} cannot set it aside")
            except (OSError, FusionRAGError) as e:  # NOTE: a read-only directory, a Redis replica...
                return self._left(chunk_id, variant, error, f"could not set it aside: {e}")
            if moved is not None:
                log.warning("%s -- moved it to %s; the chunk is prefilled until `fusionrag verify` (or "
                            "re-ingesting its document) recomputes the cache", error, moved)
            # NOTE: None: another request moved it first (and logged it); it is set aside either way.
            return CacheMiss(f"{variant} cache unusable, set aside: {_first_sentence(error)}")
        self._log_once(chunk_id, variant, error, f"{error} -- the chunk is prefilled instead")
        return CacheMiss(f"{variant} cache of another model or format: {_first_sentence(error)}")

    def _left(self, chunk_id: str, variant: Variant, error: CacheCorruptError, why: str) -> CacheMiss:
        """The miss of a corrupt blob that stays in the store, logged once."""
        self._log_once(chunk_id, variant, error, f"{error} (left in place: {why}; the chunk is prefilled meanwhile)")
        return CacheMiss(f"{variant} cache unusable, left in place ({why}): {_first_sentence(error)}")

    def _log_once(self, chunk_id: str, variant: Variant, error: Exception, message: str) -> None:
        key = (chunk_id, variant, str(error))
        with self._lock:
            if key in self._logged:
                return
            if len(self._logged) >= _MAX_REMEMBERED:
                self._logged.clear()  # NOTE: bounded memory; a long-lived server may log a blob again.
            self._logged.add(key)
        log.warning("%s", message)


def _first_sentence(error: Exception) -> str:
    return str(error).split(". ", 1)[0]


__all__ = ["BadBlobs"]
