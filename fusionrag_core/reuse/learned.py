"""Caches learned from traffic: a retrieved document's K/V, computed in a real prompt, kept as its cache.

When a request holds the text of a document that was retrieved for it (the integrations see the
retriever's results through LangChain callbacks and LlamaIndex instrumentation), or a span of its
context, that has no cache yet, the document's caches are computed once the request has answered,
as ingest computes a chunk's (`reuse.learning`), and kept here (`LearnedCaches.keep`), keyed by
content (`chunking.chunk_id` of the text), its text indexed so the next prompt holding it finds
the cache by content (`recognise.ContentIndex`).

Learned caches live in their own directory (a disk KV store, a content index and an LRU table),
bounded in bytes: the least recently used are evicted first. `reuse.ReuseSources` is what a
request reads: the caches of an index (ingested) first, then the learned ones.

Learning is best-effort: a cache that cannot be written (a full disk, a quota, a read-only
directory) is skipped, the request's answer is unaffected, and one warning per cause says why.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fusionrag_core.errors import CacheMismatchError, InvalidRequestError
from fusionrag_core.ingest.chunking import ChunkingConfig, chunk_id
from fusionrag_core.recognise.content_index import ContentIndex
from fusionrag_core.runtime.kv import VARIANTS, ChunkKV
from fusionrag_core.store.base import KVStore
from fusionrag_core.store.codec import StorageDType
from fusionrag_core.store.corpus_index import CorpusIndex
from fusionrag_core.store.disk import DiskKVStore

logger = logging.getLogger("fusionrag")

DEFAULT_MAX_BYTES = 2 << 30
"""Default bound of a learned-cache directory: 2 GiB (~2,000 SmolLM2 chunks of 256 tokens in fp16)."""
# NOTE: learned ids use the default chunking settings, so a text learned here gets the id that
# FusionKVTransform gives it (ingested and learned caches of one text share a key).
_CHUNKING = ChunkingConfig()


STORAGE_ERRORS: tuple[type[Exception], ...] = (OSError, sqlite3.OperationalError)
"""What writing learned caches raises when their directory cannot take them (ENOSPC, EDQUOT, EROFS,
EACCES..., SQLite's "database or disk is full"): learning is skipped, never the answer."""


def content_id(text: str, fingerprint: str) -> str:
    """The id a document's text is learned (and looked up) under for the model `fingerprint`."""
    return chunk_id(text, fingerprint, _CHUNKING)


@dataclass(frozen=True)
class LearnConfig:
    """Where and how much is learned.

    Attributes:
        enabled: keep the K/V of retrieved documents as their caches (False: learn nothing).
        max_bytes: bound of the directory's caches; least recently used go first.
        storage_dtype: dtype learned caches are stored in.
    """

    enabled: bool = True
    max_bytes: int = DEFAULT_MAX_BYTES
    storage_dtype: StorageDType = "float16"

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise InvalidRequestError(f"max_bytes of learned caches must be >= 1, got {self.max_bytes}")


_SCHEMA = """
CREATE TABLE IF NOT EXISTS learned (
    chunk_id TEXT PRIMARY KEY, nbytes INTEGER NOT NULL, used REAL NOT NULL, neighbours TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS learned_by_use ON learned (used);
"""


class SkippedLearning:
    """Warns once per cause (an errno, a SQLite error) that learned caches could not be opened or written."""

    def __init__(self) -> None:
        self._causes: set[str] = set()
        self._lock = threading.Lock()

    ADVICE = "free space there, move them (learned_dir=) or turn learning off (learn=False)"
    """How an operator ends the cause (part of the warning)."""

    def report(self, root: Path | str, error: Exception) -> None:
        """Log that caches under `root` were not kept (or not read) because of `error`, unless its cause was logged."""
        cause = self.cause(error)
        with self._lock:
            if cause in self._causes:
                return
            self._causes.add(cause)
        logger.warning(
            "FusionRAG could not keep learned caches in %s (%s: %s); answers are unaffected, but no cache is "
            "learned (nor read, where the caches could not be opened) while this lasts: %s (this warning is "
            "shown once per cause)", root, cause, error, self.ADVICE)

    @staticmethod
    def cause(error: Exception) -> str:
        """What one warning stands for: an errno's name, or a SQLite error's."""
        if isinstance(error, OSError) and error.errno is not None:
            return errno.errorcode.get(error.errno, str(error.errno))
        return str(getattr(error, "sqlite_errorname", "") or error)


class LearnedCaches:
    """A bounded, LRU directory of caches learned from requests of one model.

    (`reuse/shared_learned.py` keeps them in a shared Redis store instead, under the same rules.)

    Args:
        root: the directory (created if missing); one per model (see `paths.learned_dir`).
        fingerprint: the model's fingerprint; caches of other models are never stored here.
        config: bound and dtype.

    Raises:
        CacheMismatchError: the directory holds caches another model learned.
    """

    storage_errors: tuple[type[Exception], ...] = STORAGE_ERRORS
    """What a write that the caches' storage cannot take raises (skipped, never the answer)."""

    def __init__(self, root: Path | str, fingerprint: str, config: LearnConfig | None = None) -> None:
        self.root = Path(root).expanduser().resolve()
        self.fingerprint = fingerprint
        self.config = config or LearnConfig()
        made = _missing_dirs(self.root / "kv")
        try:
            self._disk = DiskKVStore(self.root / "kv", storage_dtype=self.config.storage_dtype)
            self.store: KVStore = self._disk
            found = self.store.stored_fingerprints()
            if found and fingerprint not in found:
                raise CacheMismatchError(
                    f"learned caches at {self.root} were learned by another model (fingerprint "
                    f"{min(found)[:12]}), not by this one ({fingerprint[:12]}); give each model its own "
                    "learned_dir= (the default, <data_dir>/learned/<model fingerprint>, is one per model)"
                )
            # NOTE: the LRU table before the content index: on a full disk the open fails here, before
            # the index has made (and warned about) a database of its own.
            self._db = _open_lru(self.root / "lru.sqlite")
        except BaseException:
            _remove_empty(made)  # NOTE: a directory a failed open made would make the next request open it
            raise
        self.skipped = SkippedLearning()
        self.index: CorpusIndex = ContentIndex(self.root / "content")
        self._lock = threading.Lock()

    def keep(self, chunk_id: str, text: str, fused: ChunkKV, neighbours: Sequence[str]) -> None:
        """Keep a cache computed outside any request (`reuse.learning`): `fused` is stored next to the
        chunk's independent cache, already in `store`; both are indexed and bounded as one entry.

        Raises:
            OSError, sqlite3.OperationalError (`STORAGE_ERRORS`): the directory cannot take it;
                nothing of it stays (its independent cache included).
        """
        self._put(chunk_id, text, fused, neighbours)

    def discard(self, chunk_id: str) -> None:
        """Drop every cache of `chunk_id` and its rows, best-effort (a write that failed half-way)."""
        self._forget(chunk_id)

    def _put(self, chunk_id: str, text: str, kv: ChunkKV, neighbours: Sequence[str]) -> None:
        """Store one cache with its content-index and LRU rows; when any of the three fails, none stays."""
        self.store.put(chunk_id, kv)  # NOTE: atomic: a failed put leaves no file (`DiskKVStore.put`)
        try:
            nbytes = sum(self._disk.path_for(chunk_id, v).stat().st_size for v in VARIANTS
                         if self._disk.has(chunk_id, v))
            self.index.add([(chunk_id, text)], strict=True)  # NOTE: a blob no prompt can find is not kept
            with self._lock, self._db:
                self._db.execute("INSERT OR REPLACE INTO learned VALUES (?, ?, ?, ?)",
                                 (chunk_id, nbytes, time.time(), json.dumps(list(neighbours))))
        except BaseException:
            self._forget(chunk_id)
            raise
        self._evict()

    def _forget(self, chunk_id: str) -> None:
        """Drop what a failed `_put` may have written of `chunk_id`: its blob first, so no lookup can
        reach a cache the LRU table does not bound. Best-effort: the failure being handled stays the one raised."""
        for drop in (self.store.delete, lambda c: self.index.remove([c]), self._delete_row):
            with contextlib.suppress(*STORAGE_ERRORS):
                drop(chunk_id)

    def _delete_row(self, chunk_id: str) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM learned WHERE chunk_id = ?", (chunk_id,))

    def _evict(self) -> None:
        """Drop least recently used caches until the directory fits `max_bytes`."""
        with self._lock:
            total = int(self._db.execute("SELECT coalesce(sum(nbytes), 0) FROM learned").fetchone()[0])
            victims: list[str] = []
            for cid, nbytes in self._db.execute("SELECT chunk_id, nbytes FROM learned ORDER BY used"):
                if total <= self.config.max_bytes:
                    break
                victims.append(cid)
                total -= int(nbytes)
            with self._db:
                self._db.executemany("DELETE FROM learned WHERE chunk_id = ?", [(c,) for c in victims])
        if victims:
            self.index.remove(victims)
            for cid in victims:
                self.store.delete(cid)

    def touch(self, chunk_ids: Iterable[str]) -> None:
        """Mark caches as just used (they are evicted last).

        Best-effort, as learning is: when the directory cannot take the update (`STORAGE_ERRORS`),
        the caches keep their older use time, with one warning per cause (`skipped`).
        """
        now = time.time()
        try:
            with self._lock, self._db:
                self._db.executemany("UPDATE learned SET used = ? WHERE chunk_id = ?",
                                     [(now, c) for c in chunk_ids])
        except self.storage_errors as e:
            self.skipped.report(self.location, e)

    @property
    def location(self) -> str:
        """Where the caches live, for messages."""
        return str(self.root)

    def neighbours(self, chunk_id: str) -> list[str]:
        """The chunk ids that came before this document in the prompt it was learned from."""
        with self._lock:
            row = self._db.execute("SELECT neighbours FROM learned WHERE chunk_id = ?", (chunk_id,)).fetchone()
        return list(json.loads(row[0])) if row else []

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM learned").fetchone()[0])

    @property
    def nbytes(self) -> int:
        """Bytes of learned caches: their blob files' sizes."""
        with self._lock:
            return int(self._db.execute("SELECT coalesce(sum(nbytes), 0) FROM learned").fetchone()[0])


    def close(self) -> None:
        """Close the LRU table and the content index; `open_learned` opens the directory anew after this."""
        with _open_lock:
            if _open.get(self.root) is self:
                del _open[self.root]
        with self._lock:
            self._db.close()
        self.index.close()


def _open_lru(path: Path) -> sqlite3.Connection:
    """The LRU table's database, made if missing. When that fails (a full disk fails SQLite's WAL
    setup), the connection is closed and a file it made is removed while still empty: an empty file
    left behind would be opened by every later request."""
    existed = path.exists()
    db = sqlite3.connect(path, check_same_thread=False, timeout=30.0)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(_SCHEMA)
    except BaseException:
        db.close()
        if not existed:
            for made in (path, path.with_name(f"{path.name}-wal"), path.with_name(f"{path.name}-shm")):
                with contextlib.suppress(OSError):
                    if made.stat().st_size == 0:  # NOTE: another process's rows are never removed
                        made.unlink()
        raise
    return db


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path.parent != path:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(dirs: Sequence[Path]) -> None:
    """Remove each directory of `dirs` (deepest first) that is empty; one that is not stays."""
    for d in dirs:
        with contextlib.suppress(OSError):
            d.rmdir()


OPEN_LIMIT = 64
"""Learned-cache directories a process keeps open at once (one per scope: tenant and cache salt).
Beyond it the least recently used is let go: closed once no request holds it, opened again when
its scope comes back (its caches and their LRU order live on disk)."""
_open: OrderedDict[Path, LearnedCaches] = OrderedDict()
_open_lock = threading.Lock()


def open_learned(root: Path | str, fingerprint: str, config: LearnConfig | None = None) -> LearnedCaches:
    """The process's one `LearnedCaches` of a directory (models of one data directory share it).

    Raises:
        InvalidRequestError: the directory is already open with another fingerprint or bound.
    """
    path = Path(root).expanduser().resolve()
    with _open_lock:
        learned = _open.get(path)
        if learned is None:
            learned = _open[path] = LearnedCaches(path, fingerprint, config)
            while len(_open) > OPEN_LIMIT:
                _open.popitem(last=False)
        elif learned.fingerprint != fingerprint or (config is not None and learned.config != config):
            raise InvalidRequestError(
                f"learned caches at {path} are already open for another model or with other settings; "
                "give each model its own directory (paths.learned_dir does)"
            )
        _open.move_to_end(path)
        return learned


__all__ = ["DEFAULT_MAX_BYTES", "OPEN_LIMIT", "STORAGE_ERRORS", "LearnConfig", "LearnedCaches", "SkippedLearning",
           "content_id", "open_learned"]
