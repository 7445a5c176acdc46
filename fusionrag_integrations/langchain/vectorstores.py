"""FusionRAGVectorStore: LangChain's VectorStore over a FusionIndex (Chroma + fused KV caches).

Adding documents ingests them: the index chunks them, embeds the chunks into Chroma and
precomputes each chunk's independent and fused KV caches. Searching returns chunks as Documents
whose `id` is the chunk id, the key of their caches.

NOTE on ids: ids given to / returned by `add_texts`, `add_documents` and `delete` are *document*
ids (a document may be cut into several chunks); search results carry their document id in
`metadata["doc_id"]` and their chunk id in `Document.id`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore
from typing_extensions import Self

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.index import FusionIndex, IngestConfig
from fusionrag_core.paths import DEFAULT_COLLECTION, DEFAULT_DATA_DIR
from fusionrag_integrations.langchain.documents import SCORE_KEY, search_documents


class FusionRAGVectorStore(VectorStore):
    """A FusionIndex as a LangChain vector store: `add_documents`, `similarity_search`, `as_retriever`.

    Embeddings come from the index's Chroma embedding function (offline all-MiniLM-L6-v2 by
    default), not from a LangChain `Embeddings` object.

    Example:
        >>> store = FusionRAGVectorStore.from_documents(splits, data_dir="./fusionrag-data")
        >>> retriever = store.as_retriever(search_kwargs={"k": 4})
        >>> llm = ChatFusionRAG(index=store.index)
    """

    def __init__(self, index: FusionIndex) -> None:
        """Wrap an open index (e.g. `FusionIndex.open(engine, data_dir)`)."""
        self.index = index

    # ---- writing ---------------------------------------------------------------------------------
    def add_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict[Any, Any]] | None = None,
        *,
        ids: list[str] | None = None,
        progress: bool = False,
        **kwargs: Any,
    ) -> list[str]:
        """Ingest texts as documents: chunk, embed, cache (independent and fused) and index them.

        Args:
            texts: one text per document.
            metadatas: per document, str/int/float/bool values copied to each of its chunks.
            ids: document ids (default: a hash of each text); an existing id is replaced.
            progress: show progress bars.

        Returns:
            The document ids, in input order.

        Raises:
            InvalidRequestError: unknown keyword arguments, or only some documents have an id.
        """
        _refuse(kwargs, "add_texts")
        if ids is not None and not all(ids):
            raise InvalidRequestError(
                "some documents have an id and some do not; give every document an id, or none (ids are then "
                "hashes of the texts)"
            )
        report = self.index.add_texts(list(texts), metadatas, doc_ids=ids, progress=progress)
        return report.doc_ids

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        """Delete documents by document id (their chunks and caches); True if any chunk was removed.

        Raises:
            InvalidRequestError: `ids` is None (deleting everything is not supported: delete the
                data directory) or unknown keyword arguments.
        """
        _refuse(kwargs, "delete")
        if ids is None:
            raise InvalidRequestError(
                "pass the document ids to delete; to drop the whole index, delete its data directory"
            )
        return self.index.delete(ids) > 0

    # ---- searching -------------------------------------------------------------------------------
    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        """The `k` chunks most similar to `query`, best first (metadata as `FusionRAGRetriever`'s)."""
        _refuse(kwargs, "similarity_search")
        return search_documents(self.index, query, k)

    def similarity_search_with_score(self, query: str, k: int = 4, **kwargs: Any) -> list[tuple[Document, float]]:
        """Like `similarity_search`, with each chunk's cosine *distance* (lower is closer), as langchain-chroma."""
        return [(doc, 1.0 - float(doc.metadata[SCORE_KEY])) for doc in self.similarity_search(query, k, **kwargs)]

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        return self._cosine_relevance_score_fn

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_documents(cls, documents: list[Document], embedding: Embeddings | None = None, **kwargs: Any) -> Self:
        """Ingest LangChain Documents (from any loader or splitter); `doc.id`s become document ids.

        Same keyword arguments as `from_texts`.
        """
        # NOTE: the base class takes ids from the documents and calls `from_texts`; it only lacks
        # the optional `embedding`.
        return super().from_documents(documents, embedding, **kwargs)  # type: ignore[arg-type]

    @classmethod
    def from_texts(
        cls,
        texts: list[str],
        embedding: Embeddings | None = None,
        metadatas: list[dict[Any, Any]] | None = None,
        *,
        ids: list[str] | None = None,
        index: FusionIndex | None = None,
        engine: FusionEngine | None = None,
        data_dir: str | Path = DEFAULT_DATA_DIR,
        collection_name: str = DEFAULT_COLLECTION,
        chroma_url: str | None = None,
        redis_url: str | None = None,
        config: IngestConfig | None = None,
        progress: bool = False,
        **kwargs: Any,
    ) -> Self:
        """Open (or reuse) an index and ingest `texts` into it.

        Args:
            texts: one text per document.
            embedding: must be None: chunks are embedded by the index's Chroma embedding function.
            metadatas: per document metadata (str/int/float/bool values).
            ids: document ids.
            index: an open index; otherwise one is opened with the arguments below.
            engine: the model (default: the packaged SmolLM2-135M-Instruct, loaded now).
            data_dir, collection_name, chroma_url, redis_url, config: as `FusionIndex.open`.
            progress: show progress bars.

        Raises:
            InvalidRequestError: `embedding` given, or `index` given together with where to open one.
        """
        _refuse(kwargs, "from_texts")
        if embedding is not None:
            raise InvalidRequestError(
                "FusionRAGVectorStore embeds with its index's Chroma embedding function; pass embedding=None "
                "(choose the function with FusionIndex.open(..., embedding_function=...))"
            )
        if index is None:
            index = FusionIndex.open(
                engine if engine is not None else FusionEngine.from_pretrained(),
                data_dir,
                chroma_url=chroma_url,
                redis_url=redis_url,
                collection_name=collection_name,
                config=config,
            )
        elif engine is not None or config is not None or chroma_url is not None or redis_url is not None:
            raise InvalidRequestError("pass either index= or the engine/config/urls to open one, not both")
        store = cls(index)
        store.add_texts(texts, metadatas, ids=ids, progress=progress)
        return store


def _refuse(kwargs: dict[str, Any], method: str) -> None:
    """Unknown keyword arguments are an error, not silently ignored."""
    if kwargs:
        raise InvalidRequestError(f"FusionRAGVectorStore.{method} got unsupported argument(s) {sorted(kwargs)}")
