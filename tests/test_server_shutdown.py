"""`fusionrag serve` told to stop (issue 45, item 1): SIGTERM ends the server within its shutdown
timeout whatever its requests are doing, and a request that ends within the timeout is answered whole.

Each test runs the real command in a subprocess (`tests.serve_worker`: the tiny engine, its decode
steps slowed to stand for a large model's, no end-of-sequence token so an answer runs its whole
`max_tokens`) and streams from it over a real socket.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from fusionrag_core.cli import build_parser
from fusionrag_core.errors import InvalidRequestError
from fusionrag_integrations.openai_server import command as serve_command
from tests.serve_worker import MARK

REPO_ROOT = Path(__file__).resolve().parents[1]
START_S = 120.0
"""Deadline of the server's start (loading torch and the tokenizer on a busy machine)."""
EXIT_MARGIN_S = 15.0
"""What a server may take beyond its shutdown timeout to exit: the interpreter's own teardown."""


class Server:
    """`fusionrag serve` in a subprocess; its stderr (uvicorn's log) is kept in `log`."""

    def __init__(self, tokenizer_path: Path, db: Path, *worker: str, shutdown_timeout_s: int,
                 serve: tuple[str, ...] = ()) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.serve_worker", "--tokenizer", str(tokenizer_path), *worker, "--",
             "--db", str(db), "serve", "--port", "0", "--shutdown-timeout", str(shutdown_timeout_s), *serve],
            cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.ended: list[dict[str, Any]] = []  # NOTE: the worker's lines once the command returned
        self.url = self._started()
        threading.Thread(target=self._read_log, daemon=True).start()

    def _started(self) -> str:
        assert self.process.stderr is not None
        deadline = time.monotonic() + START_S
        for line in self.process.stderr:  # NOTE: uvicorn names the port it bound (we asked for port 0)
            self.log.append(line)
            if found := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line):
                return found.group(1)
            assert time.monotonic() < deadline, "the server did not start in time"
        raise AssertionError(f"the server exited before it started:\n{''.join(self.log)}")

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        self.log.extend(self.process.stderr)

    def stop(self) -> tuple[int, float]:
        """SIGTERM; returns the exit code and the seconds until the command returned."""
        start = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        returned = self._worker_line()  # NOTE: its first line comes as the command returns
        took = time.monotonic() - start
        self.ended = [returned, self._worker_line()]
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"the server did not exit once its command returned:\n{''.join(self.log)}") from None
        return self.process.returncode, took

    def _worker_line(self) -> dict[str, Any]:
        """The worker's next line of its own on stdout (uvicorn's access log shares it)."""
        found: list[str] = []

        def read() -> None:
            for line in self.process.stdout or ():
                if line.startswith(MARK):
                    found.append(line[len(MARK):])
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(300)
        if not found:
            self.process.kill()
            raise AssertionError(f"SIGTERM did not stop the server in 300 s:\n{''.join(self.log)}")
        return dict(json.loads(found[0]))

    @property
    def load_left(self) -> dict[str, int]:
        """The engine's scheduler load once the command returned and the engine had no work left."""
        return dict(self.ended[1]["load"])


@pytest.fixture
def servers(tokenizer_path: Path, tmp_path: Path) -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(60)


