"""The OpenAI-compatible HTTP server: FastAPI routes over one `ReuseSession` (engine, KV store,
learned caches).

    POST /v1/chat/completions   chat (SSE when `stream`), tools, response_format
    POST /v1/completions        raw text continued (SSE when `stream`)
    /v1/responses, /v1/files, /v1/vector_stores   the Responses API, file_search (responses.py, store_routes.py)
    POST /v1/embeddings         the corpus's embedding model (embeddings.py)
    POST /tokenize, /detokenize vLLM's token routes (tokenize.py)
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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import AsyncExitStack
from typing import Any, NamedTuple, Protocol

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
from fusionrag_core.query.logprobs import TokenLogprob, piece_logprobs
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.tools import InvalidToolCall, ToolCall, asplit_calls
from fusionrag_core.query.unicode import not_unicode_at
from fusionrag_core.reuse.sources import ReuseSources
from fusionrag_core.scope import Scope as CacheScope
from fusionrag_integrations.fields import bound_tools
from fusionrag_integrations.logprobs import chat_logprobs, completion_logprobs
from fusionrag_integrations.openai_server.config import ServerConfig
from fusionrag_integrations.openai_server.embeddings import embeddings_route
from fusionrag_integrations.openai_server.errors import HTTPError
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
from fusionrag_integrations.openai_server.responses import ResponseOutput, add_response_routes
from fusionrag_integrations.openai_server.store_routes import add_store_routes
from fusionrag_integrations.openai_server.tenants import TenantKeys
from fusionrag_integrations.openai_server.tokenize import detokenize_route, tokenize_route
from fusionrag_integrations.openai_server.vector_stores import VectorStores
from fusionrag_integrations.request import RequestOptions
from fusionrag_integrations.session import ReuseSession

logger = logging.getLogger(__name__)
Piece = str | ToolCall | InvalidToolCall | Generation
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "responses"}
"""Metric label of each generation route."""


def create_app(session: ReuseSession, config: ServerConfig | None = None,
               vector_stores: VectorStores | None = None) -> FastAPI:
    """A FastAPI app serving `session`'s model under the OpenAI API (see the module docstring);
    `vector_stores` (None: none) serves /v1/files, /v1/vector_stores and file_search."""
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
    add_response_routes(app, server, auth, vector_stores, lambda output, scope: _ResponseStream(server, output, scope))
    add_store_routes(app, auth, vector_stores)
    app.add_api_route("/v1/embeddings", embeddings_route(), methods=["POST"], dependencies=auth)
    app.add_api_route("/tokenize", tokenize_route(session), methods=["POST"], dependencies=auth)
    app.add_api_route("/detokenize", detokenize_route(session), methods=["POST"], dependencies=auth)
    return app


class _Body(Protocol):
    """What every generation route's body has (chat, completions, responses)."""

    model: str | None

    def check_supported(self) -> None: ...

    def sampling_values(self, default_max_tokens: int) -> dict[str, Any]: ...


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
                             "parallel_tool_calls": body.parallel_calls()})
        options = RequestOptions.from_values(self._values(body), response_format=body.response_format_value(),
                                             tools=tools)
        messages = body.chat_messages()

        def prompt(sources: ReuseSources) -> FusionPrompt:
            return self.session.prompt(messages, sources, (), tools)
        stream = _Stream(self, "chat", Envelope("chatcmpl", self.name), body.stream_options is not None
                         and body.stream_options.include_usage, _scope(request, body))
        return await stream.respond(request, options, prompt, body.stream, body.n)

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        self._check(body)
        options = RequestOptions.from_values(self._values(body))
        text = body.text()

        def prompt(sources: ReuseSources) -> FusionPrompt:
            return self.session.prompt_from_text(text, sources)
        stream = _Stream(self, "completion", Envelope("cmpl", self.name), body.stream_options is not None
                         and body.stream_options.include_usage, _scope(request, body))
        return await stream.respond(request, options, prompt, body.stream, body.n)

    def _values(self, body: _Body) -> dict[str, Any]:
        """The request's option values: its sampling, and the server's selection settings."""
        selection = {"selector": self.config.selector, "ratio": self.config.ratio}
        return {**body.sampling_values(self.config.default_max_tokens),
                **{k: v for k, v in selection.items() if v is not None}}

    def _check(self, body: _Body) -> None:
        body.check_supported()
        if body.model not in (None, self.name):
            raise HTTPError(404, f"model {body.model!r} does not exist: this server serves {self.name!r}",
                            code="model_not_found")

    def check_length(self, prompt: FusionPrompt) -> None:
        limit = self.config.max_prompt_tokens
        if limit is not None and prompt.num_tokens > limit:
            raise HTTPError(400, f"the prompt has {prompt.num_tokens} tokens; this server's limit is {limit} "
                                 "(max_prompt_tokens): shorten it", code="context_length_exceeded")


