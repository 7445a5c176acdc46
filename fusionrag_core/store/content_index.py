"""Recognise stored chunks by content inside a flattened prompt, without scanning the corpus.

A corpus's content index is part of its store: a backend provides it (`KVStore.content_index()`;
the disk store keeps this on-disk one next to its caches, `<root>/.content`) or says it keeps none.
It lives in the store layer for that reason; `recognise.content_index` re-exports it.

A chunk is found by a *content anchor*: a fixed-length window of its text whose hash meets a rule
(the top bits are zero). The rule looks at the window alone, so a window that is an anchor in the
chunk is an anchor wherever the chunk's text appears. Each chunk is indexed by its first anchor:
`(anchor hash, chunk id, anchor offset, text length, text digest)`. A prompt is recognised by
hashing all its windows at once (vectorised rolling hash), keeping the ones that meet the rule,
checking them against a sorted, memory-mapped array of every indexed anchor hash (one binary search
per anchor, no per-chunk work), reading the rows of the few hashes that hit, and verifying each
candidate by the digest of the prompt text where the chunk would sit.

A chunk whose text holds no anchor (short chunks: a 200-character chunk has none with probability
~0.5%) is indexed by its first window instead, which is probed wherever a prompt line starts.
Chunks shorter than `ANCHOR_CHARS` are indexed by the digest of their whole text: they are found
only where a piece of text handed to `find` is, whitespace-trimmed, exactly such a chunk (a short
last chunk inside a marked document, see `prompt.PromptLayout.from_messages`), never inside a prompt.

Storage: one SQLite file (the rows, the source of truth, safe for several processes) and the sorted
hash array derived from it (`anchors.<generation>.i64`). Rows added after the array was built are
read back per lookup through an indexed range query (`rowid > covered`); once there are more than
`_MAX_PENDING` of them the array is rebuilt, so opening an index costs the same at any corpus size.

The index is derived data (a corpus's collection holds every chunk text), so an index that cannot
be read never fails a request: lookups find nothing, `ContentIndex.problem` says why, and one
warning names the fix. `verify` finds the damage (`ContentIndex.check`) and rebuilds the index from
the collection (`ContentIndex.rebuild`, atomic).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import xxhash

from fusionrag_core.errors import FusionRAGError
from fusionrag_core.store.files import fsync_dir

log = logging.getLogger(__name__)

ANCHOR_CHARS = 32
"""Characters per hashed window."""
ANCHOR_BITS = 5
"""A window is an anchor when the top `ANCHOR_BITS` bits of its hash are zero (one window in 32)."""
_LINE_START = 1
_ANCHOR = 0
_WHOLE = 2
WHOLE_TEXT = _WHOLE
"""The `kind` of a row indexing a chunk shorter than a window by the digest of its whole text."""
Row = tuple[int, str, int, int, int, int]
"""One index row: `(anchor hash, chunk id, anchor offset, text length, text digest, kind)`."""
# NOTE: a fixed bound keeps opening an index constant-time at any size; a rebuild costs one sorted
# read of the hashes, far less than the model passes that produced 16K chunk caches.
_MAX_PENDING = 16384
# NOTE: what an index that cannot be read raises: SQLite's errors (a damaged or locked database, a
# read-only one written to), OSError (a missing or unreadable file) and ValueError (np.memmap of a
# cut array file).
_UNREADABLE = (sqlite3.DatabaseError, OSError, ValueError)
_T = TypeVar("_T")

# NOTE: an odd base is invertible modulo 2^64, so a window's hash is a difference of two prefix
# sums times an inverse power: one vectorised pass for all windows of a prompt.
_BASE = np.uint64(0x9E3779B97F4A7C15)
_BASE_INV = np.uint64(pow(int(_BASE), -1, 1 << 64))
_powers_lock = threading.Lock()
_powers: tuple[np.ndarray, np.ndarray] = (np.ones(1, np.uint64), np.ones(1, np.uint64))


def _power_tables(n: int) -> tuple[np.ndarray, np.ndarray]:
    """`(B^j, B^-j)` for `j < n`, modulo 2^64 (kept and grown, shared by every thread)."""
    global _powers
    pw, inv = _powers
    if pw.shape[0] >= n:
        return pw, inv
    with _powers_lock:
        size = max(n, 2 * _powers[0].shape[0])
        pw = np.full(size, _BASE, np.uint64)
        inv = np.full(size, _BASE_INV, np.uint64)
        pw[0] = inv[0] = 1
        np.cumprod(pw, out=pw)
        np.cumprod(inv, out=inv)
        _powers = (pw, inv)
    return pw, inv


_scratch = threading.local()


def _buffers(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three `[n + 1]` uint64 work arrays of this thread, reused across prompts.

    NOTE: fresh megabyte-sized arrays cost more in page faults than the arithmetic on them.
    """
    bufs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = getattr(_scratch, "bufs", None)
    if bufs is None or bufs[0].shape[0] < n + 1:
        size = max(n + 1, 1 << 16)
        bufs = (np.empty(size, np.uint64), np.empty(size, np.uint64), np.empty(size, np.uint64))
        _scratch.bufs = bufs
    return bufs


