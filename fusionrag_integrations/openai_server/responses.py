"""The Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A Responses request is translated to what a chat request is (`responses_protocol`): messages,
tools, a response format and sampling, run on the chat path (`app._Stream`: one admission point,
the first token computed before the answer starts, the client's disconnect ending the request).
Only the answer's shape differs: output items and, streaming, the spec's semantic events
(`response.created`, `response.output_text.delta`, ..., `response.completed`).

file_search runs on the server, over one vector store (`vector_stores.py`): forced
(`tool_choice: {"type": "file_search"}`), it searches with the user's last message before the model
answers; otherwise the model sees a `file_search(query)` function and, when it calls it, the
server searches and the model answers in a second pass. The hits enter the prompt as a tool
message of `mark_chunk` marks, so each is found by chunk id and its stored (fused) cache reused;
the answer cites each file the hits came from (`file_citation` annotations).

`store` keeps a response and its conversation (messages, search results, answer) in memory; a
request naming it as `previous_response_id` continues that conversation: its prompt starts with
the earlier prompt and answer token for token, so the engine continues the kept K/V (the
prefix cache) instead of computing them again.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response

from fusionrag_core.engine import Generation
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.tools import InvalidToolCall, ToolCall, ToolRequest
from fusionrag_core.recognise.marks import mark_chunk
from fusionrag_core.reuse.sources import ReuseSources
from fusionrag_core.scope import Scope
from fusionrag_integrations.fields import bound_tools
from fusionrag_integrations.openai_server.errors import HTTPError
from fusionrag_integrations.openai_server.files import NoSuchObjectError
from fusionrag_integrations.openai_server.responses_protocol import (
    FILE_SEARCH,
    FileSearchSpec,
    ResponsesRequest,
    file_search_item,
    function_call_item,
    message_item,
    new_id,
    now,
    output_text,
    response_object,
    usage,
)
from fusionrag_integrations.openai_server.vector_stores import VectorStores, filename_of
from fusionrag_integrations.request import RequestOptions, generation_stats
from fusionrag_integrations.session import ReuseSession

logger = logging.getLogger(__name__)
STORED_RESPONSES = 1024
"""Responses kept for `previous_response_id` and GET (the least recently used go first)."""
SEARCH_TOOL = {"type": "function", "function": {
    "name": FILE_SEARCH, "description": "Search the uploaded files for passages that answer a query.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 64}},
                   "required": ["query"]}}}
"""The function the model calls to search (file_search not forced); the server runs it."""
Piece = str | ToolCall | InvalidToolCall | Generation


class Server(Protocol):
    """What the routes use of the app's server (`app._Server`)."""

    session: ReuseSession
    name: str

    def _check(self, body: ResponsesRequest) -> None: ...

    def _values(self, body: ResponsesRequest) -> dict[str, Any]: ...


class PassStream(Protocol):
    """What a response's output uses of the chat path's stream it runs on (`app._ResponseStream`):
    one engine pass after another, each admitted, its first piece awaited, its pieces read."""

    server: Any
    exits: AsyncExitStack

    async def respond(self, request: Request, options: RequestOptions, prompt: Callable[[ReuseSources], FusionPrompt],
                      streaming: bool) -> Response: ...

    def _prompt(self, options: RequestOptions,
                prompt: Callable[[ReuseSources], FusionPrompt]) -> tuple[FusionPrompt, ReuseSources]: ...

    def pass_start(self, options: RequestOptions,
                   built: tuple[FusionPrompt, ReuseSources]) -> AsyncGenerator[Piece, None]: ...

    async def pass_first(self, request: Request, pieces: AsyncGenerator[Piece, None]) -> Piece: ...

    def pass_pieces(self, request: Request, pieces: AsyncGenerator[Piece, None],
                    first: Piece) -> AsyncIterator[Piece]: ...

    def pass_finished(self, generation: Generation) -> None: ...


