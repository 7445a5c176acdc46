"""The per-request options both integrations share: declared once, validated once per request.

A LangChain or LlamaIndex call arrives as framework options (model fields plus per-call keyword
arguments, `fields.OptionFields`); they become one `RequestOptions`, the only place a request's
values are checked, and the finished `Generation` leaves as `generation_stats`:

    model fields + call overrides -> `RequestOptions.from_values` (validated here, once)
    -> `ReuseSession.run` (session.py)  -> text pieces, then `generation_stats(generation)`

The option names, `OPTION_NAMES`, derive from the core's `SamplingConfig` fields and
`RequestOptions`' own; framework field lists, per-call keyword lists and HF-name folding derive
from them, never from a list of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from fusionrag_core.engine import AsyncGenerationStream, FusionEngine, Generation, GenerationStream
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.query.select import SelectConfig, get_selector
from fusionrag_core.query.tools import ToolRequest
from fusionrag_core.runtime.kv import VARIANTS, Variant
from fusionrag_core.scope import OPERATOR, Scope
from fusionrag_core.store import KVStore
from fusionrag_integrations.response_format import response_grammar

RESPONSE_FORMAT = "response_format"
"""Per-call only: an OpenAI-shaped `response_format` that becomes the sampling grammar."""
TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls")
"""Per-call only: OpenAI-shaped tools, tool choice and parallel calls (`query.tools.tool_request`)."""


@dataclass(frozen=True)
class RequestOptions:
    """Everything one request passes to the engine besides its prompt.

    Constructing one validates it (`__post_init__`; `SamplingConfig` checks its own fields), with
    the core's own messages; a framework model builds exactly one per request.

    Attributes:
        sampling: max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty, seed,
            stop strings, grammar (`fusionrag_core.query.sampling.SamplingConfig`).
        selector: which chunk tokens to recompute, a name in
            `fusionrag_core.query.select.SELECTORS`; None: the engine's configured default.
        ratio: fraction of reused chunk tokens to recompute, in [0, 1]; None: the engine's default.
        variant: stored cache variant to prefer (`fusionrag_core.runtime.kv.VARIANTS`); None: the
            engine's default.
        full_attention: answer with a plain prefill of the whole prompt, reusing no cache (the
            baseline to compare with).
        tools: the tools the request binds, and its tool choice (`fusionrag_core.query.tools`):
            shown with the prompt, and the answer decodes under their grammar.

    Raises:
        InvalidRequestError: a value the engine would refuse.
    """

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    selector: str | None = None
    ratio: float | None = None
    variant: Variant | None = None
    full_attention: bool = False
    tools: ToolRequest | None = None

    def __post_init__(self) -> None:
        if self.tools is not None and self.sampling.grammar is not None:
            raise InvalidRequestError(
                "a request binds either tools or a response_format, not both: drop one (structured output "
                "needs no tool: with_structured_output decodes the schema's JSON directly)")
        if self.selector is not None:
            get_selector(self.selector)  # NOTE: the core's check against SELECTORS, and its message
        if self.ratio is not None:
            SelectConfig(ratio=self.ratio)  # NOTE: the core's range check, and its message
        if self.variant is not None and self.variant not in VARIANTS:
            raise InvalidRequestError(f"unknown cache variant {self.variant!r}; use one of {list(VARIANTS)}")

    @classmethod
    def from_values(cls, values: Mapping[str, Any], *, response_format: Any = None,
                    tools: ToolRequest | None = None) -> RequestOptions:
        """Options from flat `values` keyed by `OPTION_NAMES` (absent ones take their defaults).

        Args:
            values: option name -> value; `stop` may be any sequence of strings, or None.
            response_format: None, or an OpenAI-shaped value constraining the answer
                (`response_format.response_grammar`).
            tools: None, or the tools the request binds.

        Raises:
            InvalidRequestError: a key that is no option, or a value the engine would refuse.
        """
        unknown = set(values) - set(OPTION_NAMES)
        if unknown:
            raise InvalidRequestError(f"unknown request option(s) {sorted(unknown)}; options are {list(OPTION_NAMES)}")
        sampling = {k: v for k, v in values.items() if k in SAMPLING_OPTIONS}
        sampling["stop"] = tuple(sampling.get("stop") or ())
        if response_format is not None:
            sampling["grammar"] = response_grammar(response_format)
        selection = {k: v for k, v in values.items() if k in SELECTION_OPTIONS}
        return cls(SamplingConfig(**sampling), **selection, tools=tools)

    def stream(self, engine: FusionEngine, prompt: FusionPrompt, *, store: KVStore | None,
               scope: Scope = OPERATOR) -> GenerationStream:
        """Start generating `prompt` on `engine` for a request of `scope`, reading caches from
        `store` (full attention reads none).

        With tools, the answer decodes under the grammar of the engine's tool-call format."""
        sampling = self._sampling(engine)
        if self.full_attention:
            return engine.full_attention(prompt, sampling=sampling, scope=scope)
        return engine.stream(prompt, sampling=sampling, selector=self.selector, ratio=self.ratio,
                             variant=self.variant, store=store, scope=scope)

    def astream(self, engine: FusionEngine, prompt: FusionPrompt, *, store: KVStore | None,
                scope: Scope = OPERATOR) -> AsyncGenerationStream:
        """`stream` for an asyncio consumer (`FusionEngine.astream`)."""
        sampling = self._sampling(engine)
        if self.full_attention:
            return engine.afull_attention(prompt, sampling=sampling, scope=scope)
        return engine.astream(prompt, sampling=sampling, selector=self.selector, ratio=self.ratio,
                              variant=self.variant, store=store, scope=scope)

    def astream_choices(self, engine: FusionEngine, prompt: FusionPrompt, n: int, *, store: KVStore | None,
                        scope: Scope = OPERATOR) -> list[AsyncGenerationStream]:
        """`n` choices of `prompt` for a request of `scope`, prepared once (`FusionEngine.astream_choices`);
        on the event loop that reads them."""
        return engine.astream_choices(prompt, n, sampling=self._sampling(engine), selector=self.selector,
                                      ratio=self.ratio, variant=self.variant, store=store,
                                      full_attention=self.full_attention, scope=scope)

    def _sampling(self, engine: FusionEngine) -> SamplingConfig:
        if self.tools is None:
            return self.sampling
        grammar = engine.tool_format.grammar(self.tools, max_string_chars=engine.config.tool_string_chars)
        return replace(self.sampling, grammar=grammar)


