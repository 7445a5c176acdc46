"""`fusionrag serve`: the OpenAI-compatible server over the corpus in --db (a `fusionrag.commands` plugin)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from fusionrag_core.batching.heal import HealConfig
from fusionrag_core.batching.scheduler import SchedulerConfig
from fusionrag_core.cli import Command, open_index, positive_int
from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.paths import chroma_dir
from fusionrag_core.store import KVStore, TierConfig
from fusionrag_integrations.openai_server.config import API_KEY_ENV, LOOPBACK, ServerConfig
from fusionrag_integrations.session import ReuseConfig, ReuseSession

if TYPE_CHECKING:
    from fusionrag_integrations.openai_server.ray_serve import RayServeOptions, ReplicaSpec
    from fusionrag_integrations.openai_server.vector_stores import VectorStores

logger = logging.getLogger(__name__)

LEARN_MODES = ("off", "tenant", "shared")
"""`fusionrag serve --learn`: no learned caches, one set per tenant (and cache_salt), or one for all."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own options (the global ones, --db, --model, ..., are added by the CLI)."""
    defaults = ServerConfig()
    parser.add_argument("--host", default=LOOPBACK, help=f"address to bind (default: {LOOPBACK}, loopback only)")
    parser.add_argument("--port", type=int, default=defaults.port, help=f"TCP port (default: {defaults.port})")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set, else none)")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="accept the keys of FILE, one 'TENANT KEY' line each (read again when it changes); each "
                             "tenant's requests reuse only caches its own requests filled")
    parser.add_argument("--learn", choices=LEARN_MODES, default="tenant",
                        help="learn caches of the documents and spans requests send: 'tenant' (default) keeps them per "
                             "tenant and cache_salt, 'shared' lets every tenant hit every other's (and see that it "
                             "did), 'off' learns nothing")
    limits = SchedulerConfig()
    parser.add_argument("--max-running", type=positive_int, default=limits.max_running,
                        help=f"requests decoded at once, in one batched step (default: {limits.max_running})")
    parser.add_argument("--max-waiting", type=int, default=limits.max_waiting,
                        help=f"requests queued in the engine before 429 (default: {limits.max_waiting})")
    parser.add_argument("--heal", type=positive_int, default=None, metavar="PIECE_TOKENS",
                        help="heal kept conversations while idle, in pieces of PIECE_TOKENS tokens (e.g. 64): a "
                             "later turn continues exact K/V (EngineConfig.heal; default: off)")
    parser.add_argument("--heal-answers", action="store_true",
                        help="with --heal, also heal each answer between its decode steps, so the rest of it "
                             "decodes over exact K/V; adds a piece's pass to some decode steps "
                             "(HealConfig.answers; default: off)")
    parser.add_argument("--max-body-bytes", type=positive_int, default=defaults.max_body_bytes,
                        help=f"largest request body (default: {defaults.max_body_bytes})")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                        help="longest prompt (default: the model's context window)")
    parser.add_argument("--header-timeout", type=float, default=defaults.header_read_timeout_s, metavar="SECONDS",
                        help="a connection's time to send a request's headers before it is closed "
                             f"(default: {defaults.header_read_timeout_s:g})")
    parser.add_argument("--body-timeout", type=float, default=defaults.body_read_timeout_s, metavar="SECONDS",
                        help="a request's time to send its body once its headers are in, else 408 "
                             f"(default: {defaults.body_read_timeout_s:g})")
    parser.add_argument("--shutdown-timeout", type=int, default=defaults.shutdown_timeout_s,
                        metavar="SECONDS",
                        help="on SIGTERM or Ctrl-C, how long requests in flight may run on before they are cancelled "
                             f"(default: {defaults.shutdown_timeout_s})")
    parser.add_argument("--cache-device-mb", type=mebibytes, default=0, metavar="MB",
                        help="MiB of decoded chunk caches kept on the model's device in front of the KV store, per "
                             "server or replica (default: 0, none)")
    parser.add_argument("--cache-host-mb", type=mebibytes, default=0, metavar="MB",
                        help="MiB of decoded chunk caches kept in host memory in front of the KV store, per server or "
                             "replica, so a hot chunk is read from Redis once, not once per request (default: 0)")
    ray = parser.add_argument_group("scale-out on Ray Serve")
    ray.add_argument("--ray", metavar="local|ADDRESS",
                     help="serve --replicas replicas behind one route on Ray Serve: 'local' starts a one-machine "
                          "cluster, else a cluster address (auto, HOST:PORT, ray://HOST:10001); the replicas share "
                          "the corpus through --chroma-url and a KV store every node reaches (--redis-url); needs "
                          "pip install 'fusionrag[serve-ray]'")
    ray.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                     help="with --ray: replicas, one model each (default: 2)")
    ray.add_argument("--threads-per-replica", type=positive_int, default=None, metavar="N",
                     help="with --ray: CPUs (torch threads) per replica (default: 1)")


