"""FusionRAGQueryEngine: retrieve, then answer over the retrieved chunks' fused caches.

The canonical FusionRAG request is built straight from the retrieved nodes
(`engine.prompt(question, chunks=[(node_id, text), ...])`): the chunk caches are looked up by node
id, re-rotated to their prompt positions, and the chunk tokens the question attends to most are
recomputed with it (query-guided selective recompute). No text template sits in between, so the
answer is exactly what `FusionEngine.generate` gives for the same question and chunks.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.response.schema import Response, StreamingResponse
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.query_engine.custom import CustomQueryEngine
from llama_index.core.schema import MetadataMode, NodeWithScore
from llama_index.core.vector_stores.types import BasePydanticVectorStore

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.prompt import FusionPrompt
from fusionrag_core.store import KVStore
from fusionrag_integrations.llama_index.llm import FusionRAGLLM, clean_output, generation_metadata
from fusionrag_integrations.llama_index.retriever import FusionRAGRetriever

if TYPE_CHECKING:
    from fusionrag_core.index import FusionIndex


class FusionRAGQueryEngine(CustomQueryEngine):
    """Retrieve → fused caches → query-guided recompute → `Response` (or `StreamingResponse`).

    `Response.metadata` holds `generation_metadata` (TTFT, reused/recomputed tokens, cache misses);
    for a `StreamingResponse` the same dict is filled in once the stream is exhausted.

    Example:
        >>> qe = FusionRAGQueryEngine.from_index(index)
        >>> response = qe.query("Who designed the lighthouse?")
        >>> response.metadata["reused_tokens"], [n.node_id for n in response.source_nodes]
    """

    retriever: BaseRetriever = Field(description="Returns nodes whose node_id is a chunk id.")
    llm: FusionRAGLLM = Field(description="Engine and generation settings; its engine's store holds the caches.")
    streaming: bool = Field(default=False, description="Return a StreamingResponse.")

    _store: KVStore | None = PrivateAttr(default=None)

    @classmethod
    def from_index(
        cls,
        index: FusionIndex,
        *,
        llm: FusionRAGLLM | None = None,
        similarity_top_k: int = 4,
        streaming: bool = False,
    ) -> FusionRAGQueryEngine:
        """Query a FusionIndex (its engine answers unless `llm` is given); caches come from the index's store."""
        query_engine = cls(
            retriever=FusionRAGRetriever.from_index(index, similarity_top_k=similarity_top_k),
            llm=llm or FusionRAGLLM(engine=index.engine),
            streaming=streaming,
        )
        query_engine._store = index.store
        return query_engine

    @classmethod
    def from_vector_store(
        cls,
        vector_store: BasePydanticVectorStore,
        llm: FusionRAGLLM,
        *,
        embed_model: BaseEmbedding | None = None,
        similarity_top_k: int = 4,
        streaming: bool = False,
    ) -> FusionRAGQueryEngine:
        """Query a vector store filled through `FusionKVTransform`; `llm.kv_store` must hold its caches."""
        return cls(
            retriever=FusionRAGRetriever.from_vector_store(
                vector_store, embed_model=embed_model, similarity_top_k=similarity_top_k
            ),
            llm=llm,
            streaming=streaming,
        )

    def custom_query(self, query_str: str) -> Response | StreamingResponse:
        """Answer `query_str` from the retrieved chunks, reusing their caches.

        Raises:
            InvalidRequestError: there is no KV store to find chunk caches in.
        """
        store = self._store if self._store is not None else self.llm.kv_store
        if store is None:
            raise InvalidRequestError(
                "FusionRAGQueryEngine has no KV store to find chunk caches in: build FusionRAGLLM(store=...) with the "
                "store FusionKVTransform wrote to, or use FusionRAGQueryEngine.from_index(index)"
            )
        nodes = self.retriever.retrieve(query_str)
        stream = self.llm.stream_prompt(self._prompt(query_str, nodes), store=store)
        if not self.streaming:
            generation = stream.collect()
            return Response(clean_output(generation.text), source_nodes=nodes, metadata=generation_metadata(generation))
        metadata: dict[str, Any] = {}

        def pieces() -> Generator[str, None, None]:
            for piece in stream:
                yield clean_output(piece)
            assert stream.result is not None  # NOTE: set once the stream is exhausted.
            metadata.update(generation_metadata(stream.result))

        return StreamingResponse(response_gen=pieces(), source_nodes=nodes, metadata=metadata)

    def _prompt(self, question: str, nodes: list[NodeWithScore]) -> FusionPrompt:
        # NOTE: the cache of a chunk was computed on its text without metadata; the same text here
        # gives the same token ids, which the engine checks before reusing a cache.
        chunks = [(n.node.node_id, n.node.get_content(metadata_mode=MetadataMode.NONE)) for n in nodes]
        return self.llm.engine.prompt(question, chunks=chunks)


__all__ = ["FusionRAGQueryEngine"]
