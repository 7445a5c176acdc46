"""One model's cache reuse, the same for the LangChain and the LlamaIndex models.

A framework model translates its framework's messages and options (messages in, responses out,
callbacks), then hands the request to its `ReuseSession`, which owns everything else:

* where caches come from: the model's KV store (ingested), then its learned caches (`sources`);
* the prompt: stored chunks found by mark or content, retrieved texts made learnable (`prompt`);
* the engine call: text pieces, the learned K/V of retrieved chunks that had no cache, and one
  warning per model when a request with context reused nothing (`run`; `answer` is both steps).

Learned caches live in `ReuseConfig.root`: `learned_dir` if given, else
`<data_dir>/learned/<model fingerprint>` (`fusionrag_core.paths.learned_dir`), `data_dir`
defaulting to the bound `FusionIndex`'s data directory, else `DEFAULT_DATA_DIR`: the same rule in
both frameworks. When the KV store is a Redis store (shared by every process that opens it), they
live in that Redis server instead (`fusionrag_core.reuse.shared_learned`, unless
`ReuseConfig.share_learned` is off), so every server and replica reuses what any of them learned.

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
from fusionrag_core.query.stitch import Stitched
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
from fusionrag_core.reuse.shared_learned import (
    SharedLearnedCaches,
    SkippedSharedLearning,
    open_shared_learned,
    redis_backend,
)
from fusionrag_core.reuse.sources import ReuseMonitor, ReuseSources, check_store_model
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
        max_bytes: bound of the learned caches in bytes; the least recently used go first.
        share_learned: with a Redis KV store, keep learned caches in its server, shared by every
            process that opens the store (False: under `data_dir`, this node's only).

    Raises:
        InvalidRequestError: `max_bytes` below 1.
    """

    learn: bool = True
    data_dir: str | Path = DEFAULT_DATA_DIR
    learned_dir: str | Path | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    share_learned: bool = True

    def __post_init__(self) -> None:
        LearnConfig(max_bytes=self.max_bytes)  # NOTE: the core's bound check, at construction

    def root(self, fingerprint: str) -> Path:
        """The directory of the learned caches of the model `fingerprint`."""
        if self.learned_dir:  # NOTE: "" counts as unset, like None
            return Path(self.learned_dir).expanduser()
        return learned_dir(self.data_dir, fingerprint)


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

    def learned(self, *, create: bool = False) -> LearnedCaches | None:
        """The learned caches; None when learning is off, unless `create` when none exist yet, or
        when they cannot be opened (a full disk, a directory that cannot be made: reported once per
        cause by `skipped`, and tried again at the next request).

        Raises:
            CacheMismatchError: the directory holds another model's learned caches.
        """
        if not self.config.learn:
            return None
        shared = redis_backend(self.store) if self.config.share_learned else None
        if shared is not None:
            return self._shared_learned(shared)
        root = self.learned_root
        if not create and not (root / "lru.sqlite").exists():
            return None
        try:
            return open_learned(root, self.engine.fingerprint, LearnConfig(max_bytes=self.config.max_bytes))
        except STORAGE_ERRORS as e:
            self.skipped.report(root, e)
            return None

    def _shared_learned(self, corpus: RedisKVStore) -> SharedLearnedCaches | None:
        """The learned caches in the corpus's Redis server; None while it cannot be reached (reported
        once per cause by `skipped`, tried again at the next request)."""
        try:
            return open_shared_learned(corpus, self.engine.fingerprint, LearnConfig(max_bytes=self.config.max_bytes))
        except FusionRAGError as e:
            if isinstance(e, (CacheMismatchError, InvalidRequestError)):
                raise
            self.skipped_shared.report(f"Redis at {corpus!r}", e)
            return None

    def sources(self, options: RequestOptions) -> ReuseSources:
        """Where a request with `options` reads caches: the KV store, then the learned caches.

        A full-attention request reads none and learns nothing.
        """
        return ReuseSources(self.store, self.learned(), learning=self.config.learn and not options.full_attention)

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
               retrieved: Sequence[str] = ()) -> Iterator[str | Generation]:
        """Answer `messages`: `prompt` (with the options' tools), then `run`, both with this
        request's `sources(options)`."""
        sources = self.sources(options)
        return self.run(self.prompt(messages, sources, retrieved, options.tools), options, sources)

    def run(self, prompt: FusionPrompt, options: RequestOptions,
            sources: ReuseSources | None = None) -> Iterator[str | Generation]:
        """Generate `prompt`: non-empty text pieces (mark characters removed), then the Generation.

        Learnable chunks without a usable cache are kept as learned caches, best-effort (a full
        disk skips them with one warning per cause, never the answer); a request with context
        that reuses nothing logs one warning per session (`fusionrag_core.reuse.sources`).

        Args:
            prompt: from `prompt`, or the engine's `prompt(...)` (a canonical prompt of chunks by id).
            options: this request's options.
            sources: this request's sources (default: `sources(options)`).
        """
        sources = sources if sources is not None else self.sources(options)
        stream = options.stream(self.engine, prompt, store=sources, learn=self._learn if sources.learning else None)
        for piece in stream:
            text = clean_output(piece)
            if text:
                yield with_text(piece, text)
        generation = stream.result
        assert generation is not None  # NOTE: set by GenerationStream once exhausted
        if not options.full_attention:
            self.monitor.check(self.engine, prompt, generation, sources)
        yield generation

    async def arun(self, prompt: FusionPrompt, options: RequestOptions,
                   sources: ReuseSources | None = None) -> AsyncGenerator[str | Generation, None]:
        """`run` for an asyncio consumer: pieces arrive from the engine's loop with no thread hop per
        piece; the reuse monitor's check runs once in a worker thread."""
        sources = sources if sources is not None else self.sources(options)
        stream = options.astream(self.engine, prompt, store=sources, learn=self._learn if sources.learning else None)
        async for piece in self._apieces(stream, prompt, options, sources, check=True):
            yield piece

    def arun_choices(self, prompt: FusionPrompt, options: RequestOptions, n: int,
                     sources: ReuseSources | None = None) -> list[AsyncGenerator[str | Generation, None]]:
        """`arun` for `n` choices of one prompt, prepared once (`FusionEngine.astream_choices`): one
        iterator per choice, to be read together on the event loop this is called on. The first
        choice learns and is checked by the reuse monitor (the others share its prompt)."""
        sources = sources if sources is not None else self.sources(options)
        streams = options.astream_choices(self.engine, prompt, n, store=sources,
                                          learn=self._learn if sources.learning else None)
        return [self._apieces(s, prompt, options, sources, check=i == 0) for i, s in enumerate(streams)]

    async def _apieces(self, stream: AsyncGenerationStream, prompt: FusionPrompt, options: RequestOptions,
                       sources: ReuseSources, *, check: bool) -> AsyncGenerator[str | Generation, None]:
        async for piece in stream:
            text = clean_output(piece)
            if text:
                yield with_text(piece, text)
        generation = stream.result
        assert generation is not None  # NOTE: set by AsyncGenerationStream once exhausted
        if check and not options.full_attention:
            await asyncio.to_thread(self.monitor.check, self.engine, prompt, generation, sources)
        yield generation

    def _learn(self, prompt: FusionPrompt, st: Stitched) -> None:
        # NOTE: the engine calls this once decoding ends, in the request's own thread. Learning is
        # best-effort (`LearnedCaches.learn`): a directory that cannot be made skips it, not the answer.
        learned = self.learned(create=True)
        if learned is not None and any(prompt.segments[i].learn for i, _ in st.missed):
            learned.learn(prompt, st)


__all__ = ["ReuseConfig", "ReuseSession"]
