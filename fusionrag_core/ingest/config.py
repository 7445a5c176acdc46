"""`IngestConfig`: how documents are chunked and fused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.ingest.chunking import ChunkingConfig

NeighbourOrder = Literal["similar_last", "similar_first"]


@dataclass(frozen=True)
class IngestConfig:
    """How documents are chunked and fused.

    Attributes:
        chunk_tokens: most tokens of chunk text per chunk (the LLM's tokens).
        chunk_overlap: most tokens shared by consecutive chunks of a document.
        neighbors: n, how many most similar other chunks a fused cache is prefilled after.
        fuse: compute fused caches (False: independent caches only, the CacheBlend/EPIC setting).
        neighbour_order: "similar_last" puts the most similar neighbour right before the chunk;
            "similar_first" puts it first, right after the system prefix.
        batch_size: chunks embedded / added to the vector DB per call (resume granularity too).
        neighbour_cache_mb: memory for independent caches kept around to fuse with (LRU); the
            rest is read back from the store.
        prefill_batch: most chunks prefilled in one forward pass (packed, each chunk attending
            only to its own context; equal to one-at-a-time within fp tolerance). On CPU (SmolLM2
            fp32, 80-token chunks, one thread) 8 measured 1.09x the chunks/min of 1, 4 1.03x, 16
            1.08x (README, docs/bench/ingest-cpu-3); the gain is meant for GPUs (unmeasured).
        prefill_tokens: most KV slots (chunks + their neighbours + prefix) in one packed pass,
            which bounds its memory; a chunk whose own context is larger runs alone. A fused
            chunk takes ~(neighbors + 1) x chunk_tokens: raise it for large batches of big chunks.
    """

    chunk_tokens: int = 256
    chunk_overlap: int = 0
    neighbors: int = 10
    fuse: bool = True
    neighbour_order: NeighbourOrder = "similar_last"
    batch_size: int = 32
    neighbour_cache_mb: int = 1024
    prefill_batch: int = 8
    prefill_tokens: int = 8192

    def __post_init__(self) -> None:
        ChunkingConfig(self.chunk_tokens, self.chunk_overlap)  # NOTE: validates both eagerly.
        if self.neighbors < 0:
            raise InvalidRequestError(f"neighbors must be >= 0, got {self.neighbors}")
        if self.neighbour_order not in ("similar_last", "similar_first"):
            raise InvalidRequestError(
                f"neighbour_order must be 'similar_last' or 'similar_first', got {self.neighbour_order!r}"
            )
        if self.batch_size < 1 or self.neighbour_cache_mb < 0:
            raise InvalidRequestError("batch_size must be >= 1 and neighbour_cache_mb >= 0")
        if self.prefill_batch < 1 or self.prefill_tokens < 1:
            raise InvalidRequestError(
                f"prefill_batch and prefill_tokens must be >= 1, got {self.prefill_batch} and {self.prefill_tokens}"
            )

    @property
    def chunking(self) -> ChunkingConfig:
        return ChunkingConfig(self.chunk_tokens, self.chunk_overlap)

    def identity(self) -> dict[str, Any]:
        """The settings the stored chunks and caches depend on (recorded in the collection)."""
        return {
            "chunk_tokens": self.chunk_tokens,
            "chunk_overlap": self.chunk_overlap,
            "neighbors": self.neighbors,
            "fuse": self.fuse,
            "neighbour_order": self.neighbour_order,
        }
