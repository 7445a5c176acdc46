"""`RedisContentIndex`: a Redis store's content index, in Redis beside its caches, mirrored per process.

Keys (with `ns` the store's namespace):

* `ns:content:rows` → hash: chunk id → its index row (`content_index.index_rows`: anchor hash,
  anchor offset, text length, text digest, kind), the source of truth;
* `ns:content:log` → stream of changes: `add` (rows), `remove` (ids) or `reset` (every row was
  replaced), written in the same MULTI/EXEC as the rows they change. It is never trimmed: a
  rebuild replaces it by one `reset` entry, and `check` asks for a rebuild once it holds more than
  `LOG_ENTRIES` entries (one per `add` or `remove` call, so one per ingest or delete).

Every process keeps a mirror of the rows in memory (a dict by anchor hash and its sorted array,
the disk index's vectorised lookup). Each use first follows the log from the last entry it applied,
in one round trip: a process started before an ingest sees its chunks at its next lookup, without a
restart. A process that saw a `reset`, or finds the log gone (a flushed database), reloads the rows
whole.

The index is derived data (the collection holds every chunk text), as the disk one is: a server
that cannot be reached never fails a request; lookups find nothing, `problem` says why, one warning
names the fix, and the next use tries again.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import redis

from fusionrag_core.errors import FusionRAGError
from fusionrag_core.store.content_index import (
    ANCHOR_CHARS,
    REBUILD_HINT,
    WHOLE_TEXT,
    Match,
    Row,
    index_rows,
    member,
    prompt_probes,
    text_digest,
    verified_matches,
)

log = logging.getLogger(__name__)

LOG_ENTRIES = 10_000
"""Changes the log may hold (one per `add` or `remove` call, not per chunk) before `check` asks
`verify` to rebuild the index, which compacts it to one entry."""
_START = "0-0"  # NOTE: the stream id before any entry
_T = TypeVar("_T")
# NOTE: what an index that cannot be used raises: the server's errors (unreachable, out of memory,
# a wrong type at a key) and rows or log entries that do not parse.
_UNUSABLE = (redis.exceptions.RedisError, ValueError, TypeError, KeyError)


def _encode(row: Row) -> bytes:
    h, _, offset, length, digest, kind = row
    return f"{h} {offset} {length} {digest} {kind}".encode()


def _decode(chunk_id: str, value: bytes | str) -> Row:
    text = value.decode() if isinstance(value, bytes) else value
    h, offset, length, digest, kind = (int(x) for x in text.split())
    return h, chunk_id, offset, length, digest, kind


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class _Mirror:
    """This process's copy of the rows, and how far into the log it is (not thread-safe: the index's lock)."""

    def __init__(self) -> None:
        self.last: str | None = None  # NOTE: the last log entry applied; None: never loaded
        self.by_id: dict[str, Row] = {}
        self.by_hash: dict[int, list[Row]] = {}
        self._sorted: np.ndarray | None = np.empty(0, np.int64)  # [K] sorted anchor hashes; None: stale

    def load(self, rows: Iterable[Row], last: str) -> None:
        self.by_id, self.by_hash, self._sorted, self.last = {}, {}, None, last
        for row in rows:
            self.put(row)

    def put(self, row: Row) -> None:
        self.drop(row[1])
        self.by_id[row[1]] = row
        self.by_hash.setdefault(row[0], []).append(row)
        self._sorted = None

    def drop(self, chunk_id: str) -> None:
        old = self.by_id.pop(chunk_id, None)
        if old is None:
            return
        left = [r for r in self.by_hash[old[0]] if r[1] != chunk_id]
        if left:
            self.by_hash[old[0]] = left
        else:
            del self.by_hash[old[0]]
        self._sorted = None

    def hashes(self) -> np.ndarray:
        """`[K]` sorted anchor hashes of every row (rebuilt after a change)."""
        if self._sorted is None:
            self._sorted = np.sort(np.fromiter(self.by_hash.keys(), np.int64, len(self.by_hash)))
        return self._sorted


class RedisContentIndex:
    """The content index of a `RedisKVStore`: rows in Redis, a followed mirror in this process.

    Thread-safe (one lock per object); several processes share the rows through Redis.

    Args:
        client: the store's Redis client.
        namespace: the store's namespace (the keys are `<namespace>:content:*`).
        where: the server, for messages (its URL without a password).
        fix: how to repair the index, for the warning.
    """

    def __init__(self, client: redis.Redis, namespace: str, where: str, *, fix: str = REBUILD_HINT) -> None:
        self._client = client
        self._rows_key = f"{namespace}:content:rows"
        self._log_key = f"{namespace}:content:log"
        self.fix = fix
        self.problem: str | None = None
        self._where = f"Redis key {self._rows_key} at {where}"
        self._warned: str | None = None
        self._mirror = _Mirror()
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        """The Redis key of the rows and the server."""
        return self._where

    # ---- following the log -----------------------------------------------------------------------
    def _using(self, action: Callable[[], _T], otherwise: _T, *, follow: bool = True, warn: bool = True,
               strict: bool = False) -> _T:
        """`action()`, lock held, the mirror followed first (if `follow`); when Redis cannot be used:
        `otherwise`, with `problem` set and (if `warn`) one warning per problem; or, if `strict`,
        the error raised as a FusionRAGError (`problem` set, no warning)."""
        with self._lock:
            try:
                if follow:
                    self._follow()
                result = action()
            except _UNUSABLE as e:
                self.problem = f"content index {self._where} cannot be used ({type(e).__name__}: {e})"
                if strict:
                    raise FusionRAGError(self.problem) from e
                if warn and self._warned != self.problem:
                    self._warned = self.problem
                    log.warning("%s; chunks are not found by their content in prompts until it can: check the "
                                "server, or %s", self.problem, self.fix)
                return otherwise
            if self.problem is not None:
                log.info("the content index %s can be used again", self._where)
                self.problem = self._warned = None
            return result

    def _follow(self) -> None:
        """Apply the log's entries after the last one applied, in one round trip; reload the rows
        whole when entries were trimmed away unseen, the log was reset, or nothing was loaded yet."""
        mirror = self._mirror
        if mirror.last is not None:
            # NOTE: reads only, so no MULTI (a server at its maxmemory refuses transactions). The log
            # only grows, or is replaced whole by a rebuild (whose `reset` entry comes after every
            # earlier one); a log that is gone was flushed, with changes this mirror never saw.
            pipe = self._client.pipeline(transaction=False)
            pipe.xrange(self._log_key, min=f"({mirror.last}")
            pipe.exists(self._log_key)
            entries, exists = pipe.execute()
            lost = not exists and mirror.last != _START
            if not lost and self._apply(entries):
                return
        self._reload()

    def _apply(self, entries: Sequence[tuple[Any, Mapping[Any, Any]]]) -> bool:
        """Apply log entries to the mirror; False at a `reset` (the rows must be reloaded)."""
        for entry_id, fields in entries:
            change = {_text(k): _text(v) for k, v in fields.items()}
            if "reset" in change:
                return False
            if "add" in change:
                for chunk_id, value in json.loads(change["add"]).items():
                    self._mirror.put(_decode(chunk_id, value))
            if "remove" in change:
                for chunk_id in json.loads(change["remove"]):
                    self._mirror.drop(chunk_id)
            self._mirror.last = _text(entry_id)
        return True

    def _reload(self) -> None:
        """The rows whole, and the log's last entry read before them (entries after it are applied again
        at the next use: adding or removing a row twice changes nothing)."""
        pipe = self._client.pipeline(transaction=False)
        pipe.xrevrange(self._log_key, count=1)
        pipe.hgetall(self._rows_key)
        newest, rows = pipe.execute()
        last = _text(newest[0][0]) if newest else _START
        self._mirror.load((_decode(_text(k), v) for k, v in rows.items()), last)

    # ---- writing ---------------------------------------------------------------------------------
    def add(self, entries: Iterable[tuple[str, str]], *, strict: bool = False) -> int:
        """Index `(chunk_id, text)` pairs (a chunk id already indexed is replaced); returns how many
        were blank (not indexed). `strict`: raise a FusionRAGError when Redis refuses the write."""
        rows, blank = index_rows(entries)
        self.insert_rows(rows, strict=strict)
        return blank

    def insert_rows(self, rows: Sequence[Row], *, strict: bool = False) -> None:
        """Insert raw rows `(hash, chunk_id, anchor offset, length, digest, kind)`, with their log
        entry, in one MULTI/EXEC (benchmarks and `add`, whose `strict` this is)."""
        if not rows:
            return
        encoded = {row[1]: _encode(row).decode() for row in rows}

        def write() -> None:
            pipe = self._client.pipeline(transaction=True)
            pipe.hset(self._rows_key, mapping=encoded)  # type: ignore[arg-type]
            pipe.xadd(self._log_key, {"add": json.dumps(encoded)})
            pipe.execute()

        self._using(write, None, follow=False, strict=strict)

    def remove(self, chunk_ids: Iterable[str]) -> None:
        """Forget chunks (every process's mirror drops them at its next use)."""
        gone = list(chunk_ids)
        if not gone:
            return

        def delete() -> None:
            pipe = self._client.pipeline(transaction=True)
            pipe.hdel(self._rows_key, *gone)
            pipe.xadd(self._log_key, {"remove": json.dumps(gone)})
            pipe.execute()

        self._using(delete, None, follow=False)

    def rebuild(self, entries: Iterable[tuple[str, str]]) -> int:
        """Replace every row by `entries`, in one MULTI/EXEC (readers see the old rows or the new),
        and tell every mirror to reload; returns how many were indexed.

        Raises:
            FusionRAGError: Redis refused the write; the old rows are left as they were.
        """
        rows, _ = index_rows(entries)
        encoded = {row[1]: _encode(row) for row in rows}

        def replace() -> None:
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self._rows_key)
            if encoded:
                pipe.hset(self._rows_key, mapping=encoded)  # type: ignore[arg-type]
            # NOTE: compacted by trimming, not deleting: a trimmed stream keeps its last id, so the
            # `reset` gets an id above every earlier entry's and every mirror reads it. A deleted and
            # re-created log may hand it an id no later than one a mirror already applied (the same
            # millisecond), and that mirror would never reload.
            pipe.xtrim(self._log_key, maxlen=0, approximate=False)
            pipe.xadd(self._log_key, {"reset": "1"})
            pipe.execute()

        self._using(replace, None, follow=False, strict=True)
        return len(rows)

    # ---- reading ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._using(lambda: int(self._client.hlen(self._rows_key)), 0, follow=False)

    def chunk_ids(self) -> set[str]:
        """The ids of every indexed chunk, read from Redis (empty when it cannot be read: see `problem`)."""
        return self._using(lambda: {_text(k) for k in self._client.hkeys(self._rows_key)}, set(), follow=False)

    def check(self) -> str | None:
        """Why the index cannot be trusted, or None: Redis cannot be read, a row does not parse, or
        rows exist without the log the processes follow them by. Logs nothing."""

        def inspect() -> str:
            bad = []
            for key, value in self._client.hscan_iter(self._rows_key, count=1000):
                try:
                    _decode(_text(key), value)
                except ValueError:
                    bad.append(_text(key))
            if bad:
                return f"content index {self._where}: {len(bad)} row(s) do not parse (e.g. chunk {bad[0]})"
            if self._client.exists(self._rows_key) and not self._client.exists(self._log_key):
                return f"content index {self._where}: its change log {self._log_key} is missing"
            entries = int(self._client.xlen(self._log_key))
            if entries > LOG_ENTRIES:
                return (f"content index {self._where}: its change log holds {entries} entries (more than "
                        f"{LOG_ENTRIES}); a rebuild compacts it")
            return ""

        found = self._using(inspect, None, follow=False, warn=False)
        return self.problem if found is None else found or None

    def find(self, text: str) -> list[Match]:
        """Every indexed chunk whose text occurs verbatim in `text`, non-overlapping, in text order
        (as `ContentIndex.find`); the mirror is brought up to date first (one round trip)."""
        if 0 < len(text.strip()) < ANCHOR_CHARS:
            return self._find_whole(text)
        positions, hashes = prompt_probes(text)
        if hashes.shape[0] == 0:
            return []

        def lookup() -> tuple[np.ndarray, list[Row]]:
            known = member(hashes, self._mirror.hashes())
            rows = [row for h in np.unique(hashes[known]).tolist() for row in self._mirror.by_hash[h]]
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

        def lookup() -> str | None:
            return next((row[1] for row in self._mirror.by_hash.get(digest, ())
                         if row[5] == WHOLE_TEXT and row[3] == len(stripped) and row[4] == digest), None)

        chunk_id = self._using(lookup, None)
        if chunk_id is None:
            return []
        start = text.index(stripped)
        return [Match(start, start + len(stripped), chunk_id)]

    def close(self) -> None:
        """Forget the mirror (the next use reloads it); the connection is the store's."""
        with self._lock:
            self._mirror = _Mirror()


__all__ = ["LOG_ENTRIES", "RedisContentIndex"]
