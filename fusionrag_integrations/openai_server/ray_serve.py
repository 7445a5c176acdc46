"""`fusionrag serve --ray`: N replicas of the OpenAI-compatible server on Ray Serve, behind one route.

    client --HTTP--> Serve's proxy (host:port; loopback unless told otherwise)
                         |--> replica 1: model + ReuseSession + the `create_app` routes
                         |--> ...
                         '--> replica N          all replicas: one Chroma server, one KV store

Each replica is a Ray actor that builds the model (`ReplicaSpec.engine_factory`, pickled to it as a
Ray ingest's factory is), opens the shared corpus (a Chroma server and a KV store every replica
reaches: Redis, or a directory every node mounts) and serves `create_app(session, config)`. Serve's
proxy spreads requests over the replicas and names the one that answered in `REPLICA_HEADER`. Serve's
controller replaces a replica whose actor dies: the requests that replica held fail (clients retry
them, as OpenAI clients do), the others go to the live replicas. Replicas only read the corpus's
caches (writing them stays `fusionrag ingest`'s and `verify`'s). Learned caches are shared by every
replica through a Redis store (`reuse/shared_learned.py`); over a disk store, by each node's replicas
under `data_dir` (SQLite and atomic blob writes: safe for several processes). `ReplicaSpec.tiers`
puts a device and a host LRU in front of the shared store in each replica.

A prompt's passages are found by content through the store's content index (`KVStore.content_index()`):
a Redis store keeps it in Redis beside the caches, and every replica follows its changes at each
lookup, so a replica started before an ingest finds the new chunks without a restart.

Ray Serve is an optional dependency (`pip install 'fusionrag[serve-ray]'`; tested with 2.60), imported
when `deploy` runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any

import torch
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fusionrag_core.batching.scheduler import SchedulerConfig
from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import FusionRAGError, InvalidRequestError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.distributed import start_local_cluster
from fusionrag_core.paths import DEFAULT_COLLECTION
from fusionrag_core.store import TierConfig
from fusionrag_integrations.openai_server.app import create_app
from fusionrag_integrations.openai_server.config import LOOPBACK, ServerConfig
from fusionrag_integrations.session import ReuseConfig, ReuseSession

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-fusionrag-replica"
"""Response header naming the replica that answered (Serve's replica id)."""
_VARIANTS = ("independent", "fused")


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica builds: picklable (Ray sends it to each replica).

    Attributes:
        engine_factory: builds the replica's model; a module-level function or `functools.partial`.
        data_dir: absolute data directory: the disk KV store (without `redis_url`) and learned caches.
        chroma_url: the corpus's Chroma server; None: no corpus (learned caches only).
        redis_url: the Redis KV store of the corpus; None: the disk store under `data_dir`.
        collection: the corpus's collection.
        server: the routes' limits and API key; `host:port` is where Serve's proxy listens.
        limits: each replica's scheduler limits (`max_running`, `max_waiting`): its one admission point.
        reuse: each replica's learning settings (`--learn`); its data directory is `data_dir`'s.
        tiers: each replica's device and host LRU of decoded caches in front of the shared store
            (None: none), so a hot chunk is read from it once per replica; hits per tier in `/metrics`.

    Raises:
        InvalidRequestError: `server.port` is 0 (Serve's proxy needs a port clients can be told).
    """

    engine_factory: Callable[[], FusionEngine]
    data_dir: str
    chroma_url: str | None = None
    redis_url: str | None = None
    collection: str = DEFAULT_COLLECTION
    server: ServerConfig = field(default_factory=ServerConfig)
    limits: SchedulerConfig = field(default_factory=SchedulerConfig)
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    tiers: TierConfig | None = None

    def __post_init__(self) -> None:
        if self.server.port == 0:
            raise InvalidRequestError("Ray Serve's HTTP proxy needs a fixed port: pass --port (ServerConfig.port) "
                                      "between 1 and 65535, not 0")


@dataclass(frozen=True)
class RayServeOptions:
    """Where the replicas run and how Serve looks after them.

    Attributes:
        address: "local" starts a one-machine cluster (127.0.0.1 only, `object_store_mb`) and stops
            it on `close`; else passed to `ray.init` ("auto", "HOST:PORT", "ray://HOST:10001").
            An already initialised Ray is used as it is.
        replicas: replicas, each with its own model.
        threads_per_replica: CPUs reserved per replica, and its torch threads.
        gpus_per_replica: GPUs per replica; None: 1 when the cluster has a GPU per replica, else 0.
        health_check_period_s: how often Serve checks each replica (a dead actor is noticed sooner).
        max_constructor_retry_count: replica starts that may fail before the deploy fails.
        object_store_mb: object store of a local cluster (requests and answers only).
        runtime_env: passed to `ray.init` (e.g. `{"env_vars": {...}}`).
        name: the Serve application (and deployment) name.

    Raises:
        InvalidRequestError: a count below 1.
    """

    address: str = "local"
    replicas: int = 2
    threads_per_replica: int = 1
    gpus_per_replica: float | None = None
    health_check_period_s: float = 2.0
    max_constructor_retry_count: int = 3
    object_store_mb: int = 256
    runtime_env: Mapping[str, Any] | None = field(default=None, hash=False)
    name: str = "fusionrag"

    def __post_init__(self) -> None:
        for name in ("replicas", "threads_per_replica", "max_constructor_retry_count"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be at least 1, got {getattr(self, name)}")


# ---- the replica ------------------------------------------------------------------------------------
class Replica:
    """One replica: its model, the shared corpus, and the server's routes (Serve's late-bound
    ingress: Serve calls `__serve_build_asgi_app__` after the constructor)."""

    def __init__(self, spec: ReplicaSpec, threads: int) -> None:
        _bind_replica_grpc_to_node_address()
        torch.set_num_threads(threads)
        self.spec = spec
        engine = spec.engine_factory().with_limits(spec.limits)
        self.index = _open_corpus(spec, engine)
        store = self.index.store if self.index is not None else None
        self.session = ReuseSession(engine, store, dataclasses.replace(spec.reuse, data_dir=spec.data_dir))

    def __serve_build_asgi_app__(self) -> FastAPI:
        from ray import serve

        app = create_app(self.session, self.spec.server)
        app.add_middleware(_ReplicaHeader, replica=serve.get_replica_context().replica_id.unique_id)
        return app

    def __del__(self) -> None:
        index, self.index = getattr(self, "index", None), None
        if index is not None:
            index.close()


def _open_corpus(spec: ReplicaSpec, engine: FusionEngine) -> FusionIndex | None:
    """The shared corpus, checked to be readable here: a replica that reaches the collection but not
    its caches (a disk store on a directory this node lacks) would answer without reuse, unnoticed.

    Raises:
        InvalidRequestError: a sampled chunk has no cache in the store this replica opened.
    """
    if spec.chroma_url is None:
        return None
    index = FusionIndex.open(engine, spec.data_dir, chroma_url=spec.chroma_url, redis_url=spec.redis_url,
                             collection_name=spec.collection, tiers=spec.tiers)
    sample = index.collection.get(limit=1, include=[])["ids"]
    if sample and not any(index.store.has(sample[0], v) for v in _VARIANTS):  # type: ignore[arg-type]
        index.close()
        import ray

        raise InvalidRequestError(
            f"a replica on {ray.util.get_node_ip_address()} finds chunk {sample[0]} in {spec.chroma_url} but none "
            f"of its caches in {spec.redis_url or spec.data_dir}: give every replica the corpus's KV store "
            "(--redis-url, or a --db on a directory every node mounts), or run `fusionrag verify` if the corpus "
            "is damaged"
        )
    return index


class _ReplicaHeader:
    """ASGI middleware: adds `REPLICA_HEADER: <replica id>` to every HTTP response."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


def _bind_replica_grpc_to_node_address() -> None:
    """Make this replica's inter-deployment gRPC server listen on the node's address only.

    NOTE: Ray Serve (2.60) starts it after the constructor on `[::]:0`, every interface, with no
    option to change that (ray-project/ray#64544). Serve's routers reach a replica at its node's
    address, so binding that address alone changes nothing for Serve, and a local cluster (node
    127.0.0.1) stays on loopback. A Serve without this hook is left as it is.
    """
    try:
        from ray.serve._private import replica as serve_replica
    except ImportError:  # pragma: no cover - another Ray layout
        return
    bind = getattr(serve_replica, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "node_only", False):
        return
    import ray

    node = ray.util.get_node_ip_address()
    host = f"[{node}]" if ":" in node else node

    def node_only(server: Any, address: str) -> Any:
        return bind(server, f"{host}:0" if address == "[::]:0" else address)

    node_only.node_only = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = node_only


# ---- deploying ----------------------------------------------------------------------------------------
class RayServeApp:
    """The running replicas and their route (from `deploy`); `close` (or a `with` block) removes them.

    Attributes:
        url: the route, `http://host:port` (OpenAI clients add `/v1`).
        name: the Serve application.
    """

    def __init__(self, ray: Any, options: RayServeOptions, host: str, port: int, started: bool) -> None:
        self.ray = ray
        self.name = options.name
        self.host, self.port = host, port
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        self._started = started

    def running(self) -> int:
        """Replicas Serve reports RUNNING."""
        from ray import serve

        states: Mapping[Any, int] = serve.status().applications[self.name].deployments[self.name].replica_states
        return int(states.get("RUNNING", 0))  # NOTE: keys are a str enum: "RUNNING" finds them

    def replica_actors(self) -> dict[str, Any]:
        """The live replicas' actors by replica id (the id `REPLICA_HEADER` carries)."""
        # NOTE: Serve names each replica's actor `SERVE_REPLICA::<app>#<deployment>#<replica id>`.
        prefix = f"SERVE_REPLICA::{self.name}#{self.name}#"
        return {a["name"].removeprefix(prefix): self.ray.get_actor(a["name"], namespace=a["namespace"])
                for a in self.ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}

    def close(self) -> None:
        """Remove the application; stop Serve when no other application is left, and the cluster
        (or the connection to it) when `deploy` started it. Idempotent."""
        if not self.ray.is_initialized():
            return
        from ray import serve

        serve.delete(self.name)
        if not serve.status().applications:
            serve.shutdown()
        if self._started:
            self.ray.shutdown()
            self._started = False

    def __enter__(self) -> RayServeApp:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def deploy(spec: ReplicaSpec, options: RayServeOptions) -> RayServeApp:
    """Start `options.replicas` replicas of `spec` on Ray Serve; returns once all of them answer.

    Raises:
        InvalidRequestError: Ray is not installed, or Serve already runs on the cluster with its
            proxy on another address (its HTTP options cannot change while it runs).
        FusionRAGError: the replicas did not start (the replicas' error is in the message).
    """
    ray, started = _connect(options)
    try:
        host, port = _start_serve(spec.server)
        _run(ray, spec, options)
    except BaseException:
        if started:
            ray.shutdown()
        raise
    logger.info("%d replica(s) of %s serving on http://%s:%d", options.replicas, options.name, host, port)
    return RayServeApp(ray, options, host, port, started)


def serve_until_interrupted(spec: ReplicaSpec, options: RayServeOptions) -> None:
    """`deploy`, then keep the replicas running until Ctrl-C or SIGTERM (the CLI's `fusionrag serve
    --ray`); then remove them, and stop the cluster `deploy` started."""
    if spec.server.host != LOOPBACK:
        logger.warning("Serve's proxy binds %s: the route is reachable from other machines%s", spec.server.host,
                       "" if spec.server.api_key else " without an API key")
    with _sigterm_interrupts(), deploy(spec, options):
        try:
            while True:
                time.sleep(1.0)
        except KeyboardInterrupt:
            logger.info("stopping the replicas")


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a service manager's stop) raises KeyboardInterrupt in the block, as Ctrl-C does.

    NOTE: a driver killed by SIGTERM leaves a local cluster's agents running, orphaned; this lets
    `close` stop them. Only the main thread may set handlers: elsewhere nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _connect(options: RayServeOptions) -> tuple[Any, bool]:
    """(the `ray` module, whether this call started the cluster or the connection)."""
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return sys.modules["ray"], False
    runtime_env = dict(options.runtime_env) if options.runtime_env else None
    if options.address == "local":
        # NOTE: before `import ray`: the cluster must start in Ray's local-only (loopback) mode.
        start_local_cluster(options.replicas * options.threads_per_replica, options.object_store_mb, runtime_env)
    try:
        import ray
    except ImportError as e:
        raise InvalidRequestError("serving on Ray needs Ray Serve: pip install 'fusionrag[serve-ray]'") from e
    if options.address != "local":
        ray.init(address=options.address, runtime_env=runtime_env)
    return ray, True


def _start_serve(server: ServerConfig) -> tuple[str, int]:
    """Start Serve with its proxy on `server.host:server.port`, or check a running Serve's is there.

    NOTE: `serve.start` ignores new HTTP options when Serve already runs (with a log line); its
    private `serve_start` returns the client whose `http_config` says where the proxy really is.
    """
    from ray.serve._private.api import serve_start

    client = serve_start(http_options={"host": server.host, "port": server.port})
    host, port = client.http_config.host, client.http_config.port
    if (host, port) != (server.host, server.port):
        raise InvalidRequestError(
            f"Ray Serve already runs on this cluster with its proxy on {host}:{port}, not {server.host}:"
            f"{server.port}; pass --host {host} --port {port}, or stop it first (`serve shutdown`)"
        )
    return host, port


def _run(ray: Any, spec: ReplicaSpec, options: RayServeOptions) -> None:
    """Deploy the replicas and wait until every one is running."""
    from ray import serve

    try:
        ingress = serve.ingress()(Replica)  # NOTE: late-bound: the app is built after the constructor
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"this Ray Serve ({ray.__version__}) cannot build an app per replica; upgrade it: "
                                  "pip install -U 'fusionrag[serve-ray]' (Ray 2.60 is tested)") from e
    gpus = options.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= options.replicas else 0.0
    # NOTE: a replica takes what its engine's scheduler admits (running + waiting); Serve's proxy holds
    # at most max_waiting more, then answers 503 (OpenAI clients retry it).
    deployment = serve.deployment(
        name=options.name, num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.threads_per_replica, "num_gpus": gpus},
        max_ongoing_requests=spec.limits.max_running + spec.limits.max_waiting,
        max_queued_requests=max(1, spec.limits.max_waiting), health_check_period_s=options.health_check_period_s,
        max_constructor_retry_count=options.max_constructor_retry_count,
    )(ingress)
    try:
        serve.run(deployment.bind(spec, options.threads_per_replica), name=options.name, route_prefix="/")
    except RuntimeError as e:
        raise FusionRAGError(f"the {options.name} replicas did not start: {_replica_error(options.name) or e}") from e


def _replica_error(name: str) -> str:
    """The error a failed replica start left in Serve's status (a traceback: its last line), else ""."""
    from ray import serve

    app = serve.status().applications.get(name)
    deployment = app.deployments.get(name) if app is not None else None
    lines = [line.strip() for line in (deployment.message if deployment is not None else "").splitlines()]
    return next((line for line in reversed(lines) if line), "")


__all__ = ["REPLICA_HEADER", "RayServeApp", "RayServeOptions", "Replica", "ReplicaSpec", "deploy",
           "serve_until_interrupted"]
