"""`fusionrag serve --ray`: replicas of the OpenAI-compatible server on Ray Serve, behind one route.

Two replicas on a local Ray cluster (2 CPUs, loopback only) share a Chroma server and a Redis KV
store (started here, on loopback) that the packaged model ingested a small corpus into. Their answers
and reuse equal a single in-process server's; requests spread over both; a replica killed while
requests run is replaced, every request succeeds within a few retries, and the corpus still verifies
clean with every cache it had. Both find the ingested caches of the Redis store in a prompt by content
(its content index lives in Redis). The CLI flags are checked without starting Ray.
"""

from __future__ import annotations

import functools
import importlib.util
import ipaddress
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from fusionrag_core.cli import EngineSpec, load_engine, main
from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import FusionRAGError, InvalidRequestError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.store import TierConfig
from fusionrag_integrations.openai_server import ServerConfig, create_app, ray_serve
from fusionrag_integrations.openai_server.ray_serve import (
    REPLICA_HEADER,
    RayServeApp,
    RayServeOptions,
    ReplicaSpec,
    deploy,
)
from fusionrag_integrations.session import ReuseConfig, ReuseSession
from tests.http_server import running_app
from tests.lighthouse import QUESTION, TEXTS
from tests.servers import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
# NOTE: the test model is the packaged one, fp32 on CPU: `default_engine`'s, so replicas read its caches.
ENGINE = EngineSpec(model=None, device="cpu", dtype="float32")
CONFIG = IngestConfig(chunk_tokens=64, neighbours=2)
RETRIES = 5
"""Attempts a client makes per request before the test counts it failed."""
ray_only = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                              reason="Ray Serve not installed (pip install 'fusionrag[serve-ray]')")


def _chat(question: str, *passages: str) -> dict[str, Any]:
    """A greedy chat request whose prompt holds ingested passages."""
    context = "\n\n".join(passages)
    return {"messages": [{"role": "system", "content": f"Answer from these passages.\n\n{context}"},
                         {"role": "user", "content": question}],
            "max_tokens": 12, "temperature": 0}


CHATS = [_chat(QUESTION, TEXTS[0], TEXTS[1]), _chat("Who built the lighthouse clock?", TEXTS[3], TEXTS[0]),
         _chat("What is Marrow known for?", TEXTS[2])]
UNSEEN = ("The Corran watchmakers' guild met every Thursday above the old grain exchange, where Oren Tessaly "
          "first showed the escapement he later built into the Lumen lighthouse clock.")
"""Ingested, and in no prompt but `test_replicas_find_ingested_caches_in_the_redis_store`'s (nothing learned it)."""


# ---- the shared corpus and the replicas -------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(default_engine: FusionEngine, chroma_and_redis: tuple[str, str],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[FusionIndex]:
    chroma_url, redis_url = chroma_and_redis
    with FusionIndex.open(default_engine, tmp_path_factory.mktemp("db"), chroma_url=chroma_url,
                          redis_url=redis_url, config=CONFIG) as index:
        index.add_texts([*TEXTS, UNSEEN], doc_ids=[*(f"t{i}" for i in range(len(TEXTS))), "unseen"])
        yield index


@pytest.fixture(scope="module")
def replicas(corpus: FusionIndex, chroma_and_redis: tuple[str, str]) -> Iterator[RayServeApp]:
    """Two replicas on a local cluster that `deploy` starts (and `close` stops)."""
    # NOTE: not `import ray` here: imported before the cluster starts, ray would listen on every interface.
    earlier = sys.modules.get("ray")
    if earlier is not None and earlier.is_initialized():
        earlier.shutdown()  # NOTE: another module's cluster; `deploy(address="local")` starts its own.
    chroma_url, redis_url = chroma_and_redis
    assert corpus.data_dir is not None
    spec = ReplicaSpec(engine_factory=functools.partial(load_engine, ENGINE), data_dir=str(corpus.data_dir),
                       chroma_url=chroma_url, redis_url=redis_url, server=ServerConfig(port=free_port()))
    app = deploy(spec, RayServeOptions(address="local", replicas=2, object_store_mb=100))
    try:
        yield app
    finally:
        app.close()
    assert not sys.modules["ray"].is_initialized()  # NOTE: the cluster it started is gone


def _broken_engine() -> FusionEngine:
    raise RuntimeError("no model here (broken on purpose)")


