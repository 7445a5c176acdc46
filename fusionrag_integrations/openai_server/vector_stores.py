"""Vector stores (`/v1/vector_stores`): each one a FusionRAG corpus, a Chroma collection named by
its id with its own KV store, built and read as `fusionrag ingest` and `fusionrag ask` do.

A file added to a vector store is ingested by `FusionIndex.add_texts` (chunked, cached independent
and fused, indexed; doc id = file id), under the corpus's writer lock, journal and space check:
the claims, limits and atomicity of the CLI. The add answers once the file is ingested (status
"completed", or "failed" with the error); a file being added is "in_progress" meanwhile. A search
is `FusionIndex.search`; the file_search tool reads the hits' caches from the store's KV store by
chunk id. The vector store's name, metadata, creation time and tenant live in its collection's
metadata, so the stores survive a restart with the corpus.

A vector store is its tenant's (`tenants`), as its caches are what that tenant's uploads filled:
every method takes the asking tenant, and another tenant's store (or file) is no store (404), never
listed, searched or read from; a store made before tenants is the operator's ("").
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import FusionRAGError, InvalidRequestError
from fusionrag_core.index import FusionIndex, corpus_store
from fusionrag_core.ingest import chroma
from fusionrag_core.ingest.chroma import RetrievedChunk
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.paths import chroma_dir
from fusionrag_integrations.openai_server.files import FileStore, NoSuchObjectError
from fusionrag_integrations.openai_server.responses_protocol import new_id, now

PREFIX = "vs_"
_NAME_KEY, _CREATED_KEY, _META_KEY = "fusionrag_vs_name", "fusionrag_vs_created_at", "fusionrag_vs_metadata"
_TENANT_KEY = "fusionrag_vs_tenant"
_FILE_KEYS = ("file_id", "filename")
"""Chunk metadata each file's chunks carry (the doc id is the file id too)."""


@dataclass(frozen=True)
class VectorStoreConfig:
    """Where a server's vector stores and uploaded files live, and how files are ingested.

    Attributes:
        data_dir: holds `chroma/` (unless `chroma_url`), `kv/<vector store id>/` (unless
            `redis_url`) and `files/`.
        chroma_url: a Chroma server instead of the embedded database.
        redis_url: a Redis KV store instead of the disk one.
        ingest: chunking and fusion settings of new vector stores (None: `IngestConfig()`).
        writer_wait_s: how long an add waits for another writer of the corpus.
    """

    data_dir: Path
    chroma_url: str | None = None
    redis_url: str | None = None
    ingest: IngestConfig | None = None
    writer_wait_s: float = 60.0


