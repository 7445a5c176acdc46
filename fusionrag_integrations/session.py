"""One model's cache reuse, the same for the LangChain and the LlamaIndex models.

A framework model translates its framework's messages and options (messages in, responses out,
callbacks), then hands the request to its `ReuseSession`, which owns everything else:

* where caches come from: the model's KV store (ingested), then its learned caches (`sources`);
* the prompt: stored chunks found by mark or content, retrieved texts made learnable (`prompt`);
* the engine call: text pieces, then, once answered, the caches of the retrieved documents and
  spans that had none (`reuse.learning`), and one warning per model when a request with context
  reused nothing (`run`; `answer` is both steps).

Learned caches live in `ReuseConfig.root`: `learned_dir` if given, else
`<data_dir>/learned/<model fingerprint>` (`fusionrag_core.paths.learned_dir`), `data_dir`
defaulting to the bound `FusionIndex`'s data directory, else `DEFAULT_DATA_DIR`: the same rule in
both frameworks. A request's `Scope` (tenant, cache salt) chooses its own directory under it
(`Scope.learned_dir`), unless `ReuseConfig.share_learned`; the operator's scope, the default of
in-process calls, uses the root itself. When the KV store is a Redis store (shared by
every process that opens it), they live in that Redis server instead, one namespace per scope
(`fusionrag_core.reuse.shared_learned`, unless `ReuseConfig.learned_in_redis` is off), so every
server and replica reuses what any of them learned.

Many threads share one session (and its engine): a request's values (options, sources, prompt)
travel as arguments and locals, never as attributes; only texts and JSON-friendly statistics
leave through framework metadata, never tensors.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusionrag_core.engine import AsyncGenerationStream, FusionEngine, Generation
from fusionrag_core.errors import CacheMismatchError, FusionRAGError, InvalidRequestError
from fusionrag_core.paths import DEFAULT_DATA_DIR, learned_dir
from fusionrag_core.query.logprobs import with_text
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.tools import ToolRequest
from fusionrag_core.recognise.marks import clean_output
from fusionrag_core.reuse.learned import (
    DEFAULT_MAX_BYTES,
    STORAGE_ERRORS,
    LearnConfig,
    LearnedCaches,
    SkippedLearning,
    open_learned,
)
from fusionrag_core.reuse.learning import learn_pieces
from fusionrag_core.reuse.shared_learned import (
    SharedLearnedCaches,
    SkippedSharedLearning,
    open_shared_learned,
    redis_backend,
)
from fusionrag_core.reuse.sources import ReuseMonitor, ReuseSources, check_store_model
from fusionrag_core.scope import OPERATOR, Scope
from fusionrag_core.store import KVStore
from fusionrag_integrations.request import RequestOptions

if TYPE_CHECKING:
    from fusionrag_core.store.redis import RedisKVStore


@dataclass(frozen=True)
class ReuseConfig:
    """Whether and where a model learns caches from its requests.

    Attributes:
        learn: keep the K/V of retrieved documents found in a prompt without a cache as their
            caches, reused from the next prompt that holds them.
        data_dir: data directory whose `learned/<model fingerprint>` holds the learned caches.
        learned_dir: the learned caches' own directory instead (None: under `data_dir`).
        max_bytes: bound of the learned caches of each scope in bytes; the least recently used go first.
        share_learned: every scope reads and writes one directory of learned caches (`fusionrag
            serve --learn shared`): a request then hits caches other tenants' requests taught (and
            its timing and `cached_tokens` show it). Off: each scope has its own.
        learned_in_redis: with a Redis KV store, keep learned caches in its server, shared by every
            process that opens the store (False: under `data_dir`, this node's only).

    Raises:
        InvalidRequestError: `max_bytes` below 1.
    """

    learn: bool = True
    data_dir: str | Path = DEFAULT_DATA_DIR
    learned_dir: str | Path | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    share_learned: bool = False
    learned_in_redis: bool = True

    def __post_init__(self) -> None:
        LearnConfig(max_bytes=self.max_bytes)  # NOTE: the core's bound check, at construction

    def root(self, fingerprint: str) -> Path:
        """The directory of the learned caches of the model `fingerprint` (the operator's scope's)."""
        if self.learned_dir:  # NOTE: "" counts as unset, like None
            return Path(self.learned_dir).expanduser()
        return learned_dir(self.data_dir, fingerprint)

    def scope_root(self, fingerprint: str, scope: Scope) -> Path:
        """The directory of the learned caches requests of `scope` read and write."""
        root = self.root(fingerprint)
        return root if self.share_learned else scope.learned_dir(root)


class ReuseSession:
    """The reuse of one model instance: its engine, KV store, learned caches and reuse monitor.

    Thread-safe and shared by every request of the model; it holds no per-request state.

    Args:
        engine: the engine that answers.
        store: KV store of ingested chunk caches (None: only learned caches are reused).
        config: learning on or off, and where learned caches live.

    Raises:
        CacheMismatchError: `store`, or the learned caches already in the learned directory, hold
            another model's caches (none could be reused).
    """

    def __init__(self, engine: FusionEngine, store: KVStore | None, config: ReuseConfig | None = None) -> None:
        self.engine = engine
        self.store = store
        self.config = config or ReuseConfig()
        self.monitor = ReuseMonitor(engine.name)
        self.skipped = SkippedLearning()
        self.skipped_shared = SkippedSharedLearning()
        if store is not None:
            check_store_model(engine, store)
        self.learned()  # NOTE: opens the learned caches that exist, so another model's are refused now

    @property
    def learned_root(self) -> Path:
        """Where this session's learned caches live (see `ReuseConfig.root`)."""
        return self.config.root(self.engine.fingerprint)

    def learned(self, *, create: bool = False, scope: Scope = OPERATOR) -> LearnedCaches | None:
        """The learned caches of `scope`; None when learning is off, unless `create` when none exist yet, or
        when they cannot be opened (a full disk, a directory that cannot be made: reported once per
        cause by `skipped`, and tried again at the next request).

        Raises:
            CacheMismatchError: the directory holds another model's learned caches.
        """
        if not self.config.learn:
            return None
        shared = redis_backend(self.store) if self.config.learned_in_redis else None
        if shared is not None:
            return self._shared_learned(shared, scope)
        root = self.config.scope_root(self.engine.fingerprint, scope)
        if not create and not (root / "lru.sqlite").exists():
            return None
        try:
            return open_learned(root, self.engine.fingerprint, LearnConfig(max_bytes=self.config.max_bytes))
        except STORAGE_ERRORS as e:
            self.skipped.report(root, e)
            return None

    def _shared_learned(self, corpus: RedisKVStore, scope: Scope) -> SharedLearnedCaches | None:
        """The learned caches of `scope` in the corpus's Redis server (one namespace for every scope
        with `share_learned`); None while it cannot be reached (reported once per cause by
        `skipped_shared`, tried again at the next request)."""
        try:
            return open_shared_learned(corpus, self.engine.fingerprint, LearnConfig(max_bytes=self.config.max_bytes),
                                       OPERATOR if self.config.share_learned else scope)
        except FusionRAGError as e:
            if isinstance(e, (CacheMismatchError, InvalidRequestError)):
                raise
            self.skipped_shared.report(f"Redis at {corpus!r}", e)
            return None

    def sources(self, options: RequestOptions, scope: Scope = OPERATOR) -> ReuseSources:
        """Where a request with `options` of `scope` reads caches: the KV store (shared), then the
        learned caches of its scope.

        A full-attention request reads none and learns nothing.
        """
        return ReuseSources(self.store, self.learned(scope=scope), scope=scope,
                            learning=self.config.learn and not options.full_attention)

    def prompt(self, messages: Sequence[Mapping[str, Any]], sources: ReuseSources,
               retrieved: Sequence[str] = (), tools: ToolRequest | None = None) -> FusionPrompt:
        """`messages` (OpenAI-shaped) as a FusionPrompt: chunks found in `sources` by mark or
        content; `retrieved` texts (the documents retrieved for this request: by a retriever, or
        returned by a tool as its artifact) become learnable chunks where they occur; `tools`
        are shown with the messages."""
        return sources.prompt(self.engine, messages, retrieved, tools)

    def prompt_from_text(self, text: str, sources: ReuseSources, retrieved: Sequence[str] = ()) -> FusionPrompt:
        """A raw text prompt (a completion, no chat template) as a FusionPrompt, chunks found and
        learned as by `prompt`."""
        return sources.prompt_from_text(self.engine, text, retrieved)

    def answer(self, messages: Sequence[Mapping[str, Any]], options: RequestOptions,
               retrieved: Sequence[str] = (), scope: Scope = OPERATOR) -> Iterator[str | Generation]:
        """Answer `messages`: `prompt` (with the options' tools), then `run`, both with this
        request's `sources(options, scope)`."""
        sources = self.sources(options, scope)
        return self.run(self.prompt(messages, sources, retrieved, options.tools), options, sources)

    def run(self, prompt: FusionPrompt, options: RequestOptions,
            sources: ReuseSources | None = None) -> Iterator[str | Generation]:
        """Generate `prompt`: non-empty text pieces (mark characters removed), then the Generation.

        Once answered, the learnable pieces without a cache (`ReuseSources.pending`) are learned
        (`reuse.learning`), best-effort (a full disk skips them with one warning per cause, never
        the answer); a request with context that reuses nothing logs one warning per session
        (`fusionrag_core.reuse.sources`). The request runs in `sources.scope`.

        Args:
            prompt: from `prompt`, or the engine's `prompt(...)` (a canonical prompt of chunks by id).
            options: this request's options.
            sources: this request's sources (default: `sources(options)`).
        """
        sources = sources if sources is not None else self.sources(options)
        stream = options.stream(self.engine, prompt, store=sources, scope=sources.scope)
        for piece in stream:
            text = clean_output(piece)
            if text:
                yield with_text(piece, text)
        generation = stream.result
        assert generation is not None  # NOTE: set by GenerationStream once exhausted
        self._learn(sources)
        _report_pending(generation, sources)
        if not options.full_attention:
            self.monitor.check(self.engine, prompt, generation, sources)
        yield generation

    async def arun(self, prompt: FusionPrompt, options: RequestOptions,
                   sources: ReuseSources | None = None) -> AsyncGenerator[str | Generation, None]:
        """`run` for an asyncio consumer: pieces arrive from the engine's loop with no thread hop per
        piece; the reuse monitor's check runs once in a worker thread."""
        sources = sources if sources is not None else self.sources(options)
        stream = options.astream(self.engine, prompt, store=sources, scope=sources.scope)
        async for piece in self._apieces(stream, prompt, options, sources, first=True):
            yield piece

    def arun_choices(self, prompt: FusionPrompt, options: RequestOptions, n: int,
                     sources: ReuseSources | None = None) -> list[AsyncGenerator[str | Generation, None]]:
        """`arun` for `n` choices of one prompt, prepared once (`FusionEngine.astream_choices`): one
        iterator per choice, to be read together on the event loop this is called on. The first
        choice learns and is checked by the reuse monitor (the others share its prompt)."""
        sources = sources if sources is not None else self.sources(options)
        streams = options.astream_choices(self.engine, prompt, n, store=sources, scope=sources.scope)
        return [self._apieces(s, prompt, options, sources, first=i == 0) for i, s in enumerate(streams)]

    async def _apieces(self, stream: AsyncGenerationStream, prompt: FusionPrompt, options: RequestOptions,
                       sources: ReuseSources, *, first: bool) -> AsyncGenerator[str | Generation, None]:
        """A choice's pieces, then its Generation; the `first` choice's answer teaches the learned
        caches and is checked by the reuse monitor."""
        async for piece in stream:
            text = clean_output(piece)
            if text:
                yield with_text(piece, text)
        generation = stream.result
        assert generation is not None  # NOTE: set by AsyncGenerationStream once exhausted
        if first:
            await asyncio.to_thread(self._learn, sources)
            _report_pending(generation, sources)
        if first and not options.full_attention:
            await asyncio.to_thread(self.monitor.check, self.engine, prompt, generation, sources)
        yield generation

    def _learn(self, sources: ReuseSources) -> None:
        # NOTE: after the answer has streamed, never delaying its first token. Learning is best-effort
        # (`reuse.learning`): a directory that cannot be made skips it, not the answer.
        if not sources.learning or not sources.pending:
            return
        learned = self.learned(create=True, scope=sources.scope)
        if learned is not None:
            learn_pieces(self.engine, learned, sources.pending)


PENDING_REASON = "no cache yet: prefilled with the prompt, then learned once this answer streamed"


def _report_pending(generation: Generation, sources: ReuseSources) -> None:
    """List the pieces this request learned (`ReuseSources.pending`) among its cache misses: found
    in its prompt without a cache, as a chunk without one is (nothing lost without a trace). A piece
    the layout placed as a chunk (a mark without a cache that fell back to a document) is already a
    miss: its reason becomes this one, which also says what became of it."""
    for chunk_id, _ in sources.pending if sources.learning else ():
        generation.cache_misses[chunk_id] = PENDING_REASON


__all__ = ["PENDING_REASON", "ReuseConfig", "ReuseSession"]