# ---- the tests ---------------------------------------------------------------------------------------
@ray_only
@pytest.mark.slow
def test_replicas_that_cannot_start_fail_the_deploy(tmp_path: Path) -> None:
    """Runs before the module's replicas start: its own cluster, stopped when the deploy fails."""
    earlier = sys.modules.get("ray")
    if earlier is not None and earlier.is_initialized():
        earlier.shutdown()
    spec = ReplicaSpec(engine_factory=_broken_engine, data_dir=str(tmp_path), server=ServerConfig(port=free_port()))
    start = time.monotonic()
    with pytest.raises(FusionRAGError, match="did not start") as failure:
        # NOTE: the replica imports `_broken_engine` from this module (the repository's `tests`).
        deploy(spec, RayServeOptions(address="local", replicas=1, max_constructor_retry_count=1, object_store_mb=100,
                                     runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}}))
    assert "broken on purpose" in str(failure.value)  # NOTE: the replica's own error, not only Serve's
    assert time.monotonic() - start < 120  # NOTE: no model is retried for minutes
    assert not sys.modules["ray"].is_initialized()  # NOTE: the cluster it started is gone


@ray_only
@pytest.mark.slow
@pytest.mark.servers
def test_two_replicas_answer_like_one_server(replicas: RayServeApp, corpus: FusionIndex,
                                             default_engine: FusionEngine, tmp_path: Path) -> None:
    import openai

    # NOTE: learned caches of its own (under tmp_path): the replicas' are shared through Redis
    session = ReuseSession(default_engine, corpus.store, ReuseConfig(data_dir=tmp_path, learned_in_redis=False))
    ray_client = openai.OpenAI(base_url=f"{replicas.url}/v1", api_key="unused", max_retries=0, timeout=120)
    reused = 0
    with running_app(create_app(session, ServerConfig())) as single, httpx.Client(base_url=single, timeout=120) as one:
        for body in CHATS:
            expected = one.post("/v1/chat/completions", json=body).raise_for_status().json()
            got = ray_client.chat.completions.create(model=default_engine.name, **body)
            assert got.choices[0].message.content == expected["choices"][0]["message"]["content"]
            stats, expected_stats = (got.model_extra or {})["fusionrag"], expected["fusionrag"]
            # NOTE: the same reuse: a passage learned by an earlier request is reused by a later one, whichever
            # replica answers it (the replicas of a node share its learned caches).
            assert stats["reused_tokens"] == expected_stats["reused_tokens"], (stats, expected_stats)
            assert stats["cache_misses"] == expected_stats["cache_misses"], (stats, expected_stats)
            reused += stats["reused_tokens"]
    assert reused > 0  # NOTE: TEXTS[0], learned from the first request, is reused by the second
    with httpx.Client(base_url=replicas.url, timeout=60) as client:
        answered = {client.get("/health").raise_for_status().headers[REPLICA_HEADER] for _ in range(24)}
    assert answered == set(replicas.replica_actors()) and len(answered) == 2  # NOTE: both replicas serve


@ray_only
@pytest.mark.slow
@pytest.mark.servers
def test_replicas_find_ingested_caches_in_the_redis_store(replicas: RayServeApp, default_engine: FusionEngine,
                                                          tmp_path: Path) -> None:
    body = _chat("Where did the Corran guild meet?", UNSEEN, TEXTS[3])
    # NOTE: the same passages in an embedded corpus (embedded Chroma, disk store), ingested alike
    with FusionIndex.open(default_engine, tmp_path, config=CONFIG) as embedded:
        embedded.add_texts([*TEXTS, UNSEEN], doc_ids=[*(f"t{i}" for i in range(len(TEXTS))), "unseen"])
        session = ReuseSession(default_engine, embedded.store, ReuseConfig(data_dir=tmp_path, learn=False))
        with running_app(create_app(session, ServerConfig())) as single, httpx.Client(base_url=single,
                                                                                       timeout=120) as one:
            expected = one.post("/v1/chat/completions", json=body).raise_for_status().json()["fusionrag"]
    first = _first_answer_of_each_replica(replicas.url, body)
    assert expected["cache_misses"] == 0 and expected["reused_tokens"] > 0, expected
    for stats in first.values():  # NOTE: each replica's first ask: found by content, the embedded corpus's reuse
        assert (stats["reused_tokens"], stats["cache_misses"]) == (expected["reused_tokens"], 0), (stats, expected)


def _first_answer_of_each_replica(url: str, body: dict[str, Any], tries: int = 40) -> dict[str, dict[str, Any]]:
    """Replica id -> the `fusionrag` stats of the first answer it gave to `body` (sent until both answered)."""
    first: dict[str, dict[str, Any]] = {}
    with httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(tries):
            r = client.post("/v1/chat/completions", json=body).raise_for_status()
            first.setdefault(r.headers[REPLICA_HEADER], r.json()["fusionrag"])
            if len(first) == 2:
                return first
    raise AssertionError(f"only {sorted(first)} answered {tries} requests")