SAMPLING_OPTIONS: tuple[str, ...] = tuple(f.name for f in fields(SamplingConfig) if f.name != "grammar")
"""Options that become the `SamplingConfig` (its grammar comes from `response_format` instead)."""
SELECTION_OPTIONS: tuple[str, ...] = tuple(
    f.name for f in fields(RequestOptions) if f.name not in ("sampling", "tools"))
"""Options that choose what is reused and recomputed: selector, ratio, variant, full_attention."""
OPTION_NAMES: tuple[str, ...] = SAMPLING_OPTIONS + SELECTION_OPTIONS
"""Every per-request option by name: the fields and per-call keyword arguments of both integrations."""


def generation_stats(generation: Generation) -> dict[str, Any]:
    """What responses report about a generation: `Generation.stats()` plus `cache_miss_reasons`
    (chunk id -> why it was prefilled), `chunk_found_by` (chunk id -> how the prompt named it:
    "mark", "content", "document", "mark_then_content", ...) and `chunk_reused_from` (chunk id ->
    "corpus", "learned", "conversation" or "caller": `Generation.reused_from`).

    NOTE: JSON-friendly values only (no tensors): this travels in framework metadata.
    """
    return {**generation.stats(), "cache_miss_reasons": dict(generation.cache_misses),
            "chunk_found_by": dict(generation.found_by), "chunk_reused_from": dict(generation.reused_from)}


__all__ = [
    "OPTION_NAMES",
    "RESPONSE_FORMAT",
    "SAMPLING_OPTIONS",
    "SELECTION_OPTIONS",
    "TOOL_OPTIONS",
    "RequestOptions",
    "generation_stats",
]
