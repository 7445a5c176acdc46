"""The caches ingest computes for a chunk: independent and fused, several chunks per forward pass.

The one definition of fusion, used by the local `Ingestor`, the LlamaIndex `FusionKVTransform`
and every Ray worker, so a chunk's caches are the same whichever path computed them:

* neighbours: the n nearest other chunks by cosine distance, ties broken by chunk id
  (`rank_neighbours`, `batch_neighbours`);
* independent: the chunk prefilled right after the canonical system prefix;
* fused: the chunk prefilled after the prefix and its neighbours' independent caches (re-rotated
  to consecutive positions), the nearest last, right before the chunk; a chunk with no
  neighbour's fused cache is its independent one; one that would not fit the model's context
  window is refused (`check_fusion_fits` up front, `CacheBuilder.fused` exactly). Every fused
  cache records the digest of its neighbour ids (`ChunkKV.fused_after`), whichever process built
  it, so `verify` and a resumed ingest can tell a cache built on other neighbours; and its fusion
  drift from the chunk's independent cache (`ChunkKV.drift`, `drift.fusion_drift`), which
  `select.select_drift_aware` weighs the question's attention by.

Chunks are packed into passes of at most `prefill_batch` chunks and `prefill_tokens` buffer slots
(`prefill.prefill_chunks`); the results equal one-at-a-time prefills within fp tolerance.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import (
    CacheCorruptError,
    CacheMismatchError,
    CacheNotFoundError,
    ContextLengthError,
    InvalidRequestError,
)
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.query.drift import fusion_drift
from fusionrag_core.runtime.kv import ChunkKV, neighbours_digest
from fusionrag_core.store.base import KVStore
from fusionrag_core.store.codec import as_stored, memory_torch_dtype

log = logging.getLogger(__name__)

Neighbours = Sequence[tuple[str, float]]
"""A chunk's neighbours as `(chunk id, cosine distance)`, nearest first."""
FusionItem = tuple[str, str, Neighbours]
"""What a fused cache is computed from: chunk id, chunk text, its neighbours."""
TextLookup = Callable[[str], str | None]
"""Chunk id -> its text (to recompute a neighbour's missing independent cache), or None."""
BlobPut = Callable[[str, ChunkKV], None]
"""Stores a cache under a chunk id (`KVStore.put`, or `BlobWriter.put`)."""

# NOTE: rows of a distance matrix computed at once: [256, N] float32 stays ~100 MB at N = 100k.
DISTANCE_BLOCK = 256
# NOTE: a chunk of `chunk_tokens` tokens takes up to this many more positions (the passage separator).
_SEPARATOR_SLACK = 4


def rank_neighbours(candidates: Mapping[str, float], n: int) -> list[tuple[str, float]]:
    """The `n` nearest of `candidates` (chunk id -> cosine distance), nearest first; equal
    distances are ordered by chunk id, so every process ranks the same neighbours alike."""
    return sorted(candidates.items(), key=lambda hit: (hit[1], hit[0]))[:n]


def batch_neighbours(
    embeddings: np.ndarray, ids: Sequence[str], rows: Sequence[int], n: int
) -> list[dict[str, float]]:
    """For each of `rows`, up to `n` nearest *other* entries of `embeddings` as {chunk id: distance}.

    Args:
        embeddings: `[N, d]` unit rows (cosine similarity is a dot product).
        ids: the chunk id of each row.
        rows: which rows to find neighbours for.
        n: how many neighbours each (unranked: pass them through `rank_neighbours`).
    """
    out: list[dict[str, float]] = []
    for lo in range(0, len(rows), DISTANCE_BLOCK):
        block = list(rows[lo : lo + DISTANCE_BLOCK])
        distances = 1.0 - embeddings[block] @ embeddings.T  # [B, N]
        for row, i in zip(distances, block, strict=True):
            row[i] = np.inf  # NOTE: not its own neighbour.
            nearest = np.argpartition(row, n - 1)[:n] if 0 < n < len(row) else np.arange(len(row) if n else 0)
            out.append({ids[j]: float(row[j]) for j in nearest if math.isfinite(row[j])})
    return out


def check_fusion_fits(engine: FusionEngine, neighbours: int, chunk_tokens: int) -> None:
    """Refuse settings whose fused prefill (prefix, `neighbours` chunks, the chunk) cannot fit the model.

    Raises:
        ContextLengthError: it does not fit; says which settings to lower.
    """
    chunk = chunk_tokens + _SEPARATOR_SLACK
    need = _prefix_tokens(engine) + (neighbours + 1) * chunk
    if need > engine.context_window:
        raise ContextLengthError(
            f"a fused prefill of {neighbours} neighbours + the chunk ({chunk_tokens} tokens each) needs ~{need} "
            f"positions, more than the model's {engine.context_window}; lower the number of neighbours "
            "(IngestConfig.neighbours) or the chunk size (chunk_tokens)"
        )


