"""`fusionrag serve`: the OpenAI-compatible server over the corpus in --db (a `fusionrag.commands` plugin)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Sequence

from fusionrag_core.cli import Command, open_index, positive_int
from fusionrag_core.engine import FusionEngine
from fusionrag_core.paths import chroma_dir
from fusionrag_integrations.server.config import API_KEY_ENV, LOOPBACK, ServerConfig
from fusionrag_integrations.session import ReuseConfig, ReuseSession

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own options (the global ones, --db, --model, ..., are added by the CLI)."""
    defaults = ServerConfig()
    parser.add_argument("--host", default=LOOPBACK, help=f"address to bind (default: {LOOPBACK}, loopback only)")
    parser.add_argument("--port", type=int, default=defaults.port, help=f"TCP port (default: {defaults.port})")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set, else none)")
    parser.add_argument("--max-running", type=positive_int, default=defaults.max_running,
                        help=f"requests generating at once (default: {defaults.max_running})")
    parser.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                        help=f"requests queued before 429 (default: {defaults.max_waiting})")
    parser.add_argument("--max-body-bytes", type=positive_int, default=defaults.max_body_bytes,
                        help=f"largest request body (default: {defaults.max_body_bytes})")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                        help="longest prompt (default: the model's context window)")


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The command line as a ServerConfig; the API key from --api-key, else the environment."""
    return ServerConfig(host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                        max_running=args.max_running, max_waiting=args.max_waiting,
                        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens)


def session_for(args: argparse.Namespace, engine: FusionEngine) -> ReuseSession:
    """The session the server answers with: the --db corpus's KV store (when there is one) and
    learned caches under --db."""
    store = None
    if args.chroma_url is not None or chroma_dir(args.db).is_dir():
        store = open_index(args, engine).store
    else:
        logger.warning("no corpus in %s: serving without ingested caches (learned caches only); run "
                       "`fusionrag ingest` to add one", args.db)
    return ReuseSession(engine, store, ReuseConfig(data_dir=args.db))


def run(args: argparse.Namespace, engine: Callable[[], FusionEngine], argv: Sequence[str]) -> int:
    """`fusionrag serve`: build the app and run it under uvicorn until interrupted."""
    import uvicorn

    from fusionrag_integrations.server.app import create_app

    config = server_config(args)  # NOTE: checked before the model loads
    if config.host != LOOPBACK:
        logger.warning("binding %s: the server is reachable from other machines%s", config.host,
                       "" if config.api_key else " without an API key")
    app = create_app(session_for(args, engine()), config)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info")
    return 0


COMMAND = Command(
    name="serve",
    help="serve the model over an OpenAI-compatible HTTP API, with FusionRAG's cache reuse",
    description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics. Every prompt "
                "reuses the caches of the --db corpus's chunks it holds and learns the rest.",
    epilog="examples:\n  fusionrag serve\n  fusionrag --db ./data serve --port 8080 --api-key $KEY",
    add_arguments=add_arguments,
    run=run,
)

__all__ = ["COMMAND", "add_arguments", "run", "server_config", "session_for"]
