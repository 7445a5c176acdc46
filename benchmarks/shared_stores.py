"""The shared stores against the disk store, side by side: the same corpus and prompts, found by content.

The packaged sample corpus is ingested twice with one model, into a disk store (the default) and a
Redis store, which is also read behind a host tier (`TierConfig`, what `fusionrag serve
--cache-host-mb` puts in front of it). Every corpus gets the same RAG chat requests as
`serve_load.py` builds (retrieved chunk texts pasted in the user message, no marks), answered with
learning off, so what is reused is what the content index found. Then:

1. lookup: the time `ReuseSources.find` takes per prompt (median over the requests and `--repeats`),
   the content index's cost: the disk store's SQLite + memory-mapped array against the Redis store's
   followed mirror (one round trip per lookup); and the time to read and decode the fused caches of
   the chunks found in a prompt (median), what the store itself adds to TTFT;
2. in-process, serial: each request answered by each store in turn (interleaved, so load changes hit
   all stores alike; each request starts with the next store, so none always goes first), `--repeats`
   times: the share of prompt tokens read from caches on the first ask, TTFT p50/p95, and each
   store's TTFT over the disk store's on the same request (median ratio);
3. over HTTP: each store's session served under uvicorn, the requests streamed from `--clients`
   clients (`serve_load.load`): TTFT p50/p95, requests/s, cached share, and the Redis commands the
   server sent per request (INFO commandstats, by command: a lookup's log read is XRANGE + EXISTS in one
   round trip, a cache load 1 GET).

    python benchmarks/shared_stores.py --redis-url redis://127.0.0.1:6379/0 --out benchmarks/results/shared-stores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
import torch

from benchmarks.serve_load import (
    LoadRequest,
    answer_in_process,
    build_requests,
    load,
    percentiles,
    serving,
    summarise,
)
from fusionrag_core.data import sample_corpus_dir
from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex
from fusionrag_core.reuse.sources import ReuseSources
from fusionrag_core.store import TierConfig
from fusionrag_integrations.openai_server import ServerConfig, create_app
from fusionrag_integrations.openai_server.protocol import ChatCompletionRequest
from fusionrag_integrations.session import ReuseConfig, ReuseSession


def open_corpus(engine: FusionEngine, data_dir: Path, redis_url: str | None) -> FusionIndex:
    """The sample corpus in a disk store (no `redis_url`) or a Redis one, ingested."""
    index = FusionIndex.open(engine, data_dir, redis_url=redis_url)
    files = sorted(sample_corpus_dir().glob("*.md"))
    index.add_texts([f.read_text(encoding="utf-8") for f in files], metadatas=[{"source": f.name} for f in files],
                    doc_ids=[f"fusionrag-sample/{f.name}" for f in files])
    return index


def prompt_text(session: ReuseSession, request: LoadRequest) -> str:
    """The prompt of `request` as the content index searches it (the chat template applied)."""
    body = ChatCompletionRequest(**request.body)
    return str(session.engine.tokenizer.apply_chat_template(body.chat_messages(), tokenize=False,
                                                            add_generation_prompt=True))


def lookup_cost(sessions: dict[str, ReuseSession], requests: Sequence[LoadRequest], repeats: int) -> dict[str, float]:
    """Median microseconds of one `find` over a prompt, per store (interleaved)."""
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(repeats):
        for request in requests:
            for name, session in sessions.items():
                text = prompt_text(session, request)
                sources = ReuseSources(session.store, None, learning=False)
                start = time.perf_counter()
                sources.find(text)
                times[name].append(time.perf_counter() - start)
    return {name: round(1e6 * statistics.median(t), 1) for name, t in times.items()}


def read_cost(sessions: dict[str, ReuseSession], requests: Sequence[LoadRequest], repeats: int) -> dict[str, float]:
    """Median milliseconds to read and decode the fused caches of the chunks found in one prompt, per
    store (interleaved): what a store adds to TTFT, apart from the model's own work."""
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(repeats):
        for request in requests:
            for name, session in sessions.items():
                engine = session.engine
                found = ReuseSources(session.store, None, learning=False).find(prompt_text(session, request))
                start = time.perf_counter()
                for match in found:
                    session.store.get(match.chunk_id, "fused", fingerprint=engine.fingerprint,
                                      device=engine.device, dtype=engine.decoder.dtype)
                times[name].append(time.perf_counter() - start)
    return {name: round(1e3 * statistics.median(t), 2) for name, t in times.items()}


