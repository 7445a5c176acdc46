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
from fusionrag_core.query.logprobs import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 4
"""Most stop strings one request may pass: OpenAI's own limit."""
MAX_STOP_CHARS = 1024
"""Most characters one request's stop strings may hold in all. Stop strings are delimiters (tens of
characters); each decode step searches the new text for every stop, and re-reads a stop's length of text when
the decode changed text already read (`TextAssembler`), inside the scheduler's shared round: their
length is what one request adds to every running request's step."""


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
        stop: stop strings; the text ends before the earliest one in it (at most `MAX_STOP_STRINGS`,
            `MAX_STOP_CHARS` characters in all).
        grammar: constrain the text to a grammar (`constrained.Grammar`, e.g. a JSON schema).
        logprobs: record each generated token's log-probability (`query.logprobs`: the model's raw
            distribution, as vLLM reports it), in `Generation.logprobs` and on each streamed piece.
        top_logprobs: with `logprobs`, also the most likely tokens at each position (0 to
            `MAX_TOP_LOGPROBS`).
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
    logprobs: bool = False
    top_logprobs: int = 0

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
        _check_stop(self.stop)
        _check_logprobs(self.logprobs, self.top_logprobs)

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


def _check_logprobs(logprobs: bool, top_logprobs: int) -> None:
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top_logprobs}")
    if top_logprobs and not logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs=True: set logprobs too, or drop top_logprobs")


def _check_stop(stop: Sequence[str]) -> None:
    """Raises InvalidRequestError: a stop that is no string, or stops over the limits."""
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise InvalidRequestError(f"stop[{i}] must be a string, got {type(s).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} stop strings are "
                                  "allowed: keep the ones the answer must end at")
    chars = sum(len(s) for s in stop)
    if chars > MAX_STOP_CHARS:
        raise InvalidRequestError(f"stop strings hold {chars} characters; at most {MAX_STOP_CHARS} characters in all "
                                  "are allowed: a stop string is a delimiter, such as '\\n\\n' or '</answer>'")


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
    complete yet, so it is held back. The text ends before the earliest stop string in it; what is
    held back is the longest end of the text that is a proper prefix of a stop string, and finding
    it costs the new characters' worth of work, whatever the stops' lengths (`_StopOverlap`).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already streamed
        self.text = ""
        self.stopped = False
        # NOTE: a one-character stop is never partly there: only longer ones can hold text back
        self._overlaps = [_StopOverlap(s) for s in self.stop if len(s) > 1]
        self._window = max((len(s) - 1 for s in self.stop), default=0)  # the most a stop prefix can span
        self._scanned = ""  # the text the overlaps have read

    def add(self, token_id: int) -> str:
        """Add a token; returns the new text that is safe to stream (may be empty)."""
        self.ids.append(token_id)
        text = str(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        if text.endswith("\ufffd"):
            return ""
        self.text = text
        at = self._first_stop(text)
        if at is not None:
            self.text = text[:at]
            self.stopped = True
            return self._emit(at)
        return self._emit(len(text) - self._hold(text))

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _first_stop(self, text: str) -> int | None:
        """Where the earliest stop string in `text` starts (None: none is there).

        Only a stop ending in text not yet streamed is new: the search starts a stop's length
        before it."""
        found = [at for s in self.stop if (at := text.find(s, max(0, self.emitted - len(s)))) != -1]
        return min(found, default=None)

    def _hold(self, text: str) -> int:
        """How many of `text`'s last characters may still become a stop string (held back)."""
        if not self._overlaps:
            return 0
        scanned, self._scanned = self._scanned, text
        kept = min(len(scanned), self._window)  # NOTE: the overlaps depend on the last `window` characters read
        grew = len(scanned) <= len(text) <= len(scanned) + self._window
        if grew and text.startswith(scanned[len(scanned) - kept:], len(scanned) - kept):
            new = text[len(scanned):]
            return max(overlap.feed(new) for overlap in self._overlaps)
        # NOTE: the decode changed text already read (spacing, a completed character), or leapt ahead
        return max(overlap.reread(text) for overlap in self._overlaps)

    def _emit(self, upto: int) -> str:
        piece = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return piece


class _StopOverlap:
    """The longest end of a growing text that is a proper prefix of one stop string (Knuth-Morris-Pratt):
    each character read costs amortised O(1) whatever the stop's length.

    Attributes:
        length: that end's length, for the text read so far.
    """

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.length = 0
        # border[k]: the longest proper prefix of stop[:k + 1] that is also its suffix
        self.border = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.border[k - 1]
            k += stop[i] == stop[k]
            self.border[i] = k

    def reread(self, text: str) -> int:
        """Start over on `text` (only its last `len(stop) - 1` characters matter); returns the new `length`."""
        self.length = 0
        return self.feed(text[max(0, len(text) - len(self.stop) + 1):])

    def feed(self, chars: str) -> int:
        """Read `chars`; returns the new `length`."""
        stop, border, k = self.stop, self.border, self.length
        for c in chars:
            while k and stop[k] != c:
                k = border[k - 1]
            k += stop[k] == c
            if k == len(stop):  # NOTE: a whole stop (the caller cuts the text there): keep its longest border
                k = border[k - 1]
        self.length = k
        return k
