"""FusionIndex: a corpus of chunks searchable in Chroma, with every chunk's KV caches in a store.

It ties an engine, a Chroma collection and a KV store. The collection records which model and
which ingest settings built it, so a corpus is never read with caches of another model and never
extended with chunks cut or fused another way.

Example:
    >>> engine = FusionEngine.from_pretrained()
    >>> index = FusionIndex.open(engine, "./fusionrag-data")
    >>> index.add_texts(["The Lumen lighthouse was designed by Ada Vell.", "Ada Vell was born in Marrow."])
    >>> generation, hits = index.answer("Where was the designer of the Lumen lighthouse born?")
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from chromadb.api.models.Collection import Collection

from fusionrag_core.engine import FusionEngine, Generation, GenerationStream
from fusionrag_core.errors import CacheMismatchError, InvalidRequestError
from fusionrag_core.ingest import chroma
from fusionrag_core.ingest.chroma import RetrievedChunk
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.corpus import corpus_id_of, legacy_warning, store_namespace
from fusionrag_core.ingest.ingestor import Ingestor, IngestReport, VerifyReport, checked_doc_ids, owners_of
from fusionrag_core.ingest.lock import JOURNAL_VERSION, WriterLock, writing
from fusionrag_core.ingest.records import CHUNK_INDEX_KEY
from fusionrag_core.ingest.space import stopped_when_full
from fusionrag_core.paths import DEFAULT_COLLECTION, DEFAULT_DATA_DIR, chroma_dir, kv_dir
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.runtime.kv import Variant
from fusionrag_core.store import DiskKVStore, KVStore, StorageDType, open_store
from fusionrag_core.store.tiered import TierConfig

if TYPE_CHECKING:
    from fusionrag_core.ingest.distributed import RayConfig

# Collection metadata keys: what built the collection.
MODEL_KEY = "fusionrag_model"
MODEL_NAME_KEY = "fusionrag_model_name"
INGEST_KEY = "fusionrag_ingest"

log = logging.getLogger(__name__)


class FusionIndex:
    """Engine + Chroma collection + KV store, kept in agreement by chunk id.

    Args:
        engine: the model (shared freely: the index passes `store` with each request it makes).
        collection: the chunk collection (from `chroma.open_collection`).
        store: the chunk caches.
        config: chunking and fusion settings; None = the settings the collection was built with
            (the defaults for a new collection).
        embedding_function: the collection's embedding function (default: the offline MiniLM).
        writer_wait_s: how long a write (add_texts, delete, verify) waits for another writer of the
            corpus before failing with CorpusLockedError (one writer per corpus, see `lock`).
        data_dir: the data directory the index was opened from (`open`), where integrations keep
            the caches they learn; None when the collection and store were given directly.

    An index on an embedded Chroma database claims its directory for this process until `close()`
    (see `fusionrag_core.ingest.claim`): while it is open, no other process can write there, and a
    write of its own is refused while another process has the directory open. Embedded Chroma
    serves one process; several processes share a corpus through a Chroma server (`open`'s
    `chroma_url`).

    Raises:
        CacheMismatchError: the collection was built by another model.
        InvalidRequestError: `config` differs from the collection's settings, or the embedding
            function is not the collection's, or the collection was not built by FusionRAG.
        DatabaseInUseError: another process is writing to the embedded database (after `writer_wait_s`).
    """

    def __init__(
        self,
        engine: FusionEngine,
        collection: Collection,
        store: KVStore,
        config: IngestConfig | None = None,
        *,
        embedding_function: chroma.EmbeddingFn | None = None,
        writer_wait_s: float = 0.0,
        data_dir: str | Path | None = None,
    ) -> None:
        self.engine = engine
        self.collection = collection
        self.store = store
        # NOTE: where this index keeps local data (`open`'s data_dir); None for an index built from
        # a collection and a store directly. Integrations learn caches under it.
        self.data_dir = Path(data_dir).expanduser() if data_dir is not None else None
        self.writer_wait_s = writer_wait_s
        # NOTE: what `close` gives back: the claim (any index), the client and store `open` made.
        self._claim = chroma.claim_collection(collection, wait_s=writer_wait_s)
        self._opened: tuple[chroma.Database, KVStore] | None = None
        self._closed = False
        try:
            ef = embedding_function if embedding_function is not None else chroma.default_embedding_function()
            self.config = _bind(collection, engine, config, ef)
            self.ingestor = Ingestor(engine, collection, store, self.config, ef)
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(
        cls,
        engine: FusionEngine,
        data_dir: str | Path = DEFAULT_DATA_DIR,
        *,
        chroma_url: str | None = None,
        redis_url: str | None = None,
        collection_name: str = DEFAULT_COLLECTION,
        config: IngestConfig | None = None,
        embedding_function: chroma.EmbeddingFn | None = None,
        storage_dtype: StorageDType = "float16",
        writer_wait_s: float = 0.0,
        tiers: TierConfig | None = None,
    ) -> FusionIndex:
        """Open (creating if needed) an index: a Chroma collection and its KV store.

        Args:
            engine: the model.
            data_dir: holds `chroma/` (embedded database, unless `chroma_url`) and
                `kv/<collection_name>/` (disk caches, unless `redis_url`).
            chroma_url: `http://host:port` of a Chroma server (`chroma run`).
            redis_url: `redis://host:port/db`; caches are namespaced by the corpus id the
                collection records (`fusionrag.<collection>.<id>`).
            collection_name: the Chroma collection (one corpus).
            config: chunking and fusion settings (None: the collection's own, or the defaults).
            embedding_function: default the offline all-MiniLM-L6-v2.
            storage_dtype: dtype of stored keys/values (see `KVStore`).
            writer_wait_s: how long writes wait for another writer of the corpus (see `FusionIndex`).
            tiers: byte budgets of a device and a host LRU of decoded caches in front of the store
                (`TieredKVStore`; per-tier hits and bytes in `Generation.stats()`); None = none.

        Raises:
            CacheMismatchError / InvalidRequestError / DatabaseInUseError: as `FusionIndex(...)`.
            InsufficientSpaceError: the disk under `data_dir` is full.
            FusionRAGError: a server cannot be reached.
        """
        ef = embedding_function if embedding_function is not None else chroma.default_embedding_function()
        vconfig = chroma.VectorDBConfig(path=str(chroma_dir(data_dir)), url=chroma_url, collection=collection_name)
        with stopped_when_full(Path(data_dir).expanduser(), f"opening the index in {data_dir}", "open it again"):
            database = chroma.open_database(vconfig, wait_s=writer_wait_s)
            store: KVStore | None = None
            try:
                collection = chroma.collection_in(database.client, collection_name, ef, chroma_url or vconfig.path)
                store = corpus_store(collection, data_dir, redis_url=redis_url, storage_dtype=storage_dtype,
                                     where=chroma_url or str(Path(data_dir).expanduser()))
                if tiers is not None:
                    store = tiers.wrap(store, device=engine.device, dtype=engine.decoder.dtype)
                index = cls(engine, collection, store, config, embedding_function=ef, writer_wait_s=writer_wait_s,
                            data_dir=data_dir)
            except BaseException:
                if store is not None:
                    store.close()
                database.close()
                raise
        index._opened = (database, store)
        return index

    # ---- writing ------------------------------------------------------------------------------------
    def add_texts(
        self,
        texts: Sequence[str],
        metadatas: Sequence[Mapping[str, Any] | None] | None = None,
        doc_ids: Sequence[str] | None = None,
        *,
        progress: bool = False,
        ray: RayConfig | None = None,
        space_check: bool = True,
    ) -> IngestReport:
        """Chunk, cache (independent and fused) and index documents; resumes an interrupted run.

        A delete that died part-way is finished first. The ingest is journaled from its first write
        on: a request refused (or interrupted) before it writes leaves no record for `verify` to report.

        Args:
            texts: one text per document.
            metadatas: per document, str/int/float/bool values copied to each of its chunks.
            doc_ids: per document; default a hash of its text. An existing id is replaced.
            progress: show tqdm bars (chunking, chunks, chunks/s, ETA) and the projected cache size.
            ray: run the prefills and embeddings on a Ray cluster (`distributed.RayConfig`); the
                store must be one every worker reaches (a shared directory or Redis).
            space_check: refuse an ingest whose projected caches do not fit the store's free space.

        Returns:
            What was done (new, skipped and re-fused chunks, prefills, time).

        Raises:
            CorpusLockedError: another writer holds the corpus (after `writer_wait_s`).
            InsufficientSpaceError: the projected caches do not fit; nothing was written. Or the disk
                under `data_dir` filled part-way: nothing indexed lacks its caches, and running the
                call again once there is room resumes it.
            InvalidRequestError: bad texts, doc ids or metadata; nothing was written.
        """
        with self._writing("ingest") as lock:
            self._finish_delete(lock)
            if ray is None:
                return self.ingestor.add(texts, metadatas, doc_ids, progress=progress, space_check=space_check,
                                         journal=lock.journaled())
            from fusionrag_core.ingest.distributed import RayIngestor

            try:
                with RayIngestor(self.engine, self.collection, self.store, self.config,
                                 self.ingestor.embedding_function, ray) as ingestor:
                    return ingestor.add(texts, metadatas, doc_ids, progress=progress, space_check=space_check,
                                        journal=lock.journaled())
            finally:
                self.store.drop_copies()  # NOTE: the workers wrote to the backend, around any tiers

    @contextlib.contextmanager
    def _writing(self, action: str, *, chroma_too: bool = True) -> Iterator[WriterLock]:
        """The corpus's writer lock for the block and, when the block may write Chroma (`chroma_too`),
        no other process with its embedded database open: both are taken before anything is written."""
        self._check_open()
        alone = chroma.alone(self.collection, action, wait_s=self.writer_wait_s) if chroma_too else (
            contextlib.nullcontext())
        # NOTE: a disk that fills part-way leaves the corpus as a killed run does (blobs before
        # entries, the journal kept): running the command again finishes it. Embedded Chroma whose
        # own write failed fails every later call until the database is opened again.
        full = stopped_when_full(
            self.data_dir, f"this {action}", "run it again from a new process, or after opening the index again: it "
            "resumes where it stopped") if self.data_dir is not None else contextlib.nullcontext()
        with full, alone, writing(self.store, action, wait_s=self.writer_wait_s) as lock:
            yield lock

    def document_ids(self) -> set[str]:
        """The ids of every document with a chunk in the index."""
        self._check_open()
        return self.ingestor.document_ids()

    def document_chunks(self, doc_ids: Sequence[str]) -> dict[str, list[chroma.Row]]:
        """Per document id present in the index, its chunks (text and metadata) in document order.

        A chunk shared by several documents is listed under each of them; its metadata is its
        first owner's (see `fusionrag_core.ingest.ingestor`). Ids without chunks are left out.
        """
        self._check_open()
        rows = self.ingestor.owned_by(list(doc_ids), include=("documents", "metadatas"))
        out: dict[str, list[chroma.Row]] = {}
        for doc_id in dict.fromkeys(doc_ids):
            mine = [r for r in rows.values() if doc_id in owners_of(r.metadata)]
            if mine:
                out[doc_id] = sorted(mine, key=lambda r: int(r.metadata.get(CHUNK_INDEX_KEY, 0)))
        return out

    def delete(self, doc_ids: Sequence[str]) -> int:
        """Remove documents (Chroma entries and every cache variant of chunks no other document
        shares); chunks that were fused after them are re-fused. Returns the chunks removed.

        The journal records the doc ids until the delete is done. One that dies part-way is finished
        by `verify`, by the next `add_texts`, or by the next delete, along with its own documents
        (`interrupted_deletes` lists them: no chunk may list them any more).

        Raises:
            CorpusLockedError: another writer holds the corpus (after `writer_wait_s`).
            InvalidRequestError: `doc_ids` is one string or holds a non-string; nothing was written.
        """
        wanted = checked_doc_ids(doc_ids)
        with self._writing("delete") as lock:
            ids = list(dict.fromkeys([*_interrupted_delete(lock.interrupted()), *wanted]))
            with lock.journaled(action="delete", doc_ids=ids):
                return self.ingestor.delete(ids)

    def interrupted_deletes(self) -> list[str]:
        """The doc ids of a delete that died part-way (empty if none): `delete` of any of them, another
        write or `verify` finishes it."""
        with self._writing("delete", chroma_too=False) as lock:
            return _interrupted_delete(lock.interrupted())

    def verify(self, repair: bool = True) -> VerifyReport:
        """Check that Chroma and the KV store agree, loading every blob; optionally repair.

        Finds Chroma ids missing a blob (recomputed; removed if the entry has no text), orphan blobs
        (deleted), corrupt or mismatched blobs (recomputed) and out-of-date fused caches (re-fused).
        Takes the corpus's writer lock (a report taken beside a running ingest would count its
        in-flight blobs as orphans). After an ingest that died mid-way it reports the corpus
        incomplete and repairs nothing: re-run that ingest (it resumes), then verify. A delete that
        died mid-way is finished first (`VerifyReport.finished`); with `repair=False` it is reported
        incomplete instead.
        """
        with self._writing("repair" if repair else "verify", chroma_too=repair) as lock:
            finished = self._finish_delete(lock) if repair else ""
            interrupted = lock.interrupted()
            report = self.ingestor.verify(repair=repair, interrupted=_describe(interrupted) if interrupted else "")
            report.finished = finished
            return report

    def _finish_delete(self, lock: WriterLock) -> str:
        """Finish a delete that died part-way (the journal names its documents): which, who and
        when (empty if there was none)."""
        record = lock.interrupted() or {}
        ids = _interrupted_delete(record)
        if not ids:
            return ""
        with lock.journaled(action="delete", doc_ids=ids):
            self.ingestor.delete(ids)
        return _who(record)

    # ---- reading ------------------------------------------------------------------------------------
    def search(self, query: str, k: int = 4) -> list[RetrievedChunk]:
        """The `k` chunks most similar to `query`, best first (a hit without text is left out, with a
        warning)."""
        self._check_open()
        return chroma.search(self.collection, query, k)

    def prompt_for(self, question: str, chunks: Sequence[RetrievedChunk]) -> FusionPrompt:
        """The canonical prompt over `chunks` (in the given order), each tagged with its chunk id so
        its cache is found."""
        return self.engine.prompt(question, chunks=[(c.chunk_id, c.text) for c in chunks])

    def stream(
        self,
        prompt: FusionPrompt,
        *,
        sampling: SamplingConfig | None = None,
        selector: str | None = None,
        ratio: float | None = None,
        variant: Variant | None = None,
    ) -> GenerationStream:
        """`engine.stream` with this index's KV store (the store goes with the request, so one
        engine can serve several indexes from several threads)."""
        self._check_open()
        return self.engine.stream(prompt, store=self.store, sampling=sampling, selector=selector, ratio=ratio,
                                  variant=variant)

    def answer(
        self,
        question: str,
        k: int = 4,
        *,
        sampling: SamplingConfig | None = None,
        selector: str | None = None,
        ratio: float | None = None,
        variant: Variant | None = None,
    ) -> tuple[Generation, list[RetrievedChunk]]:
        """Search, build the prompt and generate with the chunks' stored caches.

        Args:
            question: the user's question.
            k: chunks to retrieve.
            sampling / selector / ratio / variant: as `FusionEngine.stream`.

        Raises:
            InvalidRequestError: the index is empty.
        """
        hits = self.search(question, k)
        if not hits:
            raise InvalidRequestError("the index holds no chunks; add documents with add_texts first")
        prompt = self.prompt_for(question, hits)
        return self.stream(prompt, sampling=sampling, selector=selector, ratio=ratio, variant=variant).collect(), hits

    def close(self) -> None:
        """Give back what the index holds (idempotent): its claim on an embedded database, and the
        Chroma client and KV store that `open` made. The index cannot be used after."""
        claim, self._claim = self._claim, None
        opened, self._opened = self._opened, None
        self._closed = True
        if opened is not None:
            database, store = opened
            store.close()
            database.close()
        if claim is not None:
            claim.release()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequestError(f"the index on collection {self.collection.name!r} is closed; open it again "
                                      "(FusionIndex.open)")

    def __enter__(self) -> FusionIndex:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __len__(self) -> int:
        self._check_open()
        return self.collection.count()

    def __repr__(self) -> str:
        return f"FusionIndex(collection={self.collection.name!r}, store={self.store!r}, model={self.engine.name!r})"


def corpus_store(
    collection: Collection,
    data_dir: str | Path,
    *,
    redis_url: str | None = None,
    storage_dtype: StorageDType = "float16",
    where: str = "",
) -> KVStore:
    """The KV store of the corpus `collection` holds: `kv/<collection name>/` under `data_dir` on
    disk, or a Redis namespace derived from the corpus id the collection records.

    Args:
        collection: the corpus's Chroma collection.
        data_dir: the data directory (disk caches go to `kv_dir(data_dir, collection.name)`).
        redis_url: `redis://host:port/db` instead of disk.
        storage_dtype: dtype of stored keys/values (see `KVStore`).
        where: where the collection lives, for the warning about collections without a corpus id.
    """
    # NOTE: one store per corpus: fused caches depend on the corpus, and ingest and verify delete
    # blobs the collection does not know, so two corpora must never share a store. On Redis the
    # namespace derives from the corpus id recorded in the collection (see fusionrag_core.ingest.corpus).
    if redis_url is None:
        return DiskKVStore(kv_dir(data_dir, collection.name), storage_dtype=storage_dtype)
    corpus_id = corpus_id_of(collection.metadata)
    if corpus_id is None:
        log.warning(legacy_warning(collection.name, where or str(Path(data_dir).expanduser())))
    return open_store(redis_url, storage_dtype=storage_dtype, namespace=store_namespace(collection.name, corpus_id))


def _interrupted_delete(record: Mapping[str, Any] | None) -> list[str]:
    """The doc ids of the delete a journal record describes (`FusionIndex.delete`), else []."""
    if not record or record.get("action") != "delete" or record.get("version") != JOURNAL_VERSION:
        return []  # NOTE: records of other versions are reported, never acted on.
    ids = record.get("doc_ids")
    return [i for i in ids if isinstance(i, str) and i] if isinstance(ids, list) else []


def _who(writer: Mapping[str, Any]) -> str:
    docs = _interrupted_delete(writer)
    what = f"delete of {len(docs)} document(s)" if docs else str(writer.get("action", "a write"))
    return (f"{what} by pid {writer.get('pid')} on {writer.get('host')} "
            f"({writer.get('command')!r}, started {writer.get('since')})")


def _describe(writer: Mapping[str, Any]) -> str:
    return f"{_who(writer)} did not finish"


def _bind(
    collection: Collection, engine: FusionEngine, config: IngestConfig | None, ef: chroma.EmbeddingFn
) -> IngestConfig:
    """Check (or, for an empty collection, record) the model and settings the collection is built
    with; returns the ingest config to use."""
    metadata = dict(collection.metadata or {})
    where = f"collection {collection.name!r}"
    recorded_ef = metadata.get(chroma.EMBEDDING_META_KEY)
    if recorded_ef is not None and recorded_ef != chroma.embedding_id(ef):
        raise InvalidRequestError(
            f"{where} holds embeddings of {recorded_ef!r}, but the embedding function given is "
            f"{chroma.embedding_id(ef)!r}; pass the same embedding function, or use another collection"
        )
    model = metadata.get(MODEL_KEY)
    if model is None:
        if collection.count():
            raise InvalidRequestError(
                f"{where} holds {collection.count()} entries that FusionRAG did not ingest (no model recorded); "
                "choose another collection name for a FusionRAG index"
            )
        chosen = config or IngestConfig()
        chroma.record_metadata(collection, {
            MODEL_KEY: engine.fingerprint,
            MODEL_NAME_KEY: engine.name,
            INGEST_KEY: json.dumps(chosen.identity(), sort_keys=True),
        })
        return chosen
    if model != engine.fingerprint:
        raise CacheMismatchError(
            f"{where} was built with model {metadata.get(MODEL_NAME_KEY)!r} (fingerprint {str(model)[:12]}), "
            f"but the engine runs {engine.name!r} (fingerprint {engine.fingerprint[:12]}); load the model it was "
            "built with, or use another collection name / data dir and ingest the corpus with this model"
        )
    recorded = json.loads(str(metadata.get(INGEST_KEY, "{}")))
    if config is None:
        return IngestConfig.from_identity(recorded)
    if config.identity() != recorded:
        raise InvalidRequestError(
            f"{where} was built with ingest settings {recorded}, but config={config.identity()}; pass "
            "config=None (or the same settings) to use it, or use another collection name to build it anew"
        )
    return config


__all__ = ["FusionIndex", "IngestConfig", "IngestReport", "VerifyReport", "corpus_store"]
