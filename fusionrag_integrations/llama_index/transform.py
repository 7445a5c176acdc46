"""FusionKVTransform: an `IngestionPipeline` step that builds the chunks' KV caches (fused).

Place it after the node parser (it caches chunks, not whole documents); before or after the embed
model. For every node it sees it:

1. names the node by content: `node.id_` becomes the chunk id (`fusionrag_core.ingest.chunking.chunk_id`
   of the node text without metadata), the one key shared by the vector store and the KV store;
   relationships between the nodes of the batch follow the new ids; a node whose text repeats an
   earlier node of the batch is dropped (one chunk, one id, one cache);
2. records the chunk id and its fusion state (neighbours, radius) in bookkeeping metadata that LLM
   and embedder never see: the entry format a `FusionIndex` writes (`fusionrag_core.ingest.records`),
   so the collection is read by FusionIndex, the LangChain retriever and the CLI too;
3. stores the chunk's independent cache and, with `fuse`, its fused cache: prefilled after its
   `neighbours` most similar chunks of the batch (the FusionRAG offline step). Chunks already
   cached are skipped, so re-running a pipeline costs no model passes.

Caches are computed on `node.get_content(metadata_mode=MetadataMode.NONE)`, the text
`ChromaVectorStore` stores as the document and `FusionRAGQueryEngine` puts in the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import BaseNode, Document, MetadataMode, RelatedNodeInfo, TextNode, TransformComponent
from llama_index.core.utils import get_tqdm_iterable

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import FusionRAGError, InvalidRequestError
from fusionrag_core.ingest.chunking import ChunkingConfig, chunk_id
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.fusion import CacheBuilder, Neighbours, batch_neighbours, rank_neighbours
from fusionrag_core.ingest.records import CHUNK_ID_KEY, RESERVED_KEYS, fusion_state
from fusionrag_core.runtime.kv import neighbours_digest
from fusionrag_core.store import KVStore
from fusionrag_integrations.llama_index.embedding import FusionRAGEmbedding
from fusionrag_integrations.llama_index.llm import FusionRAGLLM

if TYPE_CHECKING:
    from fusionrag_core.index import FusionIndex

BOOKKEEPING_KEYS = RESERVED_KEYS
"""Metadata keys that are bookkeeping (source, ownership, fusion, chunk id, LlamaIndex's node
record), hidden from the LLM and the embedder."""


class FusionKVTransform(TransformComponent):
    """Builds and stores the KV caches of the nodes an `IngestionPipeline` feeds it.

    Fusion follows `fusionrag_core.ingest.ingestor`: `neighbours` and `fuse` mean what they mean in
    `IngestConfig`; chunk size and overlap are the node parser's business here.

    Example:
        >>> pipeline = IngestionPipeline(
        ...     transformations=[SentenceSplitter(chunk_size=256), FusionRAGEmbedding(), FusionKVTransform(llm)],
        ...     vector_store=ChromaVectorStore(chroma_collection=collection),
        ... )
        >>> pipeline.run(documents=documents)

    NOTE: the pipeline's own transformation cache may skip this step on a rerun of the same
    documents; caches already stored are kept, so that is harmless unless the KV store was emptied
    (run the pipeline with `disable_cache=True` then).
    """

    neighbours: int = Field(default=IngestConfig.neighbours, description="How many most similar chunks of the "
                            "batch a fused cache is prefilled after (the most similar one last).")
    fuse: bool = Field(default=IngestConfig.fuse, description="Build fused caches (else independent ones only).")

    _engine: FusionEngine | FusionRAGLLM = PrivateAttr()
    _store: KVStore | None = PrivateAttr(default=None)
    _embed_model: BaseEmbedding = PrivateAttr()

    def __init__(
        self,
        engine: FusionEngine | FusionRAGLLM,
        *,
        store: KVStore | None = None,
        embed_model: BaseEmbedding | None = None,
        **data: Any,
    ) -> None:
        """Build the transform.

        Args:
            engine: the engine (or a FusionRAGLLM, whose model then loads at the first batch).
            store: where caches go; default the LLM's `kv_store` (required with a bare engine). Use
                one store per vector store collection; for a collection a FusionIndex reads too,
                build the transform with `from_index` (its store and settings).
            embed_model: ranks neighbours of nodes that carry no embedding yet (default
                FusionRAGEmbedding; put the embed model before this step to embed only once).
            **data: `neighbours`, `fuse`.

        Raises:
            InvalidRequestError: invalid fusion settings.
        """
        super().__init__(**data)
        self._ingest_config()  # NOTE: validated by the ingest config they mirror.
        self._engine = engine
        self._store = store
        self._embed_model = embed_model or FusionRAGEmbedding()

    @classmethod
    def from_index(cls, index: FusionIndex, *, embed_model: BaseEmbedding | None = None) -> FusionKVTransform:
        """A transform that fills `index`'s corpus: its engine, KV store and fusion settings.

        Feed the pipeline's vector store with the same collection
        (`ChromaVectorStore(chroma_collection=index.collection)`) and embed with the index's model
        (`FusionRAGEmbedding()` for the default): the nodes become chunks `FusionIndex.search` /
        `answer`, the LangChain retriever and the CLI read, with their caches.

        Args:
            index: the FusionIndex whose collection the pipeline writes to.
            embed_model: as `FusionKVTransform(...)`.
        """
        config = index.config
        return cls(index.engine, store=index.store, embed_model=embed_model, neighbours=config.neighbours,
                   fuse=config.fuse)

    @classmethod
    def class_name(cls) -> str:
        return "fusionrag_kv_transform"

    def __getstate__(self) -> dict[Any, Any]:
        # NOTE: IngestionPipeline(num_workers>1) pickles transformations into worker processes;
        # a model and a store handle must not travel that way.
        raise FusionRAGError(
            "FusionKVTransform cannot be sent to worker processes; run the IngestionPipeline with num_workers=None"
        )

    @property
    def engine(self) -> FusionEngine:
        return self._engine.engine if isinstance(self._engine, FusionRAGLLM) else self._engine

    @property
    def store(self) -> KVStore:
        """The KV store caches are written to.

        Raises:
            InvalidRequestError: neither the transform nor its FusionRAGLLM has a store.
        """
        store = self._store
        if store is None and isinstance(self._engine, FusionRAGLLM):
            store = self._engine.kv_store
        if store is None:
            raise InvalidRequestError(
                "FusionKVTransform has no KV store to write caches to; pass store=open_store('./fusionrag-data/kv') "
                "(and give the query-side FusionRAGLLM the same store)"
            )
        return store

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        """Rename nodes to their chunk ids, tag them, and store their caches; returns the kept nodes."""
        engine, store = self.engine, self.store
        texts = [_chunk_text(node) for node in nodes]
        kept = _rename(nodes, [chunk_id(text, engine.fingerprint, _CHUNKING) for text in texts])
        # NOTE: every kept node, cached now or before: the standard query engine's prompts then find
        # the chunks by their text (recognise.py), with no marker in the pipeline.
        content = store.content_index()  # NOTE: None for a store that keeps none: marks find them there
        if content is not None:
            content.add([(node.node_id, _chunk_text(node)) for node in kept])
        fused = self.fuse and self.neighbours > 0
        todo = [node for node in kept if not store.has(node.node_id, "fused" if fused else "independent")]
        neighbours = self._neighbours(kept, kept) if fused else {}
        for node in kept:
            _tag(node, neighbours.get(node.node_id), self.neighbours)
        progress = bool(kwargs.get("show_progress", False))
        texts_by_id = {node.node_id: _chunk_text(node) for node in kept}
        config = self._ingest_config()
        # NOTE: the core's fusion (fusionrag_core.ingest.fusion): the same neighbour ranking, order,
        # no-neighbour fallback and context check as FusionIndex ingest, several chunks per pass.
        builder = CacheBuilder(engine, store, config, text_of=texts_by_id.get)
        # NOTE: as ingest does, every chunk also gets its independent cache (the baselines' cache,
        # the engine's fallback, and what other chunks are fused after).
        missing = [(n.node_id, texts_by_id[n.node_id]) for n in todo if not store.has(n.node_id, "independent")]
        for batch in get_tqdm_iterable(_batches(missing, config.batch_size), progress, "Independent caches"):
            builder.independent(batch)
        if not fused:
            return kept
        items = [(n.node_id, texts_by_id[n.node_id], neighbours[n.node_id]) for n in todo]
        for batch in get_tqdm_iterable(_batches(items, config.batch_size), progress, "Fusing chunk caches"):
            for (cid, _, near), kv in zip(batch, builder.fused(batch), strict=True):
                # NOTE: the digest lets FusionIndex.verify check the cache against the recorded neighbours.
                store.put(cid, replace(kv, fused_after=neighbours_digest([nid for nid, _ in near])))
        return kept

    def _ingest_config(self) -> IngestConfig:
        return IngestConfig(neighbours=self.neighbours, fuse=self.fuse)

    def _neighbours(self, nodes: list[BaseNode], todo: list[BaseNode]) -> dict[str, list[tuple[str, float]]]:
        """For each node of `todo`, its `neighbours` most similar other nodes of the batch, nearest first."""
        vectors: Sequence[Sequence[float] | None] = [node.embedding for node in nodes]
        if any(v is None for v in vectors):
            # NOTE: all from one model or none: embeddings of two models are not comparable.
            vectors = self._embed_model.get_text_embedding_batch([_chunk_text(node) for node in nodes])
        emb = np.asarray(vectors, dtype=np.float32)  # [N, E]
        emb /= np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        ids = [node.node_id for node in nodes]
        position = {cid: i for i, cid in enumerate(ids)}
        found = batch_neighbours(emb, ids, [position[node.node_id] for node in todo], self.neighbours)
        return {node.node_id: rank_neighbours(hits, self.neighbours) for node, hits in zip(todo, found, strict=True)}


# NOTE: LlamaIndex's node parser, not ours, cut these chunks; the default ChunkingConfig stands in
# for "chunking settings" in the id, so a text gets the same id here as in a FusionIndex.
_CHUNKING = ChunkingConfig()
_T = TypeVar("_T")


def _chunk_text(node: BaseNode) -> str:
    """The text a node's cache is computed on (no metadata).

    Raises:
        InvalidRequestError: the node is a whole Document, not a text chunk, or its text is blank.
    """
    if isinstance(node, Document) or not isinstance(node, TextNode):
        raise InvalidRequestError(
            f"FusionKVTransform got a {type(node).__name__} ({node.node_id}); it caches text chunks: put a node "
            "parser such as SentenceSplitter(chunk_size=256) before it in the pipeline"
        )
    text = node.get_content(metadata_mode=MetadataMode.NONE)
    if not text.strip():
        raise InvalidRequestError(
            f"node {node.node_id} has no text to cache; filter out empty nodes before FusionKVTransform"
        )
    return text


def _batches(items: Sequence[_T], size: int) -> list[Sequence[_T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _rename(nodes: Sequence[BaseNode], ids: list[str]) -> list[BaseNode]:
    """Give each node its chunk id, drop repeated chunks, and re-point relationships inside the batch."""
    renamed = {node.node_id: new for node, new in zip(nodes, ids, strict=True)}
    kept: dict[str, BaseNode] = {}
    for node, new in zip(nodes, ids, strict=True):
        if new in kept:
            continue
        node.id_ = new
        kept[new] = node
    for node in kept.values():
        for info in node.relationships.values():
            for item in info if isinstance(info, list) else [info]:
                if isinstance(item, RelatedNodeInfo) and item.node_id in renamed:
                    item.node_id = renamed[item.node_id]
    return list(kept.values())


def _tag(node: BaseNode, neighbours: Neighbours | None, n: int) -> None:
    """Record the chunk id (and the neighbours its fused cache is prefilled after) in metadata hidden
    from the LLM and the embedder, under the keys a FusionIndex reads (`fusionrag_core.ingest.records`)."""
    node.metadata[CHUNK_ID_KEY] = node.node_id
    if neighbours is not None:
        node.metadata.update(fusion_state(neighbours, n))
    hide(node)


def hide(node: BaseNode) -> BaseNode:
    """List the node's bookkeeping keys in its `excluded_llm_metadata_keys` and
    `excluded_embed_metadata_keys` (in place); returns the node."""
    hidden = [key for key in node.metadata if key in BOOKKEEPING_KEYS]
    for excluded in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
        excluded.extend(key for key in hidden if key not in excluded)
    return node


__all__ = ["BOOKKEEPING_KEYS", "CHUNK_ID_KEY", "FusionKVTransform", "hide"]
