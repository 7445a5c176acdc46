"""FusionRAGEmbedding: the project's offline all-MiniLM-L6-v2 as a LlamaIndex embed model.

LlamaIndex falls back to OpenAI embeddings when none is given (a download and an API key); pass
this one instead (`embed_model=FusionRAGEmbedding()`), so vectors written by an
`IngestionPipeline` and those of a FusionIndex collection come from the same model.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr

from fusionrag_core.ingest.chroma import EMBEDDING_ID, default_embedding_function


class FusionRAGEmbedding(BaseEmbedding):
    """Thin adapter over `fusionrag_core.ingest.chroma.default_embedding_function` (384-d, unit norm).

    The sentence-transformers model loads on first use. MiniLM embeds queries and passages alike.
    """

    model_name: str = Field(default=EMBEDDING_ID, description="Identity of the embedding model.")
    device: str | None = Field(default=None, description="Torch device to embed on (None: the default, CPU).")

    _function: Any = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "fusionrag_embedding"

    def _embed(self, texts: list[str]) -> list[Embedding]:
        if self._function is None:
            # NOTE: called exactly as FusionIndex calls it when no device is set, so both share one
            # loaded model (the function is cached per argument list).
            self._function = default_embedding_function() if self.device is None else default_embedding_function(
                self.device)
        return [[float(x) for x in vector] for vector in self._function(texts)]

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._embed([query])[0]

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._embed([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return self._embed(texts)


__all__ = ["FusionRAGEmbedding"]