class VectorStores:
    """The vector stores of one server: thread-safe; one open `FusionIndex` per store, opened on first
    use and kept until `close`.

    Raises:
        FusionRAGError: the Chroma database cannot be opened.
    """

    def __init__(self, engine: FusionEngine, config: VectorStoreConfig) -> None:
        self.engine, self.config = engine, config
        self.files = FileStore(Path(config.data_dir).expanduser() / "files")
        self._database = chroma.open_database(chroma.VectorDBConfig(path=str(chroma_dir(config.data_dir)),
                                                                    url=config.chroma_url))
        self._indexes: dict[str, FusionIndex] = {}
        self._writes: dict[str, threading.Lock] = {}
        self._adding: dict[str, dict[str, dict[str, Any]]] = {}  # NOTE: vs id -> file id -> its object, until done
        self._lock = threading.RLock()

    # ---- vector stores --------------------------------------------------------------------------------
    def create(self, name: str | None, metadata: dict[str, str] | None, file_ids: list[str],
               tenant: str) -> dict[str, Any]:
        """A new vector store of `tenant`'s (its files, `tenant`'s too, ingested before it is answered)."""
        for file_id in file_ids:
            self.files.get(file_id, tenant)  # NOTE: every file exists before anything is made
        vs_id = new_id("vs")[:27]
        ef = chroma.default_embedding_function()
        collection = chroma.collection_in(self._database.client, vs_id, ef, self.config.chroma_url or "")
        chroma.record_metadata(collection, {_NAME_KEY: name or "", _CREATED_KEY: now(),
                                            _META_KEY: json.dumps(metadata or {}), _TENANT_KEY: tenant})
        for file_id in file_ids:
            self.add_file(vs_id, file_id, tenant)
        return self.retrieve(vs_id, tenant)

    def list_stores(self, tenant: str) -> list[dict[str, Any]]:
        """Every vector store object of `tenant`'s, newest first."""
        names = [c if isinstance(c, str) else c.name for c in self._database.client.list_collections()]
        stores = []
        for name in names:
            if name.startswith(PREFIX):
                try:
                    stores.append(self.retrieve(name, tenant))
                except NoSuchObjectError:
                    continue  # NOTE: another tenant's, or deleted meanwhile
        return sorted(stores, key=lambda s: (s["created_at"], s["id"]), reverse=True)

    def retrieve(self, vs_id: str, tenant: str) -> dict[str, Any]:
        index = self.index(vs_id, tenant)
        meta = index.collection.metadata or {}
        files = self.list_files(vs_id, tenant)
        counts = {status: sum(f["status"] == status for f in files) for status in
                  ("in_progress", "completed", "failed", "cancelled")}
        return {"id": vs_id, "object": "vector_store", "created_at": int(meta.get(_CREATED_KEY, 0)),
                "name": meta.get(_NAME_KEY) or None, "usage_bytes": sum(f["usage_bytes"] for f in files),
                "file_counts": {**counts, "total": len(files)},
                "status": "in_progress" if counts["in_progress"] else "completed", "expires_after": None,
                "expires_at": None, "last_active_at": None, "metadata": json.loads(str(meta.get(_META_KEY, "{}")))}

    def delete(self, vs_id: str, tenant: str) -> dict[str, Any]:
        """Remove a vector store: its documents (chunks and caches, as `fusionrag delete`), then its collection."""
        index = self.index(vs_id, tenant)
        with self._write_lock(vs_id):
            index.delete(sorted(index.document_ids()))
            with self._lock:
                self._indexes.pop(vs_id, None)
            index.close()
            self._database.client.delete_collection(vs_id)
        return {"id": vs_id, "object": "vector_store.deleted", "deleted": True}

    def index(self, vs_id: str, tenant: str) -> FusionIndex:
        """The open index of `vs_id`, a vector store of `tenant`'s.

        Raises:
            NoSuchObjectError: no such vector store of `tenant`'s.
        """
        index = self._open(vs_id)
        if (index.collection.metadata or {}).get(_TENANT_KEY, "") != tenant:
            raise NoSuchObjectError(f"No vector store with id {vs_id!r} found")
        return index

    def _open(self, vs_id: str) -> FusionIndex:
        """The open index of `vs_id`, whoever's it is (opened on first use).

        Raises:
            NoSuchObjectError: no such vector store.
        """
        with self._lock:
            if vs_id in self._indexes:
                return self._indexes[vs_id]
            if not vs_id.startswith(PREFIX):
                raise NoSuchObjectError(f"No vector store with id {vs_id!r} found")
            ef = chroma.default_embedding_function()
            try:
                collection = chroma.collection_in(self._database.client, vs_id, ef, create=False)
            except (FusionRAGError, ValueError):
                raise NoSuchObjectError(f"No vector store with id {vs_id!r} found") from None
            store = corpus_store(collection, self.config.data_dir, redis_url=self.config.redis_url)
            index = FusionIndex(self.engine, collection, store, self.config.ingest if not collection.count() else None,
                                embedding_function=ef, writer_wait_s=self.config.writer_wait_s,
                                data_dir=self.config.data_dir)
            self._indexes[vs_id] = index
            return index

    # ---- files in a vector store ------------------------------------------------------------------------
    def add_file(self, vs_id: str, file_id: str, tenant: str, chunking: dict[str, Any] | None = None) -> dict[str, Any]:
        """Ingest a file `tenant` uploaded into its vector store; its `vector_store.file` object
        ("completed", or "failed" with `last_error`: nothing of it is indexed then)."""
        index = self.index(vs_id, tenant)
        record = self.files.get(file_id, tenant)
        _check_chunking(chunking, index.config)
        entry = self._file_object(vs_id, record, "in_progress", index.config)
        with self._lock:
            self._adding.setdefault(vs_id, {})[file_id] = entry
        try:
            with self._write_lock(vs_id):
                index.add_texts([self.files.text(file_id, tenant)],
                                [{"file_id": file_id, "filename": record["filename"]}], [file_id])
            entry = {**entry, "status": "completed"}
        except FusionRAGError as e:
            entry = {**entry, "status": "failed", "last_error": {"code": "server_error", "message": str(e)}}
            return entry
        finally:
            with self._lock:
                self._adding[vs_id].pop(file_id, None)
                if entry["status"] == "failed":
                    self._adding[vs_id][file_id] = entry  # NOTE: a failure stays listed until the file is removed
        return entry

    def list_files(self, vs_id: str, tenant: str) -> list[dict[str, Any]]:
        index = self.index(vs_id, tenant)
        with self._lock:
            pending = dict(self._adding.get(vs_id, {}))
        done = [self._file_object(vs_id, self._record(file_id, tenant), "completed", index.config)
                for file_id in sorted(index.document_ids()) if file_id not in pending]
        return [*done, *pending.values()]

    def retrieve_file(self, vs_id: str, file_id: str, tenant: str) -> dict[str, Any]:
        for entry in self.list_files(vs_id, tenant):
            if entry["id"] == file_id:
                return entry
        raise NoSuchObjectError(f"No file {file_id!r} in vector store {vs_id!r}")

    def delete_file(self, vs_id: str, file_id: str, tenant: str) -> dict[str, Any]:
        """Remove a file's chunks and caches from the vector store (the uploaded file stays)."""
        self.retrieve_file(vs_id, file_id, tenant)
        index = self.index(vs_id, tenant)
        with self._write_lock(vs_id):
            index.delete([file_id])
        with self._lock:
            self._adding.get(vs_id, {}).pop(file_id, None)
        return {"id": file_id, "object": "vector_store.file.deleted", "deleted": True}

    # ---- search ----------------------------------------------------------------------------------------
    def search(self, vs_id: str, tenant: str, query: str, k: int,
               score_threshold: float | None = None) -> list[RetrievedChunk]:
        """The `k` chunks of `vs_id` most similar to `query`, best first, none below `score_threshold`
        (cosine similarity; None: no threshold).

        Raises:
            InvalidRequestError: an empty query.
        """
        index = self.index(vs_id, tenant)
        if not len(index):
            return []
        return [hit for hit in index.search(query, k) if score_threshold is None or hit.score >= score_threshold]

    def close(self) -> None:
        with self._lock:
            indexes, self._indexes = list(self._indexes.values()), {}
        for index in indexes:
            index.close()
        self._database.close()

    # ---- helpers ---------------------------------------------------------------------------------------
    def _write_lock(self, vs_id: str) -> threading.Lock:
        """The lock of this process's writes to `vs_id` (the corpus's writer lock is the process's
        across processes; threads of one process take this one first)."""
        with self._lock:
            return self._writes.setdefault(vs_id, threading.Lock())

    def _record(self, file_id: str, tenant: str) -> dict[str, Any]:
        """The uploaded file's object; a stand-in naming the id when the upload was deleted since."""
        try:
            return self.files.get(file_id, tenant)
        except NoSuchObjectError:
            return {"id": file_id, "filename": file_id, "bytes": 0, "created_at": 0}

    @staticmethod
    def _file_object(vs_id: str, record: dict[str, Any], status: str, config: IngestConfig) -> dict[str, Any]:
        return {"id": record["id"], "object": "vector_store.file", "created_at": record["created_at"],
                "vector_store_id": vs_id, "status": status, "last_error": None, "usage_bytes": record["bytes"],
                "attributes": {}, "chunking_strategy": {"type": "static", "static": {
                    "max_chunk_size_tokens": config.chunk_tokens, "chunk_overlap_tokens": config.chunk_overlap}}}


