"""One writer per corpus: the lock every ingest, delete and repairing verify holds while it writes.

Two writers interleaving on one corpus lose caches (one's orphan sweep deletes the blobs the other
has stored but not yet indexed) and fuse chunks after neighbour lists the other is rewriting. The
lock lives next to the corpus's caches, so every process that can write the caches meets it:

* disk store (embedded Chroma, or a Chroma server with caches on this host's disk): an exclusive
  `flock` on `<store root>/.writer.lock`. The kernel releases it when the process dies, SIGKILL
  included. (NOTE: `flock` is host-local; a store directory on a network filesystem shared by
  several hosts needs a Redis store to be guarded.)
* Redis store (Chroma server + Redis, any number of hosts): a key `<namespace>:writer` set with
  `SET NX PX ttl` holding a random token, kept alive by a heartbeat thread and deleted by token on
  release. A process that dies stops beating; its key expires after `ttl_s`.

A second writer waits up to `wait_s` seconds, then fails with `CorpusLockedError` naming the holder
(process, host, command, since when). Readers (queries) never take the lock.

Beside the lock, a journal entry (`<store root>/.writer.journal`, or the Redis key
`<namespace>:journal`, neither of which expires) says an ingest or delete is under way: written once
the request is validated and its first write is next, removed when it finishes (a request refused
before it writes leaves none). It is a small JSON object: `version` (`JOURNAL_VERSION`), who wrote it
(`holder_info`) and what the write needs to be finished (a delete's `doc_ids`). Found by the next
holder of the lock, it means the last writer died mid-way (`interrupted()`): verify then finishes an
interrupted delete, or reports an interrupted ingest and keeps the blobs the resumed ingest will use.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from fusionrag_core.errors import CorpusLockedError, FusionRAGError
from fusionrag_core.store.base import KVStore

LOCK_FILE = ".writer.lock"
JOURNAL_FILE = ".writer.journal"
JOURNAL_VERSION = 1
_POLL_S = 0.2


def holder_info(action: str) -> dict[str, Any]:
    """Who is writing: recorded in the lock so a blocked writer can say who it waits for."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "action": action,
            "command": " ".join(sys.argv[:4])[:200], "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _write_holder(fd: int, action: str) -> None:
    """Write `holder_info` into a lock file. Best-effort on a full disk: the file stays empty, and
    a writer it blocks is told of "another process" instead of its pid and command."""
    try:
        os.write(fd, json.dumps(holder_info(action)).encode())
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise


class WriterLock(ABC):
    """An exclusive lock on one corpus; use as a context manager (`with lock: ...`)."""

    def __init__(self, where: str, action: str, wait_s: float) -> None:
        if not wait_s >= 0:
            raise FusionRAGError(f"wait_s must be >= 0 seconds, got {wait_s}")
        self.where = where
        self.action = action
        self.wait_s = wait_s

    def acquire(self) -> None:
        """Take the lock, polling until `wait_s` has passed.

        Raises:
            CorpusLockedError: another writer still holds it (the message names it and what to do).
        """
        deadline = time.monotonic() + self.wait_s
        while not self._try_acquire():
            if time.monotonic() >= deadline:
                raise CorpusLockedError(self._locked_message())
            time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    def _locked_message(self) -> str:
        holder = self._holder() or {}
        who = (f"pid {holder.get('pid')} on {holder.get('host')} ({holder.get('action')}: "
               f"{holder.get('command')!r}, since {holder.get('since')})") if holder else "another process"
        waited = f" after waiting {self.wait_s:g} s" if self.wait_s else ""
        return (
            f"cannot {self.action}: {who} is writing to this corpus ({self.where}){waited}; one writer per corpus "
            "at a time: let it finish (or stop it), or wait for it (CLI: --wait SECONDS)"
        )

    def begin(self, **details: Any) -> None:
        """Record that a write that must finish (ingest, delete) is under way.

        Args:
            details: JSON values saying what the write does, so whoever finds the record can finish
                it (a delete: `action="delete", doc_ids=[...]`); `action` defaults to the lock's.
        """
        self._write_journal(json.dumps({"version": JOURNAL_VERSION, **holder_info(self.action), **details}))

    def end(self) -> None:
        """The write recorded by `begin` finished: clear the record."""
        self._write_journal(None)

    @contextlib.contextmanager
    def journaled(self, **details: Any) -> Iterator[None]:
        """`with lock.journaled(...):` records the block (`begin(**details)`) and clears the record
        (`end`) only when the block completes: an exception or a crash inside it leaves the record."""
        self.begin(**details)
        yield
        self.check()  # NOTE: a writer that lost the lock must not clear what the new holder records.
        self.end()

    def check(self) -> None:
        """Raise CorpusLockedError if this writer no longer holds the lock (a file lock never loses it)."""
        return None  # NOTE: the kernel holds a flock until the process dies; a Redis lock can expire

    def interrupted(self) -> dict[str, Any] | None:
        """Who began a write and died before ending it (read while holding the lock), or None."""
        raw = self._read_journal()
        if not raw:
            return None
        with contextlib.suppress(ValueError):
            value = json.loads(raw)
            if isinstance(value, dict):
                return value
        return {"action": "write"}  # NOTE: a record cut short by the crash still means one.

    @abstractmethod
    def _write_journal(self, value: str | None) -> None: ...

    @abstractmethod
    def _read_journal(self) -> str | None: ...

    @abstractmethod
    def _try_acquire(self) -> bool: ...

    @abstractmethod
    def _holder(self) -> dict[str, Any] | None: ...

    @abstractmethod
    def release(self) -> None:
        """Give the lock up (idempotent)."""

    def __enter__(self) -> WriterLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


