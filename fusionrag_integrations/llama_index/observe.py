"""What a query retrieved and what its LLM calls reused: LlamaIndex instrumentation.

`FusionRAGLLM` learns the KV cache of a retrieved node from the prompt that holds it
(`fusionrag_core.reuse.learned`), so it must know which texts in its prompt are the query's nodes; and a
query's `response.metadata` should say what its LLM calls reused, on LlamaIndex's standard query
engine path too. Both come from LlamaIndex's instrumentation (the root dispatcher sees every span
and event): a span handler records each open span's parent; `RetrievalEndEvent` records the
retrieved node texts under the retrieval's ancestor spans; each FusionRAGLLM call records its
statistics under its ancestors; `SynthesizeEndEvent` adds the statistics of the LLM calls made
inside that synthesis to the response's metadata. A span's records are dropped when it ends.

A streamed response is different: its LLM calls run as it is read, after the query's spans have
ended. So `SynthesizeEndEvent` wraps its token generator: every step runs with the query's
retrieved texts in a context variable (`retrieved_texts` falls back to it), and the statistics
of the calls made while it is read fill its metadata once it is exhausted.

Only texts and JSON-friendly statistics are kept, never tensors.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import AsyncGenerator, Generator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent
from llama_index.core.schema import MetadataMode
from llama_index_instrumentation.base import BaseEvent
from llama_index_instrumentation.event_handlers import BaseEventHandler
from llama_index_instrumentation.span import SimpleSpan, active_span_id
from llama_index_instrumentation.span_handlers import BaseSpanHandler

from fusionrag_integrations.llama_index.calls import recording

_SUMMED = ("prompt_tokens", "completion_tokens", "reused_tokens", "recomputed_tokens", "prefilled_tokens",
           "prefix_cached_tokens", "system_prefix_tokens", "kept_prefix_tokens", "context_tokens", "kv_bytes_loaded",
           "exact_cached_tokens", "approximate_cached_tokens", "cache_misses", "fused_chunks",
           "independent_chunks", "chunks_without_drift", "exact_tokens", "healed_tokens", "approximate_tokens",
           "total_s")
_MAX_DEPTH = 256
_STREAMED: ContextVar[tuple[str, ...]] = ContextVar("fusionrag_streamed_query_texts", default=())


class _Records:
    """Per open span: its parent, the texts retrieved under it, the LLM statistics recorded under it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.parents: dict[str, str | None] = {}
        self.texts: dict[str, list[str]] = {}
        self.stats: dict[str, list[dict[str, Any]]] = {}

    def ancestors(self, span_id: str | None) -> list[str]:
        """`span_id` and its open ancestors, nearest first (lock held)."""
        out: list[str] = []
        while span_id is not None and len(out) < _MAX_DEPTH:
            out.append(span_id)
            span_id = self.parents.get(span_id)
        return out

    def forget(self, span_id: str) -> None:
        with self.lock:
            self.parents.pop(span_id, None)
            self.texts.pop(span_id, None)
            self.stats.pop(span_id, None)


RECORDS = _Records()


class _SpanParents(BaseSpanHandler[SimpleSpan]):
    """Records each span's parent while it is open (nothing else: no span objects are kept)."""

    @classmethod
    def class_name(cls) -> str:
        return "FusionRAGSpanParents"

    def new_span(self, id_: str, bound_args: inspect.BoundArguments, instance: Any | None = None,
                 parent_span_id: str | None = None, tags: dict[str, Any] | None = None,
                 **kwargs: Any) -> SimpleSpan | None:
        with RECORDS.lock:
            RECORDS.parents[id_] = parent_span_id
        return None  # NOTE: no span object: the base class then keeps nothing for it

    def prepare_to_exit_span(self, id_: str, bound_args: inspect.BoundArguments, instance: Any | None = None,
                             result: Any | None = None, **kwargs: Any) -> SimpleSpan | None:
        RECORDS.forget(id_)
        return None

    def prepare_to_drop_span(self, id_: str, bound_args: inspect.BoundArguments, instance: Any | None = None,
                             err: BaseException | None = None, **kwargs: Any) -> SimpleSpan | None:
        RECORDS.forget(id_)
        return None


