"""Clients that never finish their request headers ("slowloris") are cut off: `HeaderDeadlineProtocol`
under a real uvicorn on loopback, raw sockets as the clients. Before it, uvicorn kept a connection
that sent nothing, part of a request line, or a header byte now and then, open for as long as the
client liked: only the file-descriptor limit bounded them."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from fusionrag_integrations.openai_server.connections import http_protocol
from tests.http_server import running_app

DEADLINE_S = 0.5
WAIT_S = 10.0
"""How long a test waits for the server to hang up before it counts the connection as held."""


async def _slow_answer(request: Request) -> PlainTextResponse:
    body = await request.body()
    await asyncio.sleep(2 * DEADLINE_S)  # NOTE: an answer longer than the header deadline must not be cut
    return PlainTextResponse(f"got {len(body)} bytes")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    app = Starlette(routes=[Route("/echo", _slow_answer, methods=["GET", "POST"])])
    with running_app(app, http=http_protocol(DEADLINE_S)) as url:
        yield url


def _connect(base_url: str) -> socket.socket:
    parts = urlsplit(base_url)
    assert parts.hostname is not None and parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=WAIT_S)


def _held_for(sock: socket.socket, trickle: bytes = b"") -> float:
    """Seconds until the server closed `sock` (sending `trickle` a byte every 0.1 s meanwhile);
    fails the test if it is still open after WAIT_S."""
    started = time.monotonic()
    sock.settimeout(0.1)
    for i in range(int(WAIT_S / 0.1)):
        try:
            if trickle:
                sock.sendall(trickle[i % len(trickle): i % len(trickle) + 1])
            if sock.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started
    raise AssertionError(f"the server kept the connection open for {WAIT_S} s")


@pytest.mark.parametrize("sent", [b"", b"GET /ec", b"GET /echo HTTP/1.1\r\nHost: x\r\n"],
                         ids=["nothing", "part-of-the-request-line", "headers-without-their-end"])
def test_a_connection_without_whole_headers_is_closed_at_the_deadline(base_url: str, sent: bytes) -> None:
    with _connect(base_url) as sock:
        sock.sendall(sent)
        assert _held_for(sock) < DEADLINE_S + 2.0


def test_headers_trickled_a_byte_at_a_time_are_cut_off(base_url: str) -> None:
    with _connect(base_url) as sock:
        assert _held_for(sock, trickle=b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa") < DEADLINE_S + 2.0


def test_a_kept_alive_connection_gets_a_fresh_deadline_for_its_next_headers(base_url: str) -> None:
    """The answers take longer than the deadline (it never cuts a request in progress); after each,
    the next request's headers get the whole deadline again, then a silent connection is closed."""
    with _connect(base_url) as sock:
        for _ in range(2):
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            answer = b""
            while b"got 3 bytes" not in answer:
                chunk = sock.recv(4096)
                assert chunk, f"closed before the answer: {answer!r}"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200")
        assert _held_for(sock) < DEADLINE_S + 2.0


def test_many_silent_connections_are_all_closed_and_the_server_still_answers(base_url: str) -> None:
    socks = [_connect(base_url) for _ in range(50)]
    try:
        started = time.monotonic()
        for sock in socks:
            _held_for(sock)
        assert time.monotonic() - started < DEADLINE_S + 3.0
    finally:
        for sock in socks:
            sock.close()
    assert httpx.get(f"{base_url}/echo", timeout=WAIT_S).text == "got 0 bytes"
