"""Token sampling (transformers' logits processors), stop strings and incremental detokenization."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.constrained import Grammar, GrammarProcessor


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick tokens, with transformers' `generate` meanings. `temperature == 0` is greedy.

    Greedy is the default (benchmarks rely on it); it takes the argmax after the logits
    processors (only `repetition_penalty` is one), as transformers' greedy search does.

    Attributes:
        max_new_tokens: most tokens to generate.
        temperature: 0 for greedy; otherwise the logits are divided by it before sampling.
        top_p: nucleus mass (1.0: off).
        top_k: keep the k most likely tokens (None or 0: off; NOTE: transformers' own default is 50).
        min_p: drop tokens below `min_p` x the top token's probability (None: off).
        repetition_penalty: CTRL's penalty on tokens already in the prompt or the answer (1.0: off).
        seed: sampler seed (only matters when temperature > 0); None draws a fresh one.
        stop: stop strings; the text ends before the first one.
        grammar: constrain the text to a grammar (`constrained.Grammar`, e.g. a JSON schema).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        _check_finite(self)
        _check_seed(self.seed)
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 or None: off), got {self.top_k}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0 (1.0: off), got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def logits_processors(self) -> LogitsProcessorList:
        """transformers' processors and warpers for this config, in the order `generate` applies them."""
        processors = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.greedy:
            return processors  # NOTE: warpers only reshape the distribution: argmax ignores them.
        if self.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            processors.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            processors.append(TopPLogitsWarper(self.top_p))
        if self.min_p is not None:
            processors.append(MinPLogitsWarper(self.min_p))
        return processors


SEED_RANGE = (-(2**63), 2**64 - 1)
"""The seeds torch's generator takes (`manual_seed`: a signed or an unsigned 64-bit integer; a
negative seed is its unsigned twin). OpenAI's `seed` is a signed 64-bit integer: inside it."""


def _check_finite(config: SamplingConfig) -> None:
    """Refuse an infinite or NaN knob: NaN passes every range check below (each comparison is
    False), and an infinite temperature samples noise."""
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        value = getattr(config, name)
        if value is not None and not math.isfinite(value):
            raise InvalidRequestError(f"{name} must be a finite number, got {value}")


def _check_seed(seed: int | None) -> None:
    low, high = SEED_RANGE
    if seed is not None and not low <= seed <= high:
        raise InvalidRequestError(f"seed must be an integer from {low} to {high} (a 64-bit seed), got {seed}")


class Sampler:
    """Picks each next token through transformers' logits processors, with its own seeded generator.

    It keeps the ids seen so far (prompt, then every token it picked): the repetition penalty and
    any extra processor (e.g. a grammar constraint) read them, as in `generate`.
    """

    def __init__(
        self,
        config: SamplingConfig,
        prompt_ids: torch.Tensor | None = None,
        extra: Sequence[LogitsProcessor] = (),
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        eos_ids: Iterable[int] = (),
    ) -> None:
        """Args:
            config: sampling knobs.
            prompt_ids: `[T]` ids of the prompt (what the repetition penalty counts besides the answer).
            extra: processors applied before the config's (a constraint must mask before sampling).
            tokenizer, eos_ids: the model's, needed by a `config.grammar`.

        Raises:
            InvalidRequestError: a grammar without a tokenizer to match it with.
        """
        self.config = config
        ids = prompt_ids if prompt_ids is not None else torch.zeros(0, dtype=torch.long)
        constraint: list[LogitsProcessor] = []
        if config.grammar is not None:
            if tokenizer is None:
                raise InvalidRequestError("a grammar-constrained Sampler needs the model's tokenizer")
            constraint.append(GrammarProcessor(config.grammar, tokenizer, eos_ids, prompt_tokens=ids.numel()))
        # NOTE: the constraint masks first, so penalties and warpers only ever see allowed tokens.
        self.processors = LogitsProcessorList([*constraint, *extra, *config.logits_processors()])
        self.ids = ids.reshape(1, -1).long().cpu()  # [1, T]
        self.generator = torch.Generator()
        if config.seed is not None:
            self.generator.manual_seed(config.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick one token from `[V]` logits."""
        token = self._pick(logits)
        self.ids = torch.cat([self.ids, torch.tensor([[token]])], dim=1)
        return token

    def _pick(self, logits: torch.Tensor) -> int:
        if not self.processors:
            if self.config.greedy:
                return int(torch.argmax(logits))  # NOTE: the unprocessed path: bit-identical to plain argmax
            scores = logits.float().cpu()[None]
        else:
            scores = self.processors(self.ids, logits.float().cpu()[None])  # type: ignore[arg-type]  # [1, V]
        if self.config.greedy:
            return int(torch.argmax(scores[0]))
        probs = torch.softmax(scores[0], dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class TextAssembler:
    """Turns generated token ids into text pieces, holding back what might still become a stop string.

    Decoding the whole generation each step (instead of token by token) keeps multi-byte
    characters and tokenizer-specific spacing right; a trailing U+FFFD means a character is not
    complete yet, so it is held back.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already streamed
        self.text = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Add a token; returns the new text that is safe to stream (may be empty)."""
        self.ids.append(token_id)
        text = str(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        if text.endswith("\ufffd"):
            return ""
        self.text = text
        for s in self.stop:
            at = text.find(s, max(0, self.emitted - len(s)))
            if at != -1:
                self.text = text[:at]
                self.stopped = True
                return self._emit(len(self.text))
        # hold back a tail that is a prefix of some stop string
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._emit(len(text) - hold)

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        piece = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return piece