class FileWriterLock(WriterLock):
    """`flock` on a file (see the module docstring); released by the kernel when the process dies."""

    def __init__(self, path: Path, action: str, wait_s: float = 0.0) -> None:
        super().__init__(str(path), action, wait_s)
        self.path = path
        self._fd: int | None = None

    def _try_acquire(self) -> bool:
        import fcntl

        assert self._fd is None, "FileWriterLock is not reentrant"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: one open file description per acquire: flock excludes other descriptions, so two
        # threads of one process exclude each other too.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            os.ftruncate(fd, 0)
            _write_holder(fd, self.action)
        except BaseException:
            os.close(fd)  # NOTE: else the flock outlives the failed acquire, and this process locks itself out
            raise
        self._fd = fd
        return True

    def _holder(self) -> dict[str, Any] | None:
        with contextlib.suppress(OSError, ValueError):
            value = json.loads(self.path.read_text() or "null")
            return value if isinstance(value, dict) else None
        return None

    @property
    def _journal(self) -> Path:
        return self.path.with_name(JOURNAL_FILE)

    def _write_journal(self, value: str | None) -> None:
        if value is None:
            with contextlib.suppress(FileNotFoundError):
                self._journal.unlink()
            return
        tmp = self._journal.with_name(f"{JOURNAL_FILE}.{os.getpid()}.tmp")
        try:
            tmp.write_text(value)
            os.replace(tmp, self._journal)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise

    def _read_journal(self) -> str | None:
        with contextlib.suppress(FileNotFoundError):
            return self._journal.read_text()
        return None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # NOTE: closing the description releases the flock.


# Deletes/extends the key only while it still holds our token (another writer may own it by now).
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
_EXTEND = ("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) "
           "else return 0 end")


