"""`IngestConfig`: how documents are chunked and fused."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.ingest.chunking import ChunkingConfig

# NOTE: the order fusion stitches neighbours in, as collections record it (see `identity`): the
# most similar neighbour last, right before the chunk. It is the only order ingest builds.
_NEIGHBOUR_ORDER = "similar_last"


@dataclass(frozen=True)
class IngestConfig:
    """How documents are chunked and fused.

    Attributes:
        chunk_tokens: most tokens of chunk text per chunk (the LLM's tokens).
        chunk_overlap: most tokens shared by consecutive chunks of a document.
        neighbours: n, how many most similar other chunks a fused cache is prefilled after (the
            most similar one last, right before the chunk).
        fuse: compute fused caches (False: independent caches only, the CacheBlend/EPIC setting).
        batch_size: chunks embedded / added to the vector DB per call (resume granularity too).
        neighbour_cache_mb: memory for independent caches kept around to fuse with (LRU); the
            rest is read back from the store.
        prefill_batch: most chunks prefilled in one forward pass (packed, each chunk attending
            only to its own context; equal to one-at-a-time within fp tolerance). Packing is meant
            for GPUs (fewer, larger passes); on CPU it gains little.
        prefill_tokens: most KV slots (chunks + their neighbours + prefix) in one packed pass,
            which bounds its memory; a chunk whose own context is larger runs alone. A fused
            chunk takes ~(neighbours + 1) x chunk_tokens: raise it for large batches of big chunks.
    """

    chunk_tokens: int = 256
    chunk_overlap: int = 0
    neighbours: int = 10
    fuse: bool = True
    batch_size: int = 32
    neighbour_cache_mb: int = 1024
    prefill_batch: int = 8
    prefill_tokens: int = 8192

    def __post_init__(self) -> None:
        ChunkingConfig(self.chunk_tokens, self.chunk_overlap)  # NOTE: validates both eagerly.
        if self.neighbours < 0:
            raise InvalidRequestError(f"neighbours must be >= 0, got {self.neighbours}")
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
        """The settings the stored chunks and caches depend on, as a collection records them.

        This is an on-disk format: existing collections hold these exact keys ("neighbors", in
        that spelling, and "neighbour_order", always "similar_last"), and a collection opens only
        with settings whose identity equals the one it recorded. Keep the keys and values as they are.
        """
        return {
            "chunk_tokens": self.chunk_tokens,
            "chunk_overlap": self.chunk_overlap,
            "neighbors": self.neighbours,
            "fuse": self.fuse,
            "neighbour_order": _NEIGHBOUR_ORDER,
        }

    @classmethod
    def from_identity(cls, recorded: Mapping[str, Any]) -> IngestConfig:
        """The settings a collection recorded (`identity()`), other fields at their defaults.

        Raises:
            InvalidRequestError: the collection was fused in another neighbour order than the one
                ingest builds ("similar_last"), or records a setting this version does not know.
        """
        settings = dict(recorded)
        order = settings.pop("neighbour_order", _NEIGHBOUR_ORDER)
        if order != _NEIGHBOUR_ORDER:
            raise InvalidRequestError(
                f"the collection was fused with neighbour_order={order!r}, which ingest no longer builds "
                f"(only {_NEIGHBOUR_ORDER!r}); ingest the corpus into a new collection"
            )
        if "neighbors" in settings:
            settings["neighbours"] = settings.pop("neighbors")
        unknown = sorted(set(settings) - {"chunk_tokens", "chunk_overlap", "neighbours", "fuse"})
        if unknown:
            raise InvalidRequestError(f"the collection records unknown ingest settings {unknown}; "
                                      "open it with the FusionRAG version that built it")
        return cls(**settings)
