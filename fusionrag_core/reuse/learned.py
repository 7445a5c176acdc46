"""Caches learned from traffic: a retrieved document's K/V, computed in a real prompt, kept as its cache.

When a request prefills the text of a document that was retrieved for it (the integrations see the
retriever's results through LangChain callbacks and LlamaIndex instrumentation), the recompute pass
has just computed that document's K/V after the documents placed before it: a fused cache whose
neighbours are the real co-retrieved ones. `LearnedCaches.learn` keeps that slice, at no extra
model pass, keyed by content (`chunking.chunk_id` of the text), and indexes the text so the next
prompt holding it finds the cache by content (`recognise.ContentIndex`).

Learned caches live in their own directory (a disk KV store, a content index and an LRU table),
bounded in bytes: the least recently used are evicted first. `reuse.ReuseSources` is what a
request reads: the caches of an index (ingested) first, then the learned ones.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.ingest.chunking import ChunkingConfig, chunk_id
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.stitch import Stitched
from fusionrag_core.recognise.content_index import ContentIndex
from fusionrag_core.runtime.kv import ChunkKV
from fusionrag_core.store.codec import StorageDType
from fusionrag_core.store.disk import DiskKVStore

DEFAULT_MAX_BYTES = 2 << 30
"""Default bound of a learned-cache directory: 2 GiB (~2,000 SmolLM2 chunks of 256 tokens in fp16)."""
# NOTE: learned ids use the default chunking settings, so a text learned here gets the id that
# FusionKVTransform gives it (ingested and learned caches of one text share a key).
_CHUNKING = ChunkingConfig()


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


class LearnedCaches:
    """A bounded, LRU directory of caches learned from requests of one model.

    Args:
        root: the directory (created if missing); one per model (see `paths.learned_dir`).
        fingerprint: the model's fingerprint; caches of other models are never stored here.
        config: bound and dtype.
    """

    def __init__(self, root: Path | str, fingerprint: str, config: LearnConfig | None = None) -> None:
        self.root = Path(root).expanduser().resolve()
        self.fingerprint = fingerprint
        self.config = config or LearnConfig()
        self.store = DiskKVStore(self.root / "kv", storage_dtype=self.config.storage_dtype)
        self.index = ContentIndex(self.root / "content")
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.root / "lru.sqlite", check_same_thread=False, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def learn(self, prompt: FusionPrompt, st: Stitched) -> None:
        """Keep the computed K/V of every learnable chunk of `prompt` that had no cache.

        NOTE: call after the recompute pass (as `FusionEngine.stream(learn=...)` does): only then
        do the chunk's slots hold its K/V. The slices are copies, so the request's buffer is free.
        """
        seen = [s.chunk_id for s in prompt.segments if s.chunk_id]
        for i, slots in st.missed:
            seg = prompt.segments[i]
            if not seg.learn or not seg.text or seg.chunk_id is None:
                continue
            keys, values = st.buf.slice(slots)  # [L, H, T, D] each
            kv = ChunkKV(seg.token_ids.cpu(), keys, values, st.buf.positions[slots].clone(), self.fingerprint,
                         "fused")
            before = [c for c in seen[:seen.index(seg.chunk_id)] if c != seg.chunk_id]
            self._put(seg.chunk_id, seg.text, kv, before)

    def _put(self, chunk_id: str, text: str, kv: ChunkKV, neighbours: Sequence[str]) -> None:
        self.store.put(chunk_id, kv)
        self.index.add([(chunk_id, text)])
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO learned VALUES (?, ?, ?, ?)",
                             (chunk_id, kv.nbytes // _shrink(kv, self.config.storage_dtype), time.time(),
                              json.dumps(list(neighbours))))
        self._evict()

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
        """Mark caches as just used (they are evicted last)."""
        now = time.time()
        with self._lock, self._db:
            self._db.executemany("UPDATE learned SET used = ? WHERE chunk_id = ?", [(now, c) for c in chunk_ids])

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
        """Bytes of learned caches (as stored)."""
        with self._lock:
            return int(self._db.execute("SELECT coalesce(sum(nbytes), 0) FROM learned").fetchone()[0])


def _shrink(kv: ChunkKV, storage_dtype: StorageDType) -> int:
    """How many times smaller a cache is once stored (float32 computed, float16 stored: 2)."""
    stored = {"float32": 4, "float16": 2, "bfloat16": 2}[storage_dtype]
    return max(1, kv.keys.element_size() // stored)


_open: dict[Path, LearnedCaches] = {}
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
        elif learned.fingerprint != fingerprint or (config is not None and learned.config != config):
            raise InvalidRequestError(
                f"learned caches at {path} are already open for another model or with other settings; "
                "give each model its own directory (paths.learned_dir does)"
            )
        return learned


__all__ = ["DEFAULT_MAX_BYTES", "LearnConfig", "LearnedCaches", "content_id", "open_learned"]