class RedisWriterLock(WriterLock):
    """`SET NX PX` lock with a heartbeat (see the module docstring).

    Args:
        url: the Redis server.
        key: the lock key (`<store namespace>:writer`).
        action: what the writer does (quoted to a blocked writer).
        wait_s: how long a second writer waits.
        ttl_s: how long the key outlives a writer that stopped beating (a dead process).
    """

    def __init__(self, url: str, key: str, action: str, wait_s: float = 0.0, ttl_s: float = 30.0) -> None:
        import redis

        super().__init__(f"Redis key {key}", action, wait_s)
        self.key = key
        self.ttl_ms = int(ttl_s * 1000)
        self._client = redis.Redis.from_url(url, decode_responses=True)
        self._token: str | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.lost = False
        """True when a heartbeat found the key gone or taken: this writer no longer holds the lock."""

    def _try_acquire(self) -> bool:
        assert self._token is None, "RedisWriterLock is not reentrant"
        token = json.dumps({**holder_info(self.action), "token": uuid.uuid4().hex})
        if not self._client.set(self.key, token, nx=True, px=self.ttl_ms):
            return False
        self._token, self.lost = token, False
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="fusionrag-lock-heartbeat", daemon=True)
        self._beat.start()
        return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                held = self._client.eval(_EXTEND, 1, self.key, self._token or "", self.ttl_ms)
            except Exception:  # NOTE: a blip; the next beat retries well before the key expires.
                continue
            if not held:
                self.lost = True
                return

    def check(self) -> None:
        """Raise CorpusLockedError if the lock was lost (the writer stalled longer than `ttl_s`)."""
        if self.lost:
            raise CorpusLockedError(
                f"lost the writer lock {self.key} (this process stalled longer than its {self.ttl_ms / 1000:g} s TTL "
                "and another writer may have taken over); run the command again"
            )

    @property
    def _journal(self) -> str:
        return self.key.removesuffix(":writer") + ":journal"

    def _write_journal(self, value: str | None) -> None:
        if value is None:
            self._client.delete(self._journal)
        else:
            self._client.set(self._journal, value)

    def _read_journal(self) -> str | None:
        raw = self._client.get(self._journal)
        return str(raw) if raw else None

    def _holder(self) -> dict[str, Any] | None:
        with contextlib.suppress(Exception):
            raw = self._client.get(self.key)
            value = json.loads(str(raw)) if raw else None
            return value if isinstance(value, dict) else None
        return None

    def release(self) -> None:
        if self._token is None:
            return
        token, self._token = self._token, None
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        with contextlib.suppress(Exception):  # NOTE: a server gone now lets the key expire on its own.
            self._client.eval(_RELEASE, 1, self.key, token)


def writer_lock(store: KVStore, action: str, *, wait_s: float = 0.0, ttl_s: float = 30.0) -> WriterLock:
    """The lock guarding the corpus whose caches `store` holds (file lock or Redis lock, see above).

    Args:
        store: the corpus's KV store (a `DiskKVStore` or `RedisKVStore`).
        action: what the writer is about to do ("ingest", "delete", "repair"), quoted to others.
        wait_s: how long to wait for another writer (0: fail at once; `math.inf`: forever).
        ttl_s: Redis only: how long the lock of a writer that died blocks others.

    Raises:
        FusionRAGError: a store of another kind (it has no place to keep a lock).
    """
    from fusionrag_core.store.disk import DiskKVStore

    # NOTE: a cache-tier wrapper locks the store it wraps
    store = store.backend if isinstance(store, KVStore) else store
    if isinstance(store, DiskKVStore):
        return FileWriterLock(store.root / LOCK_FILE, action, wait_s)
    url, namespace = getattr(store, "url", None), getattr(store, "namespace", None)
    if type(store).__name__ == "RedisKVStore" and isinstance(url, str) and isinstance(namespace, str):
        return RedisWriterLock(url, f"{namespace}:writer", action, wait_s, ttl_s)
    raise FusionRAGError(
        f"{type(store).__name__} has no writer lock; corpora are guarded on DiskKVStore and RedisKVStore"
    )


@contextlib.contextmanager
def writing(store: KVStore, action: str, *, wait_s: float = 0.0, journal: bool = False) -> Iterator[WriterLock]:
    """`with writing(store, "ingest"): ...` holds the corpus's writer lock for the block.

    Args:
        store: the corpus's KV store.
        action: what the block does, quoted to other writers.
        wait_s: how long to wait for another writer.
        journal: record the block as a write that must finish (`begin`/`end`): a crash inside it
            leaves the record for `interrupted()`.

    Raises:
        CorpusLockedError: another writer holds the lock; or this one lost it mid-way (Redis TTL).
    """
    with writer_lock(store, action, wait_s=wait_s) as lock:
        with lock.journaled() if journal else contextlib.nullcontext():
            yield lock
        lock.check()


__all__ = ["JOURNAL_FILE", "JOURNAL_VERSION", "LOCK_FILE", "FileWriterLock", "RedisWriterLock", "WriterLock",
           "writer_lock", "writing"]
