"""LangChain `Embeddings` as the embedding function of a FusionRAG Chroma collection.

A FusionIndex embeds through a Chroma embedding function: ingest calls it on chunk texts (and
hands Chroma the very vectors it found neighbours with), Chroma calls its `embed_query` on query
texts. `ChromaEmbeddings` routes both to a LangChain `Embeddings` object, `embed_documents` and
`embed_query`, as langchain-chroma uses them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from chromadb.api.types import Documents, EmbeddingFunction
from chromadb.api.types import Embeddings as ChromaVectors
from langchain_core.embeddings import Embeddings

# NOTE: the fields that name an embedding model in the LangChain integrations (HuggingFace, OpenAI,
# Ollama, fake embeddings...); secrets never become part of an identity.
_IDENTITY_FIELDS = ("model", "model_name", "model_id", "deployment", "dimensions", "size")


class ChromaEmbeddings(EmbeddingFunction[Documents]):
    """A Chroma embedding function over a LangChain `Embeddings` object.

    NOTE: deliberately a "legacy" Chroma function (no `name()`): Chroma then records no embedding
    function in the collection, as for langchain-chroma (which passes `embedding_function=None`),
    so the collection opens anywhere; FusionRAG records the model itself (`fusionrag_id`).

    Args:
        embeddings: any LangChain embeddings.

    Attributes:
        fusionrag_id: the model's identity recorded in (and checked against) the collection.
    """

    def __init__(self, embeddings: Embeddings) -> None:
        self.embeddings = embeddings
        self.fusionrag_id = embeddings_identity(embeddings)

    def __call__(self, input: Documents) -> ChromaVectors:
        """Document embeddings (`Embeddings.embed_documents`)."""
        return _vectors(self.embeddings.embed_documents(list(input)))

    def embed_query(self, input: Documents) -> ChromaVectors:
        """Query embeddings (`Embeddings.embed_query`, one per text)."""
        return _vectors([self.embeddings.embed_query(text) for text in input])


def embeddings_identity(embeddings: Embeddings) -> str:
    """`langchain:<module>.<class>` plus the fields naming its model, e.g.
    `langchain:langchain_core.embeddings.fake.DeterministicFakeEmbedding(size=6)`."""
    cls = type(embeddings)
    fields = [f"{name}={value}" for name in _IDENTITY_FIELDS
              if isinstance(value := getattr(embeddings, name, None), str | int) and not isinstance(value, bool)]
    return f"langchain:{cls.__module__}.{cls.__qualname__}" + (f"({','.join(fields)})" if fields else "")


def _vectors(rows: list[list[float]]) -> ChromaVectors:
    out: Any = [np.asarray(row, dtype=np.float32) for row in rows]
    return out


__all__ = ["ChromaEmbeddings", "embeddings_identity"]
