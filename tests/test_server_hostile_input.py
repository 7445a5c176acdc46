"""The server under hostile input (issue 45, items 3 to 6), over real sockets: every client error a
4xx in OpenAI's error shape (out-of-range seeds, text that is not Unicode, non-finite and
out-of-range sampling numbers, bodies nested too deep, unknown routes and methods), every route but
/health and /metrics behind the key, and a client that stops sending its body cut off after
`body_read_timeout_s`.

The 1-layer random engine answers (the weights do not matter here).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_integrations.openai_server import ServerConfig, create_app
from fusionrag_integrations.request import RequestOptions
from fusionrag_integrations.session import ReuseConfig, ReuseSession
from tests.http_server import running_app

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Say something."}]
WAIT_S = 30.0
"""Deadline of a condition the server reaches by itself (never an expected duration)."""


@pytest.fixture(scope="module")
def session(one_layer_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> ReuseSession:
    return ReuseSession(one_layer_engine, None, ReuseConfig(data_dir=tmp_path_factory.mktemp("hostile"), learn=False))


Serve = Callable[..., httpx.Client]


@pytest.fixture
def serve(session: ReuseSession) -> Iterator[Serve]:
    """Start a real server (uvicorn on loopback) with a ServerConfig from the keyword arguments;
    returns a client of it. Servers stop at teardown."""
    with contextlib.ExitStack() as stack:

        def start(**config: Any) -> httpx.Client:
            base_url = stack.enter_context(running_app(create_app(session, ServerConfig(**config))))
            return stack.enter_context(httpx.Client(base_url=base_url, timeout=WAIT_S))
        yield start


def post_json(client: httpx.Client, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    """POST `body` as JSON the way Python writes it: ASCII with escapes, so a lone surrogate travels
    as `\\ud800` (as a JavaScript client's JSON.stringify sends it) and Infinity as `Infinity`."""
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json", **headers})


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI-shaped error of a response with `status`."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return dict(body["error"])


# ---- item 3: client errors that were answered 500 -------------------------------------------------------
@pytest.mark.parametrize("seed", [2**80, 2**64, -(2**63) - 1])
def test_seed_out_of_range_is_400_naming_the_range(serve: Serve, seed: int) -> None:
    client = serve()
    response = post_json(client, CHAT, {"messages": USER, "max_tokens": 2, "temperature": 1, "seed": seed})
    error = error_of(response, 400)
    assert "seed" in error["message"] and str(2**64 - 1) in error["message"], error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 0])
def test_seed_at_the_ends_of_the_range_is_used(serve: Serve, seed: int) -> None:
    client = serve()
    body = {"messages": USER, "max_tokens": 3, "temperature": 1, "seed": seed}
    first, second = post_json(client, CHAT, body), post_json(client, CHAT, body)
    assert first.status_code == second.status_code == 200, first.text
    assert first.json()["choices"][0]["message"] == second.json()["choices"][0]["message"]


def test_sampling_config_refuses_a_seed_torch_cannot_take() -> None:
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingConfig(seed=2**80)
    SamplingConfig(seed=2**64 - 1)


@pytest.mark.parametrize(("path", "body", "named"), [
    (CHAT, {"messages": [{"role": "user", "content": "a \ud800 b"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "system", "content": "ok"},
                         {"role": "user", "content": [{"type": "text", "text": "x\udfff"}]}]}, "messages[1].content"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": "\ud83d"}]}, "messages[0].name"),
    (CHAT, {"messages": USER, "stop": ["\udc00"]}, "stop"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "description": "\ud800", "parameters": {"type": "object"}}}]}, "tools"),
    (COMPLETIONS, {"prompt": "Once \ud800"}, "prompt"),
    (COMPLETIONS, {"prompt": ["Once \udbff"]}, "prompt"),
])
def test_text_that_is_not_unicode_is_400_naming_the_field(serve: Serve, path: str, body: dict[str, Any],
                                                           named: str) -> None:
    client = serve()
    error = error_of(post_json(client, path, {"max_tokens": 2, **body}), 400)
    assert named in error["message"] and "surrogate" in error["message"], error


