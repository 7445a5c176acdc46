"""Run an ASGI app (the FastAPI app of `create_app`) under uvicorn in a thread, on loopback, for tests.

A context manager, not a fixture, so any test module can wrap it in a fixture of the scope it needs::

    from tests.http_server import running_app

    @pytest.fixture(scope="module")
    def base_url(session: ReuseSession) -> Iterator[str]:
        with running_app(create_app(session, ServerConfig())) as url:
            yield url  # "http://127.0.0.1:<port>"; clients add "/v1/..."

Contract:
    * binds 127.0.0.1 on a port the OS picks (port 0), so parallel modules never collide and no
      port is guessed; the URL names the port actually bound;
    * returns only once uvicorn accepts connections (or raises RuntimeError naming the cause if it
      failed to start or did not start within `startup_timeout_s`);
    * on exit asks uvicorn to stop (`should_exit`), which lets in-flight requests finish, and joins
      the thread; a server still running after `shutdown_timeout_s` is forced (`force_exit`) so a
      stuck stream cannot hang the test session.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

LOOPBACK = "127.0.0.1"


def _bound_port(server: uvicorn.Server) -> int:
    """The port uvicorn's listening socket actually bound (we asked for port 0)."""
    for s in server.servers:
        for sock in s.sockets:
            return int(sock.getsockname()[1])
    raise RuntimeError("uvicorn reported started but has no listening socket")


@contextlib.contextmanager
def running_app(
    app: Any,
    *,
    startup_timeout_s: float = 60.0,
    shutdown_timeout_s: float = 30.0,
    log_level: str = "warning",
    http: Any = "auto",
) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 in a daemon thread; yield its base URL; stop it on exit.

    Args:
        app: an ASGI application (e.g. `create_app(session, ServerConfig())`). The config's own
            host/port are not used: the test server always binds loopback on a free port.
        startup_timeout_s: how long to wait for uvicorn to accept connections.
        shutdown_timeout_s: how long a graceful stop may take before it is forced.
        log_level: uvicorn's log level ("warning" keeps the test output quiet).
        http: uvicorn's HTTP protocol (its name, or a protocol factory such as
            `openai_server.connections.http_protocol(...)`).

    Yields:
        The base URL, "http://127.0.0.1:<port>" (no trailing slash, no "/v1").

    Raises:
        RuntimeError: uvicorn failed or did not start in time (its exception is chained).
    """
    config = uvicorn.Config(app, host=LOOPBACK, port=0, log_level=log_level, lifespan="auto", http=http)
    server = uvicorn.Server(config)
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            server.run()
        except BaseException as exc:  # NOTE: reported to the waiting test thread, not lost.
            failure.append(exc)

    thread = threading.Thread(target=serve, name="uvicorn-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if failure or not thread.is_alive():
            cause = failure[0] if failure else None
            raise RuntimeError("uvicorn stopped before it started serving") from cause
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"uvicorn did not start within {startup_timeout_s} s")
        time.sleep(0.02)
    try:
        yield f"http://{LOOPBACK}:{_bound_port(server)}"
    finally:
        server.should_exit = True
        thread.join(shutdown_timeout_s)
        if thread.is_alive():
            server.force_exit = True
            thread.join(shutdown_timeout_s)


__all__ = ["running_app"]