def mebibytes(text: str) -> int:
    """A byte budget in MiB on the command line: a whole number >= 0."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number of MiB >= 0, got {text!r}")
    return int(text)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The command line as a ServerConfig; the API key from --api-key, else the environment; the
    global --selector and --ratio as every request's selection."""
    return ServerConfig(host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                        api_key_file=args.api_key_file,
                        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                        selector=getattr(args, "selector", None), ratio=getattr(args, "ratio", None),
                        header_read_timeout_s=args.header_timeout, body_read_timeout_s=args.body_timeout,
                        shutdown_timeout_s=args.shutdown_timeout)


def cache_tiers(args: argparse.Namespace) -> TierConfig | None:
    """--cache-device-mb and --cache-host-mb as tier budgets; None when both are 0."""
    if not (args.cache_device_mb or args.cache_host_mb):
        return None
    return TierConfig(device_bytes=args.cache_device_mb << 20, host_bytes=args.cache_host_mb << 20)


def scheduler_limits(args: argparse.Namespace) -> SchedulerConfig:
    """--max-running and --max-waiting: the engine's scheduler's limits, the server's only ones.

    Raises:
        InvalidRequestError: a limit out of range (`SchedulerConfig`'s checks).
    """
    return SchedulerConfig(max_running=args.max_running, max_waiting=args.max_waiting)


def healing(args: argparse.Namespace, engine: FusionEngine) -> FusionEngine:
    """`engine`, healing kept requests with --heal, and answers in flight with --heal-answers (on the
    same weights)."""
    if args.heal is None:
        return engine
    heal = HealConfig(piece_tokens=args.heal, answers=args.heal_answers)
    return engine.with_config(dataclasses.replace(engine.config, heal=heal))


def session_for(args: argparse.Namespace, engine: FusionEngine) -> ReuseSession:
    """The session the server answers with: the --db corpus's KV store (when there is one) and
    learned caches under --db, per tenant unless `--learn shared` (none with `--learn off`)."""
    store: KVStore | None = None
    if args.chroma_url is not None or chroma_dir(args.db).is_dir():
        store = open_index(args, engine).store
        tiers = cache_tiers(args)
        if tiers is not None:
            store = tiers.wrap(store, device=engine.device, dtype=engine.decoder.dtype)
    else:
        logger.warning("no corpus in %s: serving without ingested caches (learned caches only); run "
                       "`fusionrag ingest` to add one", args.db)
    return ReuseSession(engine, store, reuse_config(args))


def reuse_config(args: argparse.Namespace) -> ReuseConfig:
    """--learn and --db as the session's learning settings."""
    return ReuseConfig(data_dir=args.db, learn=args.learn != "off", share_learned=args.learn == "shared")


def replica_spec(args: argparse.Namespace, engine: Callable[[], FusionEngine], config: ServerConfig) -> ReplicaSpec:
    """What each `--ray` replica builds: the --model engine (through `engine`, pickled to every
    replica) and the corpus the global options name.

    Raises:
        InvalidRequestError: the corpus is an embedded Chroma database (one process serves it).
    """
    if args.chroma_url is None and chroma_dir(args.db).is_dir():
        raise InvalidRequestError(
            f"--ray replicas share the corpus through a Chroma server, but {args.db} holds an embedded one: start "
            f"`chroma run --path {chroma_dir(args.db)} --host 127.0.0.1 --port 8001` and pass "
            "--chroma-url http://127.0.0.1:8001 (and --redis-url for caches every node reaches)"
        )
    if args.chroma_url is None:
        logger.warning("no --chroma-url: the replicas serve without ingested caches (learned caches only)")
    from fusionrag_integrations.openai_server.ray_serve import ReplicaSpec

    # NOTE: absolute: replicas run in other working directories (and on other machines).
    return ReplicaSpec(engine_factory=engine, data_dir=str(Path(args.db).expanduser().resolve()),
                       chroma_url=args.chroma_url, redis_url=args.redis_url, collection=args.collection,
                       server=config, limits=scheduler_limits(args), tiers=cache_tiers(args),
                       reuse=reuse_config(args))


def ray_options(args: argparse.Namespace) -> RayServeOptions | None:
    """The --ray options (None without --ray).

    Raises:
        InvalidRequestError: --replicas or --threads-per-replica without --ray.
    """
    if args.ray is None:
        for flag, value in (("--replicas", args.replicas), ("--threads-per-replica", args.threads_per_replica)):
            if value is not None:
                raise InvalidRequestError(f"{flag} needs --ray local|ADDRESS (one server otherwise)")
        return None
    from fusionrag_integrations.openai_server.ray_serve import RayServeOptions

    return RayServeOptions(address=args.ray, replicas=args.replicas or 2,
                           threads_per_replica=args.threads_per_replica or 1)


