"""A chunk's Chroma entry: the one format every route writes and reads.

`FusionIndex` (the CLI, LangChain) and LlamaIndex's `ChromaVectorStore` (fed by an
`IngestionPipeline` with `FusionKVTransform`) write the same entry for a chunk, so a corpus built
through either route is read through the other:

* id: the chunk id, also the key of its KV caches; document: the chunk text without metadata
  (the text its caches were computed on); embedding: all-MiniLM-L6-v2 (see `chroma`).
* metadata, flat primitives, in three groups:
    - the user's own keys (`file_name`, ...): what readers and the LLM may see;
    - source keys (`doc_id`, `chunk_index`): where the chunk came from; readers see them, an LLM
      prompt does not;
    - internal keys (`INTERNAL_KEYS`): ownership and fusion bookkeeping that `FusionIndex` keeps
      up to date (`fusion_docs`, `fusion_neighbours`, `fusion_radius`, `fusion_pending`, ...),
      the chunk id (`fusionrag_chunk_id`, which marks an entry as a FusionRAG chunk), and
      LlamaIndex's node record (`_node_content`, `_node_type`, `document_id`, `ref_doc_id`).
      No reader shows them and no prompt or embedding text contains them.

LlamaIndex's `ChromaVectorStore` rebuilds a node from `_node_content` (the node's JSON without its
text) and the document; an entry without it falls back to LlamaIndex's legacy reader, which shows
every flat key to the LLM. So `FusionIndex` writes a node record for each chunk (`node_record`):
the user's keys plus the chunk id as node metadata, the chunk id listed in both
`excluded_llm_metadata_keys` and `excluded_embed_metadata_keys`, and the first owning document as
the node's source. The bookkeeping stays top-level only, where `FusionIndex` updates it.

NOTE: this module knows LlamaIndex's record layout as plain JSON; it imports no framework.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fusionrag_core.ingest.chroma import DOC_ID_KEY, Primitive

CHUNK_INDEX_KEY = "chunk_index"
"""Position of the chunk in the first document that contains it."""
OWNERS_KEY = "fusion_docs"
"""JSON list of the ids of every document containing the chunk, first owner first."""
OWNER_COUNT_KEY = "fusion_owners"
"""len(fusion_docs): lets `delete` find shared chunks with a metadata filter instead of a scan."""
NEIGHBOURS_KEY = "fusion_neighbours"
"""Space-separated ids of the chunks the fused cache was prefilled after, nearest first."""
RADIUS_KEY = "fusion_radius"
"""Cosine distance of the n-th neighbour; a new chunk nearer than this changes the neighbour set."""
PENDING_KEY = "fusion_pending"
"""True while the fused cache is out of date."""
CHUNK_ID_KEY = "fusionrag_chunk_id"
"""The chunk id (equal to the entry id): marks an entry as a FusionRAG chunk in every route."""

NODE_CONTENT_KEY = "_node_content"
NODE_TYPE_KEY = "_node_type"
# NOTE: LlamaIndex writes the source document's id under these three keys (`doc_id` is ours too);
# `ChromaVectorStore.delete(ref_doc_id)` filters on `document_id`.
LLAMA_INDEX_DOC_KEYS = ("document_id", "ref_doc_id")
NODE_RECORD_KEYS = frozenset({NODE_CONTENT_KEY, NODE_TYPE_KEY, *LLAMA_INDEX_DOC_KEYS})

SOURCE_KEYS = frozenset({DOC_ID_KEY, CHUNK_INDEX_KEY})
"""Where a chunk came from: shown to readers, hidden from prompts."""
INTERNAL_KEYS = frozenset({OWNERS_KEY, OWNER_COUNT_KEY, NEIGHBOURS_KEY, RADIUS_KEY, PENDING_KEY, CHUNK_ID_KEY}
                          | NODE_RECORD_KEYS)
"""Bookkeeping no reader shows and no prompt or embedding text contains."""
RESERVED_KEYS = SOURCE_KEYS | INTERNAL_KEYS
"""Keys a user's metadata may not use (and an LLM never sees)."""

OPEN_RADIUS = 3.0
"""Radius of a chunk with fewer than n neighbours: cosine distance is at most 2, so any new chunk
changes its neighbour set."""
_TEXT_NODE = "TextNode"
# NOTE: LlamaIndex's NodeRelationship.SOURCE and ObjectType.DOCUMENT, as its JSON spells them.
_SOURCE_RELATIONSHIP, _DOCUMENT_TYPE = "1", "4"