def filename_of(hit: RetrievedChunk) -> tuple[str, str]:
    """(file id, filename) of a search hit's chunk."""
    meta = hit.metadata
    file_id = str(meta.get("file_id") or meta.get("doc_id") or hit.chunk_id)
    return file_id, str(meta.get("filename") or file_id)


def search_results(hits: list[RetrievedChunk]) -> Iterator[dict[str, Any]]:
    """Hits as a `vector_store.search_results.page`'s data."""
    for hit in hits:
        file_id, filename = filename_of(hit)
        yield {"file_id": file_id, "filename": filename, "score": hit.score,
               "attributes": {"chunk_id": hit.chunk_id}, "content": [{"type": "text", "text": hit.text}]}


def _check_chunking(chunking: dict[str, Any] | None, config: IngestConfig) -> None:
    """A file's `chunking_strategy`: "auto", or the store's own static settings (a corpus is cut one way).

    Raises:
        InvalidRequestError: static settings other than the store's.
    """
    if chunking is None or chunking.get("type") == "auto":
        return
    static = chunking.get("static") if chunking.get("type") == "static" else None
    wanted = {"max_chunk_size_tokens": config.chunk_tokens, "chunk_overlap_tokens": config.chunk_overlap}
    if not isinstance(static, dict) or static != wanted:
        raise InvalidRequestError(f"chunking_strategy {chunking!r} is not this vector store's: its chunks are cut as "
                                  f"{{'type': 'static', 'static': {wanted}}} (or send {{'type': 'auto'}})")


__all__ = ["PREFIX", "VectorStoreConfig", "VectorStores", "filename_of", "search_results"]
