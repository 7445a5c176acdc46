"""Load test of the OpenAI-compatible server (`fusionrag serve`), on loopback: streamed RAG requests
from concurrent clients against one server, each answer checked against the same request answered
in-process.

It ingests the packaged sample corpus into a temporary FusionIndex and builds one RAG chat request
per sample question: the texts of its `-k` retrieved chunks, then the question (the server finds
the chunks in the KV store by their content, as it would for any OpenAI client). Then:

1. in-process: the `--requests` requests (cycling through the questions), greedy, one at a time,
   through the `ReuseSession` the server will serve, after one untimed warm-up. Each question's
   first answer is its reference; TTFT is the time from the call to the first text piece.
2. over HTTP: that session served by `create_app` under uvicorn on 127.0.0.1 (a free port), the
   same requests streamed from `--clients` concurrent clients; TTFT is the time from sending the
   request to the first content delta (queueing included).
3. the report: requests, errors by status, TTFT and latency p50/p95/max, requests/s, output
   tokens/s, the share of prompt tokens served from caches (`cached_tokens`), how many answers
   equal their reference, the server's own /metrics counters; written to `<out>/results.json`
   and printed as a table.

With `--hostile-clients H`, the load runs three times on the same server: clean, then with H more
clients sending hostile requests (`--hostile-share` of all requests sent, a quarter by default; 1
floods) for as long as the ordinary ones run (a megabyte stop string, a body
nested 5,000 deep, a lone surrogate, a cyclic schema, out-of-range numbers, a malformed tool call, an
unknown route, a body that never finishes arriving), then clean again. The report adds each hostile
kind's statuses and the ordinary requests' TTFT p95 under attack over the mean of the two clean
passes' (`hostile.ttft_p95_ratio`).

`--timeout` bounds the run from when the model has loaded: the ingest and each question's reference
answer always run, the rest stops at the deadline, and what did not finish is counted ("not run" in
the in-process pass, "timeout" in the load), never left out. The exit status is 1 when a request
failed or was not run, or an answer differed.

    python benchmarks/serve_load.py --requests 200 --clients 16 --out benchmarks/results/serve-load
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from fusionrag_core.batching.scheduler import SchedulerConfig
from fusionrag_core.data import load_sample_questions, sample_corpus_dir
from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.index import FusionIndex
from fusionrag_integrations.openai_server import ServerConfig, create_app
from fusionrag_integrations.openai_server.protocol import ChatCompletionRequest, usage
from fusionrag_integrations.request import RequestOptions
from fusionrag_integrations.session import ReuseConfig, ReuseSession

LOOPBACK = "127.0.0.1"
SYSTEM = "Answer the question in a few words, using the context."


@dataclass(frozen=True)
class LoadRequest:
    """One RAG chat request: the OpenAI body the clients send (streamed, greedy)."""

    question: int  # index into the sample questions: answers are compared per question
    body: dict[str, Any]


@dataclass
class Outcome:
    """One request's result, in-process or over HTTP. `status` is "200" when it answered, else the
    HTTP status, the client's exception name, "incomplete stream", "timeout" or "not run"."""

    status: str
    answer: str = ""
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    engine_ttft_s: float | None = None
    finished_at: float = field(default=0.0, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "200"


# ---- the requests ---------------------------------------------------------------------------------------
def build_requests(index: FusionIndex, args: argparse.Namespace) -> list[LoadRequest]:
    """`args.requests` RAG requests cycling through the first `args.questions` sample questions."""
    questions = load_sample_questions()[: args.questions]
    bodies = []
    for q in questions:
        context = "\n\n".join(hit.text for hit in index.search(q.question, args.k))
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Context:\n\n{context}\n\nQuestion: {q.question}"}]
        bodies.append({"messages": messages, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    return [LoadRequest(i % len(bodies), bodies[i % len(bodies)]) for i in range(args.requests)]


def ingest_sample(engine: FusionEngine, data_dir: Path) -> FusionIndex:
    """A FusionIndex of the packaged sample corpus in `data_dir` (as `fusionrag demo` builds it)."""
    files = sorted(sample_corpus_dir().glob("*.md"))
    index = FusionIndex.open(engine, data_dir)
    index.add_texts([f.read_text(encoding="utf-8") for f in files], metadatas=[{"source": f.name} for f in files],
                    doc_ids=[f"fusionrag-sample/{f.name}" for f in files])
    return index


# ---- in-process ---------------------------------------------------------------------------------------
def answer_in_process(session: ReuseSession, request: LoadRequest, config: ServerConfig) -> Outcome:
    """`request` answered through `session` with the options and messages the server would build
    from its body."""
    body = ChatCompletionRequest(**request.body)
    options = RequestOptions.from_values(body.sampling_values(config.default_max_tokens))
    start = time.perf_counter()
    text: list[str] = []
    ttft = None
    generation: Generation | None = None
    for piece in session.answer(body.chat_messages(), options):
        if isinstance(piece, Generation):
            generation = piece
            continue
        if ttft is None:
            ttft = time.perf_counter() - start
        text.append(piece)
    assert generation is not None  # NOTE: `ReuseSession.answer` ends with the Generation
    counts = usage([generation])
    return Outcome("200", "".join(text), ttft, time.perf_counter() - start, counts["prompt_tokens"],
                   counts["prompt_tokens_details"]["cached_tokens"], counts["completion_tokens"], generation.ttft_s,
                   time.perf_counter())


def in_process(session: ReuseSession, requests: Sequence[LoadRequest], config: ServerConfig,
               deadline: float) -> tuple[list[Outcome], dict[int, str], float]:
    """Every request answered serially (until `deadline`; a question's first request always runs):
    the outcomes, each question's reference answer, and the seconds they took."""
    answer_in_process(session, requests[0], config)  # NOTE: untimed warm-up: one-time costs of a process
    started = time.perf_counter()
    outcomes: list[Outcome] = []
    references: dict[int, str] = {}
    for request in requests:
        if time.monotonic() > deadline and request.question in references:
            outcomes.append(Outcome("not run"))
            continue
        outcomes.append(answer_in_process(session, request, config))
        references.setdefault(request.question, outcomes[-1].answer)
    return outcomes, references, time.perf_counter() - started


# ---- over HTTP ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """`app` under uvicorn in a thread on 127.0.0.1 (a port the OS picks); yields its base URL and
    stops it on exit (in-flight requests finish first)."""
    server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="serve-load", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn stopped before it started serving (see its log above)")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        server.should_exit = True
        thread.join(60)
        if thread.is_alive():
            server.force_exit = True
            thread.join(60)


async def stream_one(client: httpx.AsyncClient, request: LoadRequest) -> Outcome:
    """Send one streamed request; the answer is the content deltas, TTFT the first non-empty one.
    A stream that ends without `data: [DONE]` is an error ("incomplete stream"), not an answer."""
    start = time.perf_counter()
    outcome = Outcome("incomplete stream")
    text: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=request.body) as response:
            if response.status_code != 200:
                await response.aread()
                outcome.status = str(response.status_code)
            else:
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        outcome.status = "200"
                    elif line.startswith("data: "):
                        _read_chunk(json.loads(line.removeprefix("data: ")), outcome, text, start)
    except httpx.HTTPError as e:
        outcome.status = type(e).__name__
    outcome.answer, outcome.finished_at = "".join(text), time.perf_counter()
    outcome.latency_s = outcome.finished_at - start
    return outcome


def _read_chunk(chunk: dict[str, Any], outcome: Outcome, text: list[str], start: float) -> None:
    for choice in chunk["choices"]:
        content = choice["delta"].get("content")
        if content:
            if outcome.ttft_s is None:
                outcome.ttft_s = time.perf_counter() - start
            text.append(content)
    if chunk.get("usage"):
        outcome.prompt_tokens = chunk["usage"]["prompt_tokens"]
        outcome.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        outcome.output_tokens = chunk["usage"]["completion_tokens"]
        outcome.engine_ttft_s = chunk["fusionrag"]["ttft_s"]


async def load(base_url: str, requests: Sequence[LoadRequest], clients: int, deadline: float,
               pacer: Pacer | None = None) -> list[Outcome]:
    """Every request sent by `clients` concurrent clients (each takes the next unsent one); those
    not finished by `deadline` are cancelled and counted as "timeout". Each send is told `pacer`."""
    outcomes: dict[int, Outcome] = {}
    unsent = iter(range(len(requests)))  # NOTE: shared by the workers; one event loop, so no lock

    async def client_loop(client: httpx.AsyncClient) -> None:
        for i in unsent:
            if pacer is not None:
                await pacer.ordinary_sent()
            outcomes[i] = await stream_one(client, requests[i])

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        tasks = [asyncio.create_task(client_loop(client)) for _ in range(clients)]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [outcomes.get(i, Outcome("timeout")) for i in range(len(requests))]


# ---- hostile clients ----------------------------------------------------------------------------------
@dataclass
class Pacer:
    """Holds hostile requests to `share` of all requests sent: a hostile client may send its next one
    while hostile / (hostile + ordinary) stays under `share` (the ordinary clients' sends open room)."""

    share: float
    ordinary: int = 0
    hostile: int = 0
    turn: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def ordinary_sent(self) -> None:
        async with self.turn:
            self.ordinary += 1
            self.turn.notify_all()

    async def hostile_turn(self, stop: asyncio.Event) -> bool:
        """Wait for room for one more hostile request; False once `stop` is set."""
        async with self.turn:
            await self.turn.wait_for(lambda: stop.is_set() or self.hostile + 1 <= self.share * (
                self.hostile + 1 + self.ordinary))
            if stop.is_set():
                return False
            self.hostile += 1
            return True

    async def stop(self, stop: asyncio.Event) -> None:
        async with self.turn:
            stop.set()
            self.turn.notify_all()


def hostile_bodies(ordinary: dict[str, Any]) -> dict[str, bytes]:
    """The hostile chat bodies, as raw JSON bytes (ASCII-escaped, so a lone surrogate travels as JSON
    allows), each built on an ordinary request: what a server must refuse or bound, whatever it costs."""
    def variant(**changes: Any) -> bytes:
        return json.dumps({**ordinary, **changes}).encode()

    messages = ordinary["messages"]
    return {
        "megabyte_stop": variant(stop=["x" * 1_000_000], max_tokens=8),
        "deep_json": b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        "lone_surrogate": variant(messages=[*messages[:-1], {"role": "user", "content": "Who?\ud800"}]),
        "cyclic_schema": variant(response_format={"type": "json_schema",
                                                  "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}),
        "infinite_temperature": variant(temperature=1e308),
        "huge_seed": variant(seed=2**80),
        "malformed_tool_calls": variant(messages=[*messages, {"role": "assistant", "tool_calls": "notalist"},
                                                  {"role": "user", "content": "Go on."}]),
    }


async def hostile_client(base_url: str, bodies: dict[str, bytes], pacer: Pacer, stop: asyncio.Event,
                         statuses: dict[str, Counter[str]]) -> None:
    """Send the hostile kinds round-robin, each when `pacer` gives a turn, until `stop` is set,
    counting each kind's statuses. A stalled body holds its own connection meanwhile (it ends when
    the server cuts it off or the load ends), so it never holds up the client's next request."""
    kinds = [*bodies, "unknown_route", "stalled_body"]
    stalled: list[asyncio.Task[None]] = []

    async def count_stalled() -> None:
        statuses.setdefault("stalled_body", Counter())[await stalled_body(base_url, stop)] += 1

    async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as client:
        for i in range(10**9):
            if not await pacer.hostile_turn(stop):
                break
            kind = kinds[i % len(kinds)]
            if kind == "stalled_body":
                stalled.append(asyncio.create_task(count_stalled()))
                continue
            try:
                if kind == "unknown_route":
                    response = await client.get("/v1/nothing-here")
                else:
                    response = await client.post("/v1/chat/completions", content=bodies[kind],
                                                 headers={"content-type": "application/json"})
                status = str(response.status_code)
                if response.status_code >= 400:
                    status += f" {_error_message(response)[:100]!r}"
            except httpx.HTTPError as e:
                status = type(e).__name__
            statuses.setdefault(kind, Counter())[status] += 1
    await asyncio.gather(*stalled)


def _error_message(response: httpx.Response) -> str:
    """The message of an OpenAI-shaped error body, else the body itself."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text


async def stalled_body(base_url: str, stop: asyncio.Event) -> str:
    """Headers announcing 1,000 bytes, then 10 of them, then nothing: "closed" when the server hangs
    up first (with its status line if it answered), "held" when the load ended first."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 1000\r\n\r\n{{\"messages\"".encode())
        await writer.drain()
        read = asyncio.ensure_future(reader.read(200))
        ended = asyncio.ensure_future(stop.wait())
        await asyncio.wait([read, ended], return_when=asyncio.FIRST_COMPLETED)
        if not read.done():
            read.cancel()
            return "held"
        ended.cancel()
        line = read.result().split(b"\r\n", 1)[0].decode(errors="replace")
        return f"closed {line.split(' ')[1]}" if line.startswith("HTTP/") else "closed"
    except OSError:  # NOTE: the server reset the connection
        return "closed"
    finally:
        writer.close()


async def load_under_attack(base_url: str, requests: Sequence[LoadRequest], clients: int, hostile: int,
                            share: float, deadline: float) -> tuple[list[Outcome], dict[str, dict[str, int]]]:
    """`load` with `hostile` more clients sending hostile requests, `share` of all sent, until the
    ordinary ones end."""
    ordinary = {k: v for k, v in requests[0].body.items() if k != "stream_options"} | {"stream": False}
    bodies = hostile_bodies(ordinary)
    statuses: dict[str, Counter[str]] = {}
    stop, pacer = asyncio.Event(), Pacer(share)
    attackers = [asyncio.create_task(hostile_client(base_url, bodies, pacer, stop, statuses)) for _ in range(hostile)]
    try:
        outcomes = await load(base_url, requests, clients, deadline, pacer)
    finally:
        await pacer.stop(stop)
        failed = [r for r in await asyncio.gather(*attackers, return_exceptions=True) if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"a hostile client failed: {failed[0]!r}") from failed[0]
    return outcomes, {kind: dict(counts) for kind, counts in sorted(statuses.items())}


def under_attack(base_url: str, requests: Sequence[LoadRequest], references: dict[int, str],
                 args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """The load again with `args.hostile_clients` hostile clients beside it, then once more clean (the
    clean pass before it and this one bracket it): both summaries and the hostile kinds' statuses."""
    started = time.perf_counter()
    remote, statuses = asyncio.run(load_under_attack(base_url, requests, args.clients, args.hostile_clients,
                                                     args.hostile_share, deadline))
    ended = max((o.finished_at for o in remote if o.finished_at), default=started)
    attacked = summarise(remote, requests, references, ended - started)
    started = time.perf_counter()
    after = asyncio.run(load(base_url, requests, args.clients, deadline))
    ended = max((o.finished_at for o in after if o.finished_at), default=started)
    return {"server": attacked, "server_after": summarise(after, requests, references, ended - started),
            "statuses": statuses, "sent": sum(sum(c.values()) for c in statuses.values())}


def p95_ratio(attacked: dict[str, Any], clean: Sequence[dict[str, Any]]) -> float | None:
    """Ordinary requests' TTFT p95 under attack over the clean passes' mean p95 (None if one is missing)."""
    clean_p95 = [r["ttft_s"]["p95"] for r in clean]
    if attacked["ttft_s"]["p95"] is None or None in clean_p95:
        return None
    return round(attacked["ttft_s"]["p95"] / (sum(clean_p95) / len(clean_p95)), 3)


def scrape_metrics(base_url: str) -> dict[str, float]:
    """The server's /metrics counters (`*_total`, histograms' `*_count`), summed over their labels."""
    text = httpx.get(f"{base_url}/metrics").text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_total", "_count")):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


# ---- the report ---------------------------------------------------------------------------------------
def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p95 (nearest rank) and max, in seconds; None when no request answered."""
    if not values:
        return {"p50": None, "p95": None, "max": None}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return round(ordered[max(0, math.ceil(p * len(ordered)) - 1)], 4)
    return {"p50": rank(0.50), "p95": rank(0.95), "max": round(ordered[-1], 4)}


def summarise(outcomes: Sequence[Outcome], requests: Sequence[LoadRequest], references: dict[int, str],
              wall_s: float) -> dict[str, Any]:
    """Counts, latencies, throughput, reuse and answer equality of one pass over the requests."""
    done = [o for o in outcomes if o.ok]
    mismatches = [{"request": i, "question": r.question, "answer": o.answer, "reference": references[r.question]}
                  for i, (o, r) in enumerate(zip(outcomes, requests, strict=True))
                  if o.ok and o.answer != references[r.question]]
    prompt, cached, output = (sum(getattr(o, k) for o in done) for k in ("prompt_tokens", "cached_tokens",
                                                                          "output_tokens"))
    return {
        "requests": len(outcomes), "ok": len(done),
        "errors": dict(Counter(o.status for o in outcomes if not o.ok and o.status != "not run")),
        "not_run": sum(o.status == "not run" for o in outcomes),
        "ttft_s": percentiles([o.ttft_s for o in done if o.ttft_s is not None]),
        "engine_ttft_s": percentiles([o.engine_ttft_s for o in done if o.engine_ttft_s is not None]),
        "latency_s": percentiles([o.latency_s for o in done if o.latency_s is not None]),
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(done) / wall_s, 3) if wall_s > 0 else None,
        "output_tokens_per_s": round(output / wall_s, 2) if wall_s > 0 else None,
        "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": output,
        "cached_share": round(cached / prompt, 4) if prompt else None,
        "answers_equal": len(done) - len(mismatches), "mismatches": mismatches,
    }


def table(doc: dict[str, Any]) -> str:
    """The figures as the Markdown table docs/serving.md shows."""
    s, local = doc["settings"], doc["in_process"]
    head = (f"{s['requests']} requests, {s['clients']} clients, `--max-running {s['max_running']}`, "
            f"{s['max_tokens']} tokens max, {s['model']} on {s['device']}")
    rows = ["| run | TTFT p50 | TTFT p95 | engine TTFT p50 | latency p95 | requests/s | output tokens/s | cached "
            "| errors | same answer as in-process |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    runs = [(f"in-process, serial ({local['ok']} requests)", local),
            (f"server, {s['clients']} streaming clients", doc["server"])]
    if "hostile" in doc:
        runs += [(f"server, with {s['hostile_clients']} hostile clients beside", doc["hostile"]["server"]),
                 ("server, clean again", doc["hostile"]["server_after"])]
    for name, r in runs:
        errors = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "0"
        rows.append(f"| {name} | {_s(r['ttft_s']['p50'])} | {_s(r['ttft_s']['p95'])} | "
                    f"{_s(r['engine_ttft_s']['p50'])} | {_s(r['latency_s']['p95'])} | {r['requests_per_s']} | "
                    f"{r['output_tokens_per_s']} | {_pct(r['cached_share'])} | {errors} | "
                    f"{r['answers_equal']} of {r['ok']} |")
    if "hostile" in doc:
        h = doc["hostile"]
        rows += ["", f"Hostile requests sent: {h['sent']} (`--hostile-share {s['hostile_share']}`); ordinary TTFT "
                     "p95 under attack / clean: "
                     f"{h['ttft_p95_ratio']}", "", "| hostile kind | statuses |", "|---|---|"]
        rows += [f"| {kind} | {', '.join(f'{k}: {v}' for k, v in counts.items())} |"
                 for kind, counts in h["statuses"].items()]
    return "\n".join([head, "", *rows])


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


# ---- running ------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults = SchedulerConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests sent (default: 200)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default: 16)")
    parser.add_argument("--max-tokens", type=int, default=32, help="answer length limit (default: 32)")
    parser.add_argument("-k", type=int, default=3, help="retrieved chunks in each prompt (default: 3)")
    parser.add_argument("--questions", type=int, default=None, help="cycle through the first N sample questions")
    parser.add_argument("--max-running", type=int, default=defaults.max_running,
                        help=f"the engine scheduler's --max-running (default: {defaults.max_running})")
    parser.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                        help=f"the engine scheduler's --max-waiting (default: {defaults.max_waiting})")
    parser.add_argument("--hostile-clients", type=int, default=0,
                        help="clients sending hostile requests during a second load pass (default: 0, none)")
    parser.add_argument("--hostile-share", type=float, default=0.25,
                        help="hostile requests' share of all requests sent in that pass (default: 0.25); "
                             "1 floods: each hostile client sends its next as soon as the last is answered")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds the run may take once the model has loaded (default: 1800)")
    parser.add_argument("--model", default=None, help="model (default: the packaged SmolLM2-135M)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve-load"),
                        help="folder of results.json (default: benchmarks/results/serve-load)")
    args = parser.parse_args(argv)
    for flag in ("requests", "clients", "max_tokens", "k", "questions"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            name = "-k" if flag == "k" else f"--{flag.replace('_', '-')}"
            parser.error(f"{name} must be at least 1, got {value}")
    if not 0 < args.hostile_share <= 1:
        parser.error(f"--hostile-share must be in (0, 1], got {args.hostile_share}")
    if args.hostile_clients < 0:
        parser.error(f"--hostile-clients must be at least 0, got {args.hostile_clients}")
    if args.timeout < 0:
        parser.error(f"--timeout must be at least 0 seconds, got {args.timeout}")
    return args


def run(engine: FusionEngine, args: argparse.Namespace) -> int:
    """Build the corpus, run both passes, write `<out>/results.json`; 1 if anything failed or differed."""
    deadline = time.monotonic() + args.timeout
    config = ServerConfig()
    engine = engine.with_limits(SchedulerConfig(max_running=args.max_running, max_waiting=args.max_waiting))
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "model", "device")}
    settings.update(model=engine.name, device=str(engine.device), torch_threads=torch.get_num_threads(),
                    cpus=os.cpu_count(), python=platform.python_version(), torch=torch.__version__,
                    load_before=[round(x, 2) for x in os.getloadavg()])
    with tempfile.TemporaryDirectory(prefix="fusionrag-serve-load-") as tmp:
        index = ingest_sample(engine, Path(tmp))
        try:
            requests = build_requests(index, args)
            session = ReuseSession(engine, index.store, ReuseConfig(data_dir=tmp))
            local, references, local_wall = in_process(session, requests, config, deadline)
            with serving(create_app(session, config)) as base_url:
                started = time.perf_counter()
                remote = asyncio.run(load(base_url, requests, args.clients, deadline))
                ended = max((o.finished_at for o in remote if o.finished_at), default=started)
                metrics = scrape_metrics(base_url)  # NOTE: the clean pass's alone
                attacked = (under_attack(base_url, requests, references, args, deadline)
                            if args.hostile_clients else None)
        finally:
            index.close()
    doc: dict[str, Any] = {"settings": settings, "reference_answers": [references[q] for q in sorted(references)],
           "in_process": summarise(local, requests, references, local_wall),
           "server": summarise(remote, requests, references, ended - started), "metrics": metrics}
    if attacked is not None:
        doc["hostile"] = attacked
        doc["hostile"]["ttft_p95_ratio"] = p95_ratio(attacked["server"], [doc["server"], attacked["server_after"]])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(table(doc))
    passes = [doc["in_process"], doc["server"]]
    if attacked is not None:
        passes += [attacked["server"], attacked["server_after"]]
    failed = [r for r in passes if r["errors"] or r["not_run"] or r["mismatches"]]
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    engine = FusionEngine.from_pretrained(args.model, device=args.device)
    return run(engine, args)


if __name__ == "__main__":
    sys.exit(main())