def _prefix_tokens(engine: FusionEngine) -> int:
    return int(engine.layout.prefix_ids(engine.config.instruction).shape[0])


class IndependentCaches:
    """Independent caches to fuse with: an LRU in memory in front of the store.

    NOTE: kept at the precision the store gives back (`as_stored`), so a fused cache is the same
    whether its neighbours came from memory or from the store (a resumed ingest reproduces an
    uninterrupted one), 8-bit storage included.
    """

    def __init__(self, engine: FusionEngine, store: KVStore, budget_bytes: int) -> None:
        self.engine = engine
        self.store = store
        self.budget = budget_bytes
        self._dtype = memory_torch_dtype(store.storage_dtype)  # what `as_stored` keeps
        self._lru: OrderedDict[str, ChunkKV] = OrderedDict()
        self._bytes = 0

    def put(self, chunk_id: str, kv: ChunkKV, store_put: BlobPut | None = None) -> None:
        """Store `kv` (by `store_put`, default the store's own `put`) and keep it in memory to fuse with."""
        (store_put or self.store.put)(chunk_id, kv)
        self._remember(chunk_id, as_stored(kv, self.store.storage_dtype))

    def get(self, chunk_id: str) -> ChunkKV:
        """The chunk's independent cache on the engine's device and dtype.

        Raises:
            CacheNotFoundError / CacheCorruptError / CacheMismatchError: from the store.
        """
        kv = self._lru.get(chunk_id)
        if kv is None:
            kv = self.store.get(chunk_id, "independent", fingerprint=self.engine.fingerprint,
                                shape=self.engine.kv_shape, device="cpu", dtype=self._dtype)
            self._remember(chunk_id, kv)
        else:
            self._lru.move_to_end(chunk_id)
        return kv.to(self.engine.device, self.engine.decoder.dtype)

    def _remember(self, chunk_id: str, kv: ChunkKV) -> None:
        if kv.nbytes > self.budget:
            return
        if chunk_id in self._lru:
            self._bytes -= self._lru.pop(chunk_id).nbytes
        self._lru[chunk_id] = kv
        self._bytes += kv.nbytes
        while self._bytes > self.budget:
            self._bytes -= self._lru.popitem(last=False)[1].nbytes