def serial(sessions: dict[str, ReuseSession], requests: Sequence[LoadRequest], repeats: int,
           config: ServerConfig) -> dict[str, Any]:
    """Every request answered by every store in turn, `repeats` times: TTFT, cached share, ratios to disk."""
    outcomes: dict[str, list[Any]] = {name: [] for name in sessions}
    for session in sessions.values():
        answer_in_process(session, requests[0], config)  # NOTE: untimed warm-up
    names = list(sessions)
    for turn, request in enumerate(request for _ in range(repeats) for request in requests):
        # NOTE: each request starts with the next store in turn, so no store always runs first or last
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            outcomes[name].append(answer_in_process(sessions[name], request, config))
    out: dict[str, Any] = {}
    for name, done in outcomes.items():
        ratios = [o.ttft_s / d.ttft_s for o, d in zip(done, outcomes["disk"], strict=True)]
        out[name] = {"ttft_s": percentiles([o.ttft_s for o in done]),
                     "ttft_s_each": [round(o.ttft_s, 4) for o in done],
                     "cached_share": round(sum(o.cached_tokens for o in done) / sum(o.prompt_tokens for o in done), 4),
                     "ttft_over_disk_median": round(statistics.median(ratios), 3),
                     "answers_equal_disk": sum(o.answer == d.answer for o, d in zip(done, outcomes["disk"],
                                                                                     strict=True)),
                     "requests": len(done)}
    return out


def commands(client: redis.Redis) -> dict[str, int]:
    """Calls per Redis command since the server started (INFO commandstats)."""
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def over_http(name: str, session: ReuseSession, requests: Sequence[LoadRequest], clients: int,
              raw: redis.Redis) -> dict[str, Any]:
    """The requests streamed to `session` served over HTTP; the Redis commands it sent per request."""
    references = {r.question: "" for r in requests}
    before = commands(raw)
    with serving(create_app(session, ServerConfig())) as base_url:
        started = time.perf_counter()
        remote = asyncio.run(load(base_url, requests, clients, time.monotonic() + 600))
        ended = max((o.finished_at for o in remote if o.finished_at), default=started)
    after = commands(raw)
    result = summarise(remote, requests, references, ended - started)
    for key in ("mismatches", "answers_equal"):
        result.pop(key)  # NOTE: no references here: the serial pass compares answers
    if name != "disk":
        per = {cmd: round((n - before.get(cmd, 0)) / len(requests), 2) for cmd, n in after.items()
               if n > before.get(cmd, 0) and cmd not in ("info", "ping")}
        result["redis_commands_per_request"] = per
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True, help="a Redis server to ingest into (a namespace of its own)")
    parser.add_argument("--requests", type=int, default=6, help="requests (cycling the sample questions)")
    parser.add_argument("--repeats", type=int, default=2, help="serial passes over the requests")
    parser.add_argument("--clients", type=int, default=2, help="concurrent clients over HTTP")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("-k", type=int, default=3, help="retrieved chunks in each prompt")
    parser.add_argument("--questions", type=int, default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/shared-stores"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    engine = FusionEngine.from_pretrained(args.model, device=args.device)
    raw = redis.Redis.from_url(args.redis_url)
    config = ServerConfig()
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "redis_url")}
    settings.update(model=engine.name, torch_threads=torch.get_num_threads(), cpus=os.cpu_count(),
                    python=platform.python_version(), torch=torch.__version__,
                    redis=raw.info("server")["redis_version"])
    with tempfile.TemporaryDirectory(prefix="fusionrag-shared-stores-") as tmp:
        indexes = {"disk": open_corpus(engine, Path(tmp) / "disk", None),
                   "redis": open_corpus(engine, Path(tmp) / "redis", args.redis_url)}
        try:
            requests = build_requests(indexes["disk"], args)
            tiered = TierConfig(host_bytes=256 << 20).wrap(indexes["redis"].store, device=engine.device,
                                                           dtype=engine.decoder.dtype)
            stores = {"disk": indexes["disk"].store, "redis": indexes["redis"].store, "redis+host tier": tiered}
            sessions = {name: ReuseSession(engine, store, ReuseConfig(data_dir=tmp, learn=False))
                        for name, store in stores.items()}
            doc: dict[str, Any] = {"settings": settings,
                                   "lookup_us_per_prompt": lookup_cost(sessions, requests, args.repeats),
                                   "cache_read_ms_per_prompt": read_cost(sessions, requests, args.repeats),
                                   "serial": serial(sessions, requests, args.repeats, config),
                                   "http": {name: over_http(name, s, requests, args.clients, raw)
                                            for name, s in sessions.items()}}
        finally:
            for index in indexes.values():
                index.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: doc[k] for k in ("lookup_us_per_prompt", "cache_read_ms_per_prompt", "serial")}, indent=2))
    print(json.dumps({n: {k: v for k, v in r.items() if k in ("ttft_s", "requests_per_s", "cached_share",
                                                                "redis_commands_per_request")}
                      for n, r in doc["http"].items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