class Stream:
    """A streamed completion read on its own thread: its events as they come, then how it ended."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.events: list[str] = []
        self.ended = threading.Event()
        self.error: Exception | None = None
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True}
        threading.Thread(target=self._read, args=(url, body), daemon=True).start()

    def _read(self, url: str, body: dict[str, object]) -> None:
        try:
            with httpx.Client(timeout=300) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
                self.events.extend(line for line in r.iter_lines() if line.startswith("data: "))
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.ended.set()

    def wait_for_tokens(self, n: int) -> None:
        deadline = time.monotonic() + START_S
        while len(self.events) < n:
            assert not self.ended.is_set(), f"the stream ended early: {self.error!r} {self.events[-1:]}"
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.02)

    @property
    def text(self) -> str:
        return "".join(json.loads(e[6:])["choices"][0]["text"] for e in self.events if e != "data: [DONE]")


def _start(servers: list[Server], tokenizer_path: Path, tmp_path: Path, *worker: str,
           shutdown_timeout_s: int, serve: tuple[str, ...] = ()) -> Server:
    server = Server(tokenizer_path, tmp_path / "db", *worker, shutdown_timeout_s=shutdown_timeout_s, serve=serve)
    servers.append(server)
    return server


def _exited_cleanly(server: Server, code: int) -> None:
    log = "".join(server.log)
    assert code == 0, log
    assert "Traceback" not in log, log


@pytest.mark.parametrize("worker", [("--step-s", "0.05"), ("--step-s", "0.05", "--stuck-at", "6")],
                         ids=["slow-steps", "a-step-that-never-returns"])
def test_sigterm_cancels_a_long_stream_within_the_shutdown_timeout(
    servers: list[Server], tokenizer_path: Path, tmp_path: Path, worker: tuple[str, ...]
) -> None:
    server = _start(servers, tokenizer_path, tmp_path, *worker, shutdown_timeout_s=2)
    stream = Stream(server.url, max_tokens=1_500)  # NOTE: 75 s of decoding at 0.05 s a step
    stream.wait_for_tokens(3)
    code, took = server.stop()
    assert took < 2 + EXIT_MARGIN_S, f"the server took {took:.1f} s to exit after SIGTERM"
    _exited_cleanly(server, code)
    assert stream.ended.wait(10), "the client's stream did not end with the server"
    assert "data: [DONE]" not in stream.events  # NOTE: cut off, never reported as a whole answer
    if "--stuck-at" not in worker:  # NOTE: a step that never returns frees no slot; the process exits all the same
        assert server.load_left == {"running": 0, "waiting": 0, "kv_bytes": 0}, "the cancelled request kept its slot"


def _closed_within(url: str, sent: bytes, seconds: float) -> bytes:
    """What the server answered on a raw connection that sent `sent` and then nothing, once it
    closed it; fails if it is still open after `seconds`."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    answer = b""
    with socket.create_connection((parts.hostname, parts.port), timeout=seconds) as sock:
        sock.sendall(sent)
        while chunk := sock.recv(4096):
            answer += chunk
    return answer


def test_slow_clients_are_cut_off_and_a_request_that_ends_within_the_timeout_finishes(
    servers: list[Server], tokenizer_path: Path, tmp_path: Path
) -> None:
    """`fusionrag serve --header-timeout/--body-timeout` bound a client that never finishes its
    headers or its body (one server process for both checks and the shutdown's)."""
    server = _start(servers, tokenizer_path, tmp_path, "--step-s", "0.05", shutdown_timeout_s=60,
                    serve=("--header-timeout", "1", "--body-timeout", "1"))
    assert _closed_within(server.url, b"POST /v1/chat/comp", 10) == b""
    cut = _closed_within(server.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{", 10)
    assert cut.startswith(b"HTTP/1.1 408"), cut
    stream = Stream(server.url, max_tokens=30)  # NOTE: 1.5 s of decoding
    stream.wait_for_tokens(2)
    code, took = server.stop()
    _exited_cleanly(server, code)
    assert stream.ended.is_set() and stream.error is None
    assert stream.events[-1] == "data: [DONE]"
    assert took < 60, "the server waited out its timeout though its request had ended"
    assert server.load_left == {"running": 0, "waiting": 0, "kv_bytes": 0}


def test_the_read_and_shutdown_timeouts_are_server_options() -> None:
    parser = build_parser(plugins=[serve_command.COMMAND])
    config = serve_command.server_config(parser.parse_args(["serve", "--header-timeout", "2.5", "--body-timeout", "4"]))
    assert (config.header_read_timeout_s, config.body_read_timeout_s) == (2.5, 4.0)
    for flag in ("--header-timeout", "--body-timeout"):
        with pytest.raises(InvalidRequestError, match="read_timeout_s must be a positive number"):
            serve_command.server_config(parser.parse_args(["serve", flag, "0"]))
    assert serve_command.server_config(parser.parse_args(["serve", "--shutdown-timeout", "3"])).shutdown_timeout_s == 3
    with pytest.raises(InvalidRequestError, match="shutdown_timeout_s"):
        serve_command.server_config(parser.parse_args(["serve", "--shutdown-timeout", "-1"]))
