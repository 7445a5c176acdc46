"""Ingest: chunk documents, precompute every chunk's independent and fused KV caches, index them.

One `add` call, top to bottom:

    cut documents into chunks (content ids)  -> settle ownership (updated/shared documents)
    -> independent caches of new chunks (stored)  -> each new chunk's top-n neighbours among the
       collection *and* the other new chunks  -> mark existing chunks whose neighbour set changes
    -> fused caches of new chunks (stored), then their Chroma entries  -> re-fuse marked chunks.

Invariants, which make an ingest killed at any point resumable by running it again:

* a chunk's KV blobs are written before its Chroma entry, and Chroma entries are deleted before
  blobs: every Chroma id has its blobs (`verify` repairs what a crash or bit rot breaks);
* a chunk whose fused cache is out of date (a neighbour appeared or was deleted) carries
  `fusion_pending=True` in its Chroma metadata until it is re-fused; every `add`, `delete` and
  `verify` finishes pending work, whoever left it;
* a chunk's fused cache is deleted before the Chroma entry of a neighbour it was fused after: no
  query, in any process, is served a fused cache built on a chunk that is gone (it reuses the
  chunk's independent cache until the re-fusion);
* blobs of chunks the collection does not hold (a run killed between blobs and entries) are
  deleted at the end of every `add` and `delete`, once this call's chunks are all in Chroma.

New chunks' blobs are stored on a writer thread (`fusionrag_core.ingest.writer`) while the next
packed prefills run, and the new chunks' embeddings are computed on another while the independent
prefills run; the writer is flushed (its errors raised) before the store is read back and before
a Chroma batch is written, so the order above holds.

Chroma metadata of a chunk (primitives only; tensors live in the KV store under the chunk id):
`doc_id` and `chunk_index` (the first document that contains it), the caller's metadata, the
bookkeeping keys and the LlamaIndex node record (the one entry format of every route:
`fusionrag_core.ingest.records`). A chunk whose text occurs in several documents is stored once and owned by
all of them (`fusion_docs`); it is deleted with its last owner, and keeps the first owner's
`chunk_index` and metadata.

NOTE: one writer at a time per corpus: two writers interleaving lose caches (one's orphan sweep
deletes blobs the other has not indexed yet). `FusionIndex` holds the corpus's writer lock
(`fusionrag_core.ingest.lock`) around every add, delete and verify; an Ingestor used directly must too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, cast

import numpy as np
import torch
from chromadb.api.models.Collection import Collection
from tqdm.auto import tqdm

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import (
    CacheCorruptError,
    CacheMismatchError,
    CacheNotFoundError,
    InvalidRequestError,
)
from fusionrag_core.ingest import chroma
from fusionrag_core.ingest.chunking import Chunker, chunk_id
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.fusion import (
    DISTANCE_BLOCK,
    CacheBuilder,
    batch_neighbours,
    check_fusion_fits,
    rank_neighbours,
)
from fusionrag_core.ingest.records import (
    CHUNK_ID_KEY,
    CHUNK_INDEX_KEY,
    NEIGHBOURS_KEY,
    OPEN_RADIUS,
    OWNER_COUNT_KEY,
    OWNERS_KEY,
    PENDING_KEY,
    RADIUS_KEY,
    RESERVED_KEYS,
    fusion_state,
    node_record,
    ownership,
    record_upgrade,
)
from fusionrag_core.ingest.space import Projection, check_room, fewest_chunks, fits, project
from fusionrag_core.ingest.writer import BlobWriter
from fusionrag_core.query.drift import fusion_drift
from fusionrag_core.runtime.kv import ChunkKV, Variant, neighbours_digest
from fusionrag_core.store.base import KVStore

log = logging.getLogger(__name__)

Primitive = chroma.Primitive

DOC_ID_KEY = chroma.DOC_ID_KEY

# NOTE: embeddings of the same text computed in different batches differ in the last float bits;
# a neighbour must be nearer by more than this to count as a change (no re-fusion flapping).
_RADIUS_EPS = 1e-5
# NOTE: an ingest projected to write this much prints its projection even without progress bars.
_ANNOUNCE_BYTES = 1 << 30


@dataclass
class IngestReport:
    """What one `add_texts` call did.

    Attributes:
        doc_ids: the documents, in input order.
        chunk_ids: per document, its chunk ids in order (a chunk occurring twice is listed twice).
        new_chunks: chunks added to the collection by this call.
        skipped_chunks: chunks of this call already complete (Chroma entry and caches), no work.
        re_fused_chunks: chunks already in the collection that were re-fused because their
            neighbour set changed (or their fused cache was missing).
        removed_chunks: chunks deleted because an updated document no longer contains them.
        prefills: chunk prefills run (independent + fused + re-fused).
        seconds: wall time of the call.
    """

    doc_ids: list[str]
    chunk_ids: list[list[str]]
    new_chunks: int = 0
    skipped_chunks: int = 0
    re_fused_chunks: int = 0
    removed_chunks: int = 0
    prefills: int = 0
    seconds: float = 0.0


@dataclass
class VerifyReport:
    """Agreement between the collection and the KV store.

    Attributes:
        chunks: Chroma entries checked.
        blobs: chunk ids with at least one blob in the store (before repair).
        missing: Chroma ids lacking a needed blob variant.
        corrupt: blobs that fail their checksum or cannot be read.
        mismatched: blobs of another model or shape, or whose tokens are not the chunk's text.
        orphans: store ids without a Chroma entry.
        textless: Chroma entries without text (cannot be recomputed).
        stale: fused caches out of date (a neighbour is gone, or marked pending).
        wrong_neighbours: fused caches prefilled after other neighbours than the collection records.
        repaired: whether problems were fixed.
        recomputed: prefills run by the repair.
        removed: Chroma entries removed by the repair (the textless ones).
        without_drift: good fused caches of chunks with neighbours that carry no fusion drift
            (written before drift was stored): not a problem (`drift_aware` scores them
            with the prompt's mean drift), an upgrade the repair makes.
        drift_added: of those, the ones the repair gave their drift (from the two stored caches,
            no prefill).
        incomplete: set when the last ingest or delete died mid-way (who and when): the corpus is
            short of its documents, or still holds parts of deleted ones; re-running that command
            finishes it. Nothing is repaired then, so the blobs the resumed ingest will use are kept.
        finished: set when a repairing verify found a delete that died mid-way and finished it
            (which, who and when) before checking.
        content_index: why the store's content index cannot be trusted (it cannot be read, its
            hash array is missing or cut, it lacks chunk texts): chunks are not found by their
            content in prompts. The repair rebuilds it from the collection's texts.
        content_index_rebuilt: chunk texts the repair rebuilt the content index from.
    """

    chunks: int = 0
    blobs: int = 0
    missing: int = 0
    corrupt: int = 0
    mismatched: int = 0
    orphans: int = 0
    textless: int = 0
    stale: int = 0
    wrong_neighbours: int = 0
    repaired: bool = False
    recomputed: int = 0
    removed: int = 0
    without_drift: int = 0
    drift_added: int = 0
    incomplete: str = ""
    finished: str = ""
    content_index: str = ""
    content_index_rebuilt: int = 0

    @property
    def ok(self) -> bool:
        """True when nothing was found wrong."""
        return not (self.missing or self.corrupt or self.mismatched or self.orphans or self.textless or self.stale
                    or self.wrong_neighbours or self.incomplete or self.content_index)


@dataclass
class Problems:
    """What `Ingestor.find_problems` found, for `Ingestor.repair`.

    Attributes:
        report: the counts (the `verify` result).
        orphans: store ids without a Chroma entry.
        textless: Chroma ids without text.
        bad_independent: `(chunk id, text)` of missing, corrupt or mismatched independent caches.
        bad_fused: chunk ids of missing, corrupt or mismatched fused caches.
        stale: chunk ids of fused caches out of date (pending, or a neighbour is gone).
        without_drift: chunk ids of good fused caches (with neighbours) that carry no drift.
    """

    report: VerifyReport
    orphans: list[str] = field(default_factory=list)
    textless: list[str] = field(default_factory=list)
    bad_independent: list[tuple[str, str]] = field(default_factory=list)
    bad_fused: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    without_drift: list[str] = field(default_factory=list)


@dataclass
class PendingChunk:
    """One chunk to ingest: its first occurrence decides its metadata."""

    chunk_id: str
    text: str
    doc_id: str
    index: int
    metadata: dict[str, Primitive]
    owners: list[str] = field(default_factory=list)
    neighbours: list[tuple[str, float]] = field(default_factory=list)
    embedding: np.ndarray | None = None  # [d] unit vector, given to Chroma with the chunk


def owners_of(metadata: Mapping[str, Any]) -> list[str]:
    """The ids of the documents owning a chunk (from its Chroma metadata), first owner first."""
    raw = metadata.get(OWNERS_KEY)
    if isinstance(raw, str):
        return [str(o) for o in json.loads(raw)]
    return [str(metadata[DOC_ID_KEY])] if DOC_ID_KEY in metadata else []


def checked_doc_ids(doc_ids: Sequence[str]) -> list[str]:
    """`doc_ids` as a list, checked (before anything is written for them).

    Raises:
        InvalidRequestError: one string instead of a list, or an id that is not a string.
    """
    if isinstance(doc_ids, str):
        raise InvalidRequestError("delete takes a list of doc ids, not one string: wrap it in a list")
    ids = list(doc_ids)
    for doc_id in ids:
        if not isinstance(doc_id, str):
            raise InvalidRequestError(f"doc ids are strings, got {doc_id!r} ({type(doc_id).__name__}); pass str(...)")
    return ids


def _default_doc_id(text: str) -> str:
    """The id of a document given without one: a hash of its text."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _neighbour_ids(metadata: Mapping[str, Any]) -> list[str]:
    return str(metadata.get(NEIGHBOURS_KEY) or "").split()


