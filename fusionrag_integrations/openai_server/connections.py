"""How long a client may take to send a request's headers: uvicorn bounds a body (our middleware) and
an idle keep-alive connection (`timeout_keep_alive`), but no timer runs while headers arrive, so a
client that opens connections and sends nothing, or a byte now and then ("slowloris"), holds each
one until the file-descriptor limit. This protocol closes a connection whose request headers are
not complete within a deadline, counted from the connection's start or from its previous response.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers.

    Invariant: the deadline is armed exactly while the connection waits for the headers of its next
    request (from `connection_made`, and again after each response); a request whose headers are
    in disarms it, so a long answer or a slow body (bounded by the body deadline) is never cut here.
    """

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._request_in_progress():
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _request_in_progress(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if not self._request_in_progress() and not self.transport.is_closing():
            self.transport.close()


def http_protocol(header_timeout_s: float) -> Any:
    """The `http=` argument of `uvicorn.Config`/`uvicorn.run` that bounds header reads to `header_timeout_s`."""
    return functools.partial(HeaderDeadlineProtocol, header_timeout_s=header_timeout_s)


__all__ = ["HeaderDeadlineProtocol", "http_protocol"]
