"""Fused ingest on a Ray cluster: `Ingestor.add`'s three phases, spread over actors that each hold a model.

    phase 1  independent caches  actors (one model each; one GPU each on GPU nodes) prefill packed
                                 batches of chunks and write the caches to the shared KV store
    phase 2  neighbour graph     actors embed the chunks (the local ingest's batches, so the same
                                 vectors) and find each chunk's n nearest new chunks, a block of
                                 rows at a time; the driver adds the collection's own (Chroma)
    phase 3  fused caches        actors read the neighbours' independent caches from the store and
                                 write fused ones; the driver adds a Chroma batch once every blob
                                 of that batch is stored

The driver *is* an `Ingestor` (`RayIngestor` overrides only where work happens): ownership,
pending marks, Chroma writes, re-fusion and the orphan sweep stay on the driver, so the write order
(blobs before Chroma entries) and with it resume and `verify` are those of a local ingest.
Caches never travel through Ray: workers write them to the store (a directory every node mounts,
or Redis); Ray carries only chunk ids, texts and embeddings.

`ray` is an optional dependency (`pip install 'fusionrag[ray]'`), imported when a pool starts.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np
import psutil
import torch
from chromadb.api.models.Collection import Collection
from tqdm.auto import tqdm

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import CacheMismatchError, InvalidRequestError
from fusionrag_core.ingest import chroma
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.fusion import DISTANCE_BLOCK, CacheBuilder, FusionItem, batch_neighbours
from fusionrag_core.ingest.ingestor import Ingestor, IngestReport, PendingChunk, unit_rows
from fusionrag_core.store import DiskKVStore, KVStore, StorageDType, open_store

log = logging.getLogger(__name__)

# NOTE: how long `WorkerPool.close` waits for killed actors' tasks to settle (a process exit is
# quick; a node that stopped answering is not waited for longer).
_KILL_WAIT_S = 60.0

EngineFactory = Callable[[], FusionEngine]
EmbeddingFactory = Callable[[], chroma.EmbeddingFn]


@dataclass(frozen=True)
class RayConfig:
    """Where and how a Ray ingest runs.

    Attributes:
        engine_factory: builds each worker's engine (the driver's model: fingerprints are checked).
            Ray pickles it to the workers, so use a module-level function or a `functools.partial`.
        address: "local" starts a one-machine cluster for this ingest (listening on 127.0.0.1 only,
            no dashboard, `object_store_mb`; see `start_local_cluster`) and stops it after; anything
            else is passed to `ray.init(address=...)` ("auto", "127.0.0.1:6379", "ray://head:10001").
            An already initialised Ray is reused.
        workers: actors, each holding one model.
        threads_per_worker: CPUs reserved per actor, and its torch threads.
        gpus_per_worker: GPUs per actor; None: 1 when the cluster has a GPU per worker, else 0.
        object_store_mb: object store of a local cluster (only embeddings and ids go through it).
        embedding_factory: builds each worker's embedding function (must be the collection's).
        runtime_env: passed to `ray.init` (e.g. `{"pip": [...]}` or `{"env_vars": {...}}`).
        tasks_per_worker: tasks queued per actor, so an actor never waits for the driver.
    """

    engine_factory: EngineFactory
    address: str = "local"
    workers: int = 2
    threads_per_worker: int = 1
    gpus_per_worker: float | None = None
    object_store_mb: int = 256
    embedding_factory: EmbeddingFactory = chroma.default_embedding_function
    runtime_env: Mapping[str, Any] | None = field(default=None, hash=False)
    tasks_per_worker: int = 2

    def __post_init__(self) -> None:
        if self.workers < 1 or self.threads_per_worker < 1 or self.tasks_per_worker < 1:
            raise InvalidRequestError("workers, threads_per_worker and tasks_per_worker must be >= 1")
        if self.object_store_mb < 64:
            raise InvalidRequestError(f"object_store_mb must be >= 64 (Ray's minimum), got {self.object_store_mb}")
        if not callable(self.engine_factory):
            raise InvalidRequestError("engine_factory must be a callable that returns a FusionEngine")


@dataclass(frozen=True)
class StoreSpec:
    """How a worker opens the driver's store: a directory (shared by every node) or a Redis URL."""

    location: str
    storage_dtype: StorageDType
    namespace: str = "fusionrag"

    def open(self) -> KVStore:
        return open_store(self.location, storage_dtype=self.storage_dtype, namespace=self.namespace)


