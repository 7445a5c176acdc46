"""A corpus's identity: an id created with its Chroma collection, and the store names derived from it.

Two data directories (two embedded Chroma databases, or two Chroma servers) may use the same
collection name and one Redis. Keyed by collection name alone, their caches shared one Redis
namespace, and one corpus's orphan sweep deleted the other's blobs. The id is a random UUID
written into the collection's metadata when the collection is created, so every corpus gets
its own namespace, whatever it is called and wherever its database lives.

NOTE: collections ingested before corpus ids existed have none. They keep their old namespace
(`fusionrag.<collection>`) so their caches stay readable; `legacy_warning` says what that means
and how to move such a corpus to an isolated namespace (re-ingest it into a new collection).
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Mapping
from typing import Any

from fusionrag_core.store.codec import is_valid_namespace

log = logging.getLogger(__name__)

CORPUS_ID_KEY = "fusionrag_corpus_id"
"""Collection metadata key of the corpus id (32 hex characters)."""

_ID_RE = re.compile(r"[0-9a-f]{32}")


def new_corpus_id() -> str:
    """A fresh corpus id (random, 128 bits)."""
    return uuid.uuid4().hex


def corpus_id_of(metadata: Mapping[str, Any] | None) -> str | None:
    """The corpus id recorded in a collection's metadata, or None (a collection from before ids)."""
    value = (metadata or {}).get(CORPUS_ID_KEY)
    return value if isinstance(value, str) and _ID_RE.fullmatch(value) else None


def store_namespace(collection_name: str, corpus_id: str | None) -> str:
    """The Redis key prefix of a corpus: `fusionrag.<collection>.<id>` (only the id when too long).

    `corpus_id=None` (a legacy collection) gives the pre-id namespace `fusionrag.<collection>`.
    """
    if corpus_id is None:
        name = f"fusionrag.{collection_name}"
        return name if is_valid_namespace(name) else "fusionrag." + _digest(collection_name)
    name = f"fusionrag.{collection_name}.{corpus_id}"
    return name if is_valid_namespace(name) else f"fusionrag.{corpus_id}"


def legacy_warning(collection_name: str, where: str) -> str:
    """What a corpus without an id risks, and how to fix it."""
    return (
        f"collection {collection_name!r} in {where} was built before corpus ids: its caches stay under the shared "
        f"Redis namespace {store_namespace(collection_name, None)!r}, which another data directory with the same "
        "collection name on this Redis would also use (its ingest would delete this corpus's caches); re-ingest "
        "the documents into a new collection (--collection NAME) to give the corpus a namespace of its own"
    )


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


__all__ = ["CORPUS_ID_KEY", "corpus_id_of", "legacy_warning", "new_corpus_id", "store_namespace"]