def _fmix(x: np.ndarray, tmp: np.ndarray) -> None:
    """MurmurHash3's 64-bit finaliser, in place: spreads every input bit over every output bit."""
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, None):
        np.right_shift(x, np.uint64(33), out=tmp)
        np.bitwise_xor(x, tmp, out=x)
        if multiplier is not None:
            np.multiply(x, np.uint64(multiplier), out=x)


def window_hashes(text: str) -> np.ndarray:
    """`[len(text) - ANCHOR_CHARS + 1]` int64 hashes of every `ANCHOR_CHARS`-character window."""
    return _scratch_hashes(text).copy()


def _scratch_hashes(text: str) -> np.ndarray:
    """`window_hashes`, as a view of this thread's scratch buffer (valid until its next call)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")  # [N]
    n = int(codes.shape[0])
    if n < ANCHOR_CHARS:
        return np.empty(0, np.int64)
    pw, inv = _power_tables(n + 1)
    prefix, work, tmp = _buffers(n)
    w = n - ANCHOR_CHARS + 1
    np.multiply(codes, pw[:n], out=work[:n])
    prefix[0] = 0
    np.cumsum(work[:n], out=prefix[1 : n + 1])  # prefix[j] = sum_{t<j} c[t] B^t  (mod 2^64)
    windows = work[:w]
    np.subtract(prefix[ANCHOR_CHARS : n + 1], prefix[:w], out=windows)
    np.multiply(windows, inv[:w], out=windows)  # = sum_{t<K} c[i+t] B^t for window i
    _fmix(windows, tmp[:w])
    return windows.view(np.int64)


def _is_anchor(hashes: np.ndarray) -> np.ndarray:
    return hashes.view(np.uint64) < np.uint64(1 << (64 - ANCHOR_BITS))


def text_digest(text: str) -> int:
    """The 63-bit digest a candidate match is verified with (fits an SQLite integer)."""
    return xxhash.xxh3_64_intdigest(text.encode()) >> 1


@dataclass(frozen=True)
class Anchor:
    """How one chunk is found: the hash of one of its windows and that window's offset."""

    hash: int
    offset: int
    kind: int  # _ANCHOR (content rule), _LINE_START (first window, probed at line starts), _WHOLE (short)


def chunk_anchor(text: str) -> Anchor | None:
    """The anchor a chunk is indexed by: its first content anchor, else its first window; a chunk
    shorter than a window by the digest of its whole text; None for blank text."""
    if not text.strip():
        return None
    hashes = window_hashes(text)
    if hashes.shape[0] == 0:
        return Anchor(text_digest(text), 0, _WHOLE)
    hits = np.flatnonzero(_is_anchor(hashes))
    if hits.shape[0]:
        return Anchor(int(hashes[hits[0]]), int(hits[0]), _ANCHOR)
    return Anchor(int(hashes[0]), 0, _LINE_START)