def store_spec(store: KVStore) -> StoreSpec:
    """How a worker opens the same store.

    Raises:
        InvalidRequestError: the store is not a disk or Redis store (workers could not reach it).
    """
    # NOTE: workers write to the blobs' store; a driver's cache tiers are cleared after the ingest
    store = store.backend if isinstance(store, KVStore) else store
    if isinstance(store, DiskKVStore):
        return StoreSpec(str(store.root), store.storage_dtype)
    from fusionrag_core.store.redis import RedisKVStore

    if isinstance(store, RedisKVStore):
        return StoreSpec(store.url, store.storage_dtype, store.namespace)
    raise InvalidRequestError(
        f"a Ray ingest needs a KV store every worker reaches: a DiskKVStore on a shared directory or a "
        f"RedisKVStore, not {type(store).__name__}"
    )


class IngestWorker:
    """One Ray actor: a model, the shared store, and the embedding function (built on first use).

    Returns only counts, ids and embeddings: caches go straight to the store.
    """

    def __init__(self, engine_factory: EngineFactory, store: StoreSpec, config: IngestConfig, threads: int,
                 embedding_factory: EmbeddingFactory) -> None:
        torch.set_num_threads(threads)
        self.engine = engine_factory()
        self.store = store.open()
        # NOTE: no text lookup: a worker cannot read the driver's Chroma. Items whose neighbours
        # lack an independent cache are handed back (see `fused`) and computed on the driver.
        self.builder = CacheBuilder(self.engine, self.store, config)
        self._embedding_factory = embedding_factory
        self._embedding_fn: chroma.EmbeddingFn | None = None

    def fingerprint(self) -> str:
        return self.engine.fingerprint

    def process(self) -> tuple[str, int]:
        """(Ray node id, pid) of this actor's process: the driver waits for it to exit on a kill."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def torch_threads(self) -> int:
        """The actor's torch threads (`threads_per_worker`: workers must not oversubscribe a node's CPUs)."""
        return torch.get_num_threads()

    def independent(self, chunks: list[tuple[str, str]]) -> int:
        self.builder.independent(chunks)
        return len(chunks)

    def fused(self, items: list[FusionItem]) -> tuple[int, list[FusionItem]]:
        """Store the fused caches of `items`; returns (how many, the items handed back)."""
        has = [all(self.store.has(nid, "independent") for nid, _ in it[2]) for it in items]
        ready = [it for it, ok in zip(items, has, strict=True) if ok]
        back = [it for it, ok in zip(items, has, strict=True) if not ok]
        for (cid, _, _), kv in zip(ready, self.builder.fused(ready), strict=True):
            self.store.put(cid, kv)
        return len(ready), back

    def embed(self, texts: list[str]) -> list[Any]:
        if self._embedding_fn is None:
            self._embedding_fn = self._embedding_factory()
        return list(self._embedding_fn(texts))

    def neighbours(self, embeddings: np.ndarray, ids: list[str], lo: int, hi: int, n: int) -> list[dict[str, float]]:
        return batch_neighbours(embeddings, ids, range(lo, hi), n)


# NOTE: Ray's local-only mode (its default on macOS and Windows): the node address is 127.0.0.1 and
# every server of a cluster this process starts (GCS, raylet, workers, agents) binds it instead of
# every interface. Ray has no ray.init argument for it (`_node_ip_address="127.0.0.1"` is rewritten
# to the machine's address) and reads this variable once, when it is first imported.
_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _import_ray(*, local_only: bool = False) -> Any:
    if local_only and "ray" not in sys.modules:
        os.environ.setdefault(_LOCAL_ONLY_ENV, "0")
    try:
        import ray
    except ImportError as e:
        raise InvalidRequestError("a Ray ingest needs Ray: pip install 'fusionrag[ray]'") from e
    return ray


def start_local_cluster(num_cpus: int, object_store_mb: int = 256,
                        runtime_env: Mapping[str, Any] | None = None) -> None:
    """Start a one-machine Ray cluster for this process that listens on 127.0.0.1 only.

    No dashboard; Ray's token authentication stays at its default (on for new local clusters).

    Raises:
        InvalidRequestError: Ray was imported in cluster mode before (its servers would listen on
            every interface): start the ingest before anything imports `ray`, or start a cluster
            yourself and pass its address.
    """
    ray = _import_ray(local_only=True)
    # NOTE: before ray.init, this is the address a new node would take (so nothing ever listens on
    # another); after it, the node's own.
    node_ip = ray.util.get_node_ip_address()
    if ipaddress.ip_address(node_ip).is_loopback:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 object_store_memory=object_store_mb << 20, runtime_env=dict(runtime_env) if runtime_env else None)
        node_ip = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node_ip).is_loopback:
        if ray.is_initialized():
            ray.shutdown()
        raise InvalidRequestError(
            f"a local Ray cluster would listen on {node_ip} (every interface), not 127.0.0.1: `ray` was imported "
            f"before the ingest, without {_LOCAL_ONLY_ENV}=0; run the ingest before importing ray (the `fusionrag` "
            "CLI does), or start a cluster yourself (`ray start --head`) and pass its address"
        )


class WorkerPool:
    """The actors of one Ray ingest, and the cluster if this pool started it."""

    def __init__(self, config: RayConfig, store: StoreSpec, ingest: IngestConfig, fingerprint: str) -> None:
        self.ray = ray = _import_ray(local_only=config.address == "local")
        self.config = config
        self._started = False
        self._in_flight: set[Any] = set()  # ObjectRefs of tasks submitted and not yet collected
        self._local_pids: list[int] = []  # the processes of actors on this node
        if not ray.is_initialized():
            if config.address == "local":
                # NOTE: a new cluster (address="local" never joins another one on this machine); its
                # object store only holds ids, texts and embeddings, so it stays small.
                start_local_cluster(config.workers * config.threads_per_worker, config.object_store_mb,
                                    config.runtime_env)
            else:
                ray.init(address=config.address, runtime_env=dict(config.runtime_env) if config.runtime_env else None)
            self._started = True
        gpus = config.gpus_per_worker
        if gpus is None:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= config.workers else 0.0
        actor = ray.remote(IngestWorker).options(num_cpus=config.threads_per_worker, num_gpus=gpus)
        self.actors = [actor.remote(config.engine_factory, store, ingest, config.threads_per_worker,
                                    config.embedding_factory) for _ in range(config.workers)]
        try:
            fingerprints = ray.get([a.fingerprint.remote() for a in self.actors])
            here = ray.get_runtime_context().get_node_id()
            self._local_pids = [pid for node, pid in ray.get([a.process.remote() for a in self.actors]) if node == here]
        except Exception:
            self.close()
            raise
        if any(fp != fingerprint for fp in fingerprints):
            self.close()
            raise CacheMismatchError(
                f"Ray workers built models with fingerprints {sorted(set(f[:12] for f in fingerprints))}, but the "
                f"driver's is {fingerprint[:12]}: engine_factory must build the driver's model"
            )
        log.info("Ray ingest: %d workers, %s GPU each", len(self.actors), gpus)

    def imap(self, method: str, jobs: Sequence[tuple[Any, ...]]) -> Iterator[tuple[int, Any]]:
        """Run `method(*job)` for every job on the actors, `tasks_per_worker` queued per actor;
        yields `(job index, result)` as they finish (any order). A task's error is raised here."""
        pending: deque[int] = deque(range(len(jobs)))
        running: dict[Any, tuple[int, int]] = {}  # ObjectRef -> (job, actor)
        load = [0] * len(self.actors)

        def submit() -> None:
            while pending:
                actor = min(range(len(self.actors)), key=load.__getitem__)
                if load[actor] >= self.config.tasks_per_worker:
                    return
                job = pending.popleft()
                ref = getattr(self.actors[actor], method).remote(*jobs[job])
                running[ref] = (job, actor)
                self._in_flight.add(ref)
                load[actor] += 1

        submit()
        while running:
            done, _ = self.ray.wait(list(running), num_returns=1)
            job, actor = running.pop(done[0])
            self._in_flight.discard(done[0])
            load[actor] -= 1
            result = self.ray.get(done[0])
            submit()
            yield job, result

    def put(self, value: Any) -> Any:
        return self.ray.put(value)

    def close(self) -> None:
        """Kill the actors and return once none of them can still write to the store.

        NOTE: `ray.kill` only asks for the kill, and the tasks of a killed actor fail as soon as the
        cluster marks it dead, which can be before its process has exited. An ingest interrupted
        mid-way (Ctrl-C, an error) must not go on storing blobs after it returned: the tasks in
        flight are awaited, then the processes of this node's actors (other nodes' are gone once
        their tasks settle, as far as Ray tells).
        """
        for a in self.actors if hasattr(self, "actors") else ():
            self.ray.kill(a)
        if self._in_flight:
            refs = list(self._in_flight)
            _, stuck = self.ray.wait(refs, num_returns=len(refs), timeout=_KILL_WAIT_S)
            if stuck:
                log.warning("Ray ingest: %d task(s) still unsettled %ss after their actors were killed",
                            len(stuck), _KILL_WAIT_S)
            self._in_flight.clear()
        _wait_for_exit(self._local_pids, _KILL_WAIT_S)
        self._local_pids = []
        if self._started:
            self.ray.shutdown()
            self._started = False