def test_a_surrogate_pair_is_text(serve: Serve) -> None:
    """An escaped pair (`\\ud83d\\ude00`) is one character, as JSON defines it: not refused."""
    client = serve()
    response = client.post(CHAT, content=b'{"messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}], '
                                         b'"max_tokens": 2}', headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


def test_prompt_layout_refuses_text_that_is_not_unicode(session: ReuseSession) -> None:
    """In process too (LangChain, LlamaIndex): the messages entry of core says which message."""
    sources = session.sources(RequestOptions())
    with pytest.raises(InvalidRequestError, match=r"messages\[1\].*surrogate"):
        session.prompt([{"role": "user", "content": "hi"}, {"role": "user", "content": "\ud800"}], sources)
    with pytest.raises(InvalidRequestError, match="surrogate"):
        session.prompt_from_text("Once \udc00", sources)


# ---- item 5: numbers out of range ---------------------------------------------------------------------
@pytest.mark.parametrize(("field", "raw", "limit"), [
    ("temperature", "Infinity", "finite"),
    ("temperature", "1e999", "finite"),
    ("temperature", "NaN", "finite"),
    ("temperature", "1e308", "[0, 2]"),
    ("temperature", "2.5", "[0, 2]"),
    ("top_p", "-Infinity", "finite"),
    ("top_p", "1.5", "(0, 1]"),
    ("presence_penalty", "Infinity", "finite"),
    ("presence_penalty", "2.01", "[-2, 2]"),
    ("frequency_penalty", "-3", "[-2, 2]"),
])
def test_sampling_numbers_out_of_range_are_400_naming_the_limit(serve: Serve, field: str, raw: str,
                                                                 limit: str) -> None:
    """A finite number out of OpenAI's range names the range; one that is not finite (which JSON
    does not have, but Python's parser takes) names the field."""
    client = serve()
    body = f'{{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 2, "{field}": {raw}}}'
    for path, text in ((CHAT, body), (COMPLETIONS, body.replace('"messages": [{"role": "user", "content": "hi"}]',
                                                                 '"prompt": "hi"'))):
        response = client.post(path, content=text.encode(), headers={"content-type": "application/json"})
        error = error_of(response, 400)
        assert field in error["message"] and limit in error["message"], (path, error)


def test_non_finite_numbers_anywhere_in_the_body_are_400(serve: Serve) -> None:
    """JSON has no Infinity or NaN (RFC 8259); Python's parser takes them, so a schema bound or a
    tool argument could smuggle one in."""
    client = serve()
    body = (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {"type": '
            b'"json_schema", "json_schema": {"name": "n", "schema": {"type": "number", "maximum": Infinity}}}}')
    error = error_of(client.post(CHAT, content=body, headers={"content-type": "application/json"}), 400)
    assert "Infinity" in error["message"], error


def test_sampling_config_refuses_non_finite_numbers() -> None:
    for field in ("temperature", "top_p", "min_p", "repetition_penalty"):
        for value in (float("inf"), float("nan")):
            with pytest.raises(InvalidRequestError, match=field):
                SamplingConfig(**{field: value})  # type: ignore[arg-type]


# ---- item 4: every error in OpenAI's shape; every route behind the key ------------------------------
def test_a_body_nested_too_deep_is_400_in_openais_shape(serve: Serve) -> None:
    client = serve()
    deep = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    error = error_of(client.post(CHAT, content=deep, headers={"content-type": "application/json"}), 400)
    assert "nested" in error["message"], error


def test_unknown_route_is_404_in_openais_shape(serve: Serve) -> None:
    client = serve()
    error = error_of(client.get("/v1/nothing-here"), 404)
    assert "/v1/nothing-here" in error["message"], error
    error_of(client.post("/v2/chat/completions", json={}), 404)


def test_wrong_method_is_405_in_openais_shape(serve: Serve) -> None:
    client = serve()
    response = client.get(CHAT)
    error = error_of(response, 405)
    assert "POST" in error["message"] and response.headers["allow"] == "POST", error
    error_of(client.delete("/health"), 405)


def test_every_route_but_health_and_metrics_needs_the_key(serve: Serve) -> None:
    client = serve(api_key="k")
    for path in ("/docs", "/redoc", "/openapi.json", "/v1/models"):
        error = error_of(client.get(path), 401)
        assert error["code"] == "invalid_api_key", (path, error)
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    key = {"authorization": "Bearer k"}
    schema = client.get("/openapi.json", headers=key)
    assert schema.status_code == 200 and CHAT in schema.json()["paths"]
    assert client.get("/docs", headers=key).status_code == 200


# ---- item 6: a client that stops sending its body ------------------------------------------------------
def _open_partial_request(base_url: str, declared: int, sent: bytes) -> socket.socket:
    """A raw connection that sent a POST's headers declaring `declared` body bytes, then `sent` only."""
    url = urlsplit(base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=WAIT_S)
    sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {declared}\r\n\r\n".encode() + sent)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails the test)."""
    received = b""
    with contextlib.suppress(ConnectionResetError):  # NOTE: a byte sent after the close is answered by a reset
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_a_stalled_body_is_cut_off_with_408(serve: Serve) -> None:
    client = serve(body_read_timeout_s=0.5)
    base_url = str(client.base_url).rstrip("/")
    started = time.monotonic()
    stalled = [_open_partial_request(base_url, 1000, b'{"messages": ') for _ in range(5)]
    silent = _open_partial_request(base_url, 1000, b"")  # NOTE: headers, then nothing
    try:
        # NOTE: meanwhile the server answers others
        assert post_json(client, CHAT, {"messages": USER, "max_tokens": 2}).status_code == 200
        for sock in [*stalled, silent]:
            answer = _read_until_closed(sock)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), answer
            error = json.loads(body)["error"]
            assert "0.5" in error["message"] and "body_read_timeout_s" in error["message"], error
        assert time.monotonic() - started < WAIT_S
    finally:
        for sock in [*stalled, silent]:
            sock.close()
    assert post_json(client, CHAT, {"messages": USER, "max_tokens": 2}).status_code == 200


def test_a_body_trickled_past_the_deadline_is_cut_off(serve: Serve) -> None:
    """The deadline is the whole body's: a byte now and then does not keep the connection open."""
    client = serve(body_read_timeout_s=1.0)
    sock = _open_partial_request(str(client.base_url).rstrip("/"), 1000, b"{")
    started = time.monotonic()
    try:
        sock.settimeout(0.2)
        answer = b""
        for _ in range(int(WAIT_S / 0.2)):
            with contextlib.suppress(TimeoutError):
                sock.sendall(b" ")
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert time.monotonic() - started < 5.0


def test_a_slow_but_whole_body_within_the_deadline_is_answered(serve: Serve) -> None:
    client = serve(body_read_timeout_s=5.0)
    body = json.dumps({"messages": USER, "max_tokens": 2}).encode()

    def trickle() -> Iterator[bytes]:
        for i in range(0, len(body), 10):
            time.sleep(0.05)
            yield body[i:i + 10]
    response = client.post(CHAT, content=trickle(), headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


def test_body_read_timeout_is_checked() -> None:
    with pytest.raises(InvalidRequestError, match="body_read_timeout_s"):
        ServerConfig(body_read_timeout_s=0)
    assert ServerConfig().body_read_timeout_s == 30.0


def test_an_answer_before_the_body_is_read_closes_the_connection(serve: Serve) -> None:
    """A route that answers without reading the body (no such route, here) closes the connection:
    uvicorn's keep-alive timer stops at the client's next byte, so it would stay open for good."""
    client = serve(body_read_timeout_s=WAIT_S)
    url = urlsplit(str(client.base_url))
    sock = socket.create_connection((url.hostname, url.port), timeout=WAIT_S)
    try:
        sock.sendall(f"POST /v1/nothing-here HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Length: 1000\r\n\r\n{{".encode())
        head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 404") and b"connection: close" in head.lower(), head
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b" ")  # NOTE: a byte after the answer, as a trickling client sends it
        assert _read_until_closed(sock) == b""
    finally:
        sock.close()
    assert client.get("/health").headers.get("connection") != "close"  # NOTE: keep-alive where nothing is left


def test_unknown_paths_share_one_metrics_label(serve: Serve) -> None:
    """A client's made-up paths do not each add a Prometheus series."""
    client = serve()
    for i in range(3):
        error_of(client.get(f"/made-up-{i}"), 404)
    metrics = client.get("/metrics").text
    assert "made-up" not in metrics
    assert 'fusionrag_requests_total{endpoint="other",status="404"} 3.0' in metrics
