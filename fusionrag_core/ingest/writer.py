"""`BlobWriter`: stores an ingest's KV blobs on a background thread, in order, while prefills go on.

Serialising a cache and `fsync`-ing it (twice: the file, then its directory) is I/O the next packed
prefill need not wait for. The ingest hands each computed cache to `put` and carries on; one
writer thread stores them in submission order through the ordinary `KVStore.put` (so a disk blob is
still written to a temp file, fsynced and renamed: never half-written).

Invariants the ingest builds on:

* `flush` returns only once every blob handed over before it is stored, and raises the first
  error of any of them: the ingest calls it before a Chroma write that makes those chunks visible,
  so a Chroma entry never exists without its blobs, and before anything reads them from the store;
* after an error, nothing more is written (the queued blobs are dropped) and every later `put`,
  `flush` and `close` raises it until `close` has reported it: a failed ingest stops, it does
  not go on indexing chunks whose blobs are missing;
* the queue is bounded (`depth` blobs), so a slow disk throttles the prefills rather than filling
  memory with caches.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from types import TracebackType

from fusionrag_core.runtime import threads
from fusionrag_core.runtime.kv import ChunkKV
from fusionrag_core.store.base import KVStore

_Item = tuple[str, ChunkKV] | None  # None: the thread's stop signal


class BlobWriter:
    """A single background thread that stores `(chunk id, cache)` pairs in `store`, in order.

    Not for concurrent producers: one ingest (the corpus's one writer) owns it. Use as a context
    manager, or call `close` (which waits for every queued blob).

    Args:
        store: where the blobs go.
        depth: most blobs queued and not yet stored; `put` blocks beyond it.
    """

    def __init__(self, store: KVStore, depth: int = 16) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.store = store
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def put(self, chunk_id: str, kv: ChunkKV) -> None:
        """Queue `kv` to be stored under `chunk_id` (blocks while `depth` blobs wait).

        Raises:
            The error an earlier blob failed with (nothing more is written after one).
        """
        self._raise_pending()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fusionrag-blob-writer", daemon=True)
            self._thread.start()
        self._queue.put((chunk_id, kv))

    def flush(self) -> None:
        """Wait until every blob queued so far is stored.

        Raises:
            The first error a queued blob failed with.
        """
        if self._thread is not None:
            self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        """Store what is queued, stop the thread (a later `put` starts a new one), report an error.

        NOTE: blobs queued before the caller failed are still stored: they are valid caches a
        resumed ingest reuses (an ingest that dies leaves such blobs behind anyway).
        """
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if error is None:
            self.close()
            return
        # NOTE: the caller's error is the one to see (often the writer's own, raised by put or flush).
        with contextlib.suppress(Exception):
            self.close()

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:  # NOTE: after a failure nothing is written; the queue drains.
                    # NOTE: the put's torch ops must not leave an OpenMP pool beside the thread running
                    # the prefills (`runtime.threads`)
                    threads.releasing(self.store.put)(*item)
            except BaseException as e:  # NOTE: handed to the producer (put/flush/close), never lost.
                self._error = e
            finally:
                self._queue.task_done()


__all__ = ["BlobWriter"]
