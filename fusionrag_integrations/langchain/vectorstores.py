"""FusionRAGVectorStore: `langchain_chroma.Chroma`'s interface over a FusionIndex (Chroma + fused KV caches).

It takes langchain-chroma's constructor arguments with their meanings (`collection_name`,
`embedding_function`, `persist_directory`, `client`, `client_settings`, `collection_metadata`,
`collection_configuration`, `relevance_score_fn`, `create_collection_if_not_exists`, `host`/`port`/
`ssl`/`headers`, `tenant`/`database`, `chroma_cloud_api_key`), plus the engine that computes the
caches and where they live. Adding documents ingests them: each is chunked, its chunks embedded by
the LangChain `embedding_function` (Chroma stores those vectors, and fusion picks each chunk's
neighbours with them), and every chunk's independent and fused KV caches are stored before its
Chroma entry appears. Deleting or replacing a document deletes the caches of its chunks and
re-fuses the chunks that were fused after them.

Ids: a LangChain id is a *document* id. Chroma entries stay keyed by chunk id (a content hash,
the key of the chunk's caches); each records the documents that own it. A document that fits one
chunk (`IngestConfig.chunk_tokens`, 256 tokens by default) reads back exactly as it was added; a
longer one comes back as its chunks, each with the document's id and metadata. Metadata comes back
as given: FusionRAG's bookkeeping keys are never returned, and are reserved (an error if used).

NOTE (unlike langchain-chroma): a text that occurs in several documents is one chunk with one set of
caches, owned by all of them and deleted with the last. A search finds it once, under its first
document's id; it keeps the first document's metadata (`get_by_ids` of another owner returns it too).

NOTE: the Documents returned carry document ids, not chunk ids. Either way of joining them reuses
their caches: ChatFusionRAG / FusionRAGLLM find ingested chunks by their text in any prompt, and a
`format_docs` mark whose id has no cache (a document id) is found by its text too (a whole long
document by its chunks, in order; `chunk_found_by` in the response says "mark_then_content").
`FusionRAGRetriever(index=store.index)` returns chunk-id Documents, whose marks resolve directly.
"""

from __future__ import annotations

import inspect
import math
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import chromadb
import numpy as np
from chromadb.api.collection_configuration import CreateCollectionConfiguration
from chromadb.api.models.Collection import Collection
from chromadb.config import Settings
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore
from langchain_core.vectorstores.utils import maximal_marginal_relevance
from typing_extensions import Self

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.index import FusionIndex, IngestConfig, corpus_store
from fusionrag_core.ingest import chroma
from fusionrag_core.ingest.ingestor import owners_of
from fusionrag_core.ingest.records import RESERVED_KEYS
from fusionrag_core.paths import DEFAULT_DATA_DIR, chroma_dir
from fusionrag_core.store import DiskKVStore, KVStore, StorageDType
from fusionrag_integrations.arguments import refuse_unknown
from fusionrag_integrations.langchain.embeddings import ChromaEmbeddings

DEFAULT_K = 4
_LANGCHAIN_DEFAULT_COLLECTION_NAME = "langchain"

Where = Mapping[str, Any]


