"""The request layer both integrations share: call options -> one engine request -> text pieces.

A LangChain or LlamaIndex call arrives as framework options (each framework names them its own
way) and a prompt; it leaves as text pieces and JSON-friendly statistics. What is the same for
both lives here, once:

    options (SamplingConfig fields + selector / ratio / variant)  -> `request_options` (validated)
    -> `RequestOptions.stream(engine, prompt, store=...)`        (the store travels with the request)
    -> `text_pieces(stream)`: cleaned text pieces, then the finished Generation
    -> `generation_stats(generation)`: what responses report.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from fusionrag_core.engine import FusionEngine, Generation, GenerationStream, LearnFn
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.query.select import SelectConfig, get_selector
from fusionrag_core.recognise.marks import clean_output
from fusionrag_core.runtime.kv import Variant
from fusionrag_core.store import KVStore

SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingConfig))
"""Request values that become the `SamplingConfig` (max_new_tokens, temperature, stop, ...)."""
SELECTION_FIELDS = frozenset({"selector", "ratio", "variant"})
"""Request values that choose what is reused and recomputed (None: the engine's default)."""


@dataclass(frozen=True)
class RequestOptions:
    """Everything one request passes to the engine besides its prompt.

    Attributes:
        sampling: max_new_tokens, temperature, top_p, seed, stop strings, ...
        selector: which chunk tokens to recompute; None means the engine's configured default.
        ratio: recompute ratio; None means the engine's configured default.
        variant: preferred stored cache variant; None means the engine's configured default.
        full_attention: run the plain-prefill baseline instead (no cache is reused).
    """

    sampling: SamplingConfig
    selector: str | None = None
    ratio: float | None = None
    variant: Variant | None = None
    full_attention: bool = False

    def stream(self, engine: FusionEngine, prompt: FusionPrompt, *, store: KVStore | None = None,
               learn: LearnFn | None = None) -> GenerationStream:
        """Start generating `prompt` on `engine` with these options, reading caches from `store`."""
        if self.full_attention:
            return engine.full_attention(prompt, sampling=self.sampling)
        return engine.stream(prompt, sampling=self.sampling, selector=self.selector, ratio=self.ratio,
                             variant=self.variant, store=store, learn=learn)


def request_options(values: Mapping[str, Any], *, full_attention: bool = False) -> RequestOptions:
    """Validated options from `values`: `SamplingConfig` field names plus selector, ratio, variant.

    Raises:
        InvalidRequestError: a key of neither kind, or a value the engine would refuse (with the
            core's own message).
    """
    unknown = set(values) - SAMPLING_FIELDS - SELECTION_FIELDS
    if unknown:
        raise InvalidRequestError(f"unknown request option(s) {sorted(unknown)}")
    sampling = {k: v for k, v in values.items() if k in SAMPLING_FIELDS}
    if sampling.get("stop") is not None:
        sampling["stop"] = tuple(sampling["stop"])
    selector, ratio, variant = (values.get(k) for k in ("selector", "ratio", "variant"))
    if selector is not None:
        get_selector(selector)
    if ratio is not None:
        SelectConfig(ratio=ratio)
    if variant not in (None, "fused", "independent"):
        raise InvalidRequestError(f"unknown cache variant {variant!r}; use 'fused' or 'independent'")
    return RequestOptions(SamplingConfig(**sampling), selector, ratio, variant, full_attention)


def check_call_options(overrides: Mapping[str, Any], accepted: frozenset[str], *, owner: str, hint: str = "") -> None:
    """Refuse per-call keyword arguments a model does not take, naming the ones it does.

    Raises:
        InvalidRequestError: an unknown keyword.
    """
    unknown = sorted(set(overrides) - accepted)
    if unknown:
        raise InvalidRequestError(
            f"{owner} does not accept {', '.join(unknown)}; per-call options are {sorted(accepted)}{hint}"
        )


def text_pieces(stream: GenerationStream) -> Iterator[str | Generation]:
    """Non-empty text pieces (mark characters removed) as generated, then the finished Generation."""
    for piece in stream:
        text = clean_output(piece)
        if text:
            yield text
    assert stream.result is not None  # NOTE: set by GenerationStream once exhausted.
    yield stream.result


def generation_stats(generation: Generation) -> dict[str, Any]:
    """What responses report about a generation: `Generation.stats()` plus `cache_miss_reasons`
    (chunk id -> why it was prefilled) and `chunk_found_by` (chunk id -> how the prompt named it:
    "mark", "content", "document", "mark_then_content", ...).

    NOTE: JSON-friendly values only (no tensors): this travels in framework metadata.
    """
    return {**generation.stats(), "cache_miss_reasons": dict(generation.cache_misses),
            "chunk_found_by": dict(generation.found_by)}


__all__ = [
    "SAMPLING_FIELDS",
    "SELECTION_FIELDS",
    "RequestOptions",
    "check_call_options",
    "generation_stats",
    "request_options",
    "text_pieces",
]