class CacheBuilder:
    """Computes (and, for independent caches, stores) the ingest caches of chunks.

    Args:
        engine: the model.
        store: where independent caches go and neighbours' caches come from.
        config: `prefill_batch`, `prefill_tokens`, `neighbour_cache_mb`, `chunk_tokens`.
        text_of: finds a neighbour's text when its independent cache is unusable (the cache is
            then recomputed); None: such a neighbour raises `InvalidRequestError`.
    """

    def __init__(self, engine: FusionEngine, store: KVStore, config: IngestConfig,
                 text_of: TextLookup | None = None) -> None:
        self.engine = engine
        self.store = store
        self.config = config
        self.caches = IndependentCaches(engine, store, config.neighbour_cache_mb << 20)
        self.text_of = text_of
        self.prefills = 0
        """Chunk prefills run (independent and fused), for reports and tests."""

    def independent(self, chunks: Sequence[tuple[str, str]], put: BlobPut | None = None) -> None:
        """Compute and store the independent caches of `(chunk id, text)` pairs.

        Args:
            put: how each cache is stored (default: `store.put`, done when this returns). The
                ingest passes a `BlobWriter`'s, and flushes it before the store is read or the
                chunks are indexed; the caches stay readable from memory meanwhile.
        """
        ids = [self.engine.layout.chunk_ids(text) for _, text in chunks]
        for group in self._groups([int(t.shape[0]) for t in ids], [0] * len(ids)):
            kvs = self._prefill([ids[i] for i in group], [[] for _ in group])
            for i, kv in zip(group, kvs, strict=True):
                self.caches.put(chunks[i][0], kv, put)

    def fused(self, items: Sequence[FusionItem]) -> list[ChunkKV]:
        """The fused caches of `items`, in order (not stored: the caller decides when), each with the
        digest of its neighbour ids, nearest first (`fused_after`), and its drift from the chunk's
        independent cache (`drift`; None for a chunk without neighbours, whose fused cache is its
        independent one and says nothing about how its tokens depend on context).

        Raises:
            InvalidRequestError: a neighbour has no usable independent cache and no text.
        """
        out: dict[int, ChunkKV] = {}
        ids = [self.engine.layout.chunk_ids(text) for _, text, _ in items]
        ordered = [self._ordered(neighbours) for _, _, neighbours in items]
        for i, (cid, _, _) in enumerate(items):
            if not ordered[i]:
                # NOTE: a chunk with no other chunk to attend to: its fused cache is its independent one.
                out[i] = replace(self.caches.get(cid), variant="fused")
        todo = [i for i in range(len(items)) if i not in out]
        sizes = [int(ids[i].shape[0]) for i in todo]
        contexts = [self._context_tokens(ordered[i]) for i in todo]
        for group in self._groups(sizes, contexts):
            chosen = [todo[g] for g in group]
            neighbours = [[self._independent_of(n) for n in ordered[i]] for i in chosen]
            for i, kvs in zip(chosen, neighbours, strict=True):
                self._check_fits(items[i][0], ids[i], kvs)
            for i, kv in zip(chosen, self._prefill([ids[i] for i in chosen], neighbours), strict=True):
                alone = self._independent_of(items[i][0], items[i][1])
                out[i] = replace(kv, drift=fusion_drift(kv, alone, self.engine.decoder.rope))
        return [replace(out[i], fused_after=neighbours_digest([nid for nid, _ in item[2]]))
                for i, item in enumerate(items)]

    def _check_fits(self, chunk_id: str, token_ids: torch.Tensor, neighbours: Sequence[ChunkKV]) -> None:
        need = _prefix_tokens(self.engine) + int(token_ids.shape[0]) + sum(kv.num_tokens for kv in neighbours)
        if need > self.engine.context_window:
            raise ContextLengthError(
                f"chunk {chunk_id} fused after {len(neighbours)} neighbours needs {need} positions, more than the "
                f"model's {self.engine.context_window}; use fewer neighbours or smaller chunks"
            )

    def _ordered(self, neighbours: Neighbours) -> list[str]:
        """Neighbour ids in the order they are stitched in front of the chunk: the nearest last,
        right before the chunk (`neighbours` come nearest first)."""
        return [nid for nid, _ in reversed(neighbours)]

    def _context_tokens(self, neighbour_ids: Sequence[str]) -> int:
        # NOTE: a neighbour's length is only known once its cache is loaded; the chunk budget is a
        # good bound (chunks hold at most chunk_tokens tokens, + a separator).
        return len(neighbour_ids) * (self.config.chunk_tokens + _SEPARATOR_SLACK)

    def _groups(self, sizes: Sequence[int], contexts: Sequence[int]) -> Iterator[list[int]]:
        """Indices packed greedily into passes of <= prefill_batch chunks and <= prefill_tokens slots
        (a chunk larger than the token budget gets a pass of its own)."""
        group: list[int] = []
        slots = 0
        for i, (size, context) in enumerate(zip(sizes, contexts, strict=True)):
            need = size + context
            if group and (len(group) >= self.config.prefill_batch or slots + need > self.config.prefill_tokens):
                yield group
                group, slots = [], 0
            group.append(i)
            slots += need
        if group:
            yield group

    def _prefill(self, token_ids: Sequence[torch.Tensor], neighbours: Sequence[Sequence[ChunkKV]]) -> list[ChunkKV]:
        self.prefills += len(token_ids)
        return self.engine.chunk_caches(token_ids, neighbours)

    def _independent_of(self, chunk_id: str, text: str | None = None) -> ChunkKV:
        """The chunk's independent cache (a neighbour's, or the chunk's own to measure its drift).

        NOTE: the invariant says a Chroma chunk has its blobs; when it does not, recompute the cache
        from the chunk's text (`text`, else `text_of`; the result is the same cache), rather than
        fuse without it.
        """
        try:
            return self.caches.get(chunk_id)
        except (CacheNotFoundError, CacheCorruptError, CacheMismatchError) as e:
            text = text or (self.text_of(chunk_id) if self.text_of is not None else None)
            if not text:
                raise InvalidRequestError(
                    f"neighbour chunk {chunk_id} has no usable independent cache ({e}) and no text to recompute "
                    "it from; run FusionIndex.verify(repair=True)"
                ) from e
            log.warning("recomputing the independent cache of chunk %s: %s", chunk_id, e)
            self.independent([(chunk_id, text)])
            return self.caches.get(chunk_id)


__all__ = [
    "BlobPut",
    "CacheBuilder",
    "FusionItem",
    "IndependentCaches",
    "Neighbours",
    "TextLookup",
    "batch_neighbours",
    "check_fusion_fits",
    "rank_neighbours",
]