class FusionRAGVectorStore(VectorStore):
    """A FusionRAG corpus behind langchain-chroma's `Chroma` interface.

    Args:
        collection_name: the Chroma collection (default "langchain", as langchain-chroma).
        embedding_function: any LangChain `Embeddings` (documents through `embed_documents`,
            queries through `embed_query`); None: the offline all-MiniLM-L6-v2. A Chroma embedding
            function is accepted too.
        persist_directory: Chroma's database directory (`PersistentClient`); the caches go to
            `<persist_directory>/kv/<collection_name>/` unless `data_dir`, `kv_store` or `redis_url`.
        host, port, ssl, headers: a Chroma server (`HttpClient`, port 8000 by default).
        chroma_cloud_api_key: a Chroma Cloud database (`CloudClient`; needs `tenant` and `database`).
        tenant, database: Chroma's tenant and database (Chroma's defaults when None).
        client_settings: `chromadb.config.Settings` for the client made here.
        collection_metadata: metadata of a collection created here.
        collection_configuration: Chroma configuration of a collection created here (the distance
            space is always cosine: FusionRAG ranks neighbours by it).
        client: an open Chroma client (wins over persist_directory / host / cloud).
        relevance_score_fn: distance -> relevance for `similarity_search_with_relevance_scores`
            (default: cosine, `1 - distance`).
        create_collection_if_not_exists: False: the collection must exist.
        engine: the model the caches are computed with (default: the packaged SmolLM2, loaded now).
        index: an open FusionIndex to wrap instead (then no Chroma or cache argument).
        data_dir: a FusionRAG data directory: Chroma in `<data_dir>/chroma/` (unless a client,
            persist_directory or host is given) and caches in `<data_dir>/kv/<collection_name>/`,
            the layout the `fusionrag` CLI reads.
        kv_store: where the caches go (a `KVStore`); exclusive with data_dir / redis_url.
        redis_url: caches in Redis, namespaced by the corpus id the collection records.
        config: chunking and fusion settings (None: the collection's own, or the defaults).
        storage_dtype: dtype of stored keys/values.
        writer_wait_s: how long a write (add, delete) waits for another writer of the corpus (a
            thread, an `aadd_documents` running beside it, another process) before failing with
            `CorpusLockedError`; default forever, as writes to langchain-chroma queue. One writer
            at a time per corpus (`fusionrag_core.ingest.lock`); searches never wait.

    With no client, persist_directory, host, cloud key or data_dir, Chroma is in memory (as
    langchain-chroma) and so are the caches: a temporary directory per collection, removed at exit.

    Raises:
        InvalidRequestError: an unknown argument (the message names the closest valid one), two
            arguments that pick different places, or a collection built otherwise (another
            embedding model, another space, another model's caches: see `FusionIndex`).
        ReadOnlyError: `persist_directory` (or `data_dir`) is a directory this process cannot write;
            embedded Chroma writes there even to read (the message names it and what to do).

    Example:
        >>> store = FusionRAGVectorStore(collection_name="docs", embedding_function=embeddings,
        ...                              persist_directory="./chroma_db", engine=engine)
        >>> store.add_documents(splits)
        >>> retriever = store.as_retriever(search_type="mmr", search_kwargs={"k": 4})
        >>> llm = ChatFusionRAG(index=store.index)
    """

    def __init__(
        self,
        collection_name: str = _LANGCHAIN_DEFAULT_COLLECTION_NAME,
        embedding_function: Embeddings | chroma.EmbeddingFn | None = None,
        persist_directory: str | Path | None = None,
        host: str | None = None,
        port: int | None = None,
        headers: dict[str, str] | None = None,
        chroma_cloud_api_key: str | None = None,
        tenant: str | None = None,
        database: str | None = None,
        client_settings: Settings | None = None,
        collection_metadata: dict[str, Any] | None = None,
        collection_configuration: CreateCollectionConfiguration | None = None,
        client: chromadb.ClientAPI | None = None,
        relevance_score_fn: Callable[[float], float] | None = None,
        create_collection_if_not_exists: bool | None = True,
        *,
        ssl: bool = False,
        engine: FusionEngine | None = None,
        index: FusionIndex | None = None,
        data_dir: str | Path | None = None,
        kv_store: KVStore | None = None,
        redis_url: str | None = None,
        config: IngestConfig | None = None,
        storage_dtype: StorageDType = "float16",
        writer_wait_s: float = math.inf,
        **kwargs: Any,
    ) -> None:
        refuse_unknown(kwargs, _parameters(FusionRAGVectorStore.__init__), "FusionRAGVectorStore")
        self.override_relevance_score_fn = relevance_score_fn
        self._open: Callable[[bool], FusionIndex] | None = None
        if index is not None:
            _refuse_with_index(collection_name=collection_name, persist_directory=persist_directory, host=host,
                               port=port, headers=headers, chroma_cloud_api_key=chroma_cloud_api_key, tenant=tenant,
                               database=database, client_settings=client_settings,
                               collection_metadata=collection_metadata,
                               collection_configuration=collection_configuration, client=client,
                               create_collection_if_not_exists=create_collection_if_not_exists, ssl=ssl, engine=engine,
                               data_dir=data_dir, kv_store=kv_store, redis_url=redis_url, config=config,
                               storage_dtype=storage_dtype, writer_wait_s=writer_wait_s)
            self._embedding_function = _embeddings_of(index, embedding_function)
            self._index: FusionIndex | None = index
            return
        self._embedding_function = embedding_function if isinstance(embedding_function, Embeddings) else None
        ef = _chroma_function(embedding_function)
        place = _place(persist_directory, host, port, ssl, headers, chroma_cloud_api_key, tenant, database,
                       client_settings, client, data_dir)
        model = engine if engine is not None else FusionEngine.from_pretrained()

        def open_index(create: bool) -> FusionIndex:
            collection = chroma.collection_in(
                place.client, collection_name, ef, place.where, metadata=collection_metadata,
                configuration=cast(Mapping[str, Any] | None, collection_configuration), create=create)
            store = _kv_store(collection, place, data_dir, kv_store, redis_url, storage_dtype)
            return FusionIndex(model, collection, store, config, embedding_function=ef, writer_wait_s=writer_wait_s)

        self._open = open_index
        self._index = open_index(create_collection_if_not_exists is not False)

    # ---- what it wraps ---------------------------------------------------------------------------
    @property
    def index(self) -> FusionIndex:
        """The FusionIndex (Chroma collection + KV store + engine); pass it to `ChatFusionRAG(index=...)`.

        Raises:
            InvalidRequestError: after `delete_collection`.
        """
        if self._index is None:
            raise InvalidRequestError("the collection was deleted; call reset_collection() to create it anew")
        return self._index

    @property
    def embeddings(self) -> Embeddings | None:
        """The LangChain embeddings given (None when embedding with a Chroma function)."""
        return self._embedding_function

    @property
    def _collection(self) -> Collection:
        return self.index.collection

    # ---- writing ---------------------------------------------------------------------------------
    def add_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict[Any, Any]] | None = None,
        ids: list[str] | None = None,
        *,
        progress: bool = False,
        **kwargs: Any,
    ) -> list[str]:
        """Ingest texts as documents: chunk, embed, cache (independent and fused) and index them.

        Args:
            texts: one text per document.
            metadatas: per document, str/int/float/bool values (None or missing: none).
            ids: document ids; a missing (None) id becomes a new UUID, as in langchain-chroma. An
                id that exists is replaced: its old text's caches are deleted (when no other
                document shares that text) and its new metadata replaces the old.
            progress: show progress bars.

        Returns:
            The document ids, in input order.

        Raises:
            InvalidRequestError: unknown keyword arguments, a metadata value Chroma cannot store,
                or a reserved metadata key (FusionRAG's bookkeeping).
        """
        refuse_unknown(kwargs, ["texts", "metadatas", "ids", "progress"], "FusionRAGVectorStore.add_texts")
        texts = list(texts)
        given: list[str | None] = list(ids) if ids is not None else [None] * len(texts)
        doc_ids = [str(i) if i else str(uuid.uuid4()) for i in given]
        metas = [dict(m or {}) for m in (metadatas or [])] + [{}] * max(0, len(texts) - len(metadatas or []))
        if not texts:
            return []
        self.index.add_texts(texts, metas, doc_ids=doc_ids, progress=progress)
        return doc_ids

    def update_documents(self, ids: list[str], documents: list[Document]) -> None:
        """Replace documents by id (`add_documents` with those ids), as langchain-chroma's."""
        if len(ids) != len(documents):
            raise InvalidRequestError(f"update_documents got {len(ids)} ids and {len(documents)} documents")
        self.add_texts([d.page_content for d in documents], [d.metadata for d in documents], ids=ids)

    def update_document(self, document_id: str, document: Document) -> None:
        """Replace one document by id."""
        self.update_documents([document_id], [document])

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        """Delete documents by id: their Chroma entries and every cache of their chunks (chunks another
        document shares stay); chunks fused after them are re-fused. Unknown ids are ignored.

        Returns:
            True.

        Raises:
            InvalidRequestError: `ids` is None (to drop everything use `delete_collection`) or
                unknown keyword arguments.
        """
        refuse_unknown(kwargs, ["ids"], "FusionRAGVectorStore.delete")
        if ids is None:
            raise InvalidRequestError("pass the document ids to delete; to drop everything, call delete_collection()")
        self.index.delete(list(ids))
        return True

    def delete_collection(self) -> None:
        """Delete every document (with its caches), then the Chroma collection itself.

        An embedded database is this process's alone from the first deletion to the collection's drop,
        as for every write (`FusionIndex`): no other process has it open meanwhile.

        Raises:
            InvalidRequestError: a store made with `index=` (it does not own its collection).
            DatabaseInUseError: another process has the embedded database open (after `writer_wait_s`);
                nothing was deleted.
        """
        if self._open is None:
            raise InvalidRequestError("a store made with index= does not own its collection; delete it through "
                                      "FusionIndex.delete or its Chroma client")
        index = self.index
        with chroma.alone(index.collection, "delete the collection", wait_s=index.writer_wait_s):
            # NOTE: documents first, through the index: their blobs go with their entries (never the reverse).
            index.delete(sorted(index.document_ids()))
            self._index = None
            _client_of(index.collection).delete_collection(index.collection.name)
        _forget_in_memory_store(index.collection)

    def reset_collection(self) -> None:
        """Delete the collection (`delete_collection`) and create it anew, empty, with the same arguments."""
        if self._index is not None:
            self.delete_collection()
        assert self._open is not None  # NOTE: delete_collection refused a store made with index=.
        self._index = self._open(True)

    # ---- searching -------------------------------------------------------------------------------
    def similarity_search(
        self, query: str, k: int = DEFAULT_K, filter: Where | None = None, **kwargs: Any
    ) -> list[Document]:
        """The `k` documents (chunks) most similar to `query`, nearest first.

        Args:
            query: the text to search for (embedded with `embed_query`).
            k: how many results.
            filter: a Chroma `where` on metadata, e.g. `{"source": "a.md"}` or `{"year": {"$gte": 2000}}`.
            where_document: a Chroma filter on the text, e.g. `{"$contains": "lighthouse"}`.
        """
        return [doc for doc, _ in self.similarity_search_with_score(query, k, filter=filter, **kwargs)]

    def similarity_search_with_score(
        self,
        query: str,
        k: int = DEFAULT_K,
        filter: Where | None = None,
        where_document: Where | None = None,
        **kwargs: Any,
    ) -> list[tuple[Document, float]]:
        """Like `similarity_search`, with each result's cosine *distance* (lower is closer), as langchain-chroma."""
        refuse_unknown(kwargs, ["query", "k", "filter", "where_document"], "FusionRAGVectorStore.similarity_search")
        return [(doc, d) for doc, d, _ in self._query(self._embed_query(query), k, filter, where_document)]

    def similarity_search_by_vector(
        self,
        embedding: list[float],
        k: int = DEFAULT_K,
        filter: Where | None = None,
        where_document: Where | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """The `k` documents (chunks) nearest to an embedding (same filters as `similarity_search`)."""
        refuse_unknown(kwargs, ["embedding", "k", "filter", "where_document"],
                       "FusionRAGVectorStore.similarity_search_by_vector")
        return [doc for doc, _, _ in self._query(embedding, k, filter, where_document)]

    def similarity_search_by_vector_with_relevance_scores(
        self,
        embedding: list[float],
        k: int = DEFAULT_K,
        filter: Where | None = None,
        where_document: Where | None = None,
        **kwargs: Any,
    ) -> list[tuple[Document, float]]:
        """Like `similarity_search_by_vector`, with cosine distances (named as langchain-chroma's method)."""
        refuse_unknown(kwargs, ["embedding", "k", "filter", "where_document"],
                       "FusionRAGVectorStore.similarity_search_by_vector_with_relevance_scores")
        return [(doc, d) for doc, d, _ in self._query(embedding, k, filter, where_document)]

    def max_marginal_relevance_search(
        self,
        query: str,
        k: int = DEFAULT_K,
        fetch_k: int = 20,
        lambda_mult: float = 0.5,
        filter: Where | None = None,
        where_document: Where | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """`k` documents chosen by maximal marginal relevance among the `fetch_k` nearest.

        Args:
            query: the text to search for.
            k: how many results.
            fetch_k: how many nearest candidates MMR chooses from.
            lambda_mult: 0 = most diverse ... 1 = most similar (langchain's meaning).
            filter, where_document: as `similarity_search`.
        """
        refuse_unknown(kwargs, ["query", "k", "fetch_k", "lambda_mult", "filter", "where_document"],
                       "FusionRAGVectorStore.max_marginal_relevance_search")
        return self.max_marginal_relevance_search_by_vector(
            self._embed_query(query), k, fetch_k, lambda_mult, filter=filter, where_document=where_document)

    def max_marginal_relevance_search_by_vector(
        self,
        embedding: list[float],
        k: int = DEFAULT_K,
        fetch_k: int = 20,
        lambda_mult: float = 0.5,
        filter: Where | None = None,
        where_document: Where | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """MMR (`langchain_core.vectorstores.utils.maximal_marginal_relevance`) from an embedding;
        results in the order MMR picks them."""
        refuse_unknown(kwargs, ["embedding", "k", "fetch_k", "lambda_mult", "filter", "where_document"],
                       "FusionRAGVectorStore.max_marginal_relevance_search_by_vector")
        hits = self._query(embedding, max(fetch_k, k), filter, where_document, with_vectors=True)
        if not hits:
            return []
        vectors = [cast(np.ndarray, vector) for _, _, vector in hits]
        chosen = maximal_marginal_relevance(np.asarray(embedding, dtype=np.float32), cast(Any, vectors), lambda_mult, k)
        return [hits[i][0] for i in chosen]

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        """The documents with these ids, in the order asked (a long document: its chunks, in order);
        unknown ids are left out."""
        found = self.index.document_chunks(list(ids))
        return [_document(doc_id, row.text or "", row.metadata) for doc_id, rows in found.items() for row in rows]

    def get(
        self,
        ids: str | list[str] | None = None,
        where: Where | None = None,
        limit: int | None = None,
        offset: int | None = None,
        where_document: Where | None = None,
        include: list[str] | None = None,
    ) -> dict[str, Any]:
        """Entries of the collection, as langchain-chroma's `get`: one per chunk, under its document's id.

        Args:
            ids: document ids (a long document: each of its chunks); None: every document.
            where: a Chroma filter on metadata.
            limit, offset: paging, counted in chunks.
            where_document: a Chroma filter on the text.
            include: any of "documents", "metadatas", "embeddings" (default the first two).

        Returns:
            `{"ids": [...], "documents": [...], "metadatas": [...]}` (and "embeddings" when asked),
            aligned; metadata is the caller's own, without FusionRAG's bookkeeping.
        """
        wanted = [ids] if isinstance(ids, str) else ids
        include = list(include) if include is not None else ["documents", "metadatas"]
        unknown = set(include) - {"documents", "metadatas", "embeddings"}
        if unknown:
            raise InvalidRequestError(f"get(include=...) takes documents, metadatas, embeddings; got {sorted(unknown)}")
        owners: dict[str, str] = {}
        if wanted is not None:
            for doc_id, rows in self.index.document_chunks(wanted).items():
                for row in rows:
                    owners.setdefault(row.chunk_id, doc_id)
            if not owners:
                return {"ids": [], **{key: [] for key in include}}
        res = self._collection.get(ids=list(owners) if wanted is not None else None, where=cast(Any, where or None),
                                   limit=limit, offset=offset, where_document=cast(Any, where_document or None),
                                   include=cast(Any, list(dict.fromkeys(["metadatas", *include]))))
        metas = [dict(m or {}) for m in res["metadatas"] or []]
        out: dict[str, Any] = {"ids": [owners.get(cid) or owners_of(m)[0] for cid, m in zip(res["ids"], metas,
                                                                                             strict=True)]}
        if "documents" in include:
            out["documents"] = list(res["documents"] or [])
        if "metadatas" in include:
            out["metadatas"] = [{k: v for k, v in m.items() if k not in RESERVED_KEYS} for m in metas]
        if "embeddings" in include:
            out["embeddings"] = res["embeddings"]
        return out

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        return self.override_relevance_score_fn or self._cosine_relevance_score_fn

    # ---- internals -------------------------------------------------------------------------------
    def _embed_query(self, query: str) -> list[float]:
        if self._embedding_function is not None:
            return list(self._embedding_function.embed_query(query))
        ef = self.index.ingestor.embedding_function
        embed = getattr(ef, "embed_query", None)
        vectors = embed(input=[query]) if callable(embed) else ef([query])
        return [float(x) for x in vectors[0]]

    def _query(
        self,
        embedding: Sequence[float],
        k: int,
        where: Where | None,
        where_document: Where | None,
        *,
        with_vectors: bool = False,
    ) -> list[tuple[Document, float, np.ndarray | None]]:
        """`(document, cosine distance, stored embedding if asked)` of the `k` nearest chunks passing the filters."""
        if k < 1:
            raise InvalidRequestError(f"k must be >= 1, got {k}")
        collection = self._collection
        n = min(k, collection.count())
        if n == 0:
            return []
        include = ["documents", "metadatas", "distances", *(["embeddings"] if with_vectors else [])]
        query: list[Sequence[float]] = [[float(x) for x in embedding]]
        res = collection.query(query_embeddings=query, n_results=n,
                               where=cast(Any, where or None), where_document=cast(Any, where_document or None),
                               include=cast(Any, include))
        docs, metas, dists = res["documents"], res["metadatas"], res["distances"]
        assert docs is not None and metas is not None and dists is not None  # NOTE: requested via include.
        found = res["embeddings"]
        vectors: list[np.ndarray | None] = (
            [np.asarray(v, dtype=np.float32) for v in found[0]] if with_vectors and found is not None
            else [None] * len(docs[0]))
        return [
            (_document(owners_of(meta or {})[0], text or "", meta or {}), float(dist), vector)
            for text, meta, dist, vector in zip(docs[0], metas[0], dists[0], vectors, strict=True)
        ]

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_texts(
        cls,
        texts: list[str],
        embedding: Embeddings | None = None,
        metadatas: list[dict[Any, Any]] | None = None,
        ids: list[str] | None = None,
        *,
        progress: bool = False,
        **kwargs: Any,
    ) -> Self:
        """A store built with `FusionRAGVectorStore(embedding_function=embedding, **kwargs)`, with `texts` added.

        Args:
            texts: one text per document.
            embedding: the LangChain embeddings (langchain-chroma's name in `from_texts`).
            metadatas: per document metadata (str/int/float/bool values).
            ids: document ids (None entries: new UUIDs).
            progress: show progress bars.
            **kwargs: the constructor's arguments (`collection_name`, `persist_directory`,
                `client`, `engine`, `data_dir`, `index`, `config`, ...).
        """
        store = cls(embedding_function=embedding, **kwargs)
        store.add_texts(texts, metadatas, ids=ids, progress=progress)
        return store

    @classmethod
    def from_documents(cls, documents: list[Document], embedding: Embeddings | None = None, **kwargs: Any) -> Self:
        """Ingest LangChain Documents (from any loader or splitter); `doc.id`s become document ids.

        Same keyword arguments as `from_texts`.
        """
        # NOTE: the base class takes ids from the documents and calls `from_texts`; it only lacks
        # the optional `embedding`.
        return super().from_documents(documents, embedding, **kwargs)  # type: ignore[arg-type]


# ---- where Chroma and the caches live ----------------------------------------------------------------
@dataclass(frozen=True)
class _Place:
    """An open Chroma client and what kind of database it reaches."""

    client: chromadb.ClientAPI
    kind: Literal["memory", "persistent", "remote"]
    path: str | None
    where: str


def _place(
    persist_directory: str | Path | None,
    host: str | None,
    port: int | None,
    ssl: bool,
    headers: dict[str, str] | None,
    cloud_key: str | None,
    tenant: str | None,
    database: str | None,
    settings: Settings | None,
    client: chromadb.ClientAPI | None,
    data_dir: str | Path | None,
) -> _Place:
    """The Chroma client langchain-chroma would make from these arguments (`data_dir`: FusionRAG's layout)."""
    chosen = [name for name, value in (("persist_directory", persist_directory), ("host", host),
                                       ("chroma_cloud_api_key", cloud_key), ("client", client)) if value is not None]
    if len(chosen) > 1:
        raise InvalidRequestError(f"FusionRAGVectorStore got {' and '.join(chosen)}: they pick different Chroma "
                                  "databases; pass one")
    if client is not None:
        if settings is not None or tenant is not None or database is not None:
            raise InvalidRequestError("FusionRAGVectorStore got client= with client_settings/tenant/database: an "
                                      "open client has its own; pass them to the client instead")
        return _place_of(client)
    settings = settings or Settings(anonymized_telemetry=False)
    scope = {"tenant": tenant or chromadb.DEFAULT_TENANT, "database": database or chromadb.DEFAULT_DATABASE}
    if host is not None:
        remote = chromadb.HttpClient(host=host, port=port or 8000, ssl=ssl, headers=headers, settings=settings,
                                     **scope)
        return _Place(remote, "remote", None, f"{'https' if ssl else 'http'}://{host}:{port or 8000}")
    if cloud_key is not None:
        if not tenant or not database:
            raise InvalidRequestError("chroma_cloud_api_key needs tenant= and database= (as langchain-chroma)")
        return _Place(chromadb.CloudClient(tenant=tenant, database=database, api_key=cloud_key, settings=settings),
                      "remote", None, f"Chroma Cloud {tenant}/{database}")
    if persist_directory is None and data_dir is not None:
        persist_directory = chroma_dir(data_dir)
    if persist_directory is not None:
        path = Path(persist_directory).expanduser().resolve()
        return _Place(chroma.persistent_client(path, settings, **scope), "persistent", str(path), str(path))
    return _Place(chromadb.EphemeralClient(settings=settings, **scope), "memory", None, "the in-memory Chroma")


def _place_of(client: chromadb.ClientAPI) -> _Place:
    settings = client.get_settings()
    if settings.is_persistent and settings.persist_directory:
        return _Place(client, "persistent", settings.persist_directory, settings.persist_directory)
    if "fastapi" in str(settings.chroma_api_impl).lower():
        return _Place(client, "remote", None, f"the Chroma server {settings.chroma_server_host}")
    return _Place(client, "memory", None, "the in-memory Chroma")


def _kv_store(
    collection: Collection,
    place: _Place,
    data_dir: str | Path | None,
    kv_store: KVStore | None,
    redis_url: str | None,
    storage_dtype: StorageDType,
) -> KVStore:
    """Where the collection's caches live: given, Redis, `<data_dir>/kv/`, next to a persisted Chroma,
    `./fusionrag-data/kv/` for a server, or a temporary directory for an in-memory Chroma."""
    if kv_store is not None:
        if data_dir is not None or redis_url is not None:
            raise InvalidRequestError("FusionRAGVectorStore got kv_store= with data_dir=/redis_url=: pass one place "
                                      "for the caches")
        return kv_store
    if redis_url is not None or data_dir is not None:
        return corpus_store(collection, data_dir or DEFAULT_DATA_DIR, redis_url=redis_url,
                            storage_dtype=storage_dtype, where=place.where)
    if place.kind == "persistent":
        assert place.path is not None
        return corpus_store(collection, place.path, storage_dtype=storage_dtype, where=place.where)
    if place.kind == "remote":
        return corpus_store(collection, DEFAULT_DATA_DIR, storage_dtype=storage_dtype, where=place.where)
    return _in_memory_store(collection, storage_dtype)


# NOTE: an in-memory Chroma lives as long as the process, and every EphemeralClient of a process shares
# it, so its caches are kept per collection (by Chroma's collection id) for the process too: a second
# store opened on the same collection finds the first one's caches.
_IN_MEMORY: dict[str, tempfile.TemporaryDirectory[str]] = {}
_IN_MEMORY_LOCK = threading.Lock()


def _in_memory_store(collection: Collection, storage_dtype: StorageDType) -> KVStore:
    with _IN_MEMORY_LOCK:
        directory = _IN_MEMORY.get(str(collection.id))
        if directory is None:
            directory = _IN_MEMORY[str(collection.id)] = tempfile.TemporaryDirectory(prefix="fusionrag-kv-")
    return DiskKVStore(directory.name, storage_dtype=storage_dtype)


def _forget_in_memory_store(collection: Collection) -> None:
    with _IN_MEMORY_LOCK:
        directory = _IN_MEMORY.pop(str(collection.id), None)
    if directory is not None:
        directory.cleanup()


def _client_of(collection: Collection) -> chromadb.ClientAPI:
    return cast(chromadb.ClientAPI, collection._client)  # NOTE: the client the collection was opened with.


# ---- arguments -----------------------------------------------------------------------------------------
def _parameters(fn: Callable[..., Any]) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]


def _refuse_with_index(**given: Any) -> None:
    """With `index=`, the arguments that open a collection or pick an engine must keep their defaults."""
    defaults = {p.name: p.default for p in inspect.signature(FusionRAGVectorStore.__init__).parameters.values()}
    changed = sorted(name for name, value in given.items() if value is not defaults[name] and value != defaults[name])
    if changed:
        raise InvalidRequestError(
            f"FusionRAGVectorStore got index= and {changed}: an open index already has its Chroma collection, engine "
            "and caches; pass only index= (and embedding_function= / relevance_score_fn=)"
        )


def _chroma_function(embedding_function: Embeddings | chroma.EmbeddingFn | None) -> chroma.EmbeddingFn:
    """The Chroma embedding function the index embeds with."""
    if embedding_function is None:
        return chroma.default_embedding_function()
    if isinstance(embedding_function, Embeddings):
        return cast(chroma.EmbeddingFn, ChromaEmbeddings(embedding_function))
    if callable(embedding_function):
        return embedding_function
    raise InvalidRequestError(
        f"embedding_function must be LangChain Embeddings (or a Chroma embedding function), got "
        f"{type(embedding_function).__name__}"
    )


def _embeddings_of(index: FusionIndex, given: Embeddings | chroma.EmbeddingFn | None) -> Embeddings | None:
    """The LangChain embeddings of an open index; `given` must be the model the index embeds with."""
    ef = index.ingestor.embedding_function
    if given is not None and chroma.embedding_id(_chroma_function(given)) != chroma.embedding_id(ef):
        raise InvalidRequestError(
            f"embedding_function embeds with {chroma.embedding_id(_chroma_function(given))!r}, but the index "
            f"embeds with {chroma.embedding_id(ef)!r}; drop embedding_function= (the index's is used)"
        )
    if isinstance(given, Embeddings):
        return given
    return ef.embeddings if isinstance(ef, ChromaEmbeddings) else None


def _document(doc_id: str, text: str, metadata: Mapping[str, Any]) -> Document:
    """A chunk as its document's LangChain Document: the document id, the caller's metadata only."""
    return Document(id=doc_id, page_content=text, metadata={k: v for k, v in metadata.items()
                                                            if k not in RESERVED_KEYS})
