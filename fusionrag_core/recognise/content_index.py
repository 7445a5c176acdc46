"""Recognise stored chunks by content inside a flattened prompt, without scanning the corpus.

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
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from fusionrag_core.store.base import KVStore
from fusionrag_core.store.disk import DiskKVStore

ANCHOR_CHARS = 32
"""Characters per hashed window."""
ANCHOR_BITS = 5
"""A window is an anchor when the top `ANCHOR_BITS` bits of its hash are zero (one window in 32)."""
_LINE_START = 1
_ANCHOR = 0
_WHOLE = 2
# NOTE: a fixed bound keeps opening an index constant-time at any size; a rebuild costs one sorted
# read of the hashes, far less than the model passes that produced 16K chunk caches.
_MAX_PENDING = 16384

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

    Args:
        root: directory of the index (created if missing).

    Example:
        >>> index = ContentIndex(Path("./fusionrag-data/kv/fusionrag/.content"))
        >>> index.add([(chunk_id, text)])
        >>> index.find(rendered_prompt)  # [Match(start, end, chunk_id), ...]
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # NOTE: one connection, serialised by the lock: a lookup is one short query.
        self._db = sqlite3.connect(self.root / "anchors.sqlite", check_same_thread=False, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._generation = -1
        self._covered = 0
        self._array = np.empty(0, np.int64)  # [K] sorted anchor hashes up to rowid `_covered`
        self._pending = np.empty(0, np.int64)  # [P] sorted anchor hashes of later rows
        self._pending_upto = 0

    # ---- writing ---------------------------------------------------------------------------------
    def add(self, entries: Iterable[tuple[str, str]]) -> int:
        """Index `(chunk_id, text)` pairs (a chunk id already indexed is replaced); returns how many
        were blank (not indexed)."""
        rows, short = [], 0
        for chunk_id, text in entries:
            anchor = chunk_anchor(text)
            if anchor is None:
                short += 1
                continue
            rows.append((anchor.hash, chunk_id, anchor.offset, len(text), text_digest(text), anchor.kind))
        self.insert_rows(rows)
        return short

    def insert_rows(self, rows: Sequence[tuple[int, str, int, int, int, int]]) -> None:
        """Insert raw rows `(hash, chunk_id, anchor offset, length, digest, kind)` (benchmarks and `add`)."""
        if not rows:
            return
        with self._lock, self._db:
            self._db.executemany("INSERT OR REPLACE INTO anchors VALUES (?, ?, ?, ?, ?, ?)", rows)
        self._maybe_rebuild()

    def remove(self, chunk_ids: Iterable[str]) -> None:
        """Forget chunks (their hashes may stay in the array until its next rebuild: a harmless miss)."""
        with self._lock, self._db:
            self._db.executemany("DELETE FROM anchors WHERE chunk_id = ?", [(c,) for c in chunk_ids])

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM anchors").fetchone()[0])

    def _maybe_rebuild(self) -> None:
        with self._lock:
            self._refresh()
            if self._pending.shape[0] > _MAX_PENDING:
                self._rebuild()

    def _rebuild(self) -> None:
        """Write the sorted array of every anchor hash, then publish it (readers switch on their next lookup)."""
        upto = int(self._db.execute("SELECT coalesce(max(rowid), 0) FROM anchors").fetchone()[0])
        hashes = np.fromiter((h for (h,) in self._db.execute(
            "SELECT hash FROM anchors WHERE rowid <= ? ORDER BY hash", (upto,))), np.int64)
        generation = self._generation + 1
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".anchors.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(hashes.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / f"anchors.{generation}.i64")
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('generation', ?)", (generation,))
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('covered', ?)", (upto,))
        with contextlib.suppress(OSError):
            (self.root / f"anchors.{self._generation}.i64").unlink()
        self._refresh()

    # ---- reading ---------------------------------------------------------------------------------
    def _refresh(self) -> None:
        """Follow the published array and read rows added after it (lock held)."""
        meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        generation, covered = int(meta.get("generation", -1)), int(meta.get("covered", 0))
        if generation != self._generation:
            path = self.root / f"anchors.{generation}.i64"
            array = np.empty(0, np.int64)
            if generation >= 0 and path.stat().st_size:
                array = np.memmap(path, dtype=np.int64, mode="r")
            self._generation, self._covered, self._array = generation, covered, array
            self._pending, self._pending_upto = np.empty(0, np.int64), covered
        newest = int(self._db.execute("SELECT coalesce(max(rowid), 0) FROM anchors").fetchone()[0])
        if newest > self._pending_upto:
            later = np.fromiter((h for (h,) in self._db.execute(
                "SELECT hash FROM anchors WHERE rowid > ? AND rowid <= ?", (self._pending_upto, newest))), np.int64)
            self._pending = np.union1d(self._pending, later)
            self._pending_upto = newest

    def find(self, text: str) -> list[Match]:
        """Every indexed chunk whose text occurs verbatim in `text`, non-overlapping, in text order.

        Where two found chunks overlap, the one starting first (then the longer) is kept. A `text`
        shorter than `ANCHOR_CHARS` once whitespace-trimmed is found only as a whole stored chunk.
        """
        if 0 < len(text.strip()) < ANCHOR_CHARS:
            return self._find_whole(text)
        positions, hashes = prompt_probes(text)
        if hashes.shape[0] == 0:
            return []
        with self._lock:
            self._refresh()
            known = _member(hashes, self._array) | _member(hashes, self._pending)
            hit_hashes = np.unique(hashes[known])
            rows = []
            for i in range(0, hit_hashes.shape[0], 500):
                part = [int(h) for h in hit_hashes[i : i + 500]]
                rows += self._db.execute(
                    "SELECT hash, chunk_id, anchor_offset, length, digest, kind FROM anchors WHERE hash IN "
                    f"({','.join('?' * len(part))})", part).fetchall()
        return _verified(text, positions[known], hashes[known], rows)


    def _find_whole(self, text: str) -> list[Match]:
        """`text`, whitespace-trimmed, as one short stored chunk (or nothing)."""
        stripped = text.strip()
        digest = text_digest(stripped)
        with self._lock:
            row = self._db.execute(
                "SELECT chunk_id FROM anchors WHERE hash = ? AND kind = ? AND length = ? AND digest = ? LIMIT 1",
                (digest, _WHOLE, len(stripped), digest)).fetchone()
        if row is None:
            return []
        start = text.index(stripped)
        return [Match(start, start + len(stripped), row[0])]


def _member(values: np.ndarray, sorted_array: np.ndarray) -> np.ndarray:
    """`[A]` bool: which of `values` occur in `sorted_array` (binary search, no copy of the array)."""
    if sorted_array.shape[0] == 0:
        return np.zeros(values.shape[0], bool)
    idx = np.minimum(np.searchsorted(sorted_array, values), sorted_array.shape[0] - 1)
    return np.asarray(sorted_array[idx] == values)


def _verified(text: str, positions: np.ndarray, hashes: np.ndarray,
              rows: Sequence[tuple[int, str, int, int, int, int]]) -> list[Match]:
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


_indexes: dict[Path, ContentIndex] = {}
_indexes_lock = threading.Lock()


def content_index_for(store: KVStore) -> ContentIndex | None:
    """The content index kept next to a store's caches (`<root>/.content` of a DiskKVStore).

    One instance per directory and process. Redis stores keep none yet: their chunks are found
    through marks (or learned caches) only.
    """
    store = store.backend if isinstance(store, KVStore) else store
    if not isinstance(store, DiskKVStore):
        return None
    root = store.root / ".content"
    with _indexes_lock:
        if root not in _indexes:
            _indexes[root] = ContentIndex(root)
        return _indexes[root]


def index_content(store: KVStore, entries: Iterable[tuple[str, str]]) -> None:
    """Record `(chunk_id, text)` pairs stored in `store` so prompts holding the texts find them."""
    index = content_index_for(store)
    if index is not None:
        index.add(entries)


__all__ = ["ANCHOR_BITS", "ANCHOR_CHARS", "Anchor", "ContentIndex", "Match", "chunk_anchor", "content_index_for",
           "index_content", "prompt_probes", "text_digest", "window_hashes"]
