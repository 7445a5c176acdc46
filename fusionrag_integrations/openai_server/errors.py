"""The server's errors: an `HTTPError` is answered with its status and OpenAI's error body
(`{"error": {"message", "type", "param", "code"}}`, written by `app.create_app`'s handlers)."""

from __future__ import annotations

from starlette.exceptions import HTTPException


class HTTPError(HTTPException):
    """An error answered with `status` and OpenAI's error body.

    NOTE: a Starlette HTTPException, so FastAPI passes one raised while it reads the body (the
    streamed body limit) through to its handler instead of answering a generic 400.
    """

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(status, message, headers or {})
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers or {}
        self.param = param


__all__ = ["HTTPError"]
