"""Where one request's caches come from, and why a request reused nothing.

`ReuseSources` is the store a request reads: the caches of an index (ingested, found by content
through the index's `ContentIndex`) first, then caches learned from traffic (`learn.py`).
`ReuseMonitor` belongs to one model instance: the first request with real context that reuses
nothing logs one WARNING naming the likely cause and its fix, so reuse is never lost in silence.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping, Sequence

import torch

from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.errors import CacheMismatchError, CacheNotFoundError, InvalidRequestError
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.recognise.content_index import Match, content_index_for
from fusionrag_core.reuse.learned import LearnedCaches, content_id
from fusionrag_core.runtime.kv import ChunkKV, Variant
from fusionrag_core.store.base import KVStore

logger = logging.getLogger("fusionrag")

MIN_CONTEXT_TOKENS = 64
"""A request with at least this many context tokens is expected to reuse something."""


class ReuseSources(KVStore):
    """What one request reads caches from: an index's store (ingested) first, then learned caches.

    A read view (`put` goes to the primary store) that also finds chunks by content in both
    content indexes. Either part may be None.

    Args:
        primary: the KV store ingest wrote (None: none attached).
        learned: caches learned so far (None: learning off, or nothing learned yet).
        learning: whether retrieved documents are made learnable (default: `learned` is given).
    """

    def __init__(self, primary: KVStore | None, learned: LearnedCaches | None, *,
                 learning: bool | None = None) -> None:
        super().__init__(primary.storage_dtype if primary is not None else "float16")
        self.primary = primary
        self.learned = learned
        self.learning = learned is not None if learning is None else learning
        self.primary_index = content_index_for(primary) if primary is not None else None
        self.retrieved = 0  # NOTE: how many retrieved documents `prompt` was given (read by `diagnose`)

    def find(self, text: str) -> list[Match]:
        """Stored chunks found by content in `text`: the index's first, learned ones in the gaps."""
        found = self.primary_index.find(text) if self.primary_index is not None else []
        if self.learned is None:
            return found
        extra = [m for m in self.learned.index.find(text)
                 if all(m.end <= f.start or m.start >= f.end for f in found)]
        return sorted(found + extra, key=lambda m: m.start)

    def prompt(self, engine: FusionEngine, messages: Sequence[Mapping[str, str]],
               documents: Sequence[str] = ()) -> FusionPrompt:
        """`messages` as a FusionPrompt: chunks found by mark or content; `documents` (texts
        retrieved for this request) become learnable chunks where they occur, if learning is on.
        A mark whose id has no cache here is found by its text (see `PromptLayout.from_messages`)."""
        docs: dict[str, str] = {}
        self.retrieved = sum(1 for text in documents if text.strip())
        if self.learning:
            for text in documents:
                text = text.strip()
                if text:
                    docs[content_id(text, engine.fingerprint)] = text
        return engine.prompt_from_messages(messages, find=self.find, documents=docs, has_cache=self.has_cache)

    def has_cache(self, chunk_id: str) -> bool:
        """Whether any cache variant of `chunk_id` is stored here (ingested or learned)."""
        return self.has(chunk_id, "fused") or self.has(chunk_id, "independent")

    def put(self, chunk_id: str, kv: ChunkKV) -> None:
        if self.primary is None:
            raise InvalidRequestError("no KV store to write to: this view only has learned caches")
        self.primary.put(chunk_id, kv)

    def get(self, chunk_id: str, variant: Variant, *, fingerprint: str, shape: tuple[int, int, int] | None = None,
            device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> ChunkKV:
        if self.primary is not None:
            with contextlib.suppress(CacheNotFoundError):
                return self.primary.get(chunk_id, variant, fingerprint=fingerprint, shape=shape, device=device,
                                        dtype=dtype)
        if self.learned is not None:
            kv = self.learned.store.get(chunk_id, variant, fingerprint=fingerprint, shape=shape, device=device,
                                        dtype=dtype)
            self.learned.touch([chunk_id])
            return kv
        raise CacheNotFoundError(f"no {variant} KV cache for chunk {chunk_id}: no store and no learned caches")

    def has(self, chunk_id: str, variant: Variant) -> bool:
        return any(part is not None and part.has(chunk_id, variant) for part in (
            self.primary, self.learned.store if self.learned is not None else None))

    def delete(self, chunk_id: str, variant: Variant | None = None) -> None:
        if self.primary is not None:
            self.primary.delete(chunk_id, variant)

    def quarantine(self, chunk_id: str, variant: Variant) -> str | None:
        """Set the blob aside in the part `get` read it from: the primary store when it holds the
        entry, else the learned caches (see `KVStore.quarantine`; the part's errors propagate)."""
        for part in (self.primary, self.learned.store if self.learned is not None else None):
            if part is not None and part.has(chunk_id, variant):
                return part.quarantine(chunk_id, variant)
        return None  # NOTE: neither holds it any more: another request set it aside first

    def list_ids(self, variant: Variant | None = None) -> set[str]:
        return self.primary.list_ids(variant) if self.primary is not None else set()

    def close(self) -> None:
        """Nothing to release: the parts belong to their owners."""


def check_store_model(engine: FusionEngine, store: KVStore) -> None:
    """Refuse a KV store whose caches another model computed: not one of them could be reused.

    A store that cannot tell whose caches it holds (`KVStore.stored_fingerprints`) is accepted.

    Raises:
        CacheMismatchError: naming both models and the fix.
    """
    found = store.backend.stored_fingerprints()
    if found and engine.fingerprint not in found:
        raise CacheMismatchError(
            f"KV store {store.backend!r} holds caches computed by another model (fingerprint {min(found)[:12]}), "
            f"not by {engine.name!r} (fingerprint {engine.fingerprint[:12]}), so none could be reused; load the "
            "model it was built with, or pass another data_dir= / store= (one ingested with this model)"
        )


def learned_ids(prompt: FusionPrompt, generation: Generation, sources: ReuseSources) -> list[str]:
    """Chunks of `prompt` whose K/V this request kept as their learned cache."""
    if not sources.learning:
        return []
    return [s.chunk_id for s in prompt.segments if s.learn and s.chunk_id and s.chunk_id in generation.cache_misses]


class ReuseMonitor:
    """One per model instance: warns once when a request with context reuses no chunk cache."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._warned = False
        self._lock = threading.Lock()

    def check(self, engine: FusionEngine, prompt: FusionPrompt, generation: Generation,
              sources: ReuseSources) -> str | None:
        """Log (once) and return why `generation` reused nothing; None when it reused or had no context."""
        context = generation.context_tokens or generation.prompt_tokens - int(engine.layout.prefix_ids(
            engine.config.instruction).shape[0])
        if generation.reused_tokens or context < MIN_CONTEXT_TOKENS or learned_ids(prompt, generation, sources):
            return None
        cause = diagnose(prompt, generation, sources)
        with self._lock:
            if self._warned:
                return cause
            self._warned = True
        logger.warning("FusionRAG model %s reused no KV cache for a prompt with %d context tokens: %s "
                       "(this warning is shown once per model)", self.model_name, context, cause)
        return cause


def diagnose(prompt: FusionPrompt, generation: Generation, sources: ReuseSources) -> str:
    """The likely cause of a request that reused nothing, and its fix."""
    reasons = " ".join(generation.cache_misses.values())
    if "model" in reasons or "fingerprint" in reasons:
        return ("the stored caches were built by another model; re-ingest with this model or load the model the "
                "store was built with")
    if generation.cache_misses:
        return ("chunks were found but their caches are missing or do not match (" + reasons[:200] + "); run "
                "`fusionrag verify` / ingest again for this store")
    if sources.primary_index is not None and sources.primary_index.problem is not None:
        return f"{sources.primary_index.problem}; {sources.primary_index.fix}"
    if sources.primary is None and not sources.learning:
        return ("no KV store is attached and learning is off; pass index= or store= (the store ingest wrote), "
                "or turn learning on")
    if sources.primary_index is None and not sources.learning:
        return ("this KV store cannot find chunks by content (a Redis store keeps no content index); mark "
                "chunks with format_docs / FusionChunkMarker, or use a disk store")
    if sources.primary_index is not None and len(sources.primary_index) == 0 and not sources.learning:
        return ("the store holds no indexed chunk text: ingest the documents (FusionIndex.add_texts, "
                "FusionVectorStore, FusionKVTransform) or turn learning on")
    if sources.learning and sources.retrieved:
        # NOTE: the retriever ran and its documents were learnable: they are not in the prompt as returned.
        return (f"the context matches no stored chunk verbatim, and none of the {sources.retrieved} documents "
                "retrieved for this request occurs in it as the retriever returned it (the prompt changed their "
                "text: reformatted, truncated, metadata added); put the retrieved texts into the prompt unchanged, "
                "or ingest the documents as the prompt shows them")
    if not sources.learning:
        return ("the context matches no stored chunk verbatim (documents changed or were split differently after "
                "ingest); ingest these documents, or turn learning on so that retrieved documents are learned")
    return ("the context matches no stored chunk verbatim (documents changed or were split differently after "
            "ingest, or they were not retrieved through a LangChain retriever / LlamaIndex retriever this "
            "model could learn from); ingest these documents, or retrieve them with a framework retriever so "
            "learned caches pick them up from the next request on")


__all__ = ["MIN_CONTEXT_TOKENS", "ReuseMonitor", "ReuseSources", "check_store_model", "diagnose", "learned_ids"]
