"""LangChain Documents and FusionRAG chunks: `format_docs` for prompts, search hits as Documents.

A Document's `id` is the chunk id, the one key shared by the vector DB and the KV store; its
metadata says whether a cache is stored for it. Tensors never travel in a Document.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from langchain_core.documents import Document

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.chroma import RetrievedChunk
from fusionrag_core.ingest.records import user_metadata
from fusionrag_core.recognise.marks import mark_chunk
from fusionrag_core.store import KVStore, validate_chunk_id

CacheStatus = Literal["fused", "independent", "missing"]
CHUNK_ID_KEY = "chunk_id"
CACHE_KEY = "fusionrag_cache"
SCORE_KEY = "fusionrag_score"


def format_docs(docs: Sequence[Document]) -> str:
    """The context text of a prompt, with each document marked so a FusionRAG model reuses its cache.

    Each document becomes `mark_chunk(doc.id, doc.page_content)`, concatenated in order (the model
    puts its passage separator after every chunk itself). Use it where a RAG chain joins retrieved
    documents: `{"context": retriever | format_docs, ...}`. A document without an id, or with an id
    that cannot be a chunk id, is rendered as plain text (found by content, else prefilled). A mark
    whose id has no cache (e.g. a document id from `FusionRAGVectorStore`) is found by its text:
    the stored chunks whose whole text occurs in it are reused, reported as "mark_then_content"
    in `chunk_found_by`; a text that matches none stays a reported cache miss under its id.

    NOTE: the marks are private-use characters read by ChatFusionRAG / FusionRAGLLM; for any other
    model remove them with `fusionrag_core.strip_marks`.

    NOTE: a document's text may hold any characters, mark characters included: a mark records
    its text's length and a MAC, so nothing inside a document can end or forge a mark.
    """
    parts: list[str] = []
    for doc in docs:
        chunk_id = _chunk_id(doc)
        parts.append(mark_chunk(chunk_id, doc.page_content) if chunk_id else doc.page_content)
    return "".join(parts)


def chunk_inputs(docs: Sequence[Document]) -> list[tuple[str | None, str]]:
    """`(chunk_id, text)` pairs for `FusionEngine.prompt`; same id rules as `format_docs`."""
    return [(_chunk_id(doc), doc.page_content) for doc in docs]


def _chunk_id(doc: Document) -> str | None:
    """The document's id if a KV cache can be stored under it, else None (plain text)."""
    if not doc.id:
        return None
    try:
        return validate_chunk_id(doc.id)
    except InvalidRequestError:
        return None


def cache_status(store: KVStore, chunk_id: str) -> CacheStatus:
    """Which cache a query would load for `chunk_id`: the fused one is preferred (as the engine does)."""
    if store.has(chunk_id, "fused"):
        return "fused"
    if store.has(chunk_id, "independent"):
        return "independent"
    return "missing"


def search_documents(index: FusionIndex, query: str, k: int) -> list[Document]:
    """The `k` chunks of `index` most similar to `query`, best first, as Documents.

    A Document's `id` is the chunk id; its metadata is the chunk's own (doc_id, chunk_index, user
    metadata) plus `chunk_id`, `fusionrag_cache` (which cache a query would load) and
    `fusionrag_score` (cosine similarity to the query).
    """
    return [_to_document(hit, cache_status(index.store, hit.chunk_id)) for hit in index.search(query, k)]


def _to_document(chunk: RetrievedChunk, status: CacheStatus) -> Document:
    # NOTE: the index's own bookkeeping (owners, neighbours, pending re-fusion, LlamaIndex's node
    # record) is not the reader's concern.
    own = user_metadata(chunk.metadata)
    metadata = {**own, CHUNK_ID_KEY: chunk.chunk_id, CACHE_KEY: status, SCORE_KEY: chunk.score}
    return Document(id=chunk.chunk_id, page_content=chunk.text, metadata=metadata)
