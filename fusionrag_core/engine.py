"""FusionEngine: the public entry that ties model, prompt layout, caches, selection and decoding.

A query, top to bottom:
    stitch (prefix cache + re-rotated chunk caches)  -> select (a selector's probe pass, if any)
    -> recompute (selected tokens + question, one pass) -> decode (stream tokens).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import psutil
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fusionrag_core.batching.continuation import head_cache, kept_from, reopen, rest_of, settle, verified_head
from fusionrag_core.batching.prefix_cache import KeptPrefix, PrefixCache, PrefixCacheConfig, ReusedRun
from fusionrag_core.batching.scheduler import Pending, Scheduler, SchedulerConfig, Staged
from fusionrag_core.errors import (
    ContextLengthError,
    InvalidRequestError,
)
from fusionrag_core.query import audit as audit_lib
from fusionrag_core.query.audit import Auditor, AuditResult
from fusionrag_core.query.bad_blobs import BadBlobs
from fusionrag_core.query.decoding import Decoding
from fusionrag_core.query.lookup import ChunkLookup, ModelKV, no_caches
from fusionrag_core.query.prefill import prefill_chunk, prefill_chunks, prefill_prefix
from fusionrag_core.query.prompt import DEFAULT_INSTRUCTION, FusionPrompt, PromptLayout
from fusionrag_core.query.recompute import SparsePass, run_passes, sparse_pass
from fusionrag_core.query.sampling import Sampler, SamplingConfig, TextAssembler
from fusionrag_core.query.select import SelectConfig, get_selector, probe_for
from fusionrag_core.query.selectors import DEFAULT_SELECTOR
from fusionrag_core.query.stitch import CacheLookup, Stitched, prefetch, stitch
from fusionrag_core.query.tools import ToolCallFormat, ToolRequest
from fusionrag_core.recognise.content_index import Match
from fusionrag_core.runtime import loading, threads
from fusionrag_core.runtime.decoder import Decoder
from fusionrag_core.runtime.kv import ChunkKV, Variant
from fusionrag_core.runtime.memory import DEFAULT_IDLE_BYTES
from fusionrag_core.store.tiered import TierStats

if TYPE_CHECKING:
    from fusionrag_core.store.base import KVStore

log = logging.getLogger(__name__)

ChunkInput = str | tuple[str | None, str]
# Called once a request's prompt is computed: keeps the K/V of chunks that had no cache (see learn.py).
LearnFn = Callable[[FusionPrompt, Stitched], None]


@dataclass(frozen=True)
class EngineConfig:
    """Defaults of every query; each can be overridden per call.

    Attributes:
        selector: which chunk tokens to recompute: a name in `fusionrag_core.query.select.SELECTORS`
            (each selector's docstring says what it picks). The default, "drift_aware", is
            FusionRAG's query-guided selection with a 3/4-depth probe, no budget spent on tokens
            whose cache is already exact, and the question's attention weighted by each token's
            fusion drift (`fusionrag_core.query.drift`).
        select: ratio and selector knobs.
        cache_variant: which stored cache to prefer: "fused" (FusionRAG) or "independent".
        exact_first_chunk: with "fused", a chunk right after the system prefix that caches are
            computed after (the configured instruction's) reuses its independent cache when
            stored: there it is exactly what full attention computes, while its fused cache
            attended to neighbours that full attention does not see.
        instruction: system instruction of the canonical layout.
        prefix_cache_size: how many distinct prefixes to keep computed in memory.
        load_workers: threads that load a request's chunk caches from the store concurrently.
        audit_rate: share of requests (evenly spread, in [0, 1]) that are also answered with full
            attention once their answer has streamed, off the critical path; the first-token KL
            and agreement land in `Generation.audit`, `stats()`, `FusionEngine.audit_summary()`
            and the `fusionrag_core.query.audit` log (see `fusionrag_core.query.audit`).
        compile_decode: `torch.compile` each layer's MLP for one-token passes (the decode step).
            Meant for GPUs: a one-token pass is bound by kernel launches there, and compiling
            with CUDA graphs ("reduce-overhead") replays a step's kernels without the launch
            overhead, as gpt-fast does. Off by default: on CPU a step is bound by reading the
            weights and K/V, and compiling does not pay. The first step of each engine pays the
            compilation.
        scheduler: how requests from several threads share the model (`fusionrag_core.batching.scheduler`):
            one loop prepares arriving requests between decode steps and decodes every running
            request in one batched step. None: each request runs its own passes on its caller's
            thread (requests on several threads then contend for the cores).
        prefix_cache: keep every finished request's K/V (prompt and answer) so that a later prompt
            starting with the same tokens (the next turn of a conversation, an agent's next call)
            continues from it (`fusionrag_core.batching.prefix_cache`); its reused chunk tokens stay
            open to the new question's recompute. None: only the system prefix is memoised.
        packed_linears: on CPU, run the decoder's fp32 projections and vocabulary head (probe,
            recompute, prefills, decode steps) through oneDNN with weights packed once
            (`fusionrag_core.runtime.linear`), faster than torch's `F.linear` (MKL) on such
            few-row products. Costs a second copy of the layers' projection weights and of the
            head; off keeps `F.linear`. No effect on GPUs or non-fp32 weights.
        idle_kv_bytes: on CPU, how much memory of finished requests' K/V buffers is kept for the next
            requests' buffers (`fusionrag_core.runtime.memory`) instead of being handed back to the
            system, which makes each new buffer touch its pages afresh (slow on VMs whose host
            reclaims freed memory). 0: every buffer is allocated afresh. On GPUs torch's caching allocator does this.
    """

    selector: str = DEFAULT_SELECTOR
    select: SelectConfig = field(default_factory=SelectConfig)
    cache_variant: Variant = "fused"
    exact_first_chunk: bool = True
    instruction: str = DEFAULT_INSTRUCTION
    prefix_cache_size: int = 8
    load_workers: int = 8
    audit_rate: float = 0.0
    compile_decode: bool = False
    packed_linears: bool = True
    idle_kv_bytes: int = DEFAULT_IDLE_BYTES
    scheduler: SchedulerConfig | None = field(default_factory=SchedulerConfig)
    prefix_cache: PrefixCacheConfig | None = field(default_factory=PrefixCacheConfig)

    def __post_init__(self) -> None:
        if self.idle_kv_bytes < 0:
            raise InvalidRequestError(f"idle_kv_bytes must be >= 0, got {self.idle_kv_bytes}")
        if self.load_workers < 1:
            raise InvalidRequestError(f"load_workers must be >= 1, got {self.load_workers}")
        if not 0.0 <= self.audit_rate <= 1.0:
            raise InvalidRequestError(f"audit_rate must be in [0, 1], got {self.audit_rate}")


@dataclass
class Generation:
    """The result of one request, with the statistics integrations report.

    Attributes:
        text: the answer (stop string excluded).
        token_ids: generated ids.
        finish_reason: "stop" (EOS or stop string) or "length".
        ttft_s: seconds from the call to the first token (stitching, selection, recompute included).
        total_s: seconds for the whole generation.
        prompt_tokens: prompt size; always `reused_tokens + recomputed_tokens + prefilled_tokens +
            prefix_cached_tokens` (`token_partition`).
        reused_tokens: chunk tokens whose cached K/V were kept.
        recomputed_tokens: reused-chunk tokens the selector chose to compute again.
        prefilled_tokens: every other prompt token computed afresh: context with no usable cache
            (unrecognised text included), the question, and the prefix when it was not memoised.
        prefix_cached_tokens: prompt tokens whose K/V came from the engine's memory as an earlier
            request computed them: a memoised system prefix, or the head of a kept request
            (`EngineConfig.prefix_cache`; its reused chunk tokens never recomputed count as
            reused or recomputed instead).
        context_tokens: tokens between prefix and question (chunks and the text around them).
        first_token_logits: `[V]` fp32 logits of the first generated position.
        cache_misses: chunk id -> why its cache was not used (it was prefilled instead).
        found_by: chunk id -> how the prompt named that chunk (`prompt.FoundBy`: "given", "mark",
            "content", "document", "mark_then_content", "mark_then_document").
        cache_variants: reused chunks per cache variant; a missing fused cache falls back to the
            independent one, and this is where that shows.
        cache_fallbacks: chunk id -> why it reused another cache variant than the one preferred
            (e.g. no fused cache stored: never fused, or withdrawn until re-fusion because a
            neighbour it was fused after was deleted).
        chunks_without_drift: reused chunks whose cache carries no fusion drift (independent
            caches, learned ones, blobs written before drift was stored); `drift_aware`
            scores their tokens with the prompt's mean drift.
        kv_tiers: this request's chunk loads from a store, per tier: `{device,host,store}_hits`
            and `_bytes` (the device and host tiers are a `TieredKVStore`'s; "store" is the backend).
        audit: the request's quality audit against full attention (see EngineConfig.audit_rate),
            or None when it was not audited.
    """

    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length"]
    ttft_s: float
    total_s: float
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    selector: str
    ratio: float | None
    kv_bytes_loaded: int
    first_token_logits: torch.Tensor
    cache_misses: dict[str, str] = field(default_factory=dict)
    found_by: dict[str, str] = field(default_factory=dict)
    cache_variants: dict[str, int] = field(default_factory=dict)
    cache_fallbacks: dict[str, str] = field(default_factory=dict)
    chunks_without_drift: int = 0
    kv_tiers: dict[str, int] = field(default_factory=dict)
    prefilled_tokens: int = 0
    context_tokens: int = 0
    prefix_cached_tokens: int = 0
    audit: AuditResult | None = None

    @property
    def recomputed_fraction(self) -> float:
        """Share of context tokens computed afresh (recomputed or without a usable cache)."""
        return 1.0 - self.reused_tokens / self.context_tokens if self.context_tokens else 0.0

    @property
    def reuse_ratio(self) -> float:
        """Share of the prompt whose K/V this request did not compute: kept chunk-cache tokens plus
        prefix-cache tokens, over `prompt_tokens`."""
        return (self.reused_tokens + self.prefix_cached_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    def token_partition(self) -> dict[str, int]:
        """Where each prompt token's K/V came from: four counts that sum to `prompt_tokens`.

        Raises:
            AssertionError: they do not (a defect in the engine's accounting, never the caller's).
        """
        parts = {"reused_tokens": self.reused_tokens, "recomputed_tokens": self.recomputed_tokens,
                 "prefilled_tokens": self.prefilled_tokens, "prefix_cached_tokens": self.prefix_cached_tokens}
        assert sum(parts.values()) == self.prompt_tokens, (
            f"token counts {parts} account for {sum(parts.values())} of {self.prompt_tokens} prompt tokens")
        return parts

    def stats(self) -> dict[str, float | int | str | None]:
        """JSON-friendly statistics (what integrations put in response metadata)."""
        return {
            "ttft_s": self.ttft_s,
            "total_s": self.total_s,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.token_ids),
            "reused_tokens": self.reused_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "prefix_cached_tokens": self.prefix_cached_tokens,
            "context_tokens": self.context_tokens,
            "reuse_ratio": self.reuse_ratio,
            "recomputed_fraction": self.recomputed_fraction,
            "selector": self.selector,
            "ratio": self.ratio,
            "kv_bytes_loaded": self.kv_bytes_loaded,
            "finish_reason": self.finish_reason,
            "cache_misses": len(self.cache_misses),
            "fused_chunks": self.cache_variants.get("fused", 0),
            "independent_chunks": self.cache_variants.get("independent", 0),
            "cache_fallbacks": len(self.cache_fallbacks),
            "chunks_without_drift": self.chunks_without_drift,
            **{f"kv_{k}": v for k, v in self.kv_tiers.items()},
            "audit_kl_first_token": self.audit.kl_first_token if self.audit else None,
            "audit_first_token_agree": self.audit.first_token_agree if self.audit else None,
        }


class GenerationStream:
    """Iterates text pieces as they are generated; `result` holds the Generation once exhausted."""

    def __init__(self, pieces: Iterator[str | Generation]) -> None:
        self._pieces = pieces
        self.result: Generation | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            for piece in self._pieces:
                if isinstance(piece, Generation):
                    self.result = piece
                elif piece:
                    yield piece
        finally:
            # NOTE: a reader that stops early (break, close) ends the request now, not when the
            # stream object is collected: the scheduler frees its slot at the next step
            close = getattr(self._pieces, "close", None)
            if close is not None:
                close()

    def collect(self) -> Generation:
        for _ in self:
            pass
        assert self.result is not None
        return self.result


@dataclass
class Prepared:
    """A request prepared up to its first token: what decoding continues from.

    Attributes:
        prompt: the request.
        stitched: the KV buffer (prefix, re-rotated chunk caches, recomputed tokens, question),
            with room for the new tokens.
        first_logits: `[V]` logits of the first generated position.
        selected_tokens: chunk tokens the selector chose to recompute.
        prefilled_tokens: prompt tokens computed afresh besides the selected ones (question, prefix
            when not memoised, context without a usable cache).
        prefix_cached_tokens: prefix tokens served from the in-memory prefix cache.
        selector / ratio: as the Generation reports them.
        selected: `[K]` the slots the selector chose.
        stitched_prompt: the prompt as stitched (its head a kept prefix, when one was continued).
        kept_runs: the chunk runs of the kept prefix it continued (carried into what it keeps).
        continued: the kept prefix it continued whole (what it keeps supersedes it).
        exact_base: leading slots exact before its passes ran (see `continuation.kept_from`).
    """

    prompt: FusionPrompt
    stitched: Stitched
    first_logits: torch.Tensor
    selected_tokens: int
    prefilled_tokens: int
    selector: str
    ratio: float | None
    selected: torch.Tensor
    stitched_prompt: FusionPrompt
    prefix_cached_tokens: int = 0
    kept_runs: tuple[ReusedRun, ...] = ()
    continued: KeptPrefix | None = None
    exact_base: int = 0


@dataclass(frozen=True)
class _Stage:
    """A request stitched, before its selection (`FusionEngine._stitch`, then `FusionEngine._select`).

    Attributes:
        prompt, st, stitched_prompt, kept_runs, continued, exact_base: as in `Prepared`.
        name, select_fn, select_config, budget: the selector and its budget of chunk tokens.
        prefilled, prefix_cached: prompt tokens computed afresh / served from the prefix cache so far.
        forced_prefilled: context without a usable cache counts as prefilled (not full attention).
    """

    prompt: FusionPrompt
    st: Stitched
    stitched_prompt: FusionPrompt
    name: str
    select_fn: Callable[..., torch.Tensor]
    select_config: SelectConfig
    budget: int
    prefilled: int
    prefix_cached: int
    forced_prefilled: bool
    kept_runs: tuple[ReusedRun, ...]
    continued: KeptPrefix | None
    exact_base: int


class FusionEngine:
    """Fused-cache reuse with query-guided selective recompute over a Llama-family model.

    Example:
        >>> engine = FusionEngine.from_pretrained()  # packaged SmolLM2-135M-Instruct
        >>> prompt = engine.prompt("Who designed it?", chunks=["The Lumen lighthouse ...", "Ada Vell ..."])
        >>> engine.generate(prompt).text
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        name: str | None = None,
        config: EngineConfig | None = None,
        decoder: Decoder | None = None,
    ) -> None:
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
        self._prefixes: OrderedDict[tuple[int, ...], ChunkKV] = OrderedDict()
        self._prefix_lock = threading.Lock()  # integrations serve requests from several threads
        self._bad_blobs = BadBlobs()
        self.auditor = Auditor(self.config.audit_rate)
        self._loader = ThreadPoolExecutor(self.config.load_workers, thread_name_prefix="fusionrag-load")
        # NOTE: the prefix every chunk cache is computed after (see `chunk_cache`): a prompt that
        # starts with it has an exact independent cache for its first chunk.
        self._canonical_prefix = self.layout.prefix_ids(self.config.instruction)
        self.eos_ids = self._eos_ids()
        self.kept_prefixes = (PrefixCache(self.config.prefix_cache, self.fingerprint, self.device)
                             if self.config.prefix_cache is not None else None)
        self.scheduler = (Scheduler(self.decoder, self.config.scheduler, self._kv_budget(self.config.scheduler))
                          if self.config.scheduler is not None else None)
        # NOTE: loading and packing the model ran parallel ops on this thread; the OpenMP pool they left
        # would slow whichever other thread runs the model (`runtime.threads`)
        threads.release_pool()

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        config: EngineConfig | None = None,
    ) -> FusionEngine:
        """Load a model and build an engine.

        Args:
            model: None for the packaged default (SmolLM2-135M-Instruct), a packaged alias
                ("smollm2-135m", "gemma3-270m"), a .gguf file, a local directory, or an HF id.
            device: default CUDA if available, else CPU.
            dtype: default bf16 on GPU, fp32 on CPU.
            config: query defaults.
        """
        hf_model, tokenizer, source = loading.load(model, device=device, dtype=dtype)
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

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    def _kv_budget(self, config: SchedulerConfig) -> int:
        """The running requests' KV byte budget: configured, else half the device memory free now."""
        if config.kv_budget_bytes is not None:
            return config.kv_budget_bytes
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            free = psutil.virtual_memory().available
        log.info("scheduler KV budget: %.1f GiB (half the %s memory free now; SchedulerConfig.kv_budget_bytes "
                 "sets it)", free / 2 / 2**30, self.device.type)
        return int(free // 2)

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of a KV buffer holding `tokens` tokens (keys and values, every layer)."""
        L, H, D = self.kv_shape
        return 2 * L * H * D * tokens * self.decoder.dtype.itemsize

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return self.decoder.kv_shape

    @property
    def model_kv(self) -> ModelKV:
        """What a chunk cache must match to be used with this engine, and where it is loaded."""
        return ModelKV(self.fingerprint, self.kv_shape, self.device, self.decoder.dtype)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(int(i) for i in source)
        # chat models end a turn with a template token that is not always the configured EOS
        for token in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>"):
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid >= 0:
                ids.add(tid)
        return ids

    # ---- prompts ---------------------------------------------------------------------------------
    def prompt(
        self, question: str, chunks: Sequence[ChunkInput] = (), *, instruction: str | None = None
    ) -> FusionPrompt:
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

    def prompt_from_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        find: Callable[[str], Sequence[Match]] | None = None,
        documents: Mapping[str, str] | None = None,
        has_cache: Callable[[str], bool] | None = None,
        spans: Mapping[str, str] | None = None,
        tools: ToolRequest | None = None,
    ) -> FusionPrompt:
        """A request from chat messages: chunks found by mark, by content (`find`), as retrieved
        `documents` or as `spans` of the context (content id -> text, both) become chunk segments;
        a mark whose id fails `has_cache` is found by its text instead (see `PromptLayout.from_messages`).
        Messages are OpenAI-shaped (assistant `tool_calls`, `tool` results); `tools` are shown to
        the model through its chat template, or the fallback format (`query.tools.ChatTools`)."""
        return self.layout.from_messages(messages, find=find, documents=documents, has_cache=has_cache, spans=spans,
                                         tools=tools)

    def prompt_from_text(
        self,
        text: str,
        *,
        find: Callable[[str], Sequence[Match]] | None = None,
        documents: Mapping[str, str] | None = None,
        has_cache: Callable[[str], bool] | None = None,
        spans: Mapping[str, str] | None = None,
    ) -> FusionPrompt:
        """A raw text request (a completion, no chat template), chunks found as in `prompt_from_messages`."""
        return self.layout.from_text(text, find=find, documents=documents, has_cache=has_cache, spans=spans)

    @property
    def tool_format(self) -> ToolCallFormat:
        """How this model writes tool calls (its template's syntax, or the fallback's)."""
        return self.layout.tools.format

    # ---- caches ----------------------------------------------------------------------------------
    def prefix_cache(self, prefix_ids: torch.Tensor) -> ChunkKV | None:
        """The exact cache of a prefix, computed once and kept (LRU) in memory."""
        return self._prefix_cache(prefix_ids)[0]

    def _prefix_cache(self, prefix_ids: torch.Tensor) -> tuple[ChunkKV | None, bool]:
        """`prefix_cache`, and whether it came from memory (False: computed by this call)."""
        if prefix_ids.numel() == 0:
            return None, False
        key = tuple(int(t) for t in prefix_ids)
        with self._prefix_lock:
            if key in self._prefixes:
                self._prefixes.move_to_end(key)
                return self._prefixes[key], True
        kv = prefill_prefix(self.decoder, prefix_ids, self.fingerprint)
        with self._prefix_lock:
            self._prefixes[key] = kv
            while len(self._prefixes) > self.config.prefix_cache_size:
                self._prefixes.popitem(last=False)
        return kv, False

    def chunk_cache(
        self, text: str | torch.Tensor, neighbours: Sequence[ChunkKV] = (), *, instruction: str | None = None
    ) -> ChunkKV:
        """A chunk's cache: independent (no neighbours) or fused after `neighbours`, in order.

        Args:
            text: the chunk's text, or its token ids from `layout.chunk_ids`.
            neighbours: caches stitched in front of the chunk (their slices are not kept).
            instruction: the system instruction whose prefix precedes everything.
        """
        ids = self.layout.chunk_ids(text) if isinstance(text, str) else text
        prefix = self.prefix_cache(self.layout.prefix_ids(instruction or self.config.instruction))
        return prefill_chunk(self.decoder, prefix, ids.to(self.device), self.fingerprint, neighbours)

    def chunk_caches(
        self, token_ids: Sequence[torch.Tensor], neighbours: Sequence[Sequence[ChunkKV]]
    ) -> list[ChunkKV]:
        """`chunk_cache` for several chunks (ids from `layout.chunk_ids`) in one packed pass; equal
        to one call per chunk within fp tolerance (see `prefill.prefill_chunks`)."""
        if len(token_ids) == 1:
            return [self.chunk_cache(token_ids[0], neighbours[0])]
        prefix = self.prefix_cache(self.layout.prefix_ids(self.config.instruction))
        return prefill_chunks(self.decoder, prefix, [t.to(self.device) for t in token_ids], self.fingerprint,
                              neighbours)

    # ---- generation ------------------------------------------------------------------------------
    def generate(
        self,
        prompt: FusionPrompt,
        *,
        store: KVStore | None = None,
        sampling: SamplingConfig | None = None,
        selector: str | None = None,
        ratio: float | None = None,
        caches: Mapping[str, ChunkKV] | None = None,
        variant: Variant | None = None,
        learn: LearnFn | None = None,
    ) -> Generation:
        """Answer `prompt` and return the finished Generation; the arguments are `stream`'s."""
        return self.stream(prompt, store=store, sampling=sampling, selector=selector, ratio=ratio, caches=caches,
                           variant=variant, learn=learn).collect()

    def stream(
        self,
        prompt: FusionPrompt,
        *,
        store: KVStore | None = None,
        sampling: SamplingConfig | None = None,
        selector: str | None = None,
        ratio: float | None = None,
        caches: Mapping[str, ChunkKV] | None = None,
        variant: Variant | None = None,
        learn: LearnFn | None = None,
    ) -> GenerationStream:
        """Answer `prompt`, streaming text pieces.

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
                chunk had no usable cache (e.g. `learn.LearnedCaches.learn`).
        """
        sampling = sampling or SamplingConfig()
        select_config = self.config.select
        if ratio is not None:
            select_config = dataclasses.replace(select_config, ratio=ratio)
        name = selector or self.config.selector
        select_fn = get_selector(name)
        self._check_length(prompt, sampling)
        exact_first = self.config.exact_first_chunk and torch.equal(prompt.prefix.cpu(), self._canonical_prefix)
        lookup = ChunkLookup(self.model_kv, caches=caches, store=store, variant=variant or self.config.cache_variant,
                             exact_first=exact_first, bad_blobs=self._bad_blobs)
        return GenerationStream(self._run(prompt, sampling, name, select_fn, select_config, lookup,
                                          in_memory=caches or (), learn=learn, tiers=lookup.tiers,
                                          fallbacks=lookup.fallbacks, audit=self.auditor.should_audit()))

    def full_attention(self, prompt: FusionPrompt, *, sampling: SamplingConfig | None = None) -> GenerationStream:
        """The baseline: a plain prefill of every prompt token from position 0, no cache reused."""
        sampling = sampling or SamplingConfig()
        self._check_length(prompt, sampling)
        return GenerationStream(
            self._run(prompt, sampling, "full_attention", get_selector("none"), self.config.select,
                      no_caches, use_prefix=False)
        )

    def _check_length(self, prompt: FusionPrompt, sampling: SamplingConfig) -> None:
        need = prompt.num_tokens + sampling.max_new_tokens
        if need > self.context_window:
            raise ContextLengthError(
                f"prompt of {prompt.num_tokens} tokens + {sampling.max_new_tokens} new tokens exceeds the model's "
                f"context window of {self.context_window}; retrieve fewer or smaller chunks, or lower max_new_tokens"
            )

    def _run(
        self,
        prompt: FusionPrompt,
        sampling: SamplingConfig,
        name: str,
        select_fn: Callable[..., torch.Tensor],
        select_config: SelectConfig,
        lookup: CacheLookup,
        *,
        use_prefix: bool = True,
        in_memory: Container[str] = (),
        learn: LearnFn | None = None,
        audit: bool = False,
        tiers: TierStats | None = None,
        fallbacks: Mapping[str, str] | None = None,
    ) -> Iterator[str | Generation]:
        # NOTE: a generator, so nothing runs (and the TTFT clock does not start) until iterated.
        start = time.perf_counter()

        def prepare() -> Staged[Prepared]:
            stage = self._stitch(prompt, sampling, name, select_fn, select_config, lookup,
                                 use_prefix=use_prefix, in_memory=in_memory)

            def select() -> Pending[Prepared]:
                last_pass, prepared_from = self._select(stage)

                def start(first_logits: torch.Tensor) -> tuple[Prepared, Decoding]:
                    prepared = prepared_from(first_logits)
                    return prepared, self._decoding(prepared, sampling)

                return Pending(last_pass, start)

            return Staged(probe_for(name, stage.st, stage.budget, select_config), select)

        if self.scheduler is None:
            pending = prepare().select()  # NOTE: its selector runs its own probe
            first_logits = run_passes(self.decoder, [pending.last_pass])[0]  # [V]
            prepared, decoding = pending.start(first_logits)
            yield from self._decode_alone(decoding, first_logits)
        else:
            ticket = self.scheduler.submit(prepare, kv_bytes=self.kv_bytes(prompt.num_tokens + sampling.max_new_tokens),
                                           prompt_tokens=prompt.num_tokens)
            yield from ticket
            assert ticket.value is not None and ticket.decoding is not None
            prepared, decoding = ticket.value, ticket.decoding
        yield self._finish(prepared, decoding, start, learn, audit, tiers, fallbacks or {})

    def _stitch(
        self,
        prompt: FusionPrompt,
        sampling: SamplingConfig,
        name: str,
        select_fn: Callable[..., torch.Tensor],
        select_config: SelectConfig,
        lookup: CacheLookup,
        *,
        use_prefix: bool,
        in_memory: Container[str],
    ) -> _Stage:
        """A request's first stage: a kept prefix continued, caches re-rotated into one buffer, the
        selection's budget; `_select` takes it from there."""
        if use_prefix:
            lookup = prefetch(prompt, lookup, self._loader, inline=in_memory)
        # NOTE: a full recompute (and full attention) must equal a plain prefill, so it continues only
        # exact K/V: a kept turn's question and answer attended to the approximate chunk K/V of its time
        full_recompute = not use_prefix or name == "all" or select_config.ratio >= 1.0
        kept, n, repeat = self._kept_head(prompt, lookup, exact_only=full_recompute,
                                          selection=(name, self._ratio_of(name, select_config)))
        kept_runs: tuple[ReusedRun, ...] = ()
        if kept is not None:
            kept_runs = tuple(dataclasses.replace(r, end=min(r.end, n)) for r in kept.runs if r.start < n)
            stitched_prompt = rest_of(prompt, n) if use_prefix else FusionPrompt(prompt.token_ids()[:n], (),
                                                                                   prompt.token_ids()[n:])
            st = stitch(self.decoder, stitched_prompt, head_cache(kept, n), lookup,
                        extra_capacity=sampling.max_new_tokens)
            reopened = reopen(st, kept, n)
            prefilled, prefix_cached = int(stitched_prompt.question.shape[0]), n - reopened
            exact_base = min(n, kept.exact_tokens)
            # NOTE: the new question gets the recompute budget a fresh request would: a share of every
            # reused chunk token (those of the exact head are no candidates)
            chunk_tokens = sum(r.end - r.start for r in kept_runs)
            budget_base = st.num_reused_tokens + max(0, chunk_tokens - reopened)
        elif use_prefix:
            stitched_prompt = prompt
            prefix, memoised = self._prefix_cache(prompt.prefix)
            # NOTE: the prefix is either served from memory or computed now: in one count, never both
            prefix_cached = int(prompt.prefix.shape[0]) if memoised else 0
            prefilled = int(prompt.question.shape[0]) + int(prompt.prefix.shape[0]) - prefix_cached
            st = stitch(self.decoder, prompt, prefix, lookup, extra_capacity=sampling.max_new_tokens,
                        exact_prefix=torch.equal(prompt.prefix.cpu(), self._canonical_prefix))
            exact_base, budget_base = int(prompt.prefix.shape[0]), st.num_reused_tokens
            if st.exact_slots.numel() and int(st.exact_slots[0]) == exact_base:
                exact_base += int(st.exact_slots.shape[0])
        else:  # full attention: everything, prefix included, is computed in one causal pass
            stitched_prompt = FusionPrompt(prompt.prefix[:0], (), prompt.token_ids())
            st = stitch(self.decoder, stitched_prompt, None, lookup, extra_capacity=sampling.max_new_tokens)
            prefilled, prefix_cached, exact_base, budget_base = prompt.num_tokens, 0, 0, 0
        return _Stage(
            prompt=prompt, st=st, stitched_prompt=stitched_prompt, name=name, select_fn=select_fn,
            select_config=select_config,
            budget=0 if repeat else min(select_config.budget(budget_base), st.num_reused_tokens),
            prefilled=prefilled, prefix_cached=prefix_cached, forced_prefilled=use_prefix or kept is not None,
            kept_runs=kept_runs, continued=kept if kept is not None and n == kept.num_tokens else None,
            exact_base=exact_base,
        )

    def _select(self, stage: _Stage) -> tuple[SparsePass, Callable[[torch.Tensor], Prepared]]:
        """A request's second stage: select, up to its last pass (the recompute and the question);
        returns that pass and what makes the `Prepared` request from its logits (the first
        generated position's)."""
        st = stage.st
        selected = stage.select_fn(st, stage.budget, stage.select_config)
        # NOTE: the new question's selection is a fresh request's; what an earlier one already
        # recomputed is continued as kept, and only the rest of it is computed now
        selected, settled = settle(st, selected)
        last_pass = sparse_pass(st, selected)
        num_selected = int(selected.shape[0])
        prefilled = stage.prefilled
        if stage.forced_prefilled:
            prefilled += last_pass.recomputed - num_selected  # NOTE: forced context: chunks without a cache

        def prepared(first_logits: torch.Tensor) -> Prepared:
            return Prepared(
                prompt=stage.prompt, stitched=st, first_logits=first_logits, selected_tokens=num_selected,
                prefilled_tokens=prefilled, selector=stage.name, ratio=self._ratio_of(stage.name, stage.select_config),
                prefix_cached_tokens=stage.prefix_cached + settled, selected=selected,
                stitched_prompt=stage.stitched_prompt, kept_runs=stage.kept_runs, continued=stage.continued,
                exact_base=stage.exact_base,
            )

        return last_pass, prepared

    @staticmethod
    def _ratio_of(selector: str, config: SelectConfig) -> float | None:
        """The ratio a request with `selector` reports (None for those that take no budget)."""
        return config.ratio if selector not in ("none", "all", "full_attention") else None

    def _kept_head(self, prompt: FusionPrompt, lookup: CacheLookup, *, exact_only: bool,
                   selection: tuple[str, float | None]) -> tuple[KeptPrefix | None, int, bool]:
        """The kept prefix this prompt continues, how many of its tokens (all but the last at most;
        `exact_only`: within the entry's exact head), and whether the prompt repeats the entry's own;
        or (None, 0, False).

        A later turn (the prompt holds the entry's whole prompt) continues all it shares. Any other
        prompt continues only with `PrefixCacheConfig.shared_documents`, and only an entry its own
        `selection` (selector, ratio) computed, so a method compared with another on one prompt never
        reads the other's K/V: the same prompt again is answered from the K/V as kept (that selection
        computed them for this very question, so nothing is selected anew: the first time's
        first-token logits); a prompt sharing the entry's documents, maybe part of its question,
        continues up to its own question, which its selection reads whole, as a fresh request's does.
        """
        cache = self.kept_prefixes
        if cache is None:
            return None, 0, False
        found = cache.match(prompt.token_ids(), prompt.num_tokens - 1)
        kept, n = found if found is not None else (None, 0)
        repeat = False
        if kept is not None:
            n = min(n, kept.exact_tokens) if exact_only else verified_head(prompt, kept, n, lookup)
            if n < kept.prompt_tokens:
                same = (cache.config.shared_documents and not exact_only
                        and (kept.selector, kept.ratio) == selection)
                repeat = same and n == prompt.num_tokens - 1 == kept.prompt_tokens - 1
                if not repeat:
                    n = min(n, prompt.num_tokens - int(prompt.question.shape[0])) if same else 0
            # NOTE: a head within the system prefix is the memoised prefix's to serve (with the exact
            # first chunk after it); a kept entry is continued for shared documents or earlier turns
            if n < cache.config.min_tokens or (n <= int(prompt.prefix.shape[0]) and n < kept.prompt_tokens):
                kept, n, repeat = None, 0, False
        cache.served(n)
        return kept, n, repeat

    def _decoding(self, prepared: Prepared, sampling: SamplingConfig) -> Decoding:
        """The request's decoding, continuing its prepared buffer."""
        prompt = prepared.prompt
        sampler = Sampler(sampling, prompt.token_ids(), tokenizer=self.tokenizer, eos_ids=self.eos_ids)
        return Decoding(prepared.stitched.buf, prompt.num_tokens, sampler, TextAssembler(self.tokenizer, sampling.stop),
                        sampling.max_new_tokens, self.eos_ids)

    def _decode_alone(self, decoding: Decoding, first_logits: torch.Tensor) -> Iterator[str]:
        """Decoding without the scheduler: one cached step per token on the caller's thread."""
        piece = decoding.start(first_logits)
        while True:
            if piece:
                yield piece
            if decoding.finished:
                break
            token, slot = decoding.next_input()
            piece = decoding.advance(self.decoder.decode_step(decoding.buf, token, slot))
        tail = decoding.flush()
        if tail:
            yield tail

    def _finish(
        self,
        prepared: Prepared,
        decoding: Decoding,
        start: float,
        learn: LearnFn | None,
        audit: bool,
        tiers: TierStats | None,
        fallbacks: Mapping[str, str],
    ) -> Generation:
        """The finished request's Generation; its chunks learned and its audit run first, when asked."""
        prompt, st = prepared.prompt, prepared.stitched
        assert decoding.finish_reason is not None and decoding.first_token_at is not None
        if learn is not None and st.missed:
            # NOTE: after decoding: what it stores never delays the answer
            learn(prepared.stitched_prompt, st)
        if self.kept_prefixes is not None:
            kept = kept_from(st, prepared.selected, decoding.ids, self.fingerprint, prepared.kept_runs,
                             prepared.exact_base, (prepared.selector, prepared.ratio))
            self.kept_prefixes.keep(kept, replaces=prepared.continued)
        context = prompt.num_tokens - int(prompt.prefix.shape[0]) - int(prompt.question.shape[0])
        generation = Generation(
            text=decoding.text,
            token_ids=list(decoding.ids),
            finish_reason=decoding.finish_reason,
            ttft_s=decoding.first_token_at - start,
            total_s=time.perf_counter() - start,
            prompt_tokens=prompt.num_tokens,
            reused_tokens=st.num_reused_tokens - prepared.selected_tokens,
            recomputed_tokens=prepared.selected_tokens,
            selector=prepared.selector,
            ratio=prepared.ratio,
            kv_bytes_loaded=st.kv_bytes_loaded,
            first_token_logits=prepared.first_logits.detach().cpu(),
            cache_misses=dict(st.misses),
            found_by={s.chunk_id: s.found_by for s in prompt.segments if s.chunk_id and s.found_by},
            cache_variants=dict(st.variants),
            cache_fallbacks=dict(fallbacks),
            chunks_without_drift=st.chunks_without_drift,
            kv_tiers=tiers.as_dict() if tiers is not None else {},
            prefilled_tokens=prepared.prefilled_tokens,
            context_tokens=context,
            prefix_cached_tokens=prepared.prefix_cached_tokens,
        )
        generation.token_partition()  # NOTE: the invariant every integration's statistics rely on
        if audit:  # NOTE: the answer has streamed; only the final statistics wait for the audit
            generation.audit = self._audit(prompt, generation)
        return generation

    def _audit(self, prompt: FusionPrompt, served: Generation) -> AuditResult:
        """Answer `prompt` with full attention (first token only) and compare it with `served`."""
        start = time.perf_counter()
        reference = self.full_attention(prompt, sampling=SamplingConfig(max_new_tokens=1)).collect()
        result = audit_lib.compare(reference.first_token_logits, served.first_token_logits, selector=served.selector,
                                   ratio=served.ratio, seconds=time.perf_counter() - start)
        self.auditor.record(result)
        return result

    def stats(self) -> dict[str, int]:
        """Lifetime totals of the engine's shared state: the prefix cache's hits, misses, tokens
        served, evictions, entries and bytes; the scheduler's decode steps and their rows, its
        sparse passes and the requests they carried (packed), and the requests running and waiting now."""
        out: dict[str, int] = {}
        if self.kept_prefixes is not None:
            out.update(self.kept_prefixes.stats())
        if self.scheduler is not None:
            load = self.scheduler.load
            out.update(decode_steps=self.scheduler.steps, decode_rows=self.scheduler.batched_rows,
                       sparse_passes=self.scheduler.passes, sparse_pass_requests=self.scheduler.packed_requests,
                       running=load["running"], waiting=load["waiting"], running_kv_bytes=load["kv_bytes"])
        return out

    def audit_summary(self) -> dict[str, Any]:
        """Live audit totals over the engine's life (see `fusionrag_core.query.audit.Auditor.summary`)."""
        return self.auditor.summary()


__all__ = ["ChunkInput", "EngineConfig", "FusionEngine", "Generation", "GenerationStream", "LearnFn"]