@dataclass(frozen=True)
class StoredResponse:
    """A stored response: its object, the conversation it ends (chat messages, instructions left out:
    a follow-up brings its own) and the vector store its search read, if any."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    vector_store_id: str | None


class ResponseStore:
    """Stored responses by tenant and id, most recently used last; thread-safe and bounded. A tenant
    never reads, continues or deletes another's (its id is unknown to it: 404)."""

    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[tenant, response_id] = stored
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> StoredResponse:
        """Raises NoSuchObjectError: no such response of `tenant` (never stored, deleted, or evicted)."""
        with self._lock:
            stored = self._items.get((tenant, response_id))
            if stored is None:
                raise NoSuchObjectError(f"No response with id {response_id!r} found (responses are kept in memory: "
                                        f"the {self.capacity} most recent with store=true)")
            self._items.move_to_end((tenant, response_id))
            return stored

    def delete(self, tenant: str, response_id: str) -> None:
        with self._lock:
            if self._items.pop((tenant, response_id), None) is None:
                raise NoSuchObjectError(f"No response with id {response_id!r} found")


def add_response_routes(app: FastAPI, server: Server, auth: list[Any], vector_stores: VectorStores | None,
                        stream: Callable[[ResponseOutput, Scope], PassStream]) -> None:
    """Register the Responses API's routes on `app`; `stream` runs a response's passes on the chat path,
    in the cache scope of the request's tenant (`request.state.tenant`, set by the server's authorization)."""
    routes = _Responses(server, vector_stores, stream)
    app.add_api_route("/v1/responses", routes.create, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/responses/{response_id}", routes.retrieve, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/responses/{response_id}", routes.delete, methods=["DELETE"], dependencies=auth)


class _Responses:
    """The routes' shared state: the server, its vector stores, the stored responses."""

    def __init__(self, server: Server, vector_stores: VectorStores | None,
                 stream: Callable[[ResponseOutput, Scope], PassStream]) -> None:
        self.server, self.vector_stores, self.stream = server, vector_stores, stream
        self.stored = ResponseStore()

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        self.server._check(body)
        functions, search = body.split_tools()
        choice, forced = body.chat_tool_choice()
        tenant: str = request.state.tenant
        previous = self._previous(tenant, body.previous_response_id)
        turn = _Turn(body, self._vector_store(search, previous, tenant), search, functions, tenant, self.vector_stores)
        turn.messages = [*([{"role": "system", "content": body.instructions}] if body.instructions else []),
                         *(previous.conversation if previous else []), *body.input_messages()]
        turn.instructions = 1 if body.instructions else 0
        if forced:
            if search is None:
                raise InvalidRequestError("tool_choice {'type': 'file_search'} needs a file_search tool in tools")
            await turn.search(_last_user_text(turn.messages))
        offered = [*functions, *([SEARCH_TOOL] if search is not None and not forced else [])]
        tools = bound_tools({"tools": offered or None, "tool_choice": "auto" if forced and offered else (
            choice if offered else None), "parallel_tool_calls": body.parallel_tool_calls if offered else None})
        options = RequestOptions.from_values(self.server._values(body), response_format=body.response_format(),
                                             tools=tools)
        stream = self.stream(ResponseOutput(self, turn, tenant), Scope(tenant))
        return await stream.respond(request, options, turn.prompt_fn(self.server, tools), body.stream)

    async def retrieve(self, response_id: str, request: Request) -> dict[str, Any]:
        return self._stored(request.state.tenant, response_id, None).response

    async def delete(self, response_id: str, request: Request) -> dict[str, Any]:
        try:
            self.stored.delete(request.state.tenant, response_id)
        except NoSuchObjectError as e:
            raise HTTPError(404, e.message, code="not_found") from None
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _stored(self, tenant: str, response_id: str, param: str | None) -> StoredResponse:
        try:
            return self.stored.get(tenant, response_id)
        except NoSuchObjectError as e:
            raise HTTPError(404, e.message, code="not_found", param=param) from None

    def _previous(self, tenant: str, response_id: str | None) -> StoredResponse | None:
        return None if response_id is None else self._stored(tenant, response_id, "previous_response_id")

    def _conversation_store(self, previous: StoredResponse | None, tenant: str) -> str | None:
        """The vector store a continued conversation's passages came from, if it still exists."""
        vs_id = previous.vector_store_id if previous is not None else None
        if vs_id is None or self.vector_stores is None:
            return None
        try:
            self.vector_stores.index(vs_id, tenant)
        except NoSuchObjectError:
            _gone(vs_id)
            return None
        return vs_id

    def _vector_store(self, search: FileSearchSpec | None, previous: StoredResponse | None,
                      tenant: str) -> str | None:
        """The vector store this turn reads caches from: its file_search's, else its conversation's
        (a store of the request's tenant: another tenant's is no store)."""
        if search is None:
            return self._conversation_store(previous, tenant)
        if self.vector_stores is None:
            raise HTTPError(400, "file_search needs vector stores: this server was started without a data directory "
                                 "for them", param="tools")
        if len(search.vector_store_ids) != 1:
            raise HTTPError(400, f"file_search searches one vector store here, got {len(search.vector_store_ids)}: "
                                 "put the files in one store", param="tools")
        vs_id = search.vector_store_ids[0]
        try:
            self.vector_stores.index(vs_id, tenant)
        except NoSuchObjectError as e:
            raise HTTPError(404, e.message, code="not_found", param="tools") from None
        return vs_id