def _ids_of(neighbours: Sequence[tuple[str, float]]) -> list[str]:
    return [cid for cid, _ in neighbours]


def unit_rows(vectors: Sequence[Any]) -> np.ndarray:
    """`[N, d]` float32 unit rows (cosine similarity becomes a dot product)."""
    m = np.asarray([np.asarray(v, dtype=np.float32) for v in vectors], dtype=np.float32)
    if m.size == 0:
        return m.reshape(0, 0)
    return m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12)


class Ingestor:
    """Writes chunks into a collection and a KV store, keeping both in agreement.

    Args:
        engine: computes the caches (its fingerprint and tokenizer define the chunk ids).
        collection: Chroma collection of chunk texts (from `chroma.open_collection`).
        store: where the caches go.
        config: chunking and fusion settings.
        embedding_function: the collection's embedding function (embeds new chunks to find
            their neighbours before they are in the collection).

    Raises:
        ContextLengthError: n neighbours of `chunk_tokens` plus the chunk do not fit the model.
    """

    def __init__(
        self,
        engine: FusionEngine,
        collection: Collection,
        store: KVStore,
        config: IngestConfig,
        embedding_function: chroma.EmbeddingFn,
    ) -> None:
        self.engine = engine
        self.collection = collection
        self.store = store
        self.config = config
        self.embedding_function = embedding_function
        self.chunker = Chunker(engine.tokenizer, config.chunking)
        self.builder = CacheBuilder(engine, store, config, text_of=self._text_of)
        # NOTE: new chunks' blobs are stored on this writer's thread while the next prefills run;
        # it is flushed before their Chroma entries are written (and before the store is read).
        self.writer = BlobWriter(store)
        self._check_fits()

    @property
    def prefills(self) -> int:
        """Chunk prefills run by this ingestor (independent, fused and re-fused), for reports and tests."""
        return self.builder.prefills

    def _check_fits(self) -> None:
        if self.config.fuse:
            check_fusion_fits(self.engine, self.config.neighbours, self.config.chunk_tokens)

    # ---- add ----------------------------------------------------------------------------------------
    def add(
        self,
        texts: Sequence[str],
        metadatas: Sequence[Mapping[str, Any] | None] | None = None,
        doc_ids: Sequence[str] | None = None,
        *,
        progress: bool = False,
        space_check: bool = True,
        journal: AbstractContextManager[object] | None = None,
    ) -> IngestReport:
        """Ingest documents (see the module docstring for the order of work). Adding a document
        id that exists replaces that document: chunks it no longer contains are deleted.

        Before chunking, an estimate of the caches of the documents new to the collection, and
        before the first write, the caches of the new chunks, are checked against the store's free
        space (`space_check=False` goes on regardless).

        Args:
            journal: entered once the request is validated, chunked and its space checked, around
                every write (`FusionIndex` passes the writer lock's journal record): a request refused
                or interrupted before it writes leaves no record.

        Raises:
            InsufficientSpaceError: the projected caches do not fit (nothing was written).
            InvalidRequestError: bad texts, doc ids or metadata (nothing was written).
        """
        start = time.perf_counter()
        if space_check:
            self._check_room_before_chunking(texts, doc_ids)
        docs, chunks = self._cut(texts, metadatas, doc_ids, progress)
        present = chroma.get_rows(self.collection, list(chunks))
        new = [c for cid, c in chunks.items() if cid not in present]
        self._check_room(new, space_check, progress)
        # NOTE: nothing was written up to here; from here on every step writes.
        with journal or nullcontext(), self.writer:
            report = self._add(docs, chunks, present, new, progress)
        report.seconds = time.perf_counter() - start
        return report

    # NOTE: the embedding model and the LLM are different models on different cores; a subclass whose
    # prefills and embeddings share workers (Ray) turns this off.
    _embed_alongside_prefills = True

    def _add(self, docs: Mapping[str, list[str]], chunks: Mapping[str, PendingChunk],
             present: Mapping[str, chroma.Row], new: Sequence[PendingChunk], progress: bool) -> IngestReport:
        """The writing part of `add`, with the blob writer open (closed, and its error raised, by `add`):
        `docs` and `chunks` as `_cut` gives them, `present` the chunks already in the collection."""
        report = IngestReport(doc_ids=list(docs), chunk_ids=[list(ids) for ids in docs.values()])
        prefills = self.prefills
        report.removed_chunks = self._settle_ownership(docs, present)
        self._refresh_metadata(chunks, present)
        incomplete = self._incomplete(present)
        report.skipped_chunks = len(present) - len(incomplete)

        missing_independent = [c for c in new if not self._usable(c.chunk_id, "independent")]
        missing_independent += [c for c in incomplete if not self.store.has(c.chunk_id, "independent")]
        computing = {c.chunk_id for c in missing_independent}
        # NOTE: a run that died after storing these independent caches may not have indexed their texts.
        self._index_texts([(c.chunk_id, c.text) for c in new if c.chunk_id not in computing])
        embeddings = self._independent_and_embeddings(missing_independent, new, progress)
        if self.config.fuse:
            assert embeddings is not None
            self._mark_pending([c.chunk_id for c in incomplete])
            for c, embedding in zip(new, embeddings, strict=True):
                c.embedding = embedding
            self._find_neighbours(new, embeddings)
            self._mark_pending(self._affected_by(new, embeddings))
        self._add_new(new, progress)
        report.new_chunks = len(new)
        report.re_fused_chunks = self.fuse_pending(progress=progress)
        self._sweep_orphans()
        report.prefills = self.prefills - prefills
        return report

    def _independent_and_embeddings(self, missing: Sequence[PendingChunk], new: Sequence[PendingChunk],
                                    progress: bool) -> np.ndarray | None:
        """Phase 1 (independent caches of `missing`), and the embeddings of `new` when fusing (None
        otherwise): on a second thread while the prefills run, as neither needs the other."""
        if not self.config.fuse:
            self._independent(missing, progress)
            return None
        texts = [c.text for c in new]
        if not self._embed_alongside_prefills or not missing or not texts:
            self._independent(missing, progress)
            return self._embed(texts)
        with ThreadPoolExecutor(1, thread_name_prefix="fusionrag-embed") as pool:
            embedded = pool.submit(self._embed, texts)
            self._independent(missing, progress)
            return embedded.result()

    def _check_room_before_chunking(self, texts: Sequence[str], doc_ids: Sequence[str] | None) -> None:
        """Refuse documents whose caches cannot fit even by an estimate (chunking a large file takes
        minutes): each document new to the collection by id, its text counted once, as its tokens
        in the fewest chunks. Documents `_cut` will refuse are left to it."""
        if isinstance(texts, str) or self.store.free_bytes() is None:
            return
        texts = list(texts)
        ids = [_default_doc_id(t) if isinstance(t, str) else "" for t in texts] if doc_ids is None else list(doc_ids)
        if len(ids) != len(texts):
            return
        docs = {doc_id: t for t, doc_id in zip(texts, ids, strict=True)
                if isinstance(t, str) and t.strip() and isinstance(doc_id, str)}
        # NOTE: a token covers at least one UTF-8 byte, so bytes bound tokens: when even that fits,
        # which is the common case, nothing is tokenized before chunking.
        if self._room_for([len(t.encode()) for t in set(docs.values())]):
            return
        tokens = {t: self.chunker.tokens(t) for t in set(docs.values())}
        if self._room_for(list(tokens.values())):
            return
        # NOTE: only when all of them would not fit: the documents already indexed are looked up.
        known = {o for row in self.owned_by(list(docs)).values() for o in owners_of(row.metadata)}
        unknown = [tokens[t] for t in {t for doc_id, t in docs.items() if doc_id not in known}]
        if self._room_for(unknown) or self.store.list_ids() - chroma.all_ids(self.collection):
            # NOTE: caches no entry indexes yet are a stopped run's (a full disk, a kill), which this
            # run reuses; only the chunks tell which, so the check after chunking decides.
            return
        self._room_for(unknown, enforce=True)

    def _room_for(self, document_tokens: Sequence[int], *, enforce: bool = False) -> bool:
        """Whether documents of `document_tokens` tokens have room, by `fewest_chunks` (refused when
        `enforce`)."""
        counts = fewest_chunks(document_tokens, self.config.chunk_tokens)
        projection = project(self.store, self.engine.kv_shape, counts, 2 if self.config.fuse else 1, estimated=True)
        if enforce:
            check_room(projection, repr(self.store))
        return fits(projection)

    def _check_room(self, new: Sequence[PendingChunk], enforce: bool, progress: bool) -> None:
        """Project the new chunks' caches; refuse (when `enforce`) what the store has no room for.

        New chunks whose caches are all stored already (a stopped run wrote them before their
        entries) are not counted when the whole would not fit: the run resumed reuses them."""
        if not new:
            return
        variants: tuple[Variant, ...] = ("independent", "fused") if self.config.fuse else ("independent",)
        projection = self._projection(new, len(variants))
        if progress or projection.bytes >= _ANNOUNCE_BYTES:
            tqdm.write(f"fusionrag: projected {projection.describe(repr(self.store))}")
        if enforce and not fits(projection):
            to_write = [c for c in new if not all(self.store.has(c.chunk_id, v) for v in variants)]
            check_room(self._projection(to_write, len(variants)), repr(self.store))

    def _projection(self, chunks: Sequence[PendingChunk], variants: int) -> Projection:
        counts = [int(self.engine.layout.chunk_ids(c.text).shape[0]) for c in chunks]
        return project(self.store, self.engine.kv_shape, counts, variants)

    def _cut(
        self,
        texts: Sequence[str],
        metadatas: Sequence[Mapping[str, Any] | None] | None,
        doc_ids: Sequence[str] | None,
        progress: bool = False,
    ) -> tuple[dict[str, list[str]], dict[str, PendingChunk]]:
        """Chunk every document: (doc id -> its chunk ids, chunk id -> first occurrence)."""
        if isinstance(texts, str):
            raise InvalidRequestError("add_texts takes a list of texts, not one string: wrap it in a list")
        texts = list(texts)
        metas = list(metadatas) if metadatas is not None else [None] * len(texts)
        ids = list(doc_ids) if doc_ids is not None else [_default_doc_id(t) for t in texts]
        if not len(texts) == len(metas) == len(ids):
            raise InvalidRequestError(
                f"got {len(texts)} texts, {len(metas)} metadatas and {len(ids)} doc_ids; pass one of each per text"
            )
        docs: dict[str, list[str]] = {}
        seen_text: dict[str, str] = {}
        chunks: dict[str, PendingChunk] = {}
        # NOTE: in characters, and moving inside a document too: one long file can take minutes to cut.
        bar = tqdm(total=sum(len(t) for t in texts if isinstance(t, str)), desc="chunking", unit="char",
                   unit_scale=True, disable=not progress)
        done = 0
        for text, meta, doc_id in zip(texts, metas, ids, strict=True):
            if not isinstance(doc_id, str) or not doc_id:
                raise InvalidRequestError(f"doc ids must be non-empty strings, got {doc_id!r}")
            if not isinstance(text, str) or not text.strip():
                raise InvalidRequestError(f"document {doc_id!r} has no text; drop it or pass its text")
            if doc_id in seen_text:
                if seen_text[doc_id] != text:
                    raise InvalidRequestError(
                        f"doc id {doc_id!r} is given twice with different texts; doc ids must be unique"
                    )
                continue
            seen_text[doc_id] = text
            # NOTE: checked before any prefill: a bad value found at the Chroma add would leave orphans.
            user_meta = chroma.check_metadata(f"document {doc_id!r}", meta, RESERVED_KEYS)
            docs[doc_id] = []
            on_progress = (lambda at, base=done: bar.update(base + at - bar.n)) if progress else None
            pieces = self.chunker.split(text, on_progress)
            done += len(text)
            bar.update(done - bar.n)
            for index, piece in enumerate(pieces):
                cid = chunk_id(piece, self.engine.fingerprint, self.config.chunking)
                docs[doc_id].append(cid)
                chunk = chunks.setdefault(cid, PendingChunk(cid, piece, doc_id, index, user_meta))
                if doc_id not in chunk.owners:
                    chunk.owners.append(doc_id)
        bar.close()
        return docs, chunks

    def _text_of(self, chunk_id: str) -> str | None:
        row = chroma.get_rows(self.collection, [chunk_id]).get(chunk_id)
        return row.text if row is not None else None

    def _settle_ownership(self, docs: Mapping[str, list[str]], present: Mapping[str, chroma.Row]) -> int:
        """Claim present chunks for the documents that contain them, release (and delete) chunks an
        updated document no longer contains; returns how many chunks were deleted."""
        owners: dict[str, list[str]] = {cid: owners_of(r.metadata) for cid, r in self.owned_by(list(docs)).items()}
        owners.update({cid: owners_of(r.metadata) for cid, r in present.items() if cid not in owners})
        before = {cid: list(o) for cid, o in owners.items()}
        for cid, current in owners.items():
            for doc_id in docs:
                if doc_id in current and cid not in docs[doc_id]:
                    current.remove(doc_id)
        for doc_id, ids in docs.items():
            for cid in ids:
                if cid in owners and doc_id not in owners[cid]:
                    owners[cid].append(doc_id)
        released = [cid for cid, o in owners.items() if not o]
        changed = [cid for cid, o in owners.items() if o and o != before[cid]]
        if changed:
            chroma.update_metadata(self.collection, changed, [ownership(owners[cid]) for cid in changed])
        return self._remove(released)

    def _refresh_metadata(self, chunks: Mapping[str, PendingChunk], present: Mapping[str, chroma.Row]) -> None:
        """A document added again with other metadata (same text) gets its new metadata on the
        chunks it is the first owner of: keys it dropped are removed, bookkeeping is kept."""
        ids: list[str] = []
        metas: list[dict[str, Primitive | None]] = []
        for cid, row in present.items():
            c = chunks[cid]
            if owners_of(row.metadata)[:1] != [c.doc_id]:
                continue  # NOTE: a chunk keeps its first owner's metadata (see the module docstring).
            old = {k: v for k, v in row.metadata.items() if k not in RESERVED_KEYS}
            if old != c.metadata or row.metadata.get(CHUNK_INDEX_KEY) != c.index:
                ids.append(cid)
                # NOTE: LlamaIndex's node record holds the user's metadata too (chunk_record.node_record).
                metas.append({**dict.fromkeys(old), **c.metadata, CHUNK_INDEX_KEY: c.index,
                              **node_record(cid, c.doc_id, c.metadata)})
        for start in range(0, len(ids), self.config.batch_size):
            sl = slice(start, start + self.config.batch_size)
            # NOTE: Chroma's update merges metadata; a None value deletes the key.
            self.collection.update(ids=ids[sl], metadatas=cast(Any, metas[sl]))

    def owned_by(self, doc_ids: Sequence[str], include: chroma.Include = ("metadatas",)) -> dict[str, chroma.Row]:
        """Chunks (any owner position) of the given documents, with `include` read ("metadatas" at least)."""
        if not doc_ids:
            return {}
        where = {"$or": [{DOC_ID_KEY: {"$in": list(doc_ids)}}, {OWNER_COUNT_KEY: {"$gt": 1}}]}
        wanted = set(doc_ids)
        out: dict[str, chroma.Row] = {}
        for page in chroma.scan(self.collection, list(dict.fromkeys(["metadatas", *include])), where):
            out.update({cid: r for cid, r in page.items() if wanted.intersection(owners_of(r.metadata))})
        return out

    def _incomplete(self, present: Mapping[str, chroma.Row]) -> list[PendingChunk]:
        """Present chunks lacking a usable blob (a crash between a delete and its cleanup, manual
        deletion, a corrupt blob): their text comes back from the collection. Bad blobs are set aside
        on the way, so `store.has` tells the truth afterwards."""
        variants: tuple[Variant, ...] = ("independent", "fused") if self.config.fuse else ("independent",)
        out = []
        for cid, row in present.items():
            if row.text and not all([self._usable(cid, v) for v in variants]):
                out.append(PendingChunk(cid, row.text, owners_of(row.metadata)[0], 0, {}))
        return out

    def _usable(self, cid: str, variant: Variant, neighbours: Sequence[str] | None = None) -> bool:
        """Whether the stored blob loads and validates (and, given `neighbours`, was fused after
        them). A blob that does not is set aside (`KVStore.quarantine`), to be recomputed."""
        if not self.store.has(cid, variant):
            return False
        try:
            kv = self.store.get(cid, variant, fingerprint=self.engine.fingerprint, shape=self.engine.kv_shape)
        except CacheNotFoundError:
            return False
        except (CacheCorruptError, CacheMismatchError) as e:
            where = self.store.quarantine(cid, variant)
            log.warning("recomputing the %s cache of chunk %s: %s (set aside: %s)", variant, cid, e, where)
            return False
        return neighbours is None or kv.fused_after == neighbours_digest(neighbours)

    def _independent(self, chunks: Sequence[PendingChunk], progress: bool) -> None:
        """Phase 1: compute and store the independent caches of `chunks`, then index their texts."""
        self._independent_caches(chunks, progress)
        self.writer.flush()  # NOTE: every blob is stored before it is read back or indexed.
        # NOTE: so prompts that hold a chunk's text find its cache without marks (recognise.py).
        self._index_texts([(c.chunk_id, c.text) for c in chunks])

    def _index_texts(self, entries: Sequence[tuple[str, str]]) -> None:
        """Add `(chunk_id, text)` pairs to the store's content index (nothing for a store that keeps none)."""
        content = self.store.content_index()
        if content is not None:
            content.add(entries)

    def _independent_caches(self, chunks: Sequence[PendingChunk], progress: bool) -> None:
        with tqdm(total=len(chunks), desc="independent caches", unit="chunk", disable=not progress) as bar:
            for start in range(0, len(chunks), self.config.batch_size):
                batch = chunks[start : start + self.config.batch_size]
                self.builder.independent([(c.chunk_id, c.text) for c in batch], self.writer.put)
                bar.update(len(batch))

    def _embed(self, texts: Sequence[str]) -> np.ndarray:
        """`[N, d]` unit embeddings by the collection's embedding function, in batches."""
        out: list[Any] = []
        for start in range(0, len(texts), self.config.batch_size):
            out.extend(self.embedding_function(list(texts[start : start + self.config.batch_size])))
        return unit_rows(out)

    def _find_neighbours(self, new: Sequence[PendingChunk], embeddings: np.ndarray) -> None:
        """Each new chunk's n nearest other chunks among the collection and the other new chunks."""
        n = self.config.neighbours
        if not new or n == 0:
            return
        in_batch = self._batch_neighbours(embeddings, [c.chunk_id for c in new], n)
        stored = chroma.query_neighbours_many(self.collection, embeddings.tolist(), n, [[c.chunk_id] for c in new])
        for c, found, local in zip(new, stored, in_batch, strict=True):
            hits = dict(found)
            for cid, distance in local.items():
                hits.setdefault(cid, distance)
            c.neighbours = rank_neighbours(hits, n)

    def _batch_neighbours(self, embeddings: np.ndarray, ids: Sequence[str], n: int) -> list[dict[str, float]]:
        """Per new chunk, its n nearest other new chunks (`batch_neighbours`, a block of rows at a time)."""
        return batch_neighbours(embeddings, ids, range(len(ids)), n)

    def _affected_by(self, new: Sequence[PendingChunk], embeddings: np.ndarray) -> list[str]:
        """Chunks in the collection whose top-n set gains one of `new` (nearer than their n-th)."""
        if not new or self.config.neighbours == 0:
            return []
        new_ids = [c.chunk_id for c in new]
        new_set = set(new_ids)
        affected: list[str] = []
        for page in chroma.scan(self.collection, ["embeddings", "metadatas"]):
            rows = [r for r in page.values() if r.chunk_id not in new_set and r.embedding is not None]
            if not rows:
                continue
            existing = unit_rows([r.embedding for r in rows])
            for lo in range(0, len(rows), DISTANCE_BLOCK):
                distances = 1.0 - existing[lo : lo + DISTANCE_BLOCK] @ embeddings.T  # [B, N]
                for row, dist in zip(rows[lo : lo + DISTANCE_BLOCK], distances, strict=True):
                    radius = float(row.metadata.get(RADIUS_KEY, OPEN_RADIUS))
                    nearer = np.flatnonzero(dist < radius - _RADIUS_EPS)
                    current = set(_neighbour_ids(row.metadata))
                    if any(new_ids[j] not in current for j in nearer):
                        affected.append(row.chunk_id)
        return affected

    def _mark_pending(self, ids: Sequence[str]) -> None:
        chroma.update_metadata(self.collection, ids, [{PENDING_KEY: True}] * len(ids))

    def _add_new(self, new: Sequence[PendingChunk], progress: bool) -> None:
        """Fused caches of new chunks, then their Chroma entries, a batch at a time."""
        bar = tqdm(total=len(new), desc="fused caches" if self.config.fuse else "indexing", unit="chunk",
                   disable=not progress)
        with bar:
            for batch in self._fused_batches(new):
                metas: list[dict[str, Primitive]] = []
                for c in batch:
                    meta: dict[str, Primitive] = {**c.metadata, DOC_ID_KEY: c.doc_id, CHUNK_INDEX_KEY: c.index,
                                                  **ownership(c.owners), CHUNK_ID_KEY: c.chunk_id,
                                                  **node_record(c.chunk_id, c.owners[0], c.metadata)}
                    if self.config.fuse:
                        meta.update(fusion_state(c.neighbours, self.config.neighbours))
                    metas.append(meta)
                unembedded = [c for c in batch if c.embedding is None]
                for c, embedding in zip(unembedded, self._embed([c.text for c in unembedded]), strict=True):
                    c.embedding = embedding
                # NOTE: only now, with every blob of the batch stored, do the chunks become visible;
                # Chroma stores the embeddings the neighbours were found with, not its own.
                chroma.add_chunks(self.collection, [c.chunk_id for c in batch], [c.text for c in batch], metas,
                                    embeddings=np.stack([cast(np.ndarray, c.embedding) for c in batch]))
                bar.update(len(batch))

    def _fused_batches(self, new: Sequence[PendingChunk]) -> Iterator[Sequence[PendingChunk]]:
        """Phase 3: `new` in batches of `batch_size`, each yielded once every fused cache of it is stored."""
        for start in range(0, len(new), self.config.batch_size):
            batch = new[start : start + self.config.batch_size]
            if self.config.fuse:
                # NOTE: a fused blob left by an interrupted run is reused only if it was built on
                # the neighbours found now (the corpus may have changed since).
                todo = [c for c in batch if not self._usable(c.chunk_id, "fused", _ids_of(c.neighbours))]
                kvs = self.builder.fused([(c.chunk_id, c.text, c.neighbours) for c in todo])
                for c, kv in zip(todo, kvs, strict=True):
                    self.writer.put(c.chunk_id, kv)
                self.writer.flush()  # NOTE: the batch's Chroma entries are written only after this.
            yield batch

    # ---- re-fusion ----------------------------------------------------------------------------------
    def fuse_pending(self, *, progress: bool = False) -> int:
        """Re-fuse every chunk marked pending with its current top-n neighbours; returns how many."""
        if not self.config.fuse:
            return 0
        pending: dict[str, chroma.Row] = {}
        for page in chroma.scan(self.collection, ["documents", "metadatas", "embeddings"], {PENDING_KEY: True}):
            pending.update(page)
        done = 0
        for row in tqdm(pending.values(), desc="re-fused caches", unit="chunk", disable=not progress):
            if not row.text or row.embedding is None:
                continue  # NOTE: left pending; verify reports (and removes) text-less entries.
            if not self.store.has(row.chunk_id, "independent"):
                self.builder.independent([(row.chunk_id, row.text)])
            neighbours = rank_neighbours(dict(chroma.query_neighbours(
                self.collection, unit_rows([row.embedding])[0].tolist(), self.config.neighbours,
                exclude_ids=[row.chunk_id])), self.config.neighbours)
            kv = self.builder.fused([(row.chunk_id, row.text, neighbours)])[0]
            self.store.put(row.chunk_id, kv)
            chroma.update_metadata(self.collection, [row.chunk_id], [fusion_state(neighbours, self.config.neighbours)])
            done += 1
        return done

    # ---- delete -------------------------------------------------------------------------------------
    def document_ids(self) -> set[str]:
        """Every document id that owns a chunk of the collection."""
        pages = chroma.scan(self.collection, ["metadatas"])
        return {o for page in pages for row in page.values() for o in owners_of(row.metadata)}

    def delete(self, doc_ids: Sequence[str]) -> int:
        """Remove documents: chunks no other document owns lose their Chroma entry and every blob;
        chunks fused after them are re-fused. Returns how many chunks were removed.

        Idempotent: run again with the same ids after it died part-way, it finishes the work (the
        documents' remaining chunks are found by owner, the chunks left pending are re-fused and the
        blobs left behind are swept).

        Raises:
            InvalidRequestError: `doc_ids` is one string, or holds something other than strings.
        """
        gone = set(checked_doc_ids(doc_ids))
        released: list[str] = []
        changed: dict[str, list[str]] = {}
        for cid, row in self.owned_by(list(gone)).items():
            owners = [o for o in owners_of(row.metadata) if o not in gone]
            if owners:
                changed[cid] = owners
            else:
                released.append(cid)
        if changed:
            chroma.update_metadata(self.collection, list(changed), [ownership(o) for o in changed.values()])
        removed = self._remove(released)
        self.fuse_pending()
        self._sweep_orphans()
        return removed

    def _remove(self, chunk_ids: Sequence[str]) -> int:
        """Delete chunks: mark the chunks fused after them pending and delete their fused caches,
        forget the chunks' texts, drop their Chroma entries, then their blobs (in that order: a crash
        leaves orphan blobs, never entries without blobs, and no fused cache built on a chunk that is
        gone; the chunks marked pending reuse their independent caches until they are re-fused)."""
        if not chunk_ids:
            return 0
        gone = set(chunk_ids)
        if self.config.fuse:
            dependants = [
                cid
                for page in chroma.scan(self.collection, ["metadatas"])
                for cid, row in page.items()
                if cid not in gone and gone.intersection(_neighbour_ids(row.metadata))
            ]
            self._mark_pending(dependants)
            for cid in dependants:
                self.store.delete(cid, "fused")
        content = self.store.content_index()
        if content is not None:
            # NOTE: before the entries: a rerun after a crash finds what is left through the entries.
            content.remove(chunk_ids)
        chroma.delete_ids(self.collection, chunk_ids)
        for cid in chunk_ids:
            self.store.delete(cid)
        return len(chunk_ids)

    def _sweep_orphans(self) -> int:
        """Delete blobs of chunks the collection does not hold (left by a run killed between
        writing blobs and adding their entries, or between deleting entries and blobs)."""
        orphans = self.store.list_ids() - chroma.all_ids(self.collection)
        for cid in orphans:
            self.store.delete(cid)
        if orphans:
            log.info("deleted %d orphan KV blobs", len(orphans))
        return len(orphans)

    # ---- verify -------------------------------------------------------------------------------------
    def verify(self, *, repair: bool = True, interrupted: str = "") -> VerifyReport:
        """Check every Chroma entry against the store (loading each blob) and vice versa, and the
        store's content index; with `repair`, rebuild a content index that cannot be trusted (from
        the collection's texts), delete orphans, drop text-less entries, recompute bad caches,
        re-fuse stale ones. `interrupted` (who died mid-ingest) marks the report incomplete and
        suppresses the repair."""
        problems = self.find_problems()
        problems.report.incomplete = interrupted
        if repair and not problems.report.ok and not interrupted:
            self.repair(problems)
        if repair and not interrupted:
            self._add_drift(problems)
            self._record_nodes()
        return problems.report

    def _record_nodes(self) -> None:
        """Give entries written before LlamaIndex node records theirs (`chunk_record.record_upgrade`),
        so LlamaIndex's ChromaVectorStore reads them with the bookkeeping hidden."""
        for page in chroma.scan(self.collection, ["metadatas"]):
            upgrades = {cid: record_upgrade(cid, row.metadata) for cid, row in page.items()}
            ids = [cid for cid, upgrade in upgrades.items() if upgrade]
            if ids:
                chroma.update_metadata(self.collection, ids, [upgrades[cid] or {} for cid in ids])

    def _content_index_problem(self, rows: Mapping[str, chroma.Row]) -> str:
        """Why the store's content index cannot be trusted for the chunks `rows` (the collection's),
        or "" (also for a store that keeps none). A corpus ingested before content indexes existed
        lacks its texts: the repair gives them."""
        index = self.store.content_index()
        if index is None:
            return ""
        problem = index.check()
        if problem is not None:
            return problem
        indexed = index.chunk_ids()
        lacking = sum(1 for cid, row in rows.items() if (row.text or "").strip() and cid not in indexed)
        return f"content index {index.where} lacks the text of {lacking} chunk(s)" if lacking else ""

    def _rebuild_content_index(self) -> int:
        """Replace the content index by the collection's chunk texts; returns how many were indexed."""
        index = self.store.content_index()
        if index is None:
            return 0
        return index.rebuild((cid, row.text) for page in chroma.scan(self.collection, ["documents"])
                             for cid, row in page.items() if row.text)

    def find_problems(self) -> Problems:
        """Read-only: what disagrees between the collection and the store (every blob is loaded)."""
        report = VerifyReport()
        stored = self.store.list_ids()
        report.blobs = len(stored)
        rows: dict[str, chroma.Row] = {}
        for page in chroma.scan(self.collection, ["documents", "metadatas"]):
            rows.update(page)
        report.chunks = len(rows)
        problems = Problems(report, orphans=sorted(stored - set(rows)),
                            textless=[cid for cid, r in rows.items() if not r.text])
        report.orphans, report.textless = len(problems.orphans), len(problems.textless)
        for cid, row in rows.items():
            if not row.text:
                continue
            expected = self.engine.layout.chunk_ids(row.text)
            for variant in ("independent", "fused") if self.config.fuse else ("independent",):
                recorded = _neighbour_ids(row.metadata) if variant == "fused" else None
                problem, kv = self._check_blob(cid, variant, expected, recorded)
                if problem is None:
                    if kv is not None and kv.drift is None and recorded:
                        problems.without_drift.append(cid)
                    continue
                setattr(report, problem, getattr(report, problem) + 1)
                if variant == "independent":
                    problems.bad_independent.append((cid, row.text))
                else:
                    problems.bad_fused.append(cid)
        problems.stale = [
            cid for cid, r in rows.items()
            if self.config.fuse and r.text and cid not in problems.bad_fused
            and (r.metadata.get(PENDING_KEY) or any(n not in rows for n in _neighbour_ids(r.metadata)))
        ]
        report.stale = len(problems.stale)
        stale = set(problems.stale)
        problems.without_drift = [cid for cid in problems.without_drift if cid not in stale]
        report.without_drift = len(problems.without_drift)
        report.content_index = self._content_index_problem(rows)
        return problems

    def _add_drift(self, problems: Problems) -> None:
        """Give good fused caches written before drift was stored their drift, from the two stored
        caches (`drift.fusion_drift`; no prefill), each rewritten whole (a blob is replaced, never
        edited)."""
        get = partial(self.store.get, fingerprint=self.engine.fingerprint, shape=self.engine.kv_shape)
        for cid in problems.without_drift:
            fused, alone = get(cid, "fused"), get(cid, "independent")
            self.store.put(cid, replace(fused, drift=fusion_drift(fused, alone, self.engine.decoder.rope)))
            problems.report.drift_added += 1

    def repair(self, problems: Problems) -> None:
        """Fix what `find_problems` found; records the work in `problems.report`."""
        report = problems.report
        prefills = self.prefills
        if report.content_index:
            # NOTE: first, so the texts the steps below index go to a usable index.
            report.content_index_rebuilt = self._rebuild_content_index()
        for cid in problems.orphans:
            self.store.delete(cid)
        report.removed = self._remove(problems.textless)
        bad = [PendingChunk(cid, text, "", 0, {}) for cid, text in problems.bad_independent]
        self._independent(bad, progress=False)
        self._mark_pending(problems.bad_fused + problems.stale)
        self.fuse_pending()
        report.repaired = True
        report.recomputed = self.prefills - prefills

    def _check_blob(self, cid: str, variant: Variant, expected: torch.Tensor,
                    neighbours: Sequence[str] | None = None) -> tuple[str | None, ChunkKV | None]:
        """`(None, the cache)` if the blob is good, else `(the VerifyReport field that counts its
        problem, None)`.

        `neighbours`: the neighbour ids the collection records for a fused cache; a blob that
        records others was fused after another list (a second writer, an interrupted update).
        NOTE: blobs written before digests were recorded have none and pass this check.
        """
        try:
            kv = self.store.get(cid, variant, fingerprint=self.engine.fingerprint, shape=self.engine.kv_shape)
        except CacheNotFoundError:
            return "missing", None
        except CacheCorruptError:
            return "corrupt", None
        except CacheMismatchError:
            return "mismatched", None
        if not torch.equal(kv.token_ids, expected):
            return "mismatched", None
        if neighbours is not None and kv.fused_after and kv.fused_after != neighbours_digest(neighbours):
            return "wrong_neighbours", None
        return None, kv


__all__ = ["IngestReport", "Ingestor", "Problems", "VerifyReport", "checked_doc_ids", "owners_of"]
