"""Token sampling, stop strings and incremental detokenization for streaming."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick tokens. `temperature == 0` is greedy (the default; benchmarks rely on it)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")


class Sampler:
    """Greedy or temperature/top-p sampling with its own seeded generator."""

    def __init__(self, config: SamplingConfig) -> None:
        self.config = config
        self.generator = torch.Generator()
        if config.seed is not None:
            self.generator.manual_seed(config.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick one token from `[V]` logits."""
        if self.config.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / self.config.temperature, dim=-1)
        if self.config.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < self.config.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
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