LEARNED = ("The Gull Point ferry ran twice a day from the stone quay at Marrow, and its captain, Hale Brannock, "
           "kept a log of every storm that closed the crossing between the harbour and the lighthouse.")
"""In no corpus: learned by the first replica that sees it."""
ADDED = ("The Marrow harbour board bought the lighthouse clock's spare escapement in 1904, and kept it in the "
         "tide office beside the quay until the lamp was electrified.")
"""Ingested while the replicas run."""


@ray_only
@pytest.mark.slow
@pytest.mark.servers
def test_a_document_learned_by_one_replica_is_reused_by_the_other(replicas: RayServeApp, corpus: FusionIndex
                                                                  ) -> None:
    first = _first_answer_of_each_replica(replicas.url, _chat("Who kept the storm log?", LEARNED))
    learner, other = sorted(first.values(), key=lambda stats: stats["reused_tokens"])
    assert learner["reused_tokens"] == 0 and learner["cache_misses"] > 0, learner  # NOTE: learned here...
    assert other["reused_tokens"] > 0 and other["cache_misses"] == 0, other  # NOTE: ...and reused on first sight
    assert corpus.data_dir is not None
    assert not list((corpus.data_dir / "learned").glob("*/lru.sqlite"))  # NOTE: in Redis, not on this node


@ray_only
@pytest.mark.slow
@pytest.mark.servers
def test_a_corpus_update_is_seen_by_both_replicas(replicas: RayServeApp, corpus: FusionIndex) -> None:
    corpus.add_texts([ADDED], doc_ids=["added"])  # NOTE: the replicas started before this ingest
    first = _first_answer_of_each_replica(replicas.url, _chat("When was the escapement bought?", ADDED))
    for stats in first.values():
        assert stats["cache_misses"] == 0 and stats["reused_tokens"] > 0, first