def user_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """An entry's metadata without its internal keys (the user's and the source keys)."""
    return {k: v for k, v in metadata.items() if k not in INTERNAL_KEYS}


def ownership(owners: Sequence[str]) -> dict[str, Primitive]:
    """The ownership keys of a chunk owned by `owners` (first owner first), in every route's spelling."""
    first = owners[0]
    return {DOC_ID_KEY: first, **dict.fromkeys(LLAMA_INDEX_DOC_KEYS, first),
            OWNERS_KEY: json.dumps(list(owners)), OWNER_COUNT_KEY: len(owners)}


def fusion_state(neighbours: Sequence[tuple[str, float]], n: int) -> dict[str, Primitive]:
    """The fusion keys of a chunk whose fused cache was prefilled after `neighbours`.

    Args:
        neighbours: `(chunk id, cosine distance)`, nearest first.
        n: how many neighbours fusion asks for (fewer found: the radius stays open).
    """
    radius = neighbours[-1][1] if len(neighbours) >= n and neighbours else OPEN_RADIUS
    return {NEIGHBOURS_KEY: " ".join(cid for cid, _ in neighbours), RADIUS_KEY: float(radius), PENDING_KEY: False}


def node_record(chunk_id: str, doc_id: str, metadata: Mapping[str, Primitive]) -> dict[str, str]:
    """The LlamaIndex node record of a chunk (the `_node_content` / `_node_type` keys).

    Args:
        chunk_id: the node id.
        doc_id: the document the node names as its source (`node.ref_doc_id`).
        metadata: the user's own metadata (no internal or source keys).

    Returns:
        What `llama_index.core.vector_stores.utils.metadata_dict_to_node` reads: a `TextNode` whose
        metadata is `metadata` plus the chunk id, the chunk id hidden from LLM and embedding text.
    """
    hidden = [CHUNK_ID_KEY]
    node = {
        "id_": chunk_id,
        "metadata": {**metadata, CHUNK_ID_KEY: chunk_id},
        "excluded_llm_metadata_keys": hidden,
        "excluded_embed_metadata_keys": hidden,
        "relationships": {_SOURCE_RELATIONSHIP: {"node_id": doc_id, "node_type": _DOCUMENT_TYPE}},
        "text": "",  # NOTE: the text is the entry's document (as LlamaIndex stores it)
    }
    return {NODE_CONTENT_KEY: json.dumps(node, ensure_ascii=False), NODE_TYPE_KEY: _TEXT_NODE}


def record_upgrade(chunk_id: str, metadata: Mapping[str, Any]) -> dict[str, Primitive] | None:
    """The keys an entry FusionIndex wrote before node records existed lacks, or None if it has them.

    Such an entry is read by LlamaIndex's legacy reader, which shows every flat key to the LLM;
    with its node record added it reads like a new one.
    """
    doc_id = metadata.get(DOC_ID_KEY)
    if NODE_CONTENT_KEY in metadata or OWNERS_KEY not in metadata or not isinstance(doc_id, str):
        return None
    own = {k: v for k, v in metadata.items() if k not in RESERVED_KEYS}
    return {CHUNK_ID_KEY: chunk_id, **dict.fromkeys(LLAMA_INDEX_DOC_KEYS, doc_id),
            **node_record(chunk_id, doc_id, own)}


def is_chunk_entry(chunk_id: str, metadata: Mapping[str, Any]) -> bool:
    """Whether an entry was written by a FusionRAG route (its id is a chunk id with caches).

    Entries written before the chunk id was recorded carry FusionIndex's ownership keys instead.
    """
    return metadata.get(CHUNK_ID_KEY) == chunk_id or OWNERS_KEY in metadata


__all__ = [
    "CHUNK_ID_KEY",
    "CHUNK_INDEX_KEY",
    "INTERNAL_KEYS",
    "NEIGHBOURS_KEY",
    "NODE_CONTENT_KEY",
    "NODE_RECORD_KEYS",
    "NODE_TYPE_KEY",
    "OPEN_RADIUS",
    "OWNERS_KEY",
    "OWNER_COUNT_KEY",
    "PENDING_KEY",
    "RADIUS_KEY",
    "RESERVED_KEYS",
    "SOURCE_KEYS",
    "fusion_state",
    "is_chunk_entry",
    "node_record",
    "ownership",
    "record_upgrade",
    "user_metadata",
]