def prompt_probes(text: str) -> tuple[np.ndarray, np.ndarray]:
    """`(positions [A], hashes [A])` of the prompt windows worth looking up: anchors and line starts."""
    hashes = _scratch_hashes(text)
    if hashes.shape[0] == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    anchors = np.flatnonzero(_is_anchor(hashes))
    # NOTE: a line starts after every newline; str.find loops in C, and prompts have few lines.
    line_starts, at = [0], text.find("\n")
    while 0 <= at < hashes.shape[0] - 1:
        line_starts.append(at + 1)
        at = text.find("\n", at + 1)
    positions = np.union1d(anchors, np.asarray(line_starts, np.int64))
    return positions, hashes[positions]


@dataclass(frozen=True)
class Match:
    """A stored chunk found verbatim in a prompt at `text[start:end]`."""

    start: int
    end: int
    chunk_id: str


_SCHEMA = """
CREATE TABLE IF NOT EXISTS anchors (
    hash INTEGER NOT NULL, chunk_id TEXT NOT NULL, anchor_offset INTEGER NOT NULL,
    length INTEGER NOT NULL, digest INTEGER NOT NULL, kind INTEGER NOT NULL,
    UNIQUE (chunk_id));
CREATE INDEX IF NOT EXISTS anchors_by_hash ON anchors (hash);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


class ContentIndex:
    """Chunk texts, findable by content in any prompt; one directory, shared by processes.

    The index is derived data: it never makes a request fail. A lookup in an index that cannot be
    read (its database damaged, its hash array missing or cut, its directory unreadable) finds
    nothing, `problem` says why, and one warning names the directory and the fix. A write that
    cannot be made is skipped the same way. `check` finds what is wrong without using the index;
    `rebuild` replaces it whole. A directory this process cannot write is opened read-only: lookups
    work (see `_open_read_only`), writes are skipped with the warning.

    Args:
        root: directory of the index (created if missing).
        fix: how to repair the index, for the warning (default: delete `root` and add the chunks again).

    Example:
        >>> index = ContentIndex(Path("./fusionrag-data/kv/fusionrag/.content"))
        >>> index.add([(chunk_id, text)])
        >>> index.find(rendered_prompt)  # [Match(start, end, chunk_id), ...]
    """

    def __init__(self, root: Path | str, *, fix: str = "") -> None:
        self.root = Path(root).expanduser().resolve()
        self.fix = fix or f"delete {self.root} and add its chunks again"
        self.problem: str | None = None
        """Why the index could not be used at its last use (None: it could)."""
        self._path = self.root / "anchors.sqlite"
        self._lock = threading.Lock()
        # NOTE: one connection, serialised by the lock: a lookup is one short query.
        self._db: sqlite3.Connection | None = None
        self._opened: tuple[int, int] | None = None  # (st_dev, st_ino) of the database file connected to
        self._warned: str | None = None
        self._forget_array()
        with self._lock:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._connection(create=True)
            except _UNREADABLE as e:
                self._unreadable(e)

    @property
    def where(self) -> str:
        """Where the index lives, for messages: its directory."""
        return str(self.root)

    @property
    def read_only(self) -> bool:
        """Whether the index directory cannot be written (the index is then only read)."""
        return not os.access(self.root, os.W_OK)

    # ---- the connection --------------------------------------------------------------------------
    def _connection(self, *, create: bool = False) -> sqlite3.Connection:
        """The database, (re)connected when it was closed or its file was replaced (lock held).

        NOTE: `rebuild` may replace the file from another process; a connection to the old file
        would never see a row again, so the file's identity is checked on every use (one stat).
        """
        if self._db is not None:
            if _identity(self._path) == self._opened:
                return self._db
            self._close()
        if self.read_only:
            db = _open_read_only(self._path)
        else:
            # NOTE: only the first open creates the file: one that vanished later is damage, not a new index.
            mode = "rwc" if create else "rw"
            db = sqlite3.connect(f"{self._path.as_uri()}?mode={mode}", uri=True, check_same_thread=False,
                                 timeout=30.0)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript(_SCHEMA)
            except BaseException:
                db.close()
                raise
        self._db, self._opened = db, _identity(self._path)
        self._forget_array()
        return db

    def _close(self) -> None:
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
        self._db, self._opened = None, None
        self._forget_array()

    def _forget_array(self) -> None:
        self._generation = -1
        self._covered = 0
        self._array = np.empty(0, np.int64)  # [K] sorted anchor hashes up to rowid `_covered`
        self._pending = np.empty(0, np.int64)  # [P] sorted anchor hashes of later rows
        self._pending_upto = 0

    def close(self) -> None:
        """Close the database connection (the next use opens it again)."""
        with self._lock:
            self._close()

    def _using(self, action: Callable[[sqlite3.Connection], _T], otherwise: _T, *, warn: bool = True,
               strict: bool = False) -> _T:
        """`action(database)`, lock held, the array followed first (every use needs the whole index);
        when the index cannot be read or written: `otherwise`, with `problem` set and (if `warn`) one
        warning per problem; or, if `strict`, the error raised (`problem` set, no warning)."""
        with self._lock:
            try:
                db = self._connection()
                self._refresh(db)
                result = action(db)
            except _UNREADABLE as e:
                self._unreadable(e, warn=warn and not strict)
                if strict:
                    raise
                return otherwise
            if self.problem is not None:
                log.info("the content index %s can be used again", self.root)
                self.problem = self._warned = None
            return result

    def _unreadable(self, error: BaseException, *, warn: bool = True) -> None:
        """Record why the index cannot be used, close it (the next use retries), warn once (lock held)."""
        self._close()
        self.problem = f"content index {self.root} cannot be used ({type(error).__name__}: {error})"
        if warn and self._warned != self.problem:
            self._warned = self.problem
            log.warning("%s; chunks are not found by their content in prompts until it is repaired: %s",
                        self.problem, self.fix)

    # ---- writing ---------------------------------------------------------------------------------
    def add(self, entries: Iterable[tuple[str, str]], *, strict: bool = False) -> int:
        """Index `(chunk_id, text)` pairs (a chunk id already indexed is replaced); returns how many
        were blank (not indexed).

        Args:
            entries: the pairs.
            strict: raise what stopped the write (a full disk: `sqlite3.OperationalError`, `OSError`)
                instead of skipping it with the warning: for a caller that must undo what it wrote
                with the rows (a learned cache's blob).
        """
        rows, short = index_rows(entries)
        self.insert_rows(rows, strict=strict)
        return short

    def insert_rows(self, rows: Sequence[tuple[int, str, int, int, int, int]], *, strict: bool = False) -> None:
        """Insert raw rows `(hash, chunk_id, anchor offset, length, digest, kind)` (benchmarks and
        `add`, whose `strict` this is)."""
        if not rows:
            return

        def insert(db: sqlite3.Connection) -> None:
            with db:
                db.executemany("INSERT OR REPLACE INTO anchors VALUES (?, ?, ?, ?, ?, ?)", rows)
            self._maybe_rebuild(db)

        self._using(insert, None, strict=strict)

    def remove(self, chunk_ids: Iterable[str]) -> None:
        """Forget chunks (their hashes may stay in the array until its next rebuild: a harmless miss)."""
        gone = [(c,) for c in chunk_ids]

        def delete(db: sqlite3.Connection) -> None:
            with db:
                db.executemany("DELETE FROM anchors WHERE chunk_id = ?", gone)

        self._using(delete, None)

    def __len__(self) -> int:
        """Chunks indexed (0 when the index cannot be read)."""
        return self._using(lambda db: int(db.execute("SELECT count(*) FROM anchors").fetchone()[0]), 0)

    def chunk_ids(self) -> set[str]:
        """The ids of every indexed chunk (empty when the index cannot be read: see `problem`)."""
        return self._using(lambda db: {c for (c,) in db.execute("SELECT chunk_id FROM anchors")}, set())

    def _maybe_rebuild(self, db: sqlite3.Connection) -> None:
        self._refresh(db)
        if self._pending.shape[0] > _MAX_PENDING:
            self._rebuild(db)

    def _rebuild(self, db: sqlite3.Connection) -> None:
        """Write the sorted array of every anchor hash, then publish it (readers switch on their next lookup)."""
        previous = self._generation
        with db:
            self._publish(db, previous + 1)
        with contextlib.suppress(OSError):
            (self.root / f"anchors.{previous}.i64").unlink()
        self._refresh(db)

    def _publish(self, db: sqlite3.Connection, generation: int) -> None:
        """Write `anchors.<generation>.i64`, the sorted hashes of every row, and point the meta table
        at it (inside the caller's transaction: the array is complete before any reader is sent to it)."""
        upto = int(db.execute("SELECT coalesce(max(rowid), 0) FROM anchors").fetchone()[0])
        hashes = np.fromiter((h for (h,) in db.execute(
            "SELECT hash FROM anchors WHERE rowid <= ? ORDER BY hash", (upto,))), np.int64)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".anchors.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(hashes.tobytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.root / f"anchors.{generation}.i64")
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        db.execute("INSERT OR REPLACE INTO meta VALUES ('generation', ?)", (generation,))
        db.execute("INSERT OR REPLACE INTO meta VALUES ('covered', ?)", (upto,))

    # ---- checking and rebuilding -----------------------------------------------------------------
    def check(self) -> str | None:
        """Why the index cannot be trusted as it stands, or None: its database cannot be opened or
        fails SQLite's quick check, or its hash array is missing, cut, unsorted or lacks a row it
        covers. Reads everything once (for `verify`); logs nothing."""

        def inspect(db: sqlite3.Connection) -> str:
            status = str(db.execute("PRAGMA quick_check").fetchone()[0])
            if status != "ok":
                return f"content index {self.root} is damaged ({status})"
            array = np.asarray(self._array)
            if array.shape[0] > 1 and bool(np.any(array[1:] < array[:-1])):
                return f"content index {self.root}: anchors.{self._generation}.i64 is not sorted"
            covered = np.fromiter((h for (h,) in db.execute(
                "SELECT hash FROM anchors WHERE rowid <= ?", (self._covered,))), np.int64)
            lacking = int(np.count_nonzero(~member(covered, array)))
            if lacking:
                return f"content index {self.root}: anchors.{self._generation}.i64 lacks {lacking} indexed chunk(s)"
            return ""

        found = self._using(inspect, None, warn=False)
        return self.problem if found is None else found or None

    def rebuild(self, entries: Iterable[tuple[str, str]]) -> int:
        """Replace every row by `entries` (`(chunk_id, text)` pairs); returns how many were indexed.

        Atomic: readers see the old index until the new one is whole, and a rebuild killed midway
        leaves the old one (which `check` still reports). A readable database is rewritten in one
        transaction; one that cannot be read is replaced by a database built beside it and renamed
        over it.

        Raises:
            FusionRAGError: the new index cannot be written (read-only directory, full disk); the
                old one is left as it was.
        """
        rows, _ = index_rows(entries)
        with self._lock:
            try:
                try:
                    db = self._connection()
                    readable = db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
                except _UNREADABLE:
                    readable = False
                if readable:
                    self._rewrite(db, rows)
                else:
                    self._replace(rows)
            except _UNREADABLE as e:
                self._close()
                raise FusionRAGError(
                    f"cannot rebuild the content index {self.root} ({type(e).__name__}: {e}); the index is left "
                    "as it was: make its directory writable (and give it room), then run the rebuild again"
                ) from e
            self.problem = self._warned = None
        return len(rows)

    def _rewrite(self, db: sqlite3.Connection, rows: Sequence[tuple[int, str, int, int, int, int]]) -> None:
        """Every row replaced in one transaction, with a new array published by it (lock held)."""
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        generation = max(int(meta.get("generation", -1)), _newest_array(self.root)) + 1
        with db:
            db.execute("DELETE FROM anchors")
            db.executemany("INSERT OR REPLACE INTO anchors VALUES (?, ?, ?, ?, ?, ?)", rows)
            self._publish(db, generation)
        self._drop_arrays(but=generation)
        self._forget_array()
        self._refresh(db)

    def _replace(self, rows: Sequence[tuple[int, str, int, int, int, int]]) -> None:
        """A new database (rows and array) built beside the unreadable one, then renamed over it (lock held)."""
        self._close()
        generation = _newest_array(self.root) + 1
        fd, staging = tempfile.mkstemp(dir=self.root, prefix=".anchors.", suffix=".sqlite.tmp")
        os.close(fd)
        try:
            db = sqlite3.connect(staging)
            try:
                db.executescript(_SCHEMA)
                with db:
                    db.executemany("INSERT OR REPLACE INTO anchors VALUES (?, ?, ?, ?, ?, ?)", rows)
                    self._publish(db, generation)
            finally:
                db.close()
            with open(staging, "rb+") as f:
                os.fsync(f.fileno())
            # NOTE: the old database's WAL must not be applied to the new file: it goes first. A
            # rebuild killed between the two leaves the old (unreadable) database, still reported.
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{self._path}{suffix}")
            os.replace(staging, self._path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
            raise
        fsync_dir(self.root)
        self._drop_arrays(but=generation)
        self._refresh(self._connection())

    def _drop_arrays(self, *, but: int) -> None:
        """Delete the hash arrays of other generations (readers that mapped one keep their mapping)."""
        for path in self.root.glob("anchors.*.i64"):
            if path.name != f"anchors.{but}.i64":
                with contextlib.suppress(OSError):
                    path.unlink()

    # ---- reading ---------------------------------------------------------------------------------
    def _refresh(self, db: sqlite3.Connection) -> None:
        """Follow the published array and read rows added after it (lock held)."""
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        generation, covered = int(meta.get("generation", -1)), int(meta.get("covered", 0))
        if generation != self._generation:
            path = self.root / f"anchors.{generation}.i64"
            array = np.empty(0, np.int64)
            if generation >= 0 and path.stat().st_size:
                array = np.memmap(path, dtype=np.int64, mode="r")
            self._generation, self._covered, self._array = generation, covered, array
            self._pending, self._pending_upto = np.empty(0, np.int64), covered
        newest = int(db.execute("SELECT coalesce(max(rowid), 0) FROM anchors").fetchone()[0])
        if newest > self._pending_upto:
            later = np.fromiter((h for (h,) in db.execute(
                "SELECT hash FROM anchors WHERE rowid > ? AND rowid <= ?", (self._pending_upto, newest))), np.int64)
            self._pending = np.union1d(self._pending, later)
            self._pending_upto = newest

    def find(self, text: str) -> list[Match]:
        """Every indexed chunk whose text occurs verbatim in `text`, non-overlapping, in text order.

        Where two found chunks overlap, the one starting first (then the longer) is kept. A `text`
        shorter than `ANCHOR_CHARS` once whitespace-trimmed is found only as a whole stored chunk.
        Nothing is found while the index cannot be read (`problem` says why).
        """
        if 0 < len(text.strip()) < ANCHOR_CHARS:
            return self._find_whole(text)
        positions, hashes = prompt_probes(text)
        if hashes.shape[0] == 0:
            return []

        def lookup(db: sqlite3.Connection) -> tuple[np.ndarray, list[tuple[int, str, int, int, int, int]]]:
            known = member(hashes, self._array) | member(hashes, self._pending)
            hit_hashes = np.unique(hashes[known])
            rows = []
            for i in range(0, hit_hashes.shape[0], 500):
                part = [int(h) for h in hit_hashes[i : i + 500]]
                rows += db.execute(
                    "SELECT hash, chunk_id, anchor_offset, length, digest, kind FROM anchors WHERE hash IN "
                    f"({','.join('?' * len(part))})", part).fetchall()
            return known, rows

        found = self._using(lookup, None)
        if found is None:
            return []
        known, rows = found
        return verified_matches(text, positions[known], hashes[known], rows)

    def _find_whole(self, text: str) -> list[Match]:
        """`text`, whitespace-trimmed, as one short stored chunk (or nothing)."""
        stripped = text.strip()
        digest = text_digest(stripped)
        row = self._using(lambda db: db.execute(
            "SELECT chunk_id FROM anchors WHERE hash = ? AND kind = ? AND length = ? AND digest = ? LIMIT 1",
            (digest, _WHOLE, len(stripped), digest)).fetchone(), None)
        if row is None:
            return []
        start = text.index(stripped)
        return [Match(start, start + len(stripped), row[0])]


def index_rows(entries: Iterable[tuple[str, str]]) -> tuple[list[Row], int]:
    """The index rows `(hash, chunk_id, anchor offset, length, digest, kind)` of `(chunk_id, text)`
    pairs, and how many texts were blank (no row): what every store's content index keeps."""
    rows, blank = [], 0
    for chunk_id, text in entries:
        anchor = chunk_anchor(text)
        if anchor is None:
            blank += 1
            continue
        rows.append((anchor.hash, chunk_id, anchor.offset, len(text), text_digest(text), anchor.kind))
    return rows, blank


def _open_read_only(path: Path) -> sqlite3.Connection:
    """The database `path` in a directory this process cannot write.

    NOTE: SQLite reads a WAL database read-only only when its -wal and -shm files exist (a writer
    left them); otherwise it would have to create them, so the file is read as immutable: as it
    stands, without locks (rows written later through another, writable mount are not seen).
    """
    db = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, check_same_thread=False, timeout=30.0)
    try:
        db.execute("SELECT count(*) FROM meta").fetchone()
        return db
    except sqlite3.OperationalError:
        db.close()
    return sqlite3.connect(f"{path.as_uri()}?mode=ro&immutable=1", uri=True, check_same_thread=False)


def _identity(path: Path) -> tuple[int, int]:
    """Which file `path` names now: `(st_dev, st_ino)` (OSError when none)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _newest_array(root: Path) -> int:
    """The highest generation of a hash array file in `root` (-1: none)."""
    generations = [int(m.group(1)) for p in root.glob("anchors.*.i64")
                   if (m := re.fullmatch(r"anchors\.(\d+)\.i64", p.name))]
    return max(generations, default=-1)


def member(values: np.ndarray, sorted_array: np.ndarray) -> np.ndarray:
    """`[A]` bool: which of `values` occur in `sorted_array` (binary search, no copy of the array)."""
    if sorted_array.shape[0] == 0:
        return np.zeros(values.shape[0], bool)
    idx = np.minimum(np.searchsorted(sorted_array, values), sorted_array.shape[0] - 1)
    return np.asarray(sorted_array[idx] == values)


def verified_matches(text: str, positions: np.ndarray, hashes: np.ndarray, rows: Sequence[Row]) -> list[Match]:
    """Candidates whose text at the implied place has the stored digest, overlaps resolved."""
    by_hash: dict[int, list[tuple[int, str, int, int, int, int]]] = {}
    for row in rows:
        by_hash.setdefault(row[0], []).append(row)
    found: set[tuple[int, int, str]] = set()
    for pos, h in zip(positions.tolist(), hashes.tolist(), strict=True):
        for _, chunk_id, offset, length, digest, kind in by_hash.get(h, ()):
            start = pos - offset
            if kind == _WHOLE or (kind == _LINE_START and pos > 0 and text[pos - 1] != "\n"):
                continue
            if start >= 0 and start + length <= len(text) and text_digest(text[start : start + length]) == digest:
                found.add((start, start + length, chunk_id))
    matches: list[Match] = []
    for start, end, chunk_id in sorted(found, key=lambda m: (m[0], -m[1], m[2])):
        if not matches or start >= matches[-1].end:
            matches.append(Match(start, end, chunk_id))
    return matches


REBUILD_HINT = "`fusionrag verify` (FusionIndex.verify()) rebuilds it from the collection"
"""How a corpus's content index is repaired (named by its warnings)."""

__all__ = ["ANCHOR_BITS", "ANCHOR_CHARS", "REBUILD_HINT", "WHOLE_TEXT", "Anchor", "ContentIndex", "Match", "Row",
           "chunk_anchor", "index_rows", "member", "prompt_probes", "text_digest", "verified_matches", "window_hashes"]