@ray_only
@pytest.mark.slow
@pytest.mark.servers
def test_cluster_and_route_listen_on_loopback_only(replicas: RayServeApp) -> None:
    import psutil

    listening = []
    for process in psutil.Process().children(recursive=True):
        try:
            connections = process.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening += [(process.name(), c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
    assert any(port == replicas.port for _, _, port in listening)  # NOTE: the route's proxy is among them
    assert sum("ServeReplica" in name for name, _, _ in listening) >= 2  # NOTE: and the replicas' servers
    for name, ip, port in listening:
        assert ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback, (name, ip, port)


@dataclass
class Load:
    """Clients sending one request over and over, retrying each up to `RETRIES` times."""

    url: str
    body: dict[str, Any]
    answers: list[tuple[str, str]] = field(default_factory=list)  # (replica, text) per request
    errors: list[str] = field(default_factory=list)  # every failed attempt
    failed: list[str] = field(default_factory=list)  # requests that failed every attempt
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                self._request(client)

    def _request(self, client: httpx.Client) -> None:
        for _ in range(RETRIES):
            try:
                r = client.post("/v1/chat/completions", json=self.body)
            except httpx.TransportError as e:
                self.errors.append(f"{type(e).__name__}: {e}")
            else:
                if r.status_code == 200:
                    self.answers.append((r.headers[REPLICA_HEADER], r.json()["choices"][0]["message"]["content"]))
                    return
                self.errors.append(f"{r.status_code}: {r.text[:200]}")
            time.sleep(0.5)
        self.failed.append(self.errors[-1])


def _wait(condition: Any, timeout_s: float, what: str) -> float:
    """Seconds until `condition()` holds (polled); fails the test after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.25)
    return time.monotonic() - start


@ray_only
@pytest.mark.slow
@pytest.mark.servers
def test_a_replica_killed_under_load_is_replaced(replicas: RayServeApp, corpus: FusionIndex,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import ray

    cached = corpus.store.list_ids()
    load = Load(replicas.url, CHATS[0])
    clients = [threading.Thread(target=load.run, daemon=True) for _ in range(2)]
    for c in clients:
        c.start()
    try:
        _wait(lambda: len(load.answers) >= 4, 60, "4 answers before the kill")
        before = replicas.replica_actors()
        victim = min(before)
        ray.kill(before[victim], no_restart=True)
        replaced_s = _wait(lambda: replicas.running() == 2 and len(set(replicas.replica_actors()) - set(before)) == 1
                           and victim not in replicas.replica_actors(), 150, "the replacement replica")
        [new] = set(replicas.replica_actors()) - set(before)
        _wait(lambda: any(r == new for r, _ in load.answers), 60, "an answer from the new replica")
    finally:
        load.stop.set()
        for c in clients:
            c.join(120)
    with capsys.disabled():
        print(f"\n[ray serve] {len(load.answers)} requests answered; {len(load.errors)} failed attempt(s) retried "
              f"({sorted(set(e[:60] for e in load.errors))}); replacement RUNNING {replaced_s:.1f} s after the kill")
    assert not load.failed, load.failed
    # NOTE: only the requests the killed replica held fail: one per client at most (Serve routes none there after).
    assert len(load.errors) <= len(clients), load.errors
    assert {text for _, text in load.answers} == {load.answers[0][1]}  # NOTE: greedy: every replica, one answer
    report = corpus.verify(repair=False)
    assert report.ok, report
    assert corpus.store.list_ids() == cached  # NOTE: no cache lost (verify has loaded each of them)


# ---- the command line ---------------------------------------------------------------------------------
def _no_engine(spec: EngineSpec) -> FusionEngine:
    raise AssertionError(f"the driver loaded the model {spec}: only the replicas load it")


def test_cli_serve_ray_passes_its_options_to_deploy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[ReplicaSpec, RayServeOptions]] = []
    monkeypatch.setattr(ray_serve, "serve_until_interrupted", lambda spec, options: calls.append((spec, options)))
    monkeypatch.chdir(tmp_path)
    argv = ["--db", "db", "--chroma-url", "http://127.0.0.1:9", "--redis-url", "redis://127.0.0.1:9/0",
            "--collection", "docs", "--model", "gemma3-270m", "serve", "--ray", "auto", "--replicas", "3",
            "--threads-per-replica", "2", "--port", "8123", "--max-running", "2", "--cache-host-mb", "64"]
    assert main(argv, engine_factory=_no_engine) == 0
    [(spec, options)] = calls
    assert options == RayServeOptions(address="auto", replicas=3, threads_per_replica=2)
    # NOTE: replicas run in other directories (and machines): the data directory travels absolute.
    assert spec.data_dir == str(tmp_path / "db") and Path(spec.data_dir).is_absolute()
    assert (spec.chroma_url, spec.redis_url, spec.collection) == ("http://127.0.0.1:9", "redis://127.0.0.1:9/0",
                                                                  "docs")
    assert (spec.server.host, spec.server.port, spec.limits.max_running) == ("127.0.0.1", 8123, 2)
    assert spec.tiers == TierConfig(device_bytes=0, host_bytes=64 << 20)  # NOTE: per replica
    with pytest.raises(AssertionError, match="gemma3-270m"):  # NOTE: each replica builds the --model engine
        spec.engine_factory()


@pytest.mark.parametrize(("extra", "message"), [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--threads-per-replica", "2"], "--threads-per-replica needs --ray"),
    (["--ray", "local", "--replicas", "0"], "expected a whole number >= 1"),
    (["--ray", "local", "--port", "0"], "fixed port"),
    (["--cache-host-mb", "-1"], "MiB >= 0"),
])
def test_cli_serve_ray_refuses_bad_options(extra: list[str], message: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--db", str(tmp_path), "serve", *extra], engine_factory=_no_engine) == 2
    assert message in capsys.readouterr().err


def test_cli_serve_ray_needs_a_chroma_server_for_an_embedded_corpus(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "chroma").mkdir()  # NOTE: an embedded corpus: one process at a time may serve it
    assert main(["--db", str(tmp_path), "serve", "--ray", "local"], engine_factory=_no_engine) == 2
    assert "--chroma-url" in capsys.readouterr().err


def _ctrl_c(seconds: float) -> None:
    raise KeyboardInterrupt


def _sigterm(seconds: float) -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # NOTE: a service manager's stop; its handler raises right here
    raise AssertionError("SIGTERM did not interrupt serve_until_interrupted")


@pytest.mark.parametrize("stop", [_ctrl_c, _sigterm], ids=["ctrl-c", "sigterm"])
def test_serve_until_interrupted_removes_the_replicas_when_stopped(stop: Any, monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    events: list[str] = []

    class Deployed:
        def __enter__(self) -> Deployed:
            events.append("deployed")
            return self

        def __exit__(self, *exc: object) -> None:
            events.append("closed")

    monkeypatch.setattr(ray_serve, "deploy", lambda spec, options: Deployed())
    monkeypatch.setattr(ray_serve.time, "sleep", stop)
    handler = signal.getsignal(signal.SIGTERM)
    spec = ReplicaSpec(engine_factory=_broken_engine, data_dir=str(tmp_path))
    ray_serve.serve_until_interrupted(spec, RayServeOptions())  # NOTE: returns: stopping is the way out
    assert events == ["deployed", "closed"]
    assert signal.getsignal(signal.SIGTERM) == handler  # NOTE: the SIGTERM handler is the caller's again


def test_options_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="replicas"):
        RayServeOptions(replicas=0)
    with pytest.raises(InvalidRequestError, match="threads_per_replica"):
        RayServeOptions(threads_per_replica=0)