def run(args: argparse.Namespace, engine: Callable[[], FusionEngine], argv: Sequence[str]) -> int:
    """`fusionrag serve`: build the app and run it under uvicorn until interrupted, or, with --ray,
    its replicas on Ray Serve."""
    from fusionrag_integrations.openai_server.app import create_app

    config = server_config(args)  # NOTE: checked before the model loads
    limits = scheduler_limits(args)
    if args.heal_answers and args.heal is None:
        raise InvalidRequestError("--heal-answers heals in pieces of --heal's size: add --heal PIECE_TOKENS (e.g. "
                                  "--heal 64)")
    scale_out = ray_options(args)
    if scale_out is not None:
        if args.heal is not None:
            raise InvalidRequestError("--heal heals one server's kept conversations; --ray replicas do not heal yet: "
                                      "drop --heal or --ray")
        from fusionrag_integrations.openai_server import ray_serve

        ray_serve.serve_until_interrupted(replica_spec(args, engine, config), scale_out)
        return 0
    if config.host != LOOPBACK:
        logger.warning("binding %s: the server is reachable from other machines%s", config.host,
                       "" if config.api_key else " without an API key")
    session = session_for(args, healing(args, engine().with_limits(limits)))
    stores = vector_stores_for(args, session.engine)
    try:
        serve_until_stopped(create_app(session, config, stores), config)
    finally:
        stores.close()
    return 0


def vector_stores_for(args: argparse.Namespace, engine: FusionEngine) -> VectorStores:
    """The server's vector stores and uploaded files: collections `vs_*` of the --db corpus's Chroma
    (or --chroma-url), their caches under --db (or --redis-url), uploads in `<db>/files/`."""
    from fusionrag_integrations.openai_server.vector_stores import VectorStoreConfig, VectorStores

    return VectorStores(engine, VectorStoreConfig(data_dir=Path(args.db).expanduser(), chroma_url=args.chroma_url,
                                                  redis_url=args.redis_url))


def serve_until_stopped(app: Callable[..., Any], config: ServerConfig) -> None:
    """Run `app` under uvicorn until SIGTERM or Ctrl-C; the requests still in flight
    `config.shutdown_timeout_s` later are cancelled (their streams end and, at the engine's next
    step, their slots free; the engine's loop thread is a daemon and keeps no process alive).

    A SIGTERM returns here, so that the command ends through its cleanup (the corpus closed) and
    exits 0: uvicorn raises the signal that stopped it again once it has shut down, which would
    otherwise kill the process on the way out. Ctrl-C still ends as KeyboardInterrupt.
    """
    import uvicorn

    from fusionrag_integrations.openai_server.connections import http_protocol

    stoppable = threading.current_thread() is threading.main_thread()  # NOTE: signals are the main thread's
    previous = signal.signal(signal.SIGTERM, _terminated) if stoppable else None
    quiet = _CancelledAtShutdown()
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level="info",
                    timeout_graceful_shutdown=config.shutdown_timeout_s,
                    http=http_protocol(config.header_read_timeout_s))
    except _TerminatedError:
        pass  # NOTE: uvicorn has shut down (or had not started listening for the signal yet)
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _TerminatedError(BaseException):
    """SIGTERM, outside uvicorn's own handling of it; a BaseException, as KeyboardInterrupt is, so that
    no `except Exception` on the way takes it."""


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise _TerminatedError


class _CancelledAtShutdown(logging.Filter):
    """Drops uvicorn's traceback of each request it cancelled at its shutdown deadline: it has said
    so in one line ("Cancel N running task(s)"), and a request cut off by a shutdown is no fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


COMMAND = Command(
    name="serve",
    help="serve the model over an OpenAI-compatible HTTP API, with FusionRAG's cache reuse",
    description="Serve /v1/chat/completions, /v1/completions, /v1/responses (with file_search over /v1/vector_stores "
                "and /v1/files), /v1/models, /health and /metrics. Every prompt "
                "reuses the caches of the --db corpus's chunks it holds and learns the rest. With --ray, --replicas "
                "copies run on Ray Serve behind one route, sharing a Chroma server and a KV store.",
    epilog="examples:\n  fusionrag serve\n  fusionrag --db ./data serve --port 8080 --api-key $KEY\n"
           "  fusionrag --chroma-url http://127.0.0.1:8001 --redis-url redis://127.0.0.1:6379/0 serve --ray local "
           "--replicas 2",
    add_arguments=add_arguments,
    run=run,
)

__all__ = ["COMMAND", "LEARN_MODES", "add_arguments", "ray_options", "replica_spec", "reuse_config", "run",
           "scheduler_limits", "serve_until_stopped", "server_config", "session_for", "vector_stores_for"]
