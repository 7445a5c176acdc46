"""The model fields every FusionRAG model takes, in LangChain and in LlamaIndex alike.

`OptionFields` holds the per-request options (`request.OPTION_NAMES`) as model fields: each is the
default of every call, and a call's keyword arguments override them. Each framework's model adds
the one option its ecosystem names its own way, the generation budget (LangChain's `max_tokens`,
LlamaIndex's `max_new_tokens`), and names it in `FIELD_NAMES`. `ReuseFields` holds whether and
where the model learns caches (`session.ReuseConfig`).

Values are checked by `RequestOptions` and `ReuseConfig`, not here: one validation of each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.paths import DEFAULT_DATA_DIR
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.query.select import SELECTORS
from fusionrag_core.query.tools import ToolRequest, tool_request
from fusionrag_core.reuse.learned import DEFAULT_MAX_BYTES
from fusionrag_core.runtime.kv import VARIANTS, Variant
from fusionrag_core.scope import OPERATOR, Scope
from fusionrag_integrations.arguments import closest
from fusionrag_integrations.request import OPTION_NAMES, RESPONSE_FORMAT, TOOL_OPTIONS, RequestOptions
from fusionrag_integrations.session import ReuseConfig

_SAMPLING = SamplingConfig()  # NOTE: the core's defaults are the fields' defaults


class OptionFields(BaseModel):
    """Per-request options as model fields; a call's keyword arguments override them.

    A subclass declares the generation budget field and maps it in `FIELD_NAMES`.
    """

    # NOTE: attribute docstrings become the fields' descriptions (LangChain and LlamaIndex show those).
    model_config = ConfigDict(use_attribute_docstrings=True)
    FIELD_NAMES: ClassVar[Mapping[str, str]] = {}
    """Option name -> this model's field name, where the framework names it otherwise."""

    temperature: float = _SAMPLING.temperature
    """Sampling temperature; 0 is greedy (reproducible)."""
    top_p: float = _SAMPLING.top_p
    """Nucleus sampling mass (1.0: off)."""
    top_k: int | None = _SAMPLING.top_k
    """Sample among the k most likely tokens (None/0: off; NOTE: transformers' generate defaults to 50)."""
    min_p: float | None = _SAMPLING.min_p
    """Drop tokens below min_p x the top token's probability (None: off)."""
    repetition_penalty: float = _SAMPLING.repetition_penalty
    """CTRL repetition penalty over prompt and answer tokens, also when greedy (1.0: off)."""
    seed: int | None = _SAMPLING.seed
    """Seed of the sampler (only matters when temperature > 0)."""
    stop: list[str] | None = None
    """Stop strings (excluded from the text); a per-call `stop` replaces them."""
    logprobs: bool = _SAMPLING.logprobs
    """Record each generated token's log-probability (the model's raw distribution, as vLLM and OpenAI report it)."""
    top_logprobs: int = _SAMPLING.top_logprobs
    """With `logprobs`, also the most likely tokens at each position (0 to 20)."""
    selector: str | None = Field(
        default=None,
        description=f"Which chunk tokens to recompute: {', '.join(SELECTORS)} (`fusionrag_core.query.select."
                    "SELECTORS`; each one's docstring says what it picks); None: the engine's configured default.")
    ratio: float | None = None
    """Fraction of reused chunk tokens to recompute, in [0, 1] (None: the engine's configured default)."""
    variant: Variant | None = Field(
        default=None,
        description=f"Stored cache variant to prefer: {' or '.join(VARIANTS)} (None: the engine's configured default).")
    full_attention: bool = False
    """Answer with a plain prefill of the whole prompt, reusing no cache (the baseline to compare with)."""

    @classmethod
    def option_fields(cls) -> dict[str, str]:
        """This model's field name -> option name, for every per-request option."""
        return {cls.FIELD_NAMES.get(name, name): name for name in OPTION_NAMES}

    @classmethod
    def call_options(cls) -> frozenset[str]:
        """Keyword arguments one call accepts: the option fields, the options' own names, `response_format`
        and the tool options (`tools`, `tool_choice`, `parallel_tool_calls`)."""
        return frozenset({*cls.option_fields(), *OPTION_NAMES, RESPONSE_FORMAT, *TOOL_OPTIONS})

    def request_options(self, overrides: Mapping[str, Any], *, stop: Sequence[str] | None = None) -> RequestOptions:
        """This model's options with one call's keyword `overrides` (and LangChain's `stop`) applied.

        Raises:
            InvalidRequestError: an unknown keyword, one option given twice, or a value the engine
                would refuse.
        """
        given = dict(overrides)
        response_format = given.pop(RESPONSE_FORMAT, None)
        tools = bound_tools(given)
        refuse_call_options(given, self.call_options(), type(self).__name__)
        fields = self.option_fields()
        values = {option: getattr(self, field) for field, option in fields.items()}
        named: dict[str, str] = {}
        for key, value in given.items():
            option = fields.get(key, key)
            if option in named:
                raise InvalidRequestError(f"got {named[option]}= and {key}=: they set the same option; pass one")
            named[option] = key
            values[option] = value
        if stop is not None:
            values["stop"] = stop
        return RequestOptions.from_values(values, response_format=response_format, tools=tools)


