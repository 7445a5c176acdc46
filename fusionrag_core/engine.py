"""FusionEngine: the public facade over the model, its prompt layout and the request path.

A query, top to bottom (`fusionrag_core.batching`): the engine builds a `Request`, hands it to the
scheduler (or runs it alone), and streams its text; the request's phases stitch it (prefix cache,
system prefix, re-rotated chunk caches), select and recompute its chunk tokens with its question,
and decode. Chunk caches are looked up per request (`query.lookup`); nothing per request is kept
on the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Container, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fusionrag_core.batching.generation import AsyncGenerationStream, Generation, GenerationStream, generation_of
from fusionrag_core.batching.heal import Healer
from fusionrag_core.batching.loop import BatchLoop
from fusionrag_core.batching.phases import Shared, keep
from fusionrag_core.batching.prefix_cache import PrefixCache
from fusionrag_core.batching.request import LearnFn, Request, Selection
from fusionrag_core.batching.runner import Runner, arun_alone, run_alone
from fusionrag_core.batching.scheduler import Scheduler, SchedulerConfig, default_kv_budget
from fusionrag_core.batching.system_prefixes import SystemPrefixes
from fusionrag_core.engine_config import EngineConfig
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query import audit as audit_lib
from fusionrag_core.query.audit import Auditor, AuditResult
from fusionrag_core.query.bad_blobs import BadBlobs
from fusionrag_core.query.lookup import ChunkLookup, ModelKV, no_caches
from fusionrag_core.query.prefill import prefill_chunk, prefill_chunks
from fusionrag_core.query.prompt import FusionPrompt, PromptLayout
from fusionrag_core.query.sampling import SEED_RANGE, SamplingConfig
from fusionrag_core.query.select import get_selector
from fusionrag_core.query.stitch import CacheLookup
from fusionrag_core.query.tools import ToolCallFormat, ToolRequest
from fusionrag_core.recognise.content_index import Match
from fusionrag_core.runtime import loading, threads
from fusionrag_core.runtime.converted import DEFAULT_CONVERTED, ConvertedCache
from fusionrag_core.runtime.decoder import Decoder
from fusionrag_core.runtime.kv import ChunkKV, Variant
from fusionrag_core.scope import OPERATOR, Scope

if TYPE_CHECKING:
    from fusionrag_core.store.base import KVStore

log = logging.getLogger(__name__)

ChunkInput = str | tuple[str | None, str]


class FusionEngine:
    """Fused-cache reuse with query-guided selective recompute over a Llama-family model.

    Example:
        >>> engine = FusionEngine.from_pretrained()  # packaged SmolLM2-135M-Instruct
        >>> prompt = engine.prompt("Who designed it?", chunks=["The Lumen lighthouse ...", "Ada Vell ..."])
        >>> engine.generate(prompt).text
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, name: str | None = None,
                 config: EngineConfig | None = None, decoder: Decoder | None = None) -> None:
        """Args:
            model, tokenizer: a Llama-family transformers model and its tokenizer.
            name: how results name the model (default: its `_name_or_path`).
            config: query defaults, scheduler and prefix cache.
            decoder: another engine's `Decoder` of the same model to share (`with_config`).
        """
        # NOTE: no KV store here: the store travels with each request (`stream(store=...)`), so a
        # shared engine holds no per-request state.
        self.model = model
        self.tokenizer = tokenizer
        self.name = name or str(getattr(model.config, "_name_or_path", type(model).__name__))
        self.config = config or EngineConfig()
        self.decoder = decoder or Decoder(model, compile_decode=self.config.compile_decode,
                                          packed_linears=self.config.packed_linears,
                                          idle_kv_bytes=self.config.idle_kv_bytes)
        self.layout = PromptLayout(tokenizer)
        self.fingerprint = loading.fingerprint(model)
        self.context_window = loading.context_window(model)
        self.system_prefixes = SystemPrefixes(self.decoder, self.fingerprint, self.config.system_prefixes)
        self._bad_blobs = BadBlobs()
        self.auditor = Auditor(self.config.audit_rate)
        self._loader = ThreadPoolExecutor(self.config.load_workers, thread_name_prefix="fusionrag-load")
        self.eos_ids = loading.eos_token_ids(model, tokenizer)
        self.prefix_cache = (PrefixCache(self.config.prefix_cache, self.fingerprint, self.device)
                             if self.config.prefix_cache is not None else None)
        # NOTE: the prefix every chunk cache is computed after (see `chunk_cache`): a prompt that
        # starts with it has an exact independent cache for its first chunk.
        self._shared = Shared(self.decoder, tokenizer, self.fingerprint, self.system_prefixes, self.prefix_cache,
                              self._loader, self.layout.prefix_ids(self.config.instruction),
                              Healer(self.config.heal) if self.config.heal is not None else None)
        self.loop = (BatchLoop(Scheduler(self.config.scheduler, default_kv_budget(self.config.scheduler, self.device)),
                               Runner(self._shared)) if self.config.scheduler is not None else None)
        # NOTE: loading and packing the model ran parallel ops on this thread; the OpenMP pool they left
        # would slow whichever other thread runs the model (`runtime.threads`)
        threads.release_pool()

    @classmethod
    def from_pretrained(cls, model: str | Path | None = None, *, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None, config: EngineConfig | None = None,
                        converted_weights: ConvertedCache | None = DEFAULT_CONVERTED) -> FusionEngine:
        """Load a model and build an engine.

        Args:
            model: None for the packaged default (SmolLM2-135M-Instruct), a packaged alias
                ("smollm2-135m", "gemma3-270m"), a .gguf file, a local directory, or an HF id.
            device: default CUDA if available, else CPU.
            dtype: default bf16 on GPU, fp32 on CPU.
            config: query defaults.
            converted_weights: where a .gguf model's dequantized weights are kept for the next load
                (default `~/.cache/fusionrag/converted`); None converts the file on every load.
        """
        hf_model, tokenizer, source = loading.load(model, device=device, dtype=dtype,
                                                   converted_weights=converted_weights)
        return cls(hf_model, tokenizer, name=source.name, config=config)

    def with_config(self, config: EngineConfig) -> FusionEngine:
        """An engine on the same model with another configuration: the weights (and, when the decoder
        settings agree, their packed copy) are shared; the scheduler, prefix caches and audit are its own.

        E.g. `engine.with_config(dataclasses.replace(engine.config, prefix_cache=None))` for a tool that
        compares methods on identical prompts.
        """
        settings = (config.compile_decode, config.packed_linears)
        same = settings == (self.config.compile_decode, self.config.packed_linears)
        return FusionEngine(self.model, self.tokenizer, name=self.name, config=config,
                            decoder=self.decoder if same else None)

    def with_limits(self, limits: SchedulerConfig) -> FusionEngine:
        """This engine if its scheduler already has `limits`' `max_running` and `max_waiting`, else one
        on the same model whose scheduler does (its other settings kept); how `fusionrag serve
        --max-running/--max-waiting` reach the engine's one admission point."""
        current = self.config.scheduler or SchedulerConfig()
        wanted = dataclasses.replace(current, max_running=limits.max_running, max_waiting=limits.max_waiting)
        if self.config.scheduler == wanted:
            return self
        return self.with_config(dataclasses.replace(self.config, scheduler=wanted))

    @property
    def scheduler(self) -> Scheduler | None:
        """The engine's one admission point and step planner (None: requests run alone)."""
        return self.loop.scheduler if self.loop is not None else None

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return self.decoder.kv_shape

    @property
    def model_kv(self) -> ModelKV:
        """What a chunk cache must match to be used with this engine, and where it is loaded."""
        return ModelKV(self.fingerprint, self.kv_shape, self.device, self.decoder.dtype)

    # ---- prompts ---------------------------------------------------------------------------------
    def prompt(self, question: str, chunks: Sequence[ChunkInput] = (), *,
               instruction: str | None = None) -> FusionPrompt:
        """The canonical request: instruction, passages in order, question.

        Args:
            question: the user's question.
            chunks: passage texts, or `(chunk_id, text)` pairs whose caches may be reused.
            instruction: overrides the configured system instruction.
        """
        pairs = [(None, c) if isinstance(c, str) else c for c in chunks]
        return self.layout.build(
            [(cid, self.layout.chunk_ids(text)) for cid, text in pairs],
            question,
            instruction or self.config.instruction,
        )

    def prompt_from_messages(self, messages: Sequence[Mapping[str, Any]], *,
                             find: Callable[[str], Sequence[Match]] | None = None,
                             documents: Mapping[str, str] | None = None, has_cache: Callable[[str], bool] | None = None,
                             spans: Mapping[str, str] | None = None, tools: ToolRequest | None = None) -> FusionPrompt:
        """A request from chat messages: chunks found by mark, by content (`find`), as retrieved
        `documents` or as `spans` of the context (content id -> text, both) become chunk segments;
        a mark whose id fails `has_cache` is found by its text instead (see `PromptLayout.from_messages`).
        Messages are OpenAI-shaped (assistant `tool_calls`, `tool` results); `tools` are shown to
        the model through its chat template, or the fallback format (`query.tools.ChatTools`)."""
        return self.layout.from_messages(messages, find=find, documents=documents, has_cache=has_cache, spans=spans,
                                         tools=tools)

    def prompt_from_text(self, text: str, *, find: Callable[[str], Sequence[Match]] | None = None,
                         documents: Mapping[str, str] | None = None, has_cache: Callable[[str], bool] | None = None,
                         spans: Mapping[str, str] | None = None) -> FusionPrompt:
        """A raw text request (a completion, no chat template), chunks found as in `prompt_from_messages`."""
        return self.layout.from_text(text, find=find, documents=documents, has_cache=has_cache, spans=spans)

    @property
    def tool_format(self) -> ToolCallFormat:
        """How this model writes tool calls (its template's syntax, or the fallback's)."""
        return self.layout.tools.format

    # ---- caches ----------------------------------------------------------------------------------
    def system_prefix(self, prefix_ids: torch.Tensor) -> ChunkKV | None:
        """The exact cache of a system prefix `[P]`, computed once and kept (`EngineConfig.system_prefixes`)."""
        return self.system_prefixes.get(prefix_ids)[0]

    def chunk_cache(self, text: str | torch.Tensor, neighbours: Sequence[ChunkKV] = (), *,
                    instruction: str | None = None) -> ChunkKV:
        """A chunk's cache: independent (no neighbours) or fused after `neighbours`, in order.

        Args:
            text: the chunk's text, or its token ids from `layout.chunk_ids`.
            neighbours: caches stitched in front of the chunk (their slices are not kept).
            instruction: the system instruction whose prefix precedes everything.
        """
        ids = self.layout.chunk_ids(text) if isinstance(text, str) else text
        prefix = self.system_prefix(self.layout.prefix_ids(instruction or self.config.instruction))
        return prefill_chunk(self.decoder, prefix, ids.to(self.device), self.fingerprint, neighbours)

    def chunk_caches(self, token_ids: Sequence[torch.Tensor], neighbours: Sequence[Sequence[ChunkKV]]) -> list[ChunkKV]:
        """`chunk_cache` for several chunks (ids from `layout.chunk_ids`) in one packed pass; equal
        to one call per chunk within fp tolerance (see `prefill.prefill_chunks`)."""
        if len(token_ids) == 1:
            return [self.chunk_cache(token_ids[0], neighbours[0])]
        prefix = self.system_prefix(self.layout.prefix_ids(self.config.instruction))
        return prefill_chunks(self.decoder, prefix, [t.to(self.device) for t in token_ids], self.fingerprint,
                              neighbours)

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompt: FusionPrompt, *, store: KVStore | None = None, sampling: SamplingConfig | None = None,
                 selector: str | None = None, ratio: float | None = None, caches: Mapping[str, ChunkKV] | None = None,
                 variant: Variant | None = None, learn: LearnFn | None = None, scope: Scope = OPERATOR,
                 heal_answer: bool | None = None) -> Generation:
        """Answer `prompt` and return the finished Generation; the arguments are `stream`'s."""
        return self.stream(prompt, store=store, sampling=sampling, selector=selector, ratio=ratio, caches=caches,
                           variant=variant, learn=learn, scope=scope, heal_answer=heal_answer).collect()

    def stream(self, prompt: FusionPrompt, *, store: KVStore | None = None, sampling: SamplingConfig | None = None,
               selector: str | None = None, ratio: float | None = None, caches: Mapping[str, ChunkKV] | None = None,
               variant: Variant | None = None, learn: LearnFn | None = None,
               scope: Scope = OPERATOR, heal_answer: bool | None = None) -> GenerationStream:
        """Answer `prompt`, streaming text pieces. Nothing runs (and the TTFT clock does not start)
        until the stream is first read; the scheduler's limits are checked then.

        Args:
            prompt: from `prompt()` or `prompt_from_messages()`.
            store: where this request looks chunk caches up by chunk id (e.g. `FusionIndex.store`);
                None: only `caches`, every other chunk is prefilled (and reported in `cache_misses`).
            sampling: max_new_tokens, temperature, top_p, seed, stop strings (default greedy, 64).
            selector: which chunk tokens to recompute (default from EngineConfig).
            ratio: recompute ratio (default from EngineConfig).
            caches: chunk caches by chunk id, looked up before the store.
            variant: preferred stored cache variant (default from EngineConfig).
            learn: called with the prompt and its computed buffer once decoding ends, when some
                chunk had no usable cache (e.g. `reuse.learned.LearnedCaches.learn`).
            scope: whose request it is: it continues conversations and reuses memoised system
                prefixes of this scope only (`fusionrag_core.scope`).
            heal_answer: heal the request's K/V between its decode steps, so the rest of its answer
                decodes over exact K/V (`batching.answer_heal`); None: `HealConfig.answers`.

        Raises:
            ContextLengthError: the prompt and `max_new_tokens` exceed the model's context window.
            InvalidRequestError: an unknown selector or a bad ratio; heal_answer on an engine that
                does not heal (`EngineConfig.heal`).
        """
        request = self._request(prompt, sampling, selector, ratio, caches, variant, store, learn, scope, heal_answer)
        return GenerationStream(self._pieces(request))

    def astream(self, prompt: FusionPrompt, *, store: KVStore | None = None, sampling: SamplingConfig | None = None,
                selector: str | None = None, ratio: float | None = None, caches: Mapping[str, ChunkKV] | None = None,
                variant: Variant | None = None, learn: LearnFn | None = None,
                scope: Scope = OPERATOR, heal_answer: bool | None = None) -> AsyncGenerationStream:
        """`stream` for asyncio: `async for` the pieces. With the scheduler, the engine's loop thread
        runs the model and each piece reaches the event loop as it is decoded (no thread hop per
        piece); without one, the request runs alone on a worker thread.

        Raises:
            OverloadedError: when first read, the scheduler refused it (its message names the limit).
            ContextLengthError, InvalidRequestError: as `stream`.
        """
        request = self._request(prompt, sampling, selector, ratio, caches, variant, store, learn, scope, heal_answer)
        return self._async_stream(request)

    def astream_choices(self, prompt: FusionPrompt, n: int, *, store: KVStore | None = None,
                        sampling: SamplingConfig | None = None, selector: str | None = None,
                        ratio: float | None = None, caches: Mapping[str, ChunkKV] | None = None,
                        variant: Variant | None = None, learn: LearnFn | None = None,
                        full_attention: bool = False, scope: Scope = OPERATOR,
                        heal_answer: bool | None = None) -> list[AsyncGenerationStream]:
        """`n` answers of one prompt (an OpenAI request's `n` choices), for asyncio: the prompt is
        stitched, selected and recomputed once, and each choice decodes a copy of it with its own
        sampling (choice i's seed is `seed + i`, as vLLM's, so it equals a request of that seed).
        Call it on the event loop that reads the streams; read them together (the first submits
        all). Only the first choice is kept in the prefix cache and learned from.

        Args:
            prompt, store, sampling, selector, ratio, caches, variant, learn, scope, heal_answer: as
                `stream` (each choice heals its own answer).
            n: how many choices (the scheduler's `max_running` at most).
            full_attention: answer with a plain prefill instead (`full_attention`).

        Raises:
            InvalidRequestError: n < 1, or an engine without a scheduler (choices share its steps).
            OverloadedError, ContextLengthError: as `astream`.
        """
        if n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {n}")
        if self.loop is None and n > 1:
            raise InvalidRequestError("n > 1 needs the engine's scheduler (EngineConfig.scheduler): without it, "
                                      "requests run alone and cannot share a prepared prompt")
        parent = (self._plain_request(prompt, sampling, scope) if full_attention else
                  self._request(prompt, sampling, selector, ratio, caches, variant, store, learn, scope, heal_answer))
        parent.forks = tuple(self._fork(parent, i) for i in range(1, n))
        loop = asyncio.get_running_loop()
        for request in (parent, *parent.forks):
            request.output.attach(loop)  # NOTE: before any is submitted: a fork's first piece may come first
        return [self._async_stream(r, submit=not r.forked) for r in (parent, *parent.forks)]

    def _fork(self, parent: Request, index: int) -> Request:
        """Choice `index` of `parent`'s prompt: its seed `seed + index` (wrapped into torch's range)."""
        seed = parent.sampling.seed
        if seed is not None:
            seed = seed + index if seed + index <= SEED_RANGE[1] else seed + index - 2**64
        return Request(parent.prompt, dataclasses.replace(parent.sampling, seed=seed), parent.selection, parent.lookup,
                       parent.kv_bytes, full_attention=parent.full_attention, in_memory=parent.in_memory,
                       eos_ids=self.eos_ids, forked=True, scope=parent.scope, heal_answer=parent.heal_answer)

    def full_attention(self, prompt: FusionPrompt, *, sampling: SamplingConfig | None = None,
                       scope: Scope = OPERATOR) -> GenerationStream:
        """The baseline: a plain prefill of every prompt token from position 0, no chunk cache reused
        (an exact head of a conversation of `scope` may be continued: it is what a prefill computes)."""
        return GenerationStream(self._pieces(self._plain_request(prompt, sampling, scope)))

    def afull_attention(self, prompt: FusionPrompt, *, sampling: SamplingConfig | None = None,
                        scope: Scope = OPERATOR) -> AsyncGenerationStream:
        """`full_attention` for asyncio (as `astream`)."""
        request = self._plain_request(prompt, sampling, scope)
        return self._async_stream(request)

    def _async_stream(self, request: Request, *, submit: bool = True) -> AsyncGenerationStream:
        """The request's pieces on an event loop; its bookkeeping once streamed, in a worker thread."""
        return AsyncGenerationStream(self._apieces(request, submit=submit),
                                     lambda: asyncio.to_thread(self._finish, request))

    def _plain_request(self, prompt: FusionPrompt, sampling: SamplingConfig | None, scope: Scope) -> Request:
        selection = Selection("full_attention", get_selector("none"), self.config.select)
        return self._new_request(prompt, sampling, selection, no_caches, full_attention=True, scope=scope)

    def _request(self, prompt: FusionPrompt, sampling: SamplingConfig | None, selector: str | None,
                 ratio: float | None, caches: Mapping[str, ChunkKV] | None, variant: Variant | None,
                 store: KVStore | None, learn: LearnFn | None, scope: Scope,
                 heal_answer: bool | None = None) -> Request:
        """A new request for `stream`'s arguments, its defaults from the engine's configuration."""
        heals_answer = self._heals_answer(heal_answer)
        select_config = self.config.select if ratio is None else dataclasses.replace(self.config.select, ratio=ratio)
        name = selector or self.config.selector
        exact_first = self.config.exact_first_chunk and torch.equal(prompt.prefix.cpu(), self._shared.canonical_prefix)
        lookup = ChunkLookup(self.model_kv, caches=caches, store=store, variant=variant or self.config.cache_variant,
                             exact_first=exact_first, bad_blobs=self._bad_blobs)
        request = self._new_request(prompt, sampling, Selection(name, get_selector(name), select_config), lookup,
                                    in_memory=caches or (), learn=learn, audit=self.auditor.should_audit(), scope=scope)
        request.heal_answer = heals_answer
        return request

    def _heals_answer(self, heal_answer: bool | None) -> bool:
        """Whether a request heals its answer in flight: asked, else `HealConfig.answers`.

        Raises:
            InvalidRequestError: asked on an engine that does not heal.
        """
        heal = self.config.heal
        if heal is None:
            if heal_answer:
                raise InvalidRequestError("heal_answer needs an engine that heals (EngineConfig.heal, e.g. "
                                          "HealConfig(answers=True) to heal every answer): set it, or drop heal_answer")
            return False
        return heal.answers if heal_answer is None else heal_answer

    def _new_request(self, prompt: FusionPrompt, sampling: SamplingConfig | None, selection: Selection,
                     lookup: CacheLookup, *, full_attention: bool = False, in_memory: Container[str] = (),
                     learn: LearnFn | None = None, audit: bool = False, scope: Scope = OPERATOR) -> Request:
        """A request whose prompt and new tokens fit the context window (else ContextLengthError)."""
        sampling = sampling or SamplingConfig()
        prompt.check_fits(sampling.max_new_tokens, self.context_window)
        kv_bytes = self.decoder.kv_bytes(prompt.num_tokens + sampling.max_new_tokens)
        return Request(prompt, sampling, selection, lookup, kv_bytes, full_attention=full_attention,
                       in_memory=in_memory, learn=learn, audit=audit, eos_ids=self.eos_ids, scope=scope)

    def _pieces(self, request: Request) -> Iterator[str | Generation]:
        """The request's text pieces, then its Generation (a generator: nothing runs until read)."""
        request.arrived_at = time.perf_counter()
        yield from (self.loop.pieces(request) if self.loop is not None else run_alone(request, self._shared))
        yield self._finish(request)

    async def _apieces(self, request: Request, *, submit: bool = True) -> AsyncIterator[str]:
        request.arrived_at = time.perf_counter()
        pieces = (self.loop.apieces(request, submit=submit) if self.loop is not None
                  else arun_alone(request, self._shared))
        async for piece in pieces:
            yield piece

    def _finish(self, request: Request) -> Generation:
        """The decoded request kept and learned from (`phases.keep`), its Generation; audited when asked."""
        keep(request, self._shared)  # NOTE: after decoding: what it stores never delays the answer
        if self.loop is not None:
            self.loop.heal_soon()
        lookup = request.lookup
        tiers = lookup.tiers.as_dict() if isinstance(lookup, ChunkLookup) else {}
        fallbacks = lookup.fallbacks if isinstance(lookup, ChunkLookup) else {}
        origins = lookup.origins if isinstance(lookup, ChunkLookup) else {}
        generation = generation_of(request, kv_tiers=tiers, cache_fallbacks=fallbacks, origins=origins)
        if request.audit:  # NOTE: the answer has streamed; only the final statistics wait for the audit
            generation.audit = self._audit(request.prompt, generation, request.scope)
        return generation

    def _audit(self, prompt: FusionPrompt, served: Generation, served_scope: Scope) -> AuditResult:
        """Answer `prompt` with full attention (first token only) and compare it with `served`."""
        start = time.perf_counter()
        reference = self.full_attention(prompt, sampling=SamplingConfig(max_new_tokens=1), scope=served_scope).collect()
        result = audit_lib.compare(reference.first_token_logits, served.first_token_logits, selector=served.selector,
                                   ratio=served.ratio, seconds=time.perf_counter() - start)
        self.auditor.record(result)
        return result

    def stats(self) -> dict[str, int]:
        """Lifetime totals of the engine's shared state: the prefix cache's hits, misses, tokens
        served, evictions, entries and bytes; the scheduler's decode steps and their rows, its
        sparse passes and the requests they carried (packed), and the requests running and waiting now;
        with `EngineConfig.heal`, the healer's totals (`Healer.stats`)."""
        out: dict[str, int] = {}
        if self.prefix_cache is not None:
            out.update(self.prefix_cache.stats())
        if self.scheduler is not None:
            out.update(self.scheduler.stats())
        if self._shared.healer is not None:
            out.update(self._shared.healer.stats())
        return out

    def wait_for_heals(self, timeout_s: float | None = None) -> bool:
        """Block until no kept request is left to heal (`EngineConfig.heal`), or `timeout_s` passed;
        returns whether none is. Healing runs only while no request waits or runs.

        Raises:
            InvalidRequestError: this engine does not heal.
        """
        healer, cache = self._shared.healer, self.prefix_cache
        if healer is None or cache is None or self.loop is None:
            raise InvalidRequestError("this engine does not heal kept requests: set EngineConfig.heal")
        self.loop.heal_soon()
        return healer.wait(cache, timeout_s)

    def close(self) -> None:
        """Stop the engine's background work: healing ends after the piece in flight and its thread
        exits, and the cache-loading threads end. Call it before dropping an engine that heals, whose
        heal thread would otherwise go on healing kept requests no one will continue. The engine
        answers no request after it."""
        if self.loop is not None:
            self.loop.stop_healing(end_thread=True)
        self._loader.shutdown(wait=True)

    def audit_summary(self) -> dict[str, Any]:
        """Live audit totals over the engine's life (see `fusionrag_core.query.audit.Auditor.summary`)."""
        return self.auditor.summary()


__all__ = ["AsyncGenerationStream", "ChunkInput", "EngineConfig", "FusionEngine", "Generation", "GenerationStream",
           "LearnFn"]
