"""How a request's new context becomes learned caches: computed as ingest computes a chunk's, after the answer.

The documents and spans of a prompt that have no cache yet are left in the prompt as plain text,
so a request that reuses nothing is exactly a plain prefill whether learning is on or off. Once it
has answered, each such piece gets the caches ingest would give it (`ingest.fusion.CacheBuilder`):
an independent cache, computed after the system prefix alone, and a fused cache, computed after the
pieces that came right before it in the same prompt, with its fusion drift. So a learned cache
carries no context but its own request's, which is its own tenant's (the learned caches a request
reads and writes are its scope's: `session.ReuseSession.learned`), and never a prompt's text
around it that is not such a piece (another tenant's instruction, a question, a turn).

Best-effort, as learning always is: a directory that cannot take a cache skips the rest of the
request's, with one warning per cause, and the answer is unaffected.
"""

from __future__ import annotations

from collections.abc import Sequence

from fusionrag_core.engine import FusionEngine
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.fusion import CacheBuilder, FusionItem
from fusionrag_core.reuse.learned import LearnedCaches

NEIGHBOURS = 3
"""How many of the pieces right before a learned piece its fused cache is computed after: the
context a RAG prompt gives a document is mostly the few documents next to it."""


def learn_pieces(engine: FusionEngine, learned: LearnedCaches, pieces: Sequence[tuple[str, str]]) -> list[str]:
    """Compute and keep the caches of `pieces` (content id, text), in prompt order; returns the ids kept.

    A piece already learned (by a request that ran alongside) is not computed again. Each fused
    cache is computed after the independent caches of the up to `NEIGHBOURS` pieces before it.
    """
    pieces = list(dict(pieces).items())  # NOTE: a text the prompt repeats is learned once
    new = [(cid, text) for cid, text in pieces if not learned.store.has(cid, "fused")]
    if not new:
        return []
    text_of = dict(pieces)
    builder = CacheBuilder(engine, learned.store, IngestConfig(neighbours=NEIGHBOURS), text_of=text_of.get)
    order = [cid for cid, _ in pieces]
    items: list[FusionItem] = []
    for cid, text in new:
        at = order.index(cid)
        before = order[max(0, at - NEIGHBOURS):at]
        items.append((cid, text, [(n, 1.0) for n in reversed(before)]))  # NOTE: nearest first
    kept: list[str] = []
    try:
        builder.independent([(cid, text) for cid, text in pieces if not learned.store.has(cid, "independent")])
        for (cid, text, neighbours), fused in zip(items, builder.fused(items), strict=True):
            learned.keep(cid, text, fused, [n for n, _ in reversed(neighbours)])  # NOTE: in prompt order
            kept.append(cid)
    except learned.storage_errors as e:
        for cid, _ in new:
            if cid not in kept:
                learned.discard(cid)  # NOTE: an independent cache no LRU row bounds is not left behind
        learned.skipped.report(learned.location, e)
    return kept


__all__ = ["NEIGHBOURS", "learn_pieces"]
