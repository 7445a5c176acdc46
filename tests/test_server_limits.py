"""The server under load and bad input (issue 27, items 2 and 4): a bounded queue (429 with
Retry-After), a client that disconnects mid-stream stops its generation and frees its slot, body
and prompt limits (413 / 400 naming the limit), every unsupported field a 400 that names it, an
optional API key, loopback by default, no prompt or answer in the INFO log, Prometheus metrics.

The 1-layer random engine answers (the weights do not matter here); a `CountingSession` counts
the pieces the engine produced and can hold a request's generation at a gate, so a slot stays
taken for as long as a test needs, with no timing assumption.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fusionrag_core.batching.scheduler import SchedulerConfig
from fusionrag_core.cli import build_parser
from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.reuse.sources import ReuseSources
from fusionrag_integrations.openai_server import ServerConfig, create_app
from fusionrag_integrations.openai_server import command as serve_command
from fusionrag_integrations.openai_server.config import API_KEY_ENV
from fusionrag_integrations.openai_server.metrics import ENGINE_STATS
from fusionrag_integrations.request import RequestOptions
from fusionrag_integrations.session import ReuseConfig, ReuseSession
from tests.http_server import running_app
from tests.scheduling import use_scheduler

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Say something."}]
WAIT_S = 30.0
"""Deadline of a condition the server reaches by itself (never an expected duration)."""


class CountingSession(ReuseSession):
    """A session that counts the generations that produced a piece (`runs`), the pieces they produced
    and how many generations were closed, and slows each piece's delivery by `delay_s` (so a
    generation left running would visibly run on). A test that sets `gate` holds the engine's decode
    steps at it (`hold_decoding`): a request then keeps its running slot for as long as the test needs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.runs = 0
        self.pieces = 0
        self.closed = 0
        self.gate: threading.Event | None = None
        self.delay_s = 0.0

    async def arun(self, prompt: FusionPrompt, options: RequestOptions,
                   sources: ReuseSources | None = None) -> AsyncGenerator[str | Generation, None]:
        inner = super().arun(prompt, options, sources)
        try:
            first = True
            async for piece in inner:
                self.runs += first
                first = False
                self.pieces += 1
                yield piece
                await asyncio.sleep(self.delay_s)
        finally:
            await inner.aclose()
            self.closed += 1


def hold_decoding(engine: FusionEngine, session: CountingSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's decode steps wait at `session.gate` while a test has set one (a request's first
    token comes from its admission, so a held request has answered its first piece)."""
    decode_batch = engine.decoder.decode_batch

    def held(*args: Any, **kwargs: Any) -> Any:
        if session.gate is not None:
            session.gate.wait(WAIT_S)
        return decode_batch(*args, **kwargs)

    monkeypatch.setattr(engine.decoder, "decode_batch", held)


@pytest.fixture
def session(one_layer_engine: FusionEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
            ) -> Iterator[CountingSession]:
    s = CountingSession(one_layer_engine, None, ReuseConfig(data_dir=tmp_path, learn=False))
    hold_decoding(one_layer_engine, s, monkeypatch)
    yield s
    if s.gate is not None:
        s.gate.set()  # NOTE: a held generation never outlives its test's server


Serve = Callable[..., httpx.Client]


@pytest.fixture
def serve(session: CountingSession, monkeypatch: pytest.MonkeyPatch) -> Iterator[Serve]:
    """Start a real server (uvicorn on loopback) over `session` with a ServerConfig from the
    keyword arguments (`max_running` and `max_waiting` are the engine scheduler's, as
    `fusionrag serve` passes them); returns a client of it. Servers stop at teardown."""
    with contextlib.ExitStack() as stack:

        def start(**config: Any) -> httpx.Client:
            limits = {k: config.pop(k) for k in ("max_running", "max_waiting") if k in config}
            if limits:
                use_scheduler(session.engine, SchedulerConfig(**limits), monkeypatch)
            base_url = stack.enter_context(running_app(create_app(session, ServerConfig(**config))))
            return stack.enter_context(httpx.Client(base_url=base_url, timeout=WAIT_S))
        yield start


def chat(client: httpx.Client, max_tokens: int = 4, **extra: Any) -> httpx.Response:
    return client.post(CHAT, json={"messages": USER, "max_tokens": max_tokens, "temperature": 0, **extra})


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    return dict(body["error"])


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    """The value of one sample of the server's /metrics (0 when absent)."""
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ---- the bounded queue ------------------------------------------------------------------------------
def test_full_queue_answers_429_with_retry_after(serve: Serve, session: CountingSession) -> None:
    client = serve(max_running=1, max_waiting=0)
    session.gate = threading.Event()
    with client.stream("POST", CHAT, json={"messages": USER, "max_tokens": 8, "temperature": 0,
                                           "stream": True}) as held:
        assert held.status_code == 200
        refused = chat(client)
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        error = error_of(refused)
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
        assert "max_waiting" in error["message"]
        session.gate.set()
        assert held.read().decode().rstrip().endswith("data: [DONE]")
    assert chat(client).status_code == 200
    assert metric(client, "fusionrag_requests_total", endpoint="chat", status="429") == 1