@dataclass
class _Turn:
    """One request's conversation as it grows: its messages, the search it ran, the items it made.
    Per request, never shared."""

    body: ResponsesRequest
    vector_store_id: str | None
    search_spec: FileSearchSpec | None
    functions: list[dict[str, Any]]
    tenant: str
    vector_stores: VectorStores | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    instructions: int = 0
    items: list[dict[str, Any]] = field(default_factory=list)
    hits: list[Any] = field(default_factory=list)
    searched: bool = False

    async def search(self, query: str) -> dict[str, Any]:
        """Run the file search for `query`; its `file_search_call` item (also kept in `items`), and
        the call and its results appended to the messages (results as marks: found by chunk id)."""
        assert self.search_spec is not None and self.vector_stores is not None and self.vector_store_id is not None
        spec, vs_id, stores = self.search_spec, self.vector_store_id, self.vector_stores
        threshold = (spec.ranking_options or {}).get("score_threshold")
        hits = await anyio.to_thread.run_sync(
            lambda: stores.search(vs_id, self.tenant, query, spec.max_num_results, threshold))
        self.hits, self.searched = hits, True
        item_id = new_id("fs")
        results = [{"file_id": filename_of(h)[0], "filename": filename_of(h)[1], "score": h.score, "text": h.text,
                    "attributes": {"chunk_id": h.chunk_id}} for h in hits]
        item = file_search_item(item_id, [query], results)
        self.items.append(item)
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [{
            "id": item_id, "type": "function",
            "function": {"name": FILE_SEARCH, "arguments": json.dumps({"query": query}, ensure_ascii=False)}}]})
        context = "\n\n".join(mark_chunk(h.chunk_id, h.text) for h in hits) or "No passages found."
        self.messages.append({"role": "tool", "tool_call_id": item_id, "content": context})
        return item

    def prompt_fn(self, server: Server, tools: ToolRequest | None) -> Callable[[ReuseSources], FusionPrompt]:
        messages = list(self.messages)

        def prompt(sources: ReuseSources) -> FusionPrompt:
            return server.session.prompt(messages, sources, (), tools)
        return prompt

    def citations(self, text: str) -> list[dict[str, Any]]:
        """A file_citation per file the search's hits came from, in rank order, at the text's end."""
        files = dict.fromkeys(filename_of(h) for h in self.hits)
        return [{"type": "file_citation", "file_id": f, "filename": name, "index": len(text)} for f, name in files]