class ReuseFields(BaseModel):
    """Whether and where a model learns caches from its requests (`session.ReuseConfig`)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    learn: bool = True
    """Keep the K/V of retrieved documents found in a prompt without a cache as their caches, reused from
    the next prompt that holds them (no ingest needed)."""
    data_dir: str | Path = DEFAULT_DATA_DIR
    """Data directory (`FusionIndex.open`'s); learned caches live in its `learned/<model fingerprint>`.
    Unset on a model bound to an index: the index's own data directory."""
    learned_dir: str | Path | None = None
    """Directory of learned caches instead (None: `<data_dir>/learned/<model fingerprint>`)."""
    learned_max_bytes: int = DEFAULT_MAX_BYTES
    """Bound of the learned caches in bytes; the least recently used go first."""
    scope: Scope = OPERATOR
    """Whose requests these are (`fusionrag_core.scope.Scope`: tenant, cache salt): they reuse only the
    learned caches and conversations that requests of the same scope left. A call's `scope=` keyword
    overrides it (one model serving many users)."""

    def call_scope(self, call_options: dict[str, Any]) -> Scope:
        """The scope of one call: its `scope=` keyword (popped from `call_options`), else the model's.

        Raises:
            InvalidRequestError: `scope=` is not a `Scope`.
        """
        scope = call_options.pop("scope", None)
        if scope is None:
            return self.scope
        if not isinstance(scope, Scope):
            raise InvalidRequestError(f"scope= takes a fusionrag_core.scope.Scope(tenant, cache_salt), got "
                                      f"{type(scope).__name__}")
        return scope

    def reuse_config(self, index_data_dir: Path | None = None) -> ReuseConfig:
        """These fields as the session's configuration.

        Args:
            index_data_dir: the data directory of the `FusionIndex` the model is bound to; learned
                caches go under it unless `data_dir` or `learned_dir` was given explicitly.

        Raises:
            InvalidRequestError: `learned_max_bytes` below 1.
        """
        data_dir = self.data_dir
        if index_data_dir is not None and "data_dir" not in self.model_fields_set:
            data_dir = index_data_dir
        return ReuseConfig(learn=self.learn, data_dir=data_dir, learned_dir=self.learned_dir,
                           max_bytes=self.learned_max_bytes)


def bound_tools(options: dict[str, Any]) -> ToolRequest | None:
    """The tool options popped from one call's `options` as a ToolRequest (None: no tools bound).

    Raises:
        InvalidRequestError: a tool choice or parallel setting without tools, or a malformed tool.
    """
    tools, choice, parallel = (options.pop(name, None) for name in TOOL_OPTIONS)
    if not tools:
        if choice not in (None, False, "auto", "none") or parallel is not None:
            raise InvalidRequestError("tool_choice / parallel_tool_calls were given without tools: bind tools first")
        return None
    return tool_request(tools, choice, parallel)


def refuse_call_options(overrides: Mapping[str, Any], accepted: frozenset[str], owner: str) -> None:
    """Refuse per-call keyword arguments a model does not take, naming the ones it does.

    Raises:
        InvalidRequestError: an unknown keyword.
    """
    unknown = sorted(set(overrides) - accepted)
    if unknown:
        named = ", ".join(f"{name!r}{closest(name, accepted)}" for name in unknown)
        raise InvalidRequestError(
            f"{owner} does not accept the unsupported call option(s) {named}; per-call options are {sorted(accepted)} "
            "(chunk caches are found in the prompt, by chunk text or format_docs / FusionChunkMarker marks)"
        )


__all__ = ["OptionFields", "ReuseFields", "bound_tools", "refuse_call_options"]