def test_a_waiting_request_is_answered_when_the_slot_frees(serve: Serve, session: CountingSession) -> None:
    client = serve(max_running=1, max_waiting=1)
    session.gate = threading.Event()
    answers: list[httpx.Response] = []
    with client.stream("POST", CHAT, json={"messages": USER, "max_tokens": 8, "stream": True}) as held:
        waiter = threading.Thread(target=lambda: answers.append(chat(client)))
        waiter.start()
        wait_for(lambda: metric(client, "fusionrag_queue_depth") == 1, "the second request to queue")
        assert chat(client).status_code == 429  # NOTE: one running, one waiting: the third is refused
        session.gate.set()
        held.read()
    waiter.join(WAIT_S)
    assert [a.status_code for a in answers] == [200]
    assert metric(client, "fusionrag_queue_depth") == 0


# ---- a client that goes away --------------------------------------------------------------------------
def test_disconnect_mid_stream_stops_the_generation_and_frees_the_slot(
        serve: Serve, session: CountingSession) -> None:
    client = serve(max_running=1, max_waiting=0)
    session.delay_s = 0.01  # NOTE: left running, 900 pieces would take 9 s more: a stop shows
    max_tokens = 900
    events = 0
    with client.stream("POST", CHAT, json={"messages": USER, "max_tokens": max_tokens, "temperature": 0,
                                           "stream": True}) as response:
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    # NOTE: leaving the block closes the connection mid-stream
    closed_at = time.monotonic()
    wait_for(lambda: session.closed == 1, "the generation to be closed")
    # NOTE: a stream closed while the loop's thread runs a step leaves at the next step's plan
    # (`BatchLoop.cancel`): the slot frees a step after the close, not at the close
    wait_for(lambda: metric(client, "fusionrag_requests_running") == 0, "the slot to be freed")
    freed_s = time.monotonic() - closed_at
    produced = session.pieces
    assert chat(client).status_code == 200  # NOTE: max_waiting=0: admitted at once, so the slot is free
    assert session.pieces - produced <= 4 + 1  # NOTE: only the next request's pieces were produced
    assert produced < 50, f"{produced} pieces generated after the client left"
    assert metric(client, "fusionrag_requests_total", endpoint="chat", status="200") == 1
    assert metric(client, "fusionrag_completion_tokens_total") < 50
    print(f"disconnect: {produced} pieces before the stop, slot free {freed_s:.3f} s after the close")


def test_disconnect_while_waiting_for_a_whole_answer_frees_the_slot(
        serve: Serve, session: CountingSession) -> None:
    client = serve(max_running=1, max_waiting=0)
    session.delay_s = 0.01
    gone = httpx.Client(base_url=str(client.base_url), timeout=0.3)
    with pytest.raises(httpx.ReadTimeout):
        chat(gone, max_tokens=900)
    gone.close()
    wait_for(lambda: session.closed == 1, "the generation to be closed")
    assert session.pieces < 200, f"{session.pieces} pieces generated after the client left"
    print(f"disconnect (whole answer): {session.pieces} pieces before the stop")
    assert chat(client).status_code == 200


def test_a_client_that_gives_up_in_the_queue_is_never_generated(serve: Serve, session: CountingSession) -> None:
    client = serve(max_running=1, max_waiting=1)
    session.gate = threading.Event()
    with client.stream("POST", CHAT, json={"messages": USER, "max_tokens": 8, "stream": True}) as held:
        impatient = httpx.Client(base_url=str(client.base_url), timeout=0.5)
        with pytest.raises(httpx.ReadTimeout):
            chat(impatient)
        impatient.close()
        session.gate.set()
        held.read()
    wait_for(lambda: metric(client, "fusionrag_queue_depth") == 0, "the queue to empty")
    wait_for(lambda: metric(client, "fusionrag_requests_total", endpoint="chat", status="499") == 1,
             "the queued request to be dropped")
    assert session.runs == 1  # NOTE: only the held request was generated


# ---- limits of size ------------------------------------------------------------------------------------
def test_declared_body_over_the_limit_is_413(serve: Serve) -> None:
    client = serve(max_body_bytes=1000)
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 2000}]})
    response = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413
    error = error_of(response)
    assert "1000" in error["message"] and "max_body_bytes" in error["message"]
    assert metric(client, "fusionrag_requests_total", endpoint="chat", status="413") == 1


