"""FusionRAGRetriever: search a FusionIndex; each Document's id names its chunk's KV cache."""

from __future__ import annotations

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables.config import run_in_executor
from pydantic import ConfigDict, Field

from fusionrag_core.index import FusionIndex
from fusionrag_integrations.langchain.documents import search_documents


class FusionRAGRetriever(BaseRetriever):
    """The `k` chunks of a FusionIndex most similar to the query, best first.

    Each Document's `id` is the chunk id (the key of its KV caches) and its metadata holds
    `chunk_id`, `fusionrag_cache` ("fused", "independent" or "missing": which cache a query would
    load), `fusionrag_score` (cosine similarity) and the chunk's own metadata (`doc_id`,
    `chunk_index`, the document's metadata). Pipe it into `format_docs` for ChatFusionRAG.

    Example:
        >>> retriever = FusionRAGRetriever(index=index, k=4)
        >>> retriever.invoke("Who designed the lighthouse?", k=2)
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    index: FusionIndex = Field(repr=False)
    """The index searched (its Chroma collection and KV store)."""
    k: int = Field(default=4, ge=1)
    """How many chunks to return; `invoke(query, k=...)` overrides it."""

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        return search_documents(self.index, query, self.k if k is None else k)

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        # NOTE: BaseRetriever's default does not forward `k`; Chroma's client is blocking, so a thread.
        return await run_in_executor(None, self._get_relevant_documents, query, run_manager=run_manager.get_sync(), k=k)