class ResponseOutput:
    """One response's output over the chat path's stream (`PassStream`): its items, or the spec's
    semantic events, through every pass (a second one when the model calls file_search), and the
    caches its prompt reads. Per request, never shared."""

    def __init__(self, routes: _Responses, turn: _Turn, tenant: str) -> None:
        self.routes, self.turn, self.server, self.tenant = routes, turn, routes.server, tenant
        self.response_id, self.created = new_id("resp"), now()
        self.sequence = 0
        self.usage: dict[str, Any] = {}
        self.text: list[str] = []
        self.generation: Generation | None = None
        self.message_id, self.message_index = "", 0

    def sources(self, options: RequestOptions) -> ReuseSources | None:
        """A turn over a vector store reads that store's caches (None: the session's own)."""
        vs_id, stores = self.turn.vector_store_id, self.routes.vector_stores
        if vs_id is None or stores is None:
            return None
        session = self.server.session
        scope = Scope(self.tenant)
        return ReuseSources(stores.index(vs_id, self.tenant).store, session.learned(scope=scope), scope=scope,
                            learning=session.config.learn and not options.full_attention)

    # ---- output --------------------------------------------------------------------------------------------
    async def whole(self, stream: PassStream, request: Request, pieces: AsyncGenerator[Piece, None],
                    first: Piece) -> dict[str, Any]:
        """The response object, once every pass is done."""
        final: dict[str, Any] | None = None
        async for event in self._run(stream, request, pieces, first):
            final = event.get("response", final)
        if final is None or self.generation is None:
            raise HTTPError(499, "the client disconnected", code="client_closed")
        return final

    async def events(self, stream: PassStream, request: Request, pieces: AsyncGenerator[Piece, None],
                     first: Piece) -> AsyncIterator[str]:
        """The response's server-sent events, as each pass decodes."""
        async for event in self._run(stream, request, pieces, first):
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    async def _run(self, stream: PassStream, request: Request, pieces: AsyncGenerator[Piece, None],
                   first: Piece) -> AsyncIterator[dict[str, Any]]:
        """The response's events, in the spec's order, through every pass."""
        yield self._event("response.created", response=self._response("in_progress", []))
        yield self._event("response.in_progress", response=self._response("in_progress", []))
        for item in self.turn.items:  # NOTE: a forced search, run before the first pass
            async for event in self._search_events(item):
                yield event
        calls: list[ToolCall | InvalidToolCall] = []
        while True:
            search_call: ToolCall | None = None
            async for piece in stream.pass_pieces(request, pieces, first):
                if isinstance(piece, Generation):
                    stream.pass_finished(piece)
                    self.usage = usage(piece, self.usage or None)
                    self.generation = piece
                elif isinstance(piece, ToolCall) and piece.name == FILE_SEARCH and not self.turn.searched:
                    search_call = piece
                elif isinstance(piece, ToolCall | InvalidToolCall):
                    calls.append(piece)
                else:
                    async for event in self._text_events(piece):
                        yield event
            if search_call is None or self.generation is None:
                break
            item = await self.turn.search(str(search_call.arguments.get("query") or ""))
            async for event in self._search_events(item):
                yield event
            if self._budget_left() < 1:
                break  # NOTE: the call spent max_output_tokens: the response is incomplete, unanswered
            pieces, first = await self._next_pass(stream, request)
        if self.generation is None:
            return  # NOTE: the client went away
        async for event in self._finish_events(calls):
            yield event

    async def _next_pass(self, stream: PassStream, request: Request) -> tuple[AsyncGenerator[Piece, None], Piece]:
        """The answer after a search the model called: the results in the prompt, the client's
        functions still offered (file_search no more)."""
        body = self.turn.body
        values = {**self.server._values(body), "max_new_tokens": self._budget_left()}
        tools = bound_tools({"tools": self.turn.functions or None, "tool_choice": "auto" if self.turn.functions
                             else None, "parallel_tool_calls": body.parallel_tool_calls if self.turn.functions
                             else None})
        options = RequestOptions.from_values(values, response_format=body.response_format(), tools=tools)
        built = await anyio.to_thread.run_sync(stream._prompt, options, self.turn.prompt_fn(self.server, tools))
        pieces = stream.pass_start(options, built)
        return pieces, await stream.pass_first(request, pieces)

    def _budget_left(self) -> int:
        """Output tokens the response may still generate (max_output_tokens counts every pass's)."""
        budget: int = self.server._values(self.turn.body)["max_new_tokens"]
        return budget - int(self.usage.get("output_tokens", 0))

    async def _text_events(self, piece: str) -> AsyncIterator[dict[str, Any]]:
        if not self.text:
            self.message_id, self.message_index = new_id("msg"), len(self.turn.items)
            item = {**message_item("", [], "in_progress", self.message_id), "content": []}
            yield self._event("response.output_item.added", output_index=self.message_index, item=item)
            yield self._event("response.content_part.added", item_id=self.message_id,
                              output_index=self.message_index, content_index=0, part=output_text("", []))
        self.text.append(piece)
        yield self._event("response.output_text.delta", item_id=self.message_id, output_index=self.message_index,
                          content_index=0, delta=piece, logprobs=[])

    async def _search_events(self, item: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        index = self.turn.items.index(item)
        where = {"item_id": item["id"], "output_index": index}
        yield self._event("response.output_item.added", output_index=index,
                          item={**item, "status": "in_progress", "results": None})
        for step in ("in_progress", "searching", "completed"):
            yield self._event(f"response.file_search_call.{step}", **where)
        yield self._event("response.output_item.done", output_index=index, item=item)

    async def _finish_events(self, calls: list[ToolCall | InvalidToolCall]) -> AsyncIterator[dict[str, Any]]:
        """Close the message, add the calls, store the response, and complete it."""
        assert self.generation is not None
        cut = self.generation.finish_reason == "length" or self._budget_left() < 1
        text = "".join(self.text)
        if text or not calls:
            if not self.text:
                async for event in self._text_events(""):
                    yield event
            annotations = self.turn.citations(text)
            where = {"item_id": self.message_id, "output_index": self.message_index, "content_index": 0}
            for i, annotation in enumerate(annotations):
                yield self._event("response.output_text.annotation.added", **where, annotation_index=i,
                                  annotation=annotation)
            yield self._event("response.output_text.done", **where, text=text, logprobs=[])
            yield self._event("response.content_part.done", **where, part=output_text(text, annotations))
            item = message_item(text, annotations, "incomplete" if cut else "completed", self.message_id)
            self.turn.items.append(item)
            yield self._event("response.output_item.done", output_index=self.message_index, item=item)
        for call in calls:
            item = function_call_item(call)
            index = len(self.turn.items)
            self.turn.items.append(item)
            yield self._event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
            yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=item["arguments"])
            yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=item["name"], arguments=item["arguments"])
            yield self._event("response.output_item.done", output_index=index, item=item)
        response = {**self._response("incomplete" if cut else "completed", self.turn.items,
                                     "max_output_tokens" if cut else None),
                    "fusionrag": generation_stats(self.generation)}
        self._keep(response, text, calls)
        yield self._event("response.incomplete" if cut else "response.completed", response=response)

    def _keep(self, response: dict[str, Any], text: str, calls: list[ToolCall | InvalidToolCall]) -> None:
        """Store the response and its conversation (store=true), for GET and previous_response_id."""
        if not self.turn.body.store:
            return
        answer: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            answer["tool_calls"] = [c.openai() for c in calls]
        conversation = [*self.turn.messages[self.turn.instructions:], answer]
        stored = StoredResponse(response, conversation, self.turn.vector_store_id)
        self.routes.stored.put(self.tenant, self.response_id, stored)

    def _response(self, status: str, output: list[dict[str, Any]], incomplete: str | None = None) -> dict[str, Any]:
        return response_object(self.turn.body, self.response_id, self.created, self.server.name, status, list(output),
                               self.usage or None, incomplete)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}


def _gone(vs_id: str) -> None:
    logger.warning("the vector store %s of a continued conversation was deleted: its passages are read as text, "
                   "their caches no more", vs_id)


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    """The search query of a forced file_search: the last user message."""
    for message in reversed(messages):
        if message["role"] == "user" and str(message.get("content") or "").strip():
            return str(message["content"])
    raise InvalidRequestError("a forced file_search searches with the last user message, and there is none: send "
                              "the question as a user message")


__all__ = ["PassStream", "ResponseOutput", "ResponseStore", "Server", "StoredResponse", "add_response_routes"]

