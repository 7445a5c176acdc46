"""What a request returns: its `Generation` (the answer and where its prompt's K/V came from), and
the streams that yield its text as it is decoded.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from fusionrag_core.batching.continuation import exact_head
from fusionrag_core.batching.request import Request
from fusionrag_core.errors import AccountingError
from fusionrag_core.query.audit import AuditResult
from fusionrag_core.query.logprobs import TokenLogprob


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
            request computed them: `system_prefix_tokens + kept_prefix_tokens`.
        system_prefix_tokens: of those, the system prefix served from the engine's memo of computed
            system prefixes (`EngineConfig.system_prefixes`).
        kept_prefix_tokens: of those, the head of a kept request continued from the prefix cache
            (`EngineConfig.prefix_cache`; its reused chunk tokens never recomputed count as reused or
            recomputed instead).
        reused_from: chunk id -> where the K/V reused for it came from: "corpus" (ingested),
            "learned" (learned caches of the request's scope), "conversation" (a kept turn of its
            scope), "caller" (caches passed in memory). `stats()` also splits the cached tokens into
            exact ones (`exact_cached_tokens`: the prefix, as a plain prefill computes it) and
            approximate ones (`approximate_cached_tokens`: reused chunk K/V, computed in another
            context: FusionRAG's recompute narrows the difference, it does not remove it).
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
        kv_tiers: this request's chunk loads from a store, per source: `{device,host,store,learned}_hits`
            and `_bytes`, as the store answered them (`KVStore.get_with_source`: the device and host
            tiers of a `TieredKVStore`, the backend, or learned caches), whatever wraps it.
        audit: the request's quality audit against full attention (see EngineConfig.audit_rate),
            or None when it was not audited.
        logprobs: each generated token's log-probability (`query.logprobs.TokenLogprob`), when its
            sampling asked for them (`SamplingConfig.logprobs`); else None.
        exact_tokens: prompt tokens whose K/V, when the first token was picked, were what full
            attention computes (healed ones not included); the prompt's exact head.
        healed_tokens: prompt tokens of that head continued from a kept request that healing made
            exact (`EngineConfig.heal`).
        approximate_tokens: the rest of the prompt (reused K/V, and every token computed after
            one): `exact_tokens + healed_tokens + approximate_tokens == prompt_tokens`.
        answer_healed_at: with answer healing (`HealConfig.answers`), the index of the first answer
            token decoded over exact K/V (the tokens from it on are full attention's continuation of
            those before it); None when the answer was not healed in flight.
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
    system_prefix_tokens: int = 0
    kept_prefix_tokens: int = 0
    reused_from: dict[str, str] = field(default_factory=dict)
    audit: AuditResult | None = None
    logprobs: list[TokenLogprob] | None = None
    exact_tokens: int = 0
    healed_tokens: int = 0
    approximate_tokens: int = 0
    answer_healed_at: int | None = None

    @property
    def continued_healed_cache(self) -> bool:
        """Whether it continued a kept request's K/V that healing made exact (in part)."""
        return self.healed_tokens > 0

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
            AccountingError: they do not (a defect in the engine's accounting, never the caller's).
        """
        parts = {"reused_tokens": self.reused_tokens, "recomputed_tokens": self.recomputed_tokens,
                 "prefilled_tokens": self.prefilled_tokens, "prefix_cached_tokens": self.prefix_cached_tokens}
        if self.system_prefix_tokens + self.kept_prefix_tokens not in (0, self.prefix_cached_tokens):
            raise AccountingError(f"system prefix ({self.system_prefix_tokens}) and kept prefix "
                                  f"({self.kept_prefix_tokens}) tokens do not make the {self.prefix_cached_tokens} "
                                  "prefix-cached ones")
        if sum(parts.values()) != self.prompt_tokens:
            raise AccountingError(
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
            "system_prefix_tokens": self.system_prefix_tokens,
            "kept_prefix_tokens": self.kept_prefix_tokens,
            "exact_cached_tokens": self.prefix_cached_tokens,
            "approximate_cached_tokens": self.reused_tokens,
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
            "exact_tokens": self.exact_tokens,
            "healed_tokens": self.healed_tokens,
            "approximate_tokens": self.approximate_tokens,
            "continued_healed_cache": self.continued_healed_cache,
            "answer_healed_at": self.answer_healed_at,
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


class AsyncGenerationStream:
    """`GenerationStream` for an asyncio consumer: `async for` the text pieces, then read `result`.

    Its pieces come from the engine's loop without a thread hop per piece; the finished request's
    bookkeeping (learned caches, prefix cache, audit) runs once in a worker thread.
    """

    def __init__(self, pieces: AsyncIterator[str], finish: Callable[[], Awaitable[Generation]]) -> None:
        self._pieces = pieces
        self._finish = finish
        self.result: Generation | None = None

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            async for piece in self._pieces:
                yield piece
            self.result = await self._finish()
        finally:
            aclose = getattr(self._pieces, "aclose", None)
            if aclose is not None:
                await aclose()  # NOTE: a reader that stops early ends the request now

    async def collect(self) -> Generation:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result


def generation_of(request: Request, *, kv_tiers: dict[str, int], cache_fallbacks: dict[str, str],
                  origins: Mapping[str, str] | None = None) -> Generation:
    """The finished request's Generation; its token counts checked to add up. `origins`: where each
    chunk cache the request loaded came from (`query.lookup.ChunkLookup.origins`).

    Raises:
        AccountingError: they do not (a defect in the engine, never the caller's).
    """
    prompt, st, decoding, account = request.prompt, request.stitched_buffer(), request.decoding, request.account
    assert decoding is not None and decoding.finish_reason is not None and decoding.first_token_at is not None
    assert request.first_logits is not None
    account.check()
    context = prompt.num_tokens - int(prompt.prefix.shape[0]) - int(prompt.question.shape[0])
    assert request.selected is not None
    exact = min(exact_head(st, request.selected, request.exact_base), prompt.num_tokens)
    healed = int(request.healed_head.sum()) if request.healed_head is not None else 0
    return Generation(
        text=decoding.text,
        token_ids=list(decoding.ids),
        finish_reason=decoding.finish_reason,
        ttft_s=decoding.first_token_at - request.arrived_at,
        total_s=time.perf_counter() - request.arrived_at,
        prompt_tokens=prompt.num_tokens,
        reused_tokens=account.reused,
        recomputed_tokens=account.recomputed,
        selector=request.selection.name,
        ratio=request.selection.ratio,
        kv_bytes_loaded=st.kv_bytes_loaded,
        first_token_logits=request.first_logits.detach().cpu(),
        cache_misses=dict(st.misses),
        found_by={s.chunk_id: s.found_by for s in prompt.segments if s.chunk_id and s.found_by},
        cache_variants=dict(st.variants),
        cache_fallbacks=dict(cache_fallbacks),
        chunks_without_drift=st.chunks_without_drift,
        kv_tiers=kv_tiers,
        prefilled_tokens=account.prefilled,
        context_tokens=context,
        prefix_cached_tokens=account.prefix_cached + account.system_prefix,
        system_prefix_tokens=account.system_prefix,
        kept_prefix_tokens=account.prefix_cached,
        logprobs=list(decoding.logprobs) if request.sampling.logprobs else None,
        exact_tokens=exact - healed,
        healed_tokens=healed,
        approximate_tokens=prompt.num_tokens - exact,
        reused_from=reused_from(request, origins or {}),
        answer_healed_at=request.answer_heal.healed_at_token if request.answer_heal is not None else None,
    )


def reused_from(request: Request, origins: Mapping[str, str]) -> dict[str, str]:
    """Chunk id -> where the K/V this request reused for it came from: "conversation" (a kept turn it
    continued), else the cache's origin ("corpus": ingested, "learned": this scope's learned caches,
    "caller": passed in memory)."""
    st = request.stitched_buffer()
    out = {run.chunk_id: "conversation" for run in request.continued_runs if run.chunk_id}
    for source in st.chunk_sources:
        if source is not None and source[0] and source[0] not in out:
            out[source[0]] = origins.get(source[0], "corpus")
    return out


__all__ = ["AsyncGenerationStream", "Generation", "GenerationStream", "generation_of"]