class _Events(BaseEventHandler):
    """Retrieved node texts in; LLM statistics out into the synthesized response's metadata."""

    @classmethod
    def class_name(cls) -> str:
        return "FusionRAGEvents"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            texts = [n.node.get_content(metadata_mode=MetadataMode.NONE) for n in event.nodes]
            with RECORDS.lock:
                for span in RECORDS.ancestors(event.span_id):
                    RECORDS.texts.setdefault(span, []).extend(texts)
        elif isinstance(event, SynthesizeEndEvent):
            with RECORDS.lock:
                calls = list(RECORDS.stats.get(event.span_id or "", ()))
                retrieved = _nearest_texts(event.span_id)
            response = event.response
            if isinstance(response, StreamingResponse | AsyncStreamingResponse) and response.response_gen is not None:
                _stream_with(response, retrieved)
            elif calls and hasattr(response, "metadata"):
                response.metadata = {**(response.metadata or {}), **combined(calls)}


def _nearest_texts(span_id: str | None) -> tuple[str, ...]:
    """Texts retrieved under the nearest retrieving ancestor of `span_id` (lock held)."""
    for span in RECORDS.ancestors(span_id):
        if span in RECORDS.texts:
            return tuple(RECORDS.texts[span])
    return ()


def _stream_with(response: StreamingResponse | AsyncStreamingResponse, texts: tuple[str, ...]) -> None:
    """Read `response`'s tokens with `texts` as the query's retrieved texts; its metadata gains
    the statistics of the LLM calls made while it is read, once it is exhausted."""
    calls: list[dict[str, Any]] = []

    def finish() -> None:
        if calls:
            response.metadata = {**(response.metadata or {}), **combined(calls)}

    def steps(pieces: Generator[str, None, None]) -> Generator[str, None, None]:
        try:
            while True:
                # NOTE: set around each step only, never across a yield: the consumer's context stays its own.
                token = _STREAMED.set(texts)
                try:
                    with recording(calls):
                        piece = next(pieces)
                except StopIteration:
                    finish()
                    return
                finally:
                    _STREAMED.reset(token)
                yield piece
        finally:
            # NOTE: a reader that stops early stops the generation too (a plain iterator has nothing to close).
            close = getattr(pieces, "close", None)
            if close is not None:
                close()

    async def asteps(pieces: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
        try:
            while True:
                token = _STREAMED.set(texts)
                try:
                    with recording(calls):
                        piece = await anext(pieces)
                except StopAsyncIteration:
                    finish()
                    return
                finally:
                    _STREAMED.reset(token)
                yield piece
        finally:
            aclose = getattr(pieces, "aclose", None)
            if aclose is not None:
                await aclose()

    if isinstance(response, AsyncStreamingResponse):
        response.response_gen = asteps(response.response_gen)
    else:
        response.response_gen = steps(response.response_gen)


def retrieved_texts() -> list[str]:
    """Texts of the nodes retrieved so far under the current span's nearest retrieving ancestor;
    outside any, those of the streamed response being read (see the module docstring)."""
    with RECORDS.lock:
        texts = _nearest_texts(active_span_id.get())
    return list(texts or _STREAMED.get())


def record_call(stats: Mapping[str, Any]) -> None:
    """Record one LLM call's statistics under the current span and its ancestors."""
    with RECORDS.lock:
        for span in RECORDS.ancestors(active_span_id.get()):
            RECORDS.stats.setdefault(span, []).append(dict(stats))


def combined(calls: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The statistics of a synthesis's LLM calls as one: counts summed, first call's TTFT, and
    `llm_calls`; `reuse_ratio` over all calls' prompts (as `Generation.reuse_ratio`)."""
    out: dict[str, Any] = dict(calls[0])
    for key in _SUMMED:
        if all(key in c for c in calls):
            out[key] = sum(c[key] for c in calls)
    for key in ("cache_miss_reasons", "chunk_found_by", "chunk_reused_from"):
        out[key] = {k: v for c in calls for k, v in dict(c.get(key, {})).items()}
    not_computed = out["reused_tokens"] + out.get("prefix_cached_tokens", 0)
    out["reuse_ratio"] = not_computed / out["prompt_tokens"] if out.get("prompt_tokens") else 0.0
    out["continued_healed_cache"] = any(c.get("continued_healed_cache", False) for c in calls)
    out["llm_calls"] = len(calls)
    return out


_dispatcher = get_dispatcher()
_dispatcher.add_span_handler(_SpanParents())
_dispatcher.add_event_handler(_Events())

__all__ = ["combined", "record_call", "retrieved_texts"]
