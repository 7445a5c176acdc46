"""What a `fusionrag serve` server allows: where it listens, who may call it, how much it takes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fusionrag_core.errors import InvalidRequestError
from fusionrag_integrations.request import RequestOptions

LOOPBACK = "127.0.0.1"
API_KEY_ENV = "FUSIONRAG_API_KEY"
"""The environment variable a server reads its API key from when none is passed (a secret: never an
option in a file)."""


@dataclass(frozen=True)
class ServerConfig:
    """Limits and access of one OpenAI-compatible server. How many requests run and wait is the
    engine's scheduler's to say (`SchedulerConfig`, `fusionrag serve --max-running/--max-waiting`):
    the server has no queue of its own.

    Attributes:
        host: address to bind; loopback unless told otherwise.
        port: TCP port.
        api_key: None: no authentication (unless `api_key_file`); else every /v1 request needs
            `Authorization: Bearer <key>`, and its callers are one tenant (the operator's scope).
        api_key_file: a file of `TENANT KEY` lines, read again when it changes (`tenants.TenantKeys`):
            each key's requests hit only caches of their own tenant.
        max_body_bytes: largest request body; larger ones are answered 413.
        header_read_timeout_s: seconds a connection has, from its start or its previous answer,
            to send a request's whole headers; a slower one is closed (uvicorn runs no timer there).
        body_read_timeout_s: seconds a client has, once its headers are in, to send its whole
            request body; a slower one is answered 408 and its connection closed.
        max_prompt_tokens: longest prompt; None: the model's context window (less the answer's budget).
        default_max_tokens: answer budget when a request sets none.
        selector: which chunk tokens every request recomputes (`query.select.SELECTORS`); None:
            the engine's configured default.
        ratio: fraction of reused chunk tokens every request recomputes; None: the engine's default.
        shutdown_timeout_s: once told to stop (SIGTERM, Ctrl-C), how long the requests in flight may
            run on; then they are cancelled (their streams end, their slots free) and the server exits.

    Raises:
        InvalidRequestError: a limit below 1, a read timeout that is not a positive number, or a
            negative shutdown timeout.
    """

    host: str = LOOPBACK
    port: int = 8000
    api_key: str | None = None
    api_key_file: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    header_read_timeout_s: float = 30.0
    body_read_timeout_s: float = 30.0
    max_prompt_tokens: int | None = None
    default_max_tokens: int = 256
    selector: str | None = None
    ratio: float | None = None
    shutdown_timeout_s: int = 15

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise InvalidRequestError(f"max_prompt_tokens must be at least 1, got {self.max_prompt_tokens}")
        for name in ("header_read_timeout_s", "body_read_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise InvalidRequestError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        RequestOptions(selector=self.selector, ratio=self.ratio)  # NOTE: the core's checks, at construction
        if self.shutdown_timeout_s < 0:
            raise InvalidRequestError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be in 0..65535, got {self.port}")


__all__ = ["API_KEY_ENV", "LOOPBACK", "ServerConfig"]