class _Choice:
    """One choice of a request (OpenAI's `n`): its pieces and what it has generated and streamed."""

    def __init__(self, index: int, pieces: AsyncGenerator[Piece, None]) -> None:
        self.index, self.pieces = index, pieces
        self.calls: list[ToolCall] = []
        self.invalid: list[InvalidToolCall] = []
        self.logprobs_sent = 0  # NOTE: tokens whose logprobs a stream chunk has carried
        self.chars_sent = 0  # NOTE: text a completion stream has sent (where its next token's text starts)


class _Stream:
    """One request's generation: admitted, first token computed (every choice's), then answered
    whole or as SSE.

    Per request (never shared): the choices, the envelope, what was generated, and `exits`
    (the request's slots and generations, released once).
    """

    def __init__(self, server: _Server, endpoint: str, envelope: Envelope, include_usage: bool,
                 scope: CacheScope) -> None:
        self.server, self.endpoint, self.envelope, self.include_usage = server, endpoint, envelope, include_usage
        self.scope = scope
        self.exits = AsyncExitStack()
        self.choices: list[_Choice] = []
        self.generations: dict[int, Generation] = {}  # NOTE: by choice index, as each choice finishes

    async def respond(self, request: Request, options: RequestOptions,
                      prompt: Callable[[ReuseSources], FusionPrompt], streaming: bool, n: int = 1) -> Response:
        built = await anyio.to_thread.run_sync(self._prompt, options, prompt)
        choices = self.choices = [_Choice(i, pieces) for i, pieces in enumerate(self._start(options, built, n))]
        for choice in choices:
            self.exits.push_async_callback(choice.pieces.aclose)
        try:
            firsts = await self._first(request, choices)  # NOTE: prefill: a bad prompt fails here
        except BaseException:
            await self.exits.aclose()
            raise
        if not streaming:
            async with self.exits:
                return JSONResponse(await self._whole(request, choices, firsts))
        events = _merged([self._events(request, c, first) for c, first in zip(choices, firsts, strict=True)])
        return _ReleasingStream(self._ending(events), self.exits, media_type="text/event-stream")

    def _prompt(self, options: RequestOptions,
                prompt: Callable[[ReuseSources], FusionPrompt]) -> tuple[FusionPrompt, ReuseSources]:
        """The request's prompt and sources (tokenizing, finding chunks by content: a worker thread's job)."""
        sources = self._sources(options)
        request_prompt = prompt(sources)
        self.server.check_length(request_prompt)
        return request_prompt, sources

    def _sources(self, options: RequestOptions) -> ReuseSources:
        """Where the request reads caches: the session's KV store, then its scope's learned caches."""
        return self.server.session.sources(options, self.scope)

    def _start(self, options: RequestOptions, built: tuple[FusionPrompt, ReuseSources],
               n: int) -> list[AsyncGenerator[Piece, None]]:
        session = self.server.session
        every: list[AsyncGenerator[Piece, None]] = []
        if n == 1:
            every.append(session.arun(built[0], options, built[1]))
        else:
            every.extend(session.arun_choices(built[0], options, n, built[1]))
        if options.tools is not None:
            every = [asplit_calls(pieces, session.engine.tool_format, options.tools) for pieces in every]
        return every

    @staticmethod
    async def _first(request: Request, choices: list[_Choice]) -> list[Piece]:
        """Each choice's first piece; a client that disconnects before them (waiting in the engine's
        queue, or while its prompt is computed) ends the request instead, and a choice that fails
        (the prompt refused) fails it."""
        tasks = [asyncio.ensure_future(anext(c.pieces)) for c in choices]
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            waiting: set[asyncio.Future[Any]] = set(tasks)
            while waiting and not gone.done() and _failure(tasks) is None:
                _, waiting = await asyncio.wait(waiting | {gone}, return_when=asyncio.FIRST_COMPLETED)
                waiting.discard(gone)
        finally:
            gone.cancel()
        failed = _failure(tasks)
        if failed is None and all(t.done() for t in tasks):
            return [t.result() for t in tasks]
        for t in tasks:  # NOTE: a generator still waiting for its piece cannot be closed: cancel the wait first
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        if failed is not None:
            raise failed
        raise HTTPError(499, "the client disconnected", code="client_closed")

    async def _pieces(self, request: Request, choice: _Choice, first: Piece) -> AsyncIterator[Piece]:
        """A choice's pieces as the engine decodes them; stops when the client has gone."""
        piece: Piece | None = first
        while piece is not None:
            if isinstance(piece, Generation):
                self.generations[choice.index] = piece
                await choice.pieces.aclose()  # NOTE: the choice has left the engine before the client reads its end
            yield piece
            if isinstance(piece, Generation) or await request.is_disconnected():
                return
            piece = await anext(choice.pieces, None)

    async def _whole(self, request: Request, choices: list[_Choice], firsts: list[Piece]) -> dict[str, Any]:
        answers = await asyncio.gather(*(self._answer(request, c, f) for c, f in zip(choices, firsts, strict=True)))
        generations = [g for _, g in answers]
        self._finished()
        kind = "text_completion" if self.endpoint == "completion" else "chat.completion"
        return self.envelope.wrap(kind, [c for c, _ in answers], usage=usage(generations),
                                  fusionrag=fusionrag_stats(generations[0], choices[0].invalid))

    async def _answer(self, request: Request, choice: _Choice, first: Piece) -> tuple[dict[str, Any], Generation]:
        """One choice whole, and its generation."""
        text: list[str] = []
        generation: Generation | None = None
        async for piece in self._pieces(request, choice, first):
            if isinstance(piece, Generation):
                generation = piece
            else:
                text.append(self._text_of(choice, piece))
        if generation is None:
            raise HTTPError(499, "the client disconnected", code="client_closed")
        content = "".join(text)
        if self.endpoint == "completion":
            return {"index": choice.index, "text": content, "logprobs": self._logprobs(choice, generation.logprobs),
                    "finish_reason": generation.finish_reason}, generation
        calls: list[ToolCall | InvalidToolCall] = [*choice.calls, *choice.invalid]
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = [tool_call_dict(c) for c in calls]
        return {"index": choice.index, "message": message, "logprobs": self._logprobs(choice, generation.logprobs),
                "finish_reason": finish_reason(generation, choice.calls, choice.invalid)}, generation

    async def _events(self, request: Request, choice: _Choice, first: Piece) -> AsyncIterator[str]:
        """One choice's events, up to its finishing chunk."""
        if self.endpoint == "chat":
            yield sse(self._chunk(choice, {"role": "assistant", "content": ""}))
        async for piece in self._pieces(request, choice, first):
            if isinstance(piece, Generation):
                if piece.logprobs is not None and len(piece.logprobs) > choice.logprobs_sent:
                    # NOTE: tokens whose text never reached a piece (a stop string, marks removed, a tool call)
                    yield sse(self._chunk(choice, self._delta(""), logprobs=piece.logprobs[choice.logprobs_sent:]))
                yield self._finish_event(choice, piece)
            elif isinstance(piece, ToolCall | InvalidToolCall):
                yield sse(self._chunk(choice, {"tool_calls": [self._call_delta(choice, piece)]}))
            else:
                text = self._text_of(choice, piece)
                yield sse(self._chunk(choice, self._delta(text), logprobs=piece_logprobs(piece)))

    async def _ending(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Every choice's events, then the usage (when asked) and the end, once all have finished."""
        async for event in events:
            yield event
        if len(self.generations) < len(self.choices):
            return  # NOTE: the client has gone
        self._finished()
        if self.include_usage:
            generations = [self.generations[c.index] for c in self.choices]
            yield sse(self.envelope.wrap(self._kind, [], usage=usage(generations),
                                         fusionrag=fusionrag_stats(generations[0], self.choices[0].invalid)))
        yield sse("[DONE]")

    @property
    def _kind(self) -> str:
        return "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"

    def _chunk(self, choice: _Choice, delta: dict[str, Any] | str, finish: str | None = None,
               logprobs: Sequence[TokenLogprob] = (), **extra: Any) -> dict[str, Any]:
        """A stream chunk of `choice`; `logprobs` are those of its tokens decoded since its previous chunk."""
        shown = self._logprobs(choice, logprobs) if logprobs else None
        choice.logprobs_sent += len(logprobs)
        if self.endpoint == "chat":
            body = {"index": choice.index, "delta": delta, "logprobs": shown, "finish_reason": finish}
        else:
            body = {"index": choice.index, "text": delta, "logprobs": shown, "finish_reason": finish}
            choice.chars_sent += len(delta) if isinstance(delta, str) else 0
        return self.envelope.wrap(self._kind, [body], **extra)

    def _logprobs(self, choice: _Choice, entries: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        """A choice's `logprobs` in the endpoint's shape (None: not asked for)."""
        if entries is None:
            return None
        tokenizer = self.server.session.engine.tokenizer
        if self.endpoint == "chat":
            return chat_logprobs(entries, tokenizer)
        return completion_logprobs(entries, tokenizer, text_offset=choice.chars_sent)

    def _delta(self, text: str) -> dict[str, Any] | str:
        return {"content": text} if self.endpoint == "chat" else text

    def _text_of(self, choice: _Choice, piece: str | ToolCall | InvalidToolCall) -> str:
        """A piece's text; a call, valid or not (cut off by max_tokens), is kept aside: never content."""
        if isinstance(piece, ToolCall | InvalidToolCall):
            self._call_delta(choice, piece)
            return ""
        return piece

    @staticmethod
    def _call_delta(choice: _Choice, call: ToolCall | InvalidToolCall) -> dict[str, Any]:
        """Keep `call` aside; its stream delta, indexed in the order the choice's calls came."""
        if isinstance(call, ToolCall):
            choice.calls.append(call)
        else:
            choice.invalid.append(call)
        return tool_call_dict(call, len(choice.calls) + len(choice.invalid) - 1)

    def _finish_event(self, choice: _Choice, generation: Generation) -> str:
        """A choice's finishing chunk (empty delta, finish reason, FusionRAG's statistics)."""
        empty: dict[str, Any] | str = {} if self.endpoint == "chat" else ""
        return sse(self._chunk(choice, empty, finish_reason(generation, choice.calls, choice.invalid),
                               fusionrag=fusionrag_stats(generation, choice.invalid)))

    def _finished(self) -> None:
        """Metrics and the log line of the finished request (every choice's generation recorded)."""
        for generation in self.generations.values():
            self.server.metrics_.record(generation)
        self.server.metrics_.requests.labels(self.endpoint, "200").inc()
        first = self.generations[0]
        logger.info("%s %s: %d prompt tokens (%d reused), %d generated in %d choice(s), ttft %.3f s", self.endpoint,
                    self.envelope.id, first.prompt_tokens, first.reused_tokens,
                    sum(len(g.token_ids) for g in self.generations.values()), len(self.generations), first.ttft_s)


def _failure(tasks: Sequence[asyncio.Future[Any]]) -> BaseException | None:
    """The error of the first of `tasks` that failed (None: none has)."""
    return next((t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)


_END = object()


async def _merged(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The events of several streams as each comes (one stream: itself); the first error raises."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield event
        return
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def pump(stream: AsyncIterator[str]) -> None:
        try:
            async for event in stream:
                await queue.put(event)
        except BaseException as exc:  # NOTE: handed to the reader, which raises it
            await queue.put(exc)
        finally:
            await queue.put(_END)
    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        ended = 0
        while ended < len(tasks):
            item = await queue.get()
            if item is _END:
                ended += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                assert isinstance(item, str)
                yield item
    finally:
        for task in tasks:
            task.cancel()
        # NOTE: a choice's generator still in a cancelled pump could not be closed by the request's exits
        await asyncio.gather(*tasks, return_exceptions=True)


class _ResponseStream(_Stream):
    """A Responses API request on the chat path: `_Stream`'s admission, first token and disconnects,
    with `responses.ResponseOutput`'s sources (a vector store's) and output (items, or events). A
    response has one choice, and may run several passes (a search the model called, then the answer)."""

    def __init__(self, server: _Server, output: ResponseOutput, scope: CacheScope) -> None:
        super().__init__(server, "responses", Envelope("resp", server.name), False, scope)
        self.output = output

    def _sources(self, options: RequestOptions) -> ReuseSources:
        return self.output.sources(options) or super()._sources(options)

    async def _whole(self, request: Request, choices: list[_Choice], firsts: list[Piece]) -> dict[str, Any]:
        return await self.output.whole(self, request, choices[0].pieces, firsts[0])

    def _events(self, request: Request, choice: _Choice, first: Piece) -> AsyncIterator[str]:
        return self.output.events(self, request, choice.pieces, first)

    async def _ending(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """The output's events as they are: a Responses stream ends with its last event (no `[DONE]`),
        and each pass is recorded as it finishes (`pass_finished`)."""
        async for event in events:
            yield event

    def pass_start(self, options: RequestOptions, built: tuple[FusionPrompt, ReuseSources]
                   ) -> AsyncGenerator[Piece, None]:
        """A further pass's pieces (released with the request)."""
        [pieces] = self._start(options, built, 1)
        self.exits.push_async_callback(pieces.aclose)
        return pieces

    async def pass_first(self, request: Request, pieces: AsyncGenerator[Piece, None]) -> Piece:
        [first] = await self._first(request, [_Choice(0, pieces)])
        return first

    def pass_pieces(self, request: Request, pieces: AsyncGenerator[Piece, None], first: Piece) -> AsyncIterator[Piece]:
        return self._pieces(request, _Choice(0, pieces), first)

    def pass_finished(self, generation: Generation) -> None:
        """Metrics and the log line of one finished pass."""
        self.generations = {0: generation}
        self._finished()


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