def test_chunked_body_over_the_limit_is_413(serve: Serve) -> None:
    client = serve(max_body_bytes=1000)
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    chunks = iter([body[i:i + 500] for i in range(0, len(body), 500)])
    response = client.post(CHAT, content=chunks, headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers  # NOTE: chunked: no size declared
    assert response.status_code == 413
    error = error_of(response)
    assert "1000" in error["message"] and "max_body_bytes" in error["message"]


def test_body_at_the_limit_is_read(serve: Serve) -> None:
    body = json.dumps({"messages": USER, "max_tokens": 2}).encode()
    client = serve(max_body_bytes=len(body))
    declared = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert declared.status_code == 200, declared.text
    chunked = client.post(CHAT, content=iter([body[:10], body[10:]]), headers={"content-type": "application/json"})
    assert chunked.status_code == 200, chunked.text


def test_prompt_over_max_prompt_tokens_is_400_naming_the_limit(serve: Serve) -> None:
    client = serve(max_prompt_tokens=50)
    response = client.post(CHAT, json={"messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 2})
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "context_length_exceeded"
    assert "50" in error["message"] and "max_prompt_tokens" in error["message"]


def test_prompt_and_budget_over_the_context_window_is_400(serve: Serve, one_layer_engine: FusionEngine) -> None:
    client = serve()
    response = chat(client, max_tokens=one_layer_engine.context_window)
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "context_length_exceeded"
    assert str(one_layer_engine.context_window) in error["message"]


# ---- bad input: every unsupported thing named -------------------------------------------------------
@pytest.mark.parametrize(("body", "named"), [
    ({"messages": USER, "temperature": 0, "frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "colour"),
    ({"messages": USER, "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "wizard"),
    ({"messages": []}, "messages"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
])
def test_unsupported_request_is_400_naming_it(serve: Serve, body: dict[str, Any], named: str) -> None:
    client = serve()
    response = client.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert named in error["message"]


@pytest.mark.parametrize(("body", "named"), [
    ({"prompt": "Once", "echo": True}, "echo"),
    ({"prompt": "Once", "suffix": "end"}, "suffix"),
    ({"prompt": "Once", "best_of": 2}, "best_of"),
    ({"prompt": ["Once", "Twice"]}, "one prompt"),
    ({"prompt": "Once", "logit_bias": {"1": 5}}, "logit_bias"),
])
def test_unsupported_completion_is_400_naming_it(serve: Serve, body: dict[str, Any], named: str) -> None:
    response = serve().post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert named in error_of(response)["message"]


@pytest.mark.parametrize(("stop", "named"), [
    (["a", "b", "c", "d", "e"], "at most 4 stop strings"),
    ("x" * 100_000, "1024 characters"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_over_the_limits_are_400_naming_them(serve: Serve, stop: str | list[str], named: str,
                                                          stream: bool) -> None:
    client = serve()
    response = chat(client, stop=stop, stream=stream)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert named in error["message"]
    assert chat(client, stop=["a", "b", "c", "d"]).status_code == 200


def test_malformed_json_is_400(serve: Serve) -> None:
    client = serve()
    response = client.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in error_of(response)["message"]


def test_unknown_model_is_404_naming_the_served_model(serve: Serve, one_layer_engine: FusionEngine) -> None:
    client = serve()
    response = chat(client, model="gpt-4o")
    assert response.status_code == 404
    error = error_of(response)
    assert error["code"] == "model_not_found"
    assert "gpt-4o" in error["message"] and one_layer_engine.name in error["message"]


# ---- access ------------------------------------------------------------------------------------------
def test_api_key_is_required_when_set(serve: Serve) -> None:
    client = serve(api_key="k")
    assert chat(client).status_code == 401
    assert error_of(chat(client))["code"] == "invalid_api_key"
    wrong = client.post(CHAT, json={"messages": USER, "max_tokens": 2}, headers={"authorization": "Bearer kk"})
    assert wrong.status_code == 401
    bare = client.post(CHAT, json={"messages": USER, "max_tokens": 2}, headers={"authorization": "k"})
    assert bare.status_code == 401  # NOTE: the key without its scheme is no Bearer credential
    assert client.get("/v1/models").status_code == 401
    for scheme in ("Bearer", "bearer"):
        right = client.post(CHAT, json={"messages": USER, "max_tokens": 2}, headers={"authorization": f"{scheme} k"})
        assert right.status_code == 200, right.text
    # NOTE: liveness and metrics stay open (probes and scrapers carry no key; neither shows a prompt)
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_cli_reads_the_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser(plugins=[serve_command.COMMAND])
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert serve_command.server_config(parser.parse_args(["serve"])).api_key == "from-env"
    assert serve_command.server_config(parser.parse_args(["serve", "--api-key", "flag"])).api_key == "flag"
    monkeypatch.delenv(API_KEY_ENV)
    assert serve_command.server_config(argparse.Namespace(**vars(parser.parse_args(["serve"])))).api_key is None


def test_binds_loopback_unless_told(capsys: pytest.CaptureFixture[str]) -> None:
    assert ServerConfig().host == "127.0.0.1"
    parser = build_parser(plugins=[serve_command.COMMAND])
    assert serve_command.server_config(parser.parse_args(["serve"])).host == "127.0.0.1"
    assert serve_command.server_config(parser.parse_args(["serve", "--host", "0.0.0.0"])).host == "0.0.0.0"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert "default: 127.0.0.1" in capsys.readouterr().out


# ---- logs and metrics --------------------------------------------------------------------------------
def test_prompts_and_answers_are_not_logged_at_info(serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    client = serve()
    secret = "zebra-quartz-7731"
    # NOTE: a document-like paragraph, so the no-reuse warning (which describes the prompt) is logged too
    document = f"The keeper wrote that the code is {secret}. " + "The lamp was lit at dusk every night. " * 30
    with caplog.at_level(logging.DEBUG - 9):  # NOTE: everything, so a leak at any level shows
        response = client.post(CHAT, json={"messages": [{"role": "user", "content": document}],
                                           "max_tokens": 12, "temperature": 0})
        bad = client.post(CHAT, json={"messages": [{"role": "user", "content": secret, "colour": 1}]})
    assert response.status_code == 200 and bad.status_code == 400
    answer = response.json()["choices"][0]["message"]["content"]
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert any("chat" in line for line in logged)  # NOTE: the request itself is logged, as counts
    assert any("reused no KV cache" in line for line in logged)
    assert not [line for line in logged if secret in line]
    if len(answer.strip()) >= 8:
        assert not [line for line in logged if answer in line]


def test_metrics_are_prometheus_text(serve: Serve) -> None:
    client = serve()
    assert chat(client).status_code == 200
    text = client.get("/metrics").text
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"fusionrag_requests_total", "fusionrag_ttft_seconds_bucket", "fusionrag_prompt_tokens_total",
            "fusionrag_queue_depth", "fusionrag_requests_running", "fusionrag_completion_tokens_total"} <= names
    kinds = {s.labels["kind"] for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "fusionrag_prompt_tokens_total"}
    assert kinds and kinds <= {"reused", "recomputed", "prefilled", "prefix_cached"}
    assert metric(client, "fusionrag_requests_total", endpoint="chat", status="200") == 1
    before = metric(client, "fusionrag_errors_total", endpoint="chat", kind="invalid_request_error")
    assert chat(client, frequency_penalty=0.5).status_code == 400
    assert metric(client, "fusionrag_errors_total", endpoint="chat", kind="invalid_request_error") == before + 1
    assert metric(client, "fusionrag_requests_total", endpoint="chat", status="400") == 1


def test_metrics_export_the_engines_prefix_cache_and_scheduler(serve: Serve, session: CountingSession) -> None:
    """Every `FusionEngine.stats()` key has its metric, read at the scrape: a repeated conversation's
    second turn continues the first (a prefix-cache hit), and the decode steps are counted."""
    client, engine = serve(), session.engine
    assert set(engine.stats()) <= set(ENGINE_STATS), "a FusionEngine.stats() key has no metric in ENGINE_STATS"
    hits, steps = metric(client, "fusionrag_prefix_cache_hits_total"), metric(client, "fusionrag_decode_steps_total")
    first = chat(client, max_tokens=6)
    assert first.status_code == 200
    answer = first.json()["choices"][0]["message"]["content"]
    follow_up = [*USER, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    assert client.post(CHAT, json={"messages": follow_up, "max_tokens": 2, "temperature": 0}).status_code == 200
    assert metric(client, "fusionrag_prefix_cache_hits_total") == hits + 1
    assert metric(client, "fusionrag_prefix_cache_hit_tokens_total") > 0
    assert metric(client, "fusionrag_prefix_cache_bytes") == engine.stats()["prefix_bytes"] > 0
    assert metric(client, "fusionrag_decode_steps_total") > steps


def test_the_servers_selection_settings_reach_every_request(serve: Serve) -> None:
    client = serve(selector="query_guided", ratio=0.3)
    stats = chat(client).json()["fusionrag"]
    assert (stats["selector"], stats["ratio"]) == ("query_guided", 0.3)
    with pytest.raises(InvalidRequestError, match="ratio"):
        ServerConfig(ratio=1.5)


def test_the_cli_selection_options_reach_the_server_config() -> None:
    parser = build_parser(plugins=[serve_command.COMMAND])
    config = serve_command.server_config(parser.parse_args(["--selector", "query_guided", "--ratio", "0.3", "serve"]))
    assert (config.selector, config.ratio) == ("query_guided", 0.3)
