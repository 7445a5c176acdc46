"""The OpenAI-compatible HTTP server: FastAPI routes over one `ReuseSession` (engine, KV store,
learned caches).

    POST /v1/chat/completions   chat (SSE when `stream`), tools, response_format
    POST /v1/completions        raw text continued (SSE when `stream`)
    GET  /v1/models             the one served model
    GET  /health                liveness
    GET  /metrics               Prometheus text (metrics.py)

Every prompt gets the reuse an in-process call gets: stored chunks found by content, learned
caches, spans learned from context (`ReuseSession`). The engine's scheduler is the one admission
point: a request waits in its queue, and its refusal (`OverloadedError`) is answered 429 with
`Retry-After` (the queue is full) or 503 (a request over the K/V budget); the server sets no limit
of its own. Pieces reach the event loop from the engine's loop as they are decoded, with no
thread hop per token (`FusionEngine.astream`). The first token is computed before the response
starts, so a bad prompt is a 400, never a broken stream; a client that disconnects, while it
waits or mid-answer, ends its request in the engine and frees its slot. Errors use OpenAI's
`{"error": {"message", "type", "param", "code"}}` body. Prompts and answers are never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from typing import Any, NamedTuple

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import Message, Receive, Scope, Send

from fusionrag_core.engine import Generation
from fusionrag_core.errors import ContextLengthError, InvalidRequestError, OverloadedError
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.tools import InvalidToolCall, ToolCall, asplit_calls
from fusionrag_core.query.unicode import not_unicode_at
from fusionrag_core.reuse.sources import ReuseSources
from fusionrag_core.scope import Scope as CacheScope
from fusionrag_integrations.fields import bound_tools
from fusionrag_integrations.openai_server.config import ServerConfig
from fusionrag_integrations.openai_server.metrics import Metrics
from fusionrag_integrations.openai_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Envelope,
    finish_reason,
    fusionrag_stats,
    sse,
    tool_call_dict,
    usage,
)
from fusionrag_integrations.openai_server.tenants import TenantKeys
from fusionrag_integrations.request import RequestOptions
from fusionrag_integrations.session import ReuseSession

logger = logging.getLogger(__name__)
Piece = str | ToolCall | InvalidToolCall | Generation
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
"""Metric label of each generation route."""


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


def create_app(session: ReuseSession, config: ServerConfig | None = None) -> FastAPI:
    """A FastAPI app serving `session`'s model under the OpenAI API (see the module docstring)."""
    config = config or ServerConfig()
    server = _Server(session, config)
    # NOTE: FastAPI's own documentation routes would be open to all; `_add_docs` serves them behind the key
    app = FastAPI(title="FusionRAG", summary="OpenAI-compatible server with FusionRAG KV-cache reuse",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = _JSONRoute
    app.add_middleware(_BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(_BodyDeadline, timeout_s=config.body_read_timeout_s)
    app.state.server = server
    _add_error_handlers(app, server)
    auth = [Depends(server.authorize)]
    _add_docs(app, auth)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", server.models, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/completions", server.completion, methods=["POST"], dependencies=auth)
    return app


class _Server:
    """The routes' shared state: session, limits, queue, metrics. No per-request state lives here."""

    def __init__(self, session: ReuseSession, config: ServerConfig) -> None:
        self.session = session
        self.config = config
        self.name = session.engine.name
        self.metrics_ = Metrics(session.engine.stats)
        self.keys = TenantKeys(config.api_key, config.api_key_file)

    # ---- small routes --------------------------------------------------------------------------------
    async def health(self) -> dict[str, str]:
        return {"status": "ok", "model": self.name}

    async def metrics_text(self) -> Response:
        scheduler = self.session.engine.scheduler
        load = scheduler.load if scheduler is not None else {"running": 0, "waiting": 0}
        body = self.metrics_.render(load["running"], load["waiting"])
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": 0, "owned_by": "fusionrag"}]}

    async def authorize(self, request: Request) -> None:
        """Require `Authorization: Bearer <key>` when keys are set (compared in constant time); the
        key's tenant (`tenants.TenantKeys`) is the request's (`request.state.tenant`)."""
        request.state.tenant = ""
        if not self.keys.required:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer":
            given = ""  # NOTE: the key alone, or under another scheme, is no bearer credential
        tenant = await anyio.to_thread.run_sync(self.keys.tenant_of, given.strip())  # NOTE: may read the key file
        if tenant is None:
            raise HTTPError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error",
                            "invalid_api_key")
        request.state.tenant = tenant

    # ---- generation routes ----------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check(body)
        tools = bound_tools({"tools": body.tools, "tool_choice": body.tool_choice,
                             "parallel_tool_calls": body.parallel_tool_calls})
        options = RequestOptions.from_values(self._values(body), response_format=body.response_format_value(),
                                             tools=tools)
        messages = body.chat_messages()

        def prompt(sources: ReuseSources) -> FusionPrompt:
            return self.session.prompt(messages, sources, (), tools)
        stream = _Stream(self, "chat", Envelope("chatcmpl", self.name), body.stream_options is not None
                         and body.stream_options.include_usage, _scope(request, body))
        return await stream.respond(request, options, prompt, body.stream)

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        self._check(body)
        options = RequestOptions.from_values(self._values(body))
        text = body.text()

        def prompt(sources: ReuseSources) -> FusionPrompt:
            return self.session.prompt_from_text(text, sources)
        stream = _Stream(self, "completion", Envelope("cmpl", self.name), body.stream_options is not None
                         and body.stream_options.include_usage, _scope(request, body))
        return await stream.respond(request, options, prompt, body.stream)

    def _values(self, body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
        """The request's option values: its sampling, and the server's selection settings."""
        selection = {"selector": self.config.selector, "ratio": self.config.ratio}
        return {**body.sampling_values(self.config.default_max_tokens),
                **{k: v for k, v in selection.items() if v is not None}}

    def _check(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        body.check_supported()
        if body.model not in (None, self.name):
            raise HTTPError(404, f"model {body.model!r} does not exist: this server serves {self.name!r}",
                            code="model_not_found")

    def check_length(self, prompt: FusionPrompt) -> None:
        limit = self.config.max_prompt_tokens
        if limit is not None and prompt.num_tokens > limit:
            raise HTTPError(400, f"the prompt has {prompt.num_tokens} tokens; this server's limit is {limit} "
                                 "(max_prompt_tokens): shorten it", code="context_length_exceeded")


class _Stream:
    """One request's generation: admitted, first token computed, then answered whole or as SSE.

    Per request (never shared): the pieces iterator, the envelope, what was generated, and `exits`
    (the request's slot and generation, released once).
    """

    def __init__(self, server: _Server, endpoint: str, envelope: Envelope, include_usage: bool,
                 scope: CacheScope) -> None:
        self.server, self.endpoint, self.envelope, self.include_usage = server, endpoint, envelope, include_usage
        self.scope = scope
        self.exits = AsyncExitStack()
        self.calls: list[ToolCall] = []
        self.invalid: list[InvalidToolCall] = []

    async def respond(self, request: Request, options: RequestOptions,
                      prompt: Callable[[ReuseSources], FusionPrompt], streaming: bool) -> Response:
        pieces = self._start(options, await anyio.to_thread.run_sync(self._prompt, options, prompt))
        self.exits.push_async_callback(pieces.aclose)
        try:
            first = await self._first(request, pieces)  # NOTE: prefill: a bad prompt fails here
        except BaseException:
            await self.exits.aclose()
            raise
        if not streaming:
            async with self.exits:
                return JSONResponse(await self._whole(request, pieces, first))
        return _ReleasingStream(self._events(request, pieces, first), self.exits, media_type="text/event-stream")

    def _prompt(self, options: RequestOptions,
                prompt: Callable[[ReuseSources], FusionPrompt]) -> tuple[FusionPrompt, ReuseSources]:
        """The request's prompt and sources (tokenizing, finding chunks by content: a worker thread's job)."""
        sources = self.server.session.sources(options, self.scope)
        request_prompt = prompt(sources)
        self.server.check_length(request_prompt)
        return request_prompt, sources

    def _start(self, options: RequestOptions, built: tuple[FusionPrompt, ReuseSources]) -> AsyncGenerator[Piece, None]:
        session = self.server.session
        pieces: AsyncGenerator[Piece, None] = session.arun(built[0], options, built[1])
        if options.tools is not None:
            pieces = asplit_calls(pieces, session.engine.tool_format, options.tools)
        return pieces

    @staticmethod
    async def _first(request: Request, pieces: AsyncGenerator[Piece, None]) -> Piece:
        """The first piece; a client that disconnects before it (waiting in the engine's queue, or
        while its prompt is computed) ends the request instead."""
        first = asyncio.ensure_future(anext(pieces))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((first, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not first.done():
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            raise HTTPError(499, "the client disconnected", code="client_closed")
        return first.result()

    async def _pieces(self, request: Request, pieces: AsyncGenerator[Piece, None],
                      first: Piece) -> AsyncIterator[Piece]:
        """The pieces as the engine decodes them; stops when the client has gone."""
        piece: Piece | None = first
        while piece is not None:
            if isinstance(piece, Generation):
                await self.exits.aclose()  # NOTE: the request has left the engine before the client reads its end
            yield piece
            if isinstance(piece, Generation) or await request.is_disconnected():
                return
            piece = await anext(pieces, None)

    async def _whole(self, request: Request, pieces: AsyncGenerator[Piece, None], first: Piece) -> dict[str, Any]:
        text: list[str] = []
        generation: Generation | None = None
        async for piece in self._pieces(request, pieces, first):
            if isinstance(piece, Generation):
                generation = piece
            else:
                text.append(self._text_of(piece))
        if generation is None:
            raise HTTPError(499, "the client disconnected", code="client_closed")
        self._finished(generation)
        content = "".join(text)
        if self.endpoint == "completion":
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": generation.finish_reason}
            return self.envelope.wrap("text_completion", [choice], usage=usage(generation),
                                      fusionrag=fusionrag_stats(generation, self.invalid))
        calls: list[ToolCall | InvalidToolCall] = [*self.calls, *self.invalid]
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = [tool_call_dict(c) for c in calls]
        choice = {"index": 0, "message": message, "logprobs": None,
                  "finish_reason": finish_reason(generation, self.calls, self.invalid)}
        return self.envelope.wrap("chat.completion", [choice], usage=usage(generation),
                                  fusionrag=fusionrag_stats(generation, self.invalid))

    async def _events(self, request: Request, pieces: AsyncGenerator[Piece, None], first: Piece) -> AsyncIterator[str]:
        if self.endpoint == "chat":
            yield sse(self._chunk({"role": "assistant", "content": ""}))
        async for piece in self._pieces(request, pieces, first):
            if isinstance(piece, Generation):
                yield self._finish_event(piece)
                if self.include_usage:
                    yield sse(self.envelope.wrap(self._kind, [], usage=usage(piece),
                                                 fusionrag=fusionrag_stats(piece, self.invalid)))
                yield sse("[DONE]")
            elif isinstance(piece, ToolCall | InvalidToolCall):
                yield sse(self._chunk({"tool_calls": [self._call_delta(piece)]}))
            else:
                yield sse(self._chunk(self._delta(self._text_of(piece))))

    @property
    def _kind(self) -> str:
        return "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"

    def _chunk(self, delta: dict[str, Any] | str, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        if self.endpoint == "chat":
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        return self.envelope.wrap(self._kind, [choice], **extra)

    def _delta(self, text: str) -> dict[str, Any] | str:
        return {"content": text} if self.endpoint == "chat" else text

    def _text_of(self, piece: str | ToolCall | InvalidToolCall) -> str:
        """A piece's text; a call, valid or not (cut off by max_tokens), is kept aside: never content."""
        if isinstance(piece, ToolCall | InvalidToolCall):
            self._call_delta(piece)
            return ""
        return piece

    def _call_delta(self, call: ToolCall | InvalidToolCall) -> dict[str, Any]:
        """Keep `call` aside; its stream delta, indexed in the order calls came."""
        if isinstance(call, ToolCall):
            self.calls.append(call)
        else:
            self.invalid.append(call)
        return tool_call_dict(call, len(self.calls) + len(self.invalid) - 1)

    def _finish_event(self, generation: Generation) -> str:
        """The stream's finishing chunk (empty delta, finish reason, FusionRAG's statistics)."""
        self._finished(generation)
        empty: dict[str, Any] | str = {} if self.endpoint == "chat" else ""
        return sse(self._chunk(empty, finish_reason(generation, self.calls, self.invalid),
                               fusionrag=fusionrag_stats(generation, self.invalid)))

    def _finished(self, generation: Generation) -> None:
        self.server.metrics_.record(generation)
        self.server.metrics_.requests.labels(self.endpoint, "200").inc()
        logger.info("%s %s: %d prompt tokens (%d reused), %d generated, ttft %.3f s", self.endpoint,
                    self.envelope.id, generation.prompt_tokens, generation.reused_tokens, len(generation.token_ids),
                    generation.ttft_s)


def _scope(request: Request, body: ChatCompletionRequest | CompletionRequest) -> CacheScope:
    """The request's cache scope: its key's tenant and the `cache_salt` it sent (`tenants`)."""
    return CacheScope(request.state.tenant, body.cache_salt or "")


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body is read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _ReleasingStream(StreamingResponse):
    """A streamed response that releases its request's slot and generation however it ends
    (finished, failed, or cancelled by a client that went away)."""

    def __init__(self, content: AsyncIterator[str], exits: AsyncExitStack, media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self.exits = exits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.exits.aclose()


class _BodyLimit:
    """Answers 413 (naming the limit) for a body longer than `max_bytes`, declared or streamed."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        seen = 0

        async def limited() -> Any:
            # NOTE: raised as the route reads the body (a declared size before any byte is read),
            # so the route's error handler answers and counts it
            nonlocal seen
            if too_large:
                raise HTTPError(413, self._message(), code="body_too_large")
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPError(413, self._message(), code="body_too_large")
            return message
        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes} bytes (max_body_bytes)"


class _BodyDeadline:
    """Answers 408 (naming the limit) when a client has not sent its whole body `timeout_s` after
    its headers, and closes the connection of every response sent before the body was read whole.

    NOTE: uvicorn has no timer of its own while a body is read, and its keep-alive timer stops at a
    client's next byte: a connection left mid-body would stay open for as long as its client likes.
    The deadline is the whole body's, so a byte now and then does not keep one open either.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = anyio.current_time() + self.timeout_s
        read = not _has_body(scope)

        async def bounded() -> Message:
            nonlocal read
            if read:
                return await receive()  # NOTE: after the body, the wait for a disconnect: unbounded
            with anyio.move_on_after(deadline - anyio.current_time()) as waited:
                message = await receive()
            if waited.cancelled_caught:
                raise HTTPError(408, f"the request body did not arrive within this server's limit of "
                                     f"{self.timeout_s:g} s (body_read_timeout_s)", code="body_read_timeout",
                                headers={"Connection": "close"})
            read = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start" and not read:
                # NOTE: what the client still sends would be read for no one
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)
        await self.app(scope, bounded, closing)


def _has_body(scope: Scope) -> bool:
    headers = dict(scope.get("headers") or [])
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"0").strip() not in (b"0", b"")


class _JSONRequest(Request):
    """A request whose body is read as JSON is defined (RFC 8259: no NaN or Infinity, no number
    beyond a float), nested at most `MAX_JSON_DEPTH` deep, and holding only Unicode text."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = _parse_json(await self.body())
        return self._json


class _JSONRoute(APIRoute):
    """A route that reads its body as `_JSONRequest` does."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive, request._send))
        return strict


MAX_JSON_DEPTH = 64
"""Deepest nesting of a request body (OpenAI's bodies nest a few levels; a JSON schema a few more)."""


def _parse_json(body: bytes) -> Any:
    """`body` as JSON (RFC 8259), or an HTTPError (400) that says what is wrong where.

    Raises:
        json.JSONDecodeError: malformed JSON (FastAPI answers it as such).
        HTTPError: nesting deeper than `MAX_JSON_DEPTH`, a number that is not finite (Python's
            parser takes NaN, Infinity and 1e999), a string holding a lone surrogate.
    """
    too_deep = HTTPError(400, f"the body is nested too deeply: this server takes at most {MAX_JSON_DEPTH} levels of "
                              "arrays and objects", code="body_too_deep")
    try:
        value = json.loads(body)
    except RecursionError:
        raise too_deep from None
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError):
            raise
        raise HTTPError(400, f"the body is not valid JSON: {exc}") from None  # NOTE: e.g. an int of 5,000 digits
    deepest, where = _walk_numbers(value)
    if deepest > MAX_JSON_DEPTH:
        raise too_deep
    if where is not None:
        raise HTTPError(400, f"{where.path or 'the body'} is {json.dumps(where.value)} (as written, or a number beyond "
                             "a float's range), which is no JSON number (RFC 8259): send a finite number",
                        param=where.path or None)
    text = not_unicode_at(value, "")
    if text is not None:
        raise HTTPError(400, f"{text or 'the body'} is not valid Unicode: it holds a lone surrogate (half of a "
                             "UTF-16 pair, e.g. \\ud800 without its partner); send whole characters",
                        param=text or None)
    return value


class _Number(NamedTuple):
    path: str
    value: float


def _walk_numbers(value: Any) -> tuple[int, _Number | None]:
    """How deeply `value` nests arrays and objects, and its first number that is not finite (with
    its path, e.g. `temperature`). Iterative: the depth itself is what is checked."""
    deepest, found = 0, None
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, float) and not math.isfinite(item) and found is None:
            found = _Number(path, item)
        elif isinstance(item, dict):
            deepest = max(deepest, depth + 1)
            stack += [(v, f"{path}.{k}" if path else str(k), depth + 1) for k, v in reversed(item.items())]
        elif isinstance(item, list):
            deepest = max(deepest, depth + 1)
            stack += [(v, f"{path}[{i}]", depth + 1) for i, v in reversed(list(enumerate(item)))]
    return deepest, found


def _add_docs(app: FastAPI, auth: list[Any]) -> None:
    """FastAPI's OpenAPI schema and its two viewers, behind the key like every route but /health and
    /metrics (they describe which fields this server takes; a key-holder fetches the schema with its
    key, a browser without one can open the viewers only where no key is set)."""
    async def schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    async def swagger() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - API")

    async def redoc() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - API")
    for path, route in (("/openapi.json", schema), ("/docs", swagger), ("/redoc", redoc)):
        app.add_api_route(path, route, methods=["GET"], dependencies=auth, include_in_schema=False)


def _error(error: HTTPError) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def _add_error_handlers(app: FastAPI, server: _Server) -> None:
    def endpoint(request: Request) -> str:
        # NOTE: a path no route serves is labelled "other": a client's made-up paths are no new series
        routes = {getattr(route, "path", None) for route in app.routes}
        path = request.url.path
        return _ENDPOINTS.get(path, path if path in routes else "other")

    def answer(request: Request, error: HTTPError) -> JSONResponse:
        server.metrics_.requests.labels(endpoint(request), str(error.status)).inc()
        server.metrics_.errors.labels(endpoint(request), error.code or error.kind).inc()
        return _error(error)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPError)
        return answer(request, exc)

    async def on_invalid(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, HTTPError(400, str(exc)))

    async def on_too_long(request: Request, exc: Exception) -> JSONResponse:
        message = f"{exc} (max_new_tokens is the request's max_tokens)"
        return answer(request, HTTPError(400, message, code="context_length_exceeded"))

    async def on_overloaded(request: Request, exc: Exception) -> JSONResponse:
        # NOTE: the engine's scheduler is the one admission point: a full queue is the client's to retry
        # later (429), a request over the K/V budget the operator's limit (503); the message names it
        assert isinstance(exc, OverloadedError)
        if exc.limit == "max_waiting":
            return answer(request, HTTPError(429, str(exc), "rate_limit_error", "queue_full",
                                             {"Retry-After": str(exc.retry_after_s or 1)}))
        return answer(request, HTTPError(503, str(exc), "server_error", "engine_overloaded", {"Retry-After": "1"}))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return answer(request, HTTPError(400, _validation_message(exc)))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)  # NOTE: the traceback, never the prompt
        return answer(request, HTTPError(500, f"internal error ({type(exc).__name__}); see the server log",
                                         "server_error"))

    async def on_starlette(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return answer(request, _from_starlette(request, exc, app))

    app.add_exception_handler(HTTPError, on_http)
    app.add_exception_handler(HTTPException, on_starlette)  # NOTE: HTTPError, a subclass, keeps its own
    app.add_exception_handler(InvalidRequestError, on_invalid)
    app.add_exception_handler(ContextLengthError, on_too_long)
    app.add_exception_handler(OverloadedError, on_overloaded)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(Exception, on_unexpected)


def _from_starlette(request: Request, exc: HTTPException, app: FastAPI) -> HTTPError:
    """A Starlette or FastAPI HTTPException (no route, wrong method, a body it could not read) as an
    HTTPError, worded as OpenAI words its own."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        served = sorted(r.path for r in app.routes if isinstance(r, APIRoute) and r.include_in_schema)
        return HTTPError(404, f"Invalid URL ({where}): this server serves {', '.join(served)}", code="not_found")
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return HTTPError(405, f"Invalid method for URL ({where}): use {allowed}", code="method_not_allowed",
                         headers=dict(exc.headers or {}))
    kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return HTTPError(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {}))


def _validation_message(exc: RequestValidationError) -> str:
    """Pydantic's errors as one sentence that names each field (and says when the JSON is malformed)."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        if error.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({error.get('msg')})")
        elif error.get("type") == "extra_forbidden":
            parts.append(f"unsupported field {where!r}: this server does not do it; remove it")
        elif error.get("type") == "value_error":
            parts.append(f"{where or 'body'}: {error.get('ctx', {}).get('error', error.get('msg'))}")
        else:
            parts.append(f"{where or 'body'}: {error.get('msg')}")
    return "; ".join(parts)


__all__ = ["HTTPError", "create_app"]
