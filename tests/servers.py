"""Start real redis-server / chroma servers on loopback for tests.

Context managers, not fixtures, so any test module or conftest can wrap them in a fixture of the
scope it needs::

    @pytest.fixture(scope="module")
    def redis_url() -> Iterator[str]:
        with running_redis_server() as url:
            yield url

Both bind 127.0.0.1 on a free port, keep their state in a temp directory (Redis keeps none),
wait until the server answers, and stop the process (and only it) on exit. A missing binary
calls `pytest.skip` with the install command.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REDIS_SKIP_REASON = "redis-server not installed (apt-get install redis-server)"
CHROMA_SKIP_REASON = "chroma CLI not installed (pip install chromadb)"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_ping(port: int) -> bool:
    """Speak just enough RESP to know the server accepts commands."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _chroma_heartbeat(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v2/heartbeat", timeout=0.5) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate the process we started (by handle), escalating to kill after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def _serve(
    make_cmd: Callable[[int], list[str]],
    ready: Callable[[int], bool],
    *,
    name: str,
    log_dir: Path,
    startup_timeout_s: float,
    env: dict[str, str] | None = None,
    attempts: int = 3,
) -> Iterator[int]:
    """Run `make_cmd(port)` until `ready(port)`; retry on another port if it dies (port race)."""
    last_log = ""
    for attempt in range(attempts):
        port = free_port()
        log_path = log_dir / f"{name}-{attempt}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(make_cmd(port), stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + startup_timeout_s
            while proc.poll() is None and time.monotonic() < deadline:
                if ready(port):
                    yield port
                    return
                time.sleep(0.05)
            last_log = log_path.read_text(errors="replace")[-2000:]
        finally:
            _stop(proc)
    raise RuntimeError(f"{name} did not start after {attempts} attempts; last log:\n{last_log}")


@contextlib.contextmanager
def running_redis_server(startup_timeout_s: float = 10.0) -> Iterator[str]:
    """A throw-away redis-server on 127.0.0.1 (no persistence); yields `redis://127.0.0.1:<port>/0`."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(REDIS_SKIP_REASON)
    with tempfile.TemporaryDirectory(prefix="fusionrag-redis-") as tmp:

        def cmd(port: int) -> list[str]:
            return [
                binary,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", tmp,
                "--protected-mode", "yes",
            ]  # fmt: skip

        with _serve(cmd, _redis_ping, name="redis-server", log_dir=Path(tmp), startup_timeout_s=startup_timeout_s) as p:
            yield f"redis://127.0.0.1:{p}/0"


def chroma_binary() -> str | None:
    """The `chroma` CLI next to this interpreter (the venv), else on PATH."""
    local = Path(sys.executable).parent / "chroma"
    return str(local) if local.is_file() else shutil.which("chroma")


@contextlib.contextmanager
def running_chroma_server(path: Path | None = None, startup_timeout_s: float = 30.0) -> Iterator[str]:
    """A `chroma run` server on 127.0.0.1 persisting to `path` (a temp dir if None); yields its URL."""
    binary = chroma_binary()
    if binary is None:
        pytest.skip(CHROMA_SKIP_REASON)
    with tempfile.TemporaryDirectory(prefix="fusionrag-chroma-") as tmp:
        data = path if path is not None else Path(tmp) / "data"
        # NOTE: telemetry off: the test machine is offline, and tests must not phone home anyway.
        env = {**os.environ, "ANONYMIZED_TELEMETRY": "False"}

        def cmd(port: int) -> list[str]:
            return [binary, "run", "--path", str(data), "--host", "127.0.0.1", "--port", str(port)]

        with _serve(
            cmd, _chroma_heartbeat, name="chroma", log_dir=Path(tmp), startup_timeout_s=startup_timeout_s, env=env
        ) as p:
            yield f"http://127.0.0.1:{p}"
