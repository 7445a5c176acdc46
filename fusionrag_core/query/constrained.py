"""Grammar-constrained decoding: the answer is guaranteed to match a JSON schema (or a regex).

Built on llguidance (the engine behind Guidance and the structured output of llama.cpp, vLLM and
SGLang): a Rust matcher that computes each step's allowed-token mask from the grammar in tens of
microseconds with no ahead-of-time vocabulary compilation, as one small wheel with no
dependencies (xgrammar pulls triton; outlines-core compiles an index per schema up front;
lm-format-enforcer is pure Python and per-token slower). The constraint is one more logits
processor: it masks logits before sampling, so prefill, cache reuse and selective recompute are
exactly those of an unconstrained request.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase
from transformers.generation.logits_process import LogitsProcessor

from fusionrag_core.errors import InvalidRequestError

INSTALL_HINT = "pip install 'fusionrag[structured]' (llguidance)"
# NOTE: compact JSON (no free whitespace): fewer tokens, and a small model cannot wander off into
# endless blank lines inside an object.
_JSON_OPTIONS = {"whitespace_flexible": False}


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf  # NOTE: a submodule the package does not import itself
    except ImportError as exc:  # pragma: no cover - the extra is installed in the project's venv
        raise InvalidRequestError(f"constrained decoding needs llguidance: {INSTALL_HINT}") from exc
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """An immutable constraint on the generated text (an llguidance grammar), shareable by requests.

    Attributes:
        source: the llguidance grammar (JSON text).
        description: what it constrains to, for messages.
    """

    source: str
    description: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any]) -> Grammar:
        """JSON matching `schema` (a JSON Schema dict).

        Raises:
            InvalidRequestError: the schema uses something llguidance cannot compile.
        """
        llg = _llguidance()
        try:
            source = llg.LLMatcher.grammar_from_json_schema(json.dumps(dict(schema)), defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidRequestError(f"not a JSON schema: {exc}") from exc
        return cls._checked(source, f"JSON matching schema {schema.get('title', '')!s}".rstrip())

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (JSON mode)."""
        source = _llguidance().LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        return cls._checked(source, "a JSON object")

    @classmethod
    def lark(cls, source: str, description: str) -> Grammar:
        """Text matching the llguidance Lark grammar `source` (`%json {...}` embeds a JSON schema).

        Raises:
            InvalidRequestError: the grammar does not compile; the message holds llguidance's reason.
        """
        return cls._checked(source, description)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text matching the regular expression `pattern` in full."""
        return cls._checked(_llguidance().LLMatcher.grammar_from_regex(pattern), f"text matching /{pattern}/")

    @classmethod
    def _checked(cls, source: str, description: str) -> Grammar:
        error = _llguidance().LLMatcher.validate_grammar(source)
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(f"cannot constrain decoding to {description}: {error}")
        return cls(source, description)


class GrammarProcessor(LogitsProcessor):
    """Masks every token the grammar does not allow next; one per request (it holds parser state).

    `input_ids` holds the prompt and then every token picked so far: the tokens appended since
    the previous call are fed to the matcher before the next mask is computed.
    """

    def __init__(self, grammar: Grammar, tokenizer: PreTrainedTokenizerBase, eos_ids: Iterable[int],
                 prompt_tokens: int) -> None:
        llg = _llguidance()
        self.grammar = grammar
        self.matcher = llg.LLMatcher(_ll_tokenizer(tokenizer, tuple(sorted(eos_ids))), grammar.source, log_level=0)
        self._raise_on_error()
        self.consumed = prompt_tokens

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """`scores` `[1, V]` with disallowed tokens set to -inf."""
        new = [int(t) for t in input_ids[0, self.consumed:]]
        if new:
            self.matcher.consume_tokens(new)
            self.consumed += len(new)
            self._raise_on_error()
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)  # [ceil(V'/32)]
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
        allowed = torch.zeros(scores.shape[-1], dtype=torch.bool)  # NOTE: ids past the tokenizer's vocab: never
        n = min(allowed.numel(), bits.numel())
        allowed[:n] = bits.reshape(-1)[:n].bool()
        if not bool(allowed.any()):
            raise InvalidRequestError(f"the grammar ({self.grammar.description}) allows no next token")
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))  # type: ignore[return-value]

    @property
    def accepting(self) -> bool:
        """Whether the text so far is complete under the grammar."""
        return bool(self.matcher.is_accepting())

    def _raise_on_error(self) -> None:
        if self.matcher.is_error():
            raise InvalidRequestError(f"constrained decoding failed ({self.grammar.description}): "
                                      f"{self.matcher.get_error()}")


_TOKENIZERS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[tuple[int, ...], Any]] = (
    weakref.WeakKeyDictionary()
)
_TOKENIZERS_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer: PreTrainedTokenizerBase, eos_ids: tuple[int, ...]) -> Any:
    """llguidance's view of `tokenizer`, built once per tokenizer (it takes ~1 s) and then shared."""
    with _TOKENIZERS_LOCK:
        per_eos = _TOKENIZERS.setdefault(tokenizer, {})
        if eos_ids not in per_eos:
            llg = _llguidance()
            try:
                per_eos[eos_ids] = llg.hf.from_tokenizer(tokenizer, eos_token=list(eos_ids) or None)
            except ValueError as exc:
                raise InvalidRequestError(f"constrained decoding needs a fast tokenizer: {exc}") from exc
        return per_eos[eos_ids]


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that lists properties and does
    not say (OpenAI's strict mode): a small model otherwise invents keys until max_tokens."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


__all__ = ["INSTALL_HINT", "Grammar", "GrammarProcessor", "closed_objects"]
