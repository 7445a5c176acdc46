"""FusionRAGRetriever: LlamaIndex nodes whose `node_id` is the chunk id their KV caches are stored under.

Two sources: a `FusionIndex` (our own Chroma collection, searched by `FusionIndex.search`), or a
LlamaIndex vector store (e.g. `ChromaVectorStore`) holding FusionRAG chunks: filled by an
`IngestionPipeline` that ran `FusionKVTransform` (which made every node id the chunk's id), or the
collection of a `FusionIndex` itself (one entry format, `fusionrag_core.ingest.records`).
Bookkeeping metadata is hidden from LLM and embedding text on every node returned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.indices.vector_store.base import VectorStoreIndex
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.core.vector_stores.types import BasePydanticVectorStore

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.ingest.records import CHUNK_ID_KEY, is_chunk_entry, user_metadata
from fusionrag_integrations.llama_index.embedding import FusionRAGEmbedding
from fusionrag_integrations.llama_index.transform import hide

if TYPE_CHECKING:
    from fusionrag_core.index import FusionIndex

Search = Callable[[QueryBundle], list[NodeWithScore]]


class FusionRAGRetriever(BaseRetriever):
    """Retrieves chunks as `NodeWithScore`; each `node.node_id` is a chunk id (the KV-cache key).

    Build it with `from_index` or `from_vector_store`.
    """

    def __init__(self, search: Search, *, callback_manager: CallbackManager | None = None) -> None:
        """Wrap a search function; prefer the `from_index` / `from_vector_store` constructors."""
        super().__init__(callback_manager=callback_manager)
        self._search = search

    @classmethod
    def from_index(cls, index: FusionIndex, *, similarity_top_k: int = 4) -> FusionRAGRetriever:
        """Search a FusionIndex's Chroma collection (scores are cosine similarities).

        Args:
            index: the FusionIndex the chunks (and their caches) were ingested into.
            similarity_top_k: how many chunks to return.
        """
        _check_k(similarity_top_k)

        def search(query: QueryBundle) -> list[NodeWithScore]:
            hits = index.search(query.query_str, k=similarity_top_k)
            return [NodeWithScore(node=_chunk_node(h.chunk_id, h.text, dict(h.metadata)), score=h.score) for h in hits]

        return cls(search)

    @classmethod
    def from_vector_store(
        cls,
        vector_store: BasePydanticVectorStore,
        *,
        embed_model: BaseEmbedding | None = None,
        similarity_top_k: int = 4,
    ) -> FusionRAGRetriever:
        """Search a LlamaIndex vector store of FusionRAG chunks (`FusionKVTransform` or a FusionIndex's collection).

        Args:
            vector_store: e.g. a `ChromaVectorStore`.
            embed_model: the model the nodes were embedded with (default `FusionRAGEmbedding`).
            similarity_top_k: how many chunks to return.

        Raises:
            InvalidRequestError: at query time, when a retrieved node was ingested by neither
                `FusionKVTransform` nor a FusionIndex (its id is then not a chunk id and it has no cache).
        """
        _check_k(similarity_top_k)
        # NOTE: an explicit embed model: VectorStoreIndex would otherwise resolve Settings.embed_model (OpenAI).
        index = VectorStoreIndex.from_vector_store(vector_store, embed_model=embed_model or FusionRAGEmbedding())
        inner = index.as_retriever(similarity_top_k=similarity_top_k)

        def search(query: QueryBundle) -> list[NodeWithScore]:
            hits = inner.retrieve(query)
            for hit in hits:
                if not is_chunk_entry(hit.node.node_id, hit.node.metadata):
                    raise InvalidRequestError(
                        f"node {hit.node.node_id} in the vector store was ingested neither through FusionKVTransform "
                        "nor by a FusionIndex, so it has no chunk cache; add FusionKVTransform to the "
                        "IngestionPipeline (after the splitter) and re-ingest"
                    )
                # NOTE: an entry read through LlamaIndex's legacy path (no node record) shows every key.
                hide(hit.node)
            return hits

        return cls(search)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return self._search(query_bundle)


def _check_k(k: int) -> None:
    if k < 1:
        raise InvalidRequestError(f"similarity_top_k must be >= 1, got {k}")


def _chunk_node(chunk_id: str, text: str, metadata: dict[str, object]) -> TextNode:
    """A node for a FusionIndex hit, as a vector store over the same collection rebuilds it: the user's
    and source metadata and the chunk id, all but the user's out of the LLM's and embedder's view."""
    node = TextNode(id_=chunk_id, text=text, metadata={**user_metadata(metadata), CHUNK_ID_KEY: chunk_id})
    hide(node)
    return node


__all__ = ["FusionRAGRetriever"]
