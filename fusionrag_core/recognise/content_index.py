"""Recognising stored chunks by their content in a prompt: the content index and its anchors.

The index itself lives with the store that owns it (`fusionrag_core.store.content_index`; a store
provides its corpus's through `KVStore.content_index()`); its public names are re-exported here,
where recognising code has always found them.
"""

from __future__ import annotations

from fusionrag_core.store.content_index import (
    ANCHOR_BITS,
    ANCHOR_CHARS,
    REBUILD_HINT,
    Anchor,
    ContentIndex,
    Match,
    chunk_anchor,
    prompt_probes,
    text_digest,
    window_hashes,
)

__all__ = ["ANCHOR_BITS", "ANCHOR_CHARS", "REBUILD_HINT", "Anchor", "ContentIndex", "Match", "chunk_anchor",
           "prompt_probes", "text_digest", "window_hashes"]
