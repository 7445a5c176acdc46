"""`serve_load.py`'s load against Ray Serve replicas over the shared stores: 1 replica, then 2.

The packaged sample corpus is ingested into a Chroma server and a Redis KV store (started here on
loopback by the test suite's own scripts, `tests/servers.py`, unless `--chroma-url`/`--redis-url`
name running ones). For each count in `--replicas`, `fusionrag serve --ray`'s deployment
(`ray_serve.deploy`, a local cluster it starts and stops) serves that corpus, and the RAG chat
requests `serve_load.py` builds (retrieved chunk texts pasted in the user message, no marks) are
streamed from `--clients` clients. Replicas learn nothing (`ReplicaSpec.learn` off), so what is
reused is what the shared content index found; each replica reads Redis through a host tier
(`--cache-host-mb`, what `fusionrag serve --cache-host-mb` sets). Reported per replica count:
the share of prompt tokens read from caches, TTFT and latency p50/p95, requests/s, and the Redis
commands the replicas sent per request (INFO commandstats over the timed requests; one untimed
warm-up request per replica first).

    python -m benchmarks.serve_replicas --requests 8 --clients 2 --out benchmarks/results/serve-replicas
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis
import torch

from benchmarks.serve_load import LoadRequest, build_requests, load, summarise
from fusionrag_core.cli import EngineSpec, load_engine
from fusionrag_core.data import sample_corpus_dir
from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex
from fusionrag_core.store import TierConfig
from fusionrag_integrations.openai_server import ServerConfig
from fusionrag_integrations.openai_server.ray_serve import RayServeOptions, ReplicaSpec, deploy
from tests.servers import free_port, running_chroma_server, running_redis_server

REPO_ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def shared_servers(chroma_url: str | None, redis_url: str | None) -> Iterator[tuple[str, str]]:
    """The given servers, or throw-away ones on loopback for the run."""
    with contextlib.ExitStack() as stack:
        chroma = chroma_url or stack.enter_context(running_chroma_server())
        kv = redis_url or stack.enter_context(running_redis_server())
        yield chroma, kv


def ingest(engine: FusionEngine, data_dir: Path, chroma_url: str, redis_url: str) -> FusionIndex:
    """The sample corpus in the shared stores."""
    index = FusionIndex.open(engine, data_dir, chroma_url=chroma_url, redis_url=redis_url)
    files = sorted(sample_corpus_dir().glob("*.md"))
    index.add_texts([f.read_text(encoding="utf-8") for f in files], metadatas=[{"source": f.name} for f in files],
                    doc_ids=[f"fusionrag-sample/{f.name}" for f in files])
    return index


def commands(client: redis.Redis) -> dict[str, int]:
    """Calls per Redis command since the server started (INFO commandstats)."""
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def per_request(before: dict[str, int], after: dict[str, int], requests: int) -> dict[str, float]:
    """Commands sent per request between two `commands` readings (INFO itself left out)."""
    return {cmd: round((n - before.get(cmd, 0)) / requests, 2) for cmd, n in sorted(after.items())
            if n > before.get(cmd, 0) and cmd not in ("info", "ping")}


def one_count(spec: ReplicaSpec, replicas: int, requests: Sequence[LoadRequest], clients: int,
              raw: redis.Redis) -> dict[str, Any]:
    """`requests` against `replicas` replicas of `spec`: the load's summary and Redis commands per request."""
    started = time.perf_counter()
    # NOTE: the replicas import this checkout's package, as the driver does (not one the venv installed)
    runtime_env = {"env_vars": {"PYTHONPATH": str(REPO_ROOT)}}
    options = RayServeOptions(address="local", replicas=replicas, object_store_mb=100, runtime_env=runtime_env)
    with deploy(spec, options) as app:
        deploy_s = time.perf_counter() - started
        # NOTE: one untimed request per replica, side by side, so each pays its one-time costs first
        asyncio.run(load(app.url, requests[:replicas], replicas, time.monotonic() + 600))
        before = commands(raw)
        start = time.perf_counter()
        outcomes = asyncio.run(load(app.url, requests, clients, time.monotonic() + 600))
        wall = max((o.finished_at for o in outcomes if o.finished_at), default=start) - start
        after = commands(raw)
    result = summarise(outcomes, requests, {r.question: "" for r in requests}, wall)
    for key in ("mismatches", "answers_equal"):
        result.pop(key)  # NOTE: no references: answers are serve_load.py's and shared_stores.py's to check
    result.update(replicas=replicas, deploy_s=round(deploy_s, 1),
                  redis_commands_per_request=per_request(before, after, len(requests)))
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="replica counts, one run each")
    parser.add_argument("--requests", type=int, default=8, help="timed requests per run (cycling the questions)")
    parser.add_argument("--clients", type=int, default=2, help="concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("-k", type=int, default=3, help="retrieved chunks in each prompt")
    parser.add_argument("--questions", type=int, default=None)
    parser.add_argument("--cache-host-mb", type=int, default=256, help="each replica's host tier (0: none)")
    parser.add_argument("--chroma-url", default=None, help="a running Chroma server (default: one started here)")
    parser.add_argument("--redis-url", default=None, help="a running Redis (default: one started here)")
    parser.add_argument("--model", default=None, help="model (default: the packaged SmolLM2-135M)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve-replicas"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = EngineSpec(model=args.model, device="cpu", dtype="float32")
    engine = load_engine(model)
    tiers = TierConfig(host_bytes=args.cache_host_mb << 20) if args.cache_host_mb else None
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "chroma_url", "redis_url")}
    settings.update(model=engine.name, cpus=os.cpu_count(), python=platform.python_version(), torch=torch.__version__,
                    learn=False)
    runs = []
    with shared_servers(args.chroma_url, args.redis_url) as (chroma_url, redis_url), \
            tempfile.TemporaryDirectory(prefix="fusionrag-serve-replicas-") as tmp:
        raw = redis.Redis.from_url(redis_url)
        settings["redis"] = raw.info("server")["redis_version"]
        with ingest(engine, Path(tmp), chroma_url, redis_url) as index:
            requests = build_requests(index, args)
        spec = ReplicaSpec(engine_factory=functools.partial(load_engine, model), data_dir=tmp, chroma_url=chroma_url,
                           redis_url=redis_url, server=ServerConfig(port=free_port()), learn=False, tiers=tiers)
        for replicas in args.replicas:
            runs.append(one_count(spec, replicas, requests, args.clients, raw))
            print(json.dumps({k: runs[-1][k] for k in ("replicas", "ok", "ttft_s", "requests_per_s", "cached_share",
                                                      "redis_commands_per_request")}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"settings": settings, "runs": runs}, indent=2) + "\n",
                                           encoding="utf-8")
    return 0 if all(r["ok"] == r["requests"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