def _wait_for_exit(pids: Sequence[int], timeout_s: float) -> None:
    """Wait until none of `pids` is a live process (a zombie cannot write), warning past `timeout_s`."""
    live = [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
    _, alive = psutil.wait_procs(live, timeout=timeout_s) if live else ([], [])
    alive = [p for p in alive if _running(p)]
    if alive:
        log.warning("Ray ingest: worker process(es) %s still running %ss after their actors were killed",
                    [p.pid for p in alive], timeout_s)


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class RayIngestor(Ingestor):
    """An `Ingestor` whose prefills and embeddings run on Ray actors (use as a context manager).

    Args:
        ray_config: the cluster and workers.
        Others: as `Ingestor`; the store must be one every worker reaches (`store_spec`).

    NOTE: re-fusion of chunks an ingest marked pending runs on the driver's engine (it is the
    small part of the work: chunks whose neighbour set changed).
    """

    def __init__(self, engine: FusionEngine, collection: Collection, store: KVStore, config: IngestConfig,
                 embedding_function: chroma.EmbeddingFn, ray_config: RayConfig) -> None:
        super().__init__(engine, collection, store, config, embedding_function)
        self.ray_config = ray_config
        self._store_spec = store_spec(store)
        self._pool: WorkerPool | None = None
        self._progress = False

    # NOTE: embeddings and prefills run on the same actors: one after the other.
    _embed_alongside_prefills = False

    def __enter__(self) -> RayIngestor:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop the actors (and the cluster, if this ingest started it)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @property
    def pool(self) -> WorkerPool:
        if self._pool is None:
            self._pool = WorkerPool(self.ray_config, self._store_spec, self.config, self.engine.fingerprint)
        return self._pool

    def add(self, texts: Sequence[str], metadatas: Sequence[Mapping[str, Any] | None] | None = None,
            doc_ids: Sequence[str] | None = None, *, progress: bool = False,
            space_check: bool = True, journal: AbstractContextManager[object] | None = None) -> IngestReport:
        self._progress = progress
        return super().add(texts, metadatas, doc_ids, progress=progress, space_check=space_check, journal=journal)

    def _independent_caches(self, chunks: Sequence[PendingChunk], progress: bool) -> None:
        if not chunks:
            return
        jobs = [([(c.chunk_id, c.text) for c in group],) for group in self._groups(chunks)]
        with tqdm(total=len(chunks), desc="independent caches", unit="chunk", disable=not progress) as bar:
            for _, done in self.pool.imap("independent", jobs):
                self.builder.prefills += done
                bar.update(done)

    def _embed(self, texts: Sequence[str]) -> np.ndarray:
        # NOTE: the local ingest's batches: the same texts in the same batch give the same bits.
        size = self.config.batch_size
        jobs = [(list(texts[lo : lo + size]),) for lo in range(0, len(texts), size)]
        parts: dict[int, list[Any]] = {}
        with tqdm(total=len(texts), desc="embeddings", unit="chunk", disable=not self._progress) as bar:
            for i, vectors in self.pool.imap("embed", jobs):
                parts[i] = vectors
                bar.update(len(vectors))
        return unit_rows([v for i in range(len(jobs)) for v in parts[i]])

    def _batch_neighbours(self, embeddings: np.ndarray, ids: Sequence[str], n: int) -> list[dict[str, float]]:
        # NOTE: the matrix goes to the object store once; each task reads it and computes one block
        # of rows ([DISTANCE_BLOCK, N] distances at a time), so memory per worker stays bounded.
        ref, id_ref = self.pool.put(embeddings), self.pool.put(list(ids))
        jobs = [(ref, id_ref, lo, min(lo + DISTANCE_BLOCK, len(ids)), n) for lo in range(0, len(ids), DISTANCE_BLOCK)]
        blocks: dict[int, list[dict[str, float]]] = {}
        with tqdm(total=len(embeddings), desc="neighbour graph", unit="chunk", disable=not self._progress) as bar:
            for i, rows in self.pool.imap("neighbours", jobs):
                blocks[i] = rows
                bar.update(len(rows))
        return [row for i in range(len(jobs)) for row in blocks[i]]

    def _fused_batches(self, new: Sequence[PendingChunk]) -> Iterator[Sequence[PendingChunk]]:
        """Every fused cache computed on the actors; a Chroma batch is yielded (in order) once all of its
        chunks' blobs are stored, while the actors go on with later batches."""
        size = self.config.batch_size
        batches = [new[lo : lo + size] for lo in range(0, len(new), size)]
        if not self.config.fuse:
            yield from batches
            return
        # NOTE: as the local ingest: a fused blob left by an interrupted run is reused only if it was
        # built on the neighbours found now.
        todo = [c for c in new if not self._usable(c.chunk_id, "fused", [nid for nid, _ in c.neighbours])]
        groups = list(self._groups(todo))
        batch_of = {c.chunk_id: b for b, batch in enumerate(batches) for c in batch}
        todo_ids = {c.chunk_id for c in todo}
        waiting = [sum(1 for c in batch if c.chunk_id in todo_ids) for batch in batches]
        group_batches = [[batch_of[c.chunk_id] for c in group] for group in groups]
        jobs = [([(c.chunk_id, c.text, c.neighbours) for c in group],) for group in groups]
        results = self.pool.imap("fused", jobs)
        for b, batch in enumerate(batches):
            while waiting[b]:
                job, (done, back) = next(results)
                self.builder.prefills += done
                if back:
                    # NOTE: a neighbour without an independent cache: the driver recomputes it from
                    # the collection's text (`CacheBuilder` text lookup), then fuses.
                    log.warning("fusing %d chunk(s) on the driver: a neighbour's independent cache is missing",
                                len(back))
                    for (cid, _, _), kv in zip(back, self.builder.fused(back), strict=True):
                        self.store.put(cid, kv)
                for owner in group_batches[job]:
                    waiting[owner] -= 1
            yield batch

    def _groups(self, chunks: Sequence[PendingChunk]) -> Iterator[list[PendingChunk]]:
        """Chunks in tasks of at most `prefill_batch` (each task is one packed pass), as many tasks as
        a multiple of the workers, of near-equal size.

        NOTE: a phase ends with its slowest worker. 40 chunks in tasks of 8 are 5 tasks: one of 2
        workers runs 3, so the phase takes 3 task-times instead of 2.5 (at most 1.67x of one
        worker); 6 tasks of 7 chunks keep both busy to the end.
        """
        if not chunks:
            return
        workers = self.ray_config.workers
        tasks = -(-len(chunks) // self.config.prefill_batch)
        tasks = -(-tasks // workers) * workers
        step = -(-len(chunks) // tasks)
        for lo in range(0, len(chunks), step):
            yield list(chunks[lo : lo + step])


__all__ = ["IngestWorker", "RayConfig", "RayIngestor", "StoreSpec", "WorkerPool", "start_local_cluster", "store_spec"]
