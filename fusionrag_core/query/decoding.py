"""One request's decoding as a step machine: pick a token from each step's logits, stream its text,
decide when the answer ends.

The engine drives it one step at a time for a request served alone, and the scheduler drives many
of them with one batched model step (`fusionrag_core.batching.scheduler`): the same object decides
tokens, text and the end in both, so the two only differ in how the logits are computed.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Literal

import torch

from fusionrag_core.query.logprobs import TextPiece, TokenLogprob, token_logprob
from fusionrag_core.query.sampling import Sampler, TextAssembler
from fusionrag_core.runtime.kv import KVBuffer


class Decoding:
    """The answer of one request, from its first logits to its end.

    Use: `start(first_logits)`, then while not `finished`: `next_input()` -> run the model on that
    token at that slot -> `advance(logits)`; each returns the text it adds (possibly ""). `flush()`
    gives the text held back at the end.

    Attributes:
        buf: the request's KV buffer (generated tokens take its next slots).
        ids: the generated token ids (eos excluded).
        logprobs: each generated token's log-probability, when its sampling asks for them (else empty).
        finish_reason: "stop" (eos or a stop string), "length" (max_new_tokens), None while running.
        first_token_at: `time.perf_counter()` when the first token was picked.
    """

    def __init__(self, buf: KVBuffer, position: int, sampler: Sampler, assembler: TextAssembler,
                 max_new_tokens: int, eos_ids: Collection[int]) -> None:
        """Args:
            buf: the buffer the prompt was computed into.
            position: the position of the first generated token (the prompt's length).
            sampler, assembler: this request's own (sampling state, stop strings, detokenization).
            max_new_tokens: the most tokens to generate.
            eos_ids: tokens that end the answer.
        """
        self.buf = buf
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: Literal["stop", "length"] | None = None
        self.first_token_at: float | None = None
        self._position = position
        self._sampler = sampler
        self._assembler = assembler
        self._max_new_tokens = max_new_tokens
        self._eos_ids = eos_ids
        self._last = -1  # the last token picked: the next step's input
        self._unsent = 0  # NOTE: logprobs of tokens whose text is still held back go with the next piece

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._assembler.text

    def start(self, first_logits: torch.Tensor) -> str:
        """Pick the first token from the prompt's last logits `[V]`; returns its text."""
        piece = self._take(self._sampler(first_logits), first_logits)
        self.first_token_at = time.perf_counter()
        return piece

    def next_input(self) -> tuple[int, torch.Tensor]:
        """The token to feed next and the slot `[1]` it takes (claimed in the buffer now)."""
        if self.finished:
            raise RuntimeError("next_input() after the answer finished")
        slot = self.buf.reserve(torch.tensor([self._position], device=self.buf.keys.device), valid=True)
        self._position += 1
        return self._last, slot

    def advance(self, logits: torch.Tensor) -> str:
        """Pick the next token from the `[V]` logits of the last input; returns its text."""
        return self._take(self._sampler(logits), logits)

    def flush(self) -> str:
        """The text held back (a possible stop-string prefix, an incomplete character) once finished."""
        return self._carrying(self._assembler.flush())

    def _take(self, token: int, logits: torch.Tensor) -> str:
        if token in self._eos_ids:
            self.finish_reason = "stop"
            return ""
        self.ids.append(token)
        self._last = token
        config = self._sampler.config
        if config.logprobs:
            self.logprobs.append(token_logprob(logits, token, config.top_logprobs))
        piece = self._assembler.add(token)
        if self._assembler.stopped:
            self.finish_reason = "stop"
        elif len(self.ids) >= self._max_new_tokens:
            self.finish_reason = "length"
        return self._carrying(piece)

    def _carrying(self, piece: str) -> str:
        """`piece` with the logprobs not yet sent, when logprobs are recorded and it holds text."""
        if not piece or self._unsent == len(self.logprobs):
            return piece
        carried = tuple(self.logprobs[self._unsent:])
        self._unsent = len(self.logprobs)
        return TextPiece(piece, carried)


__all__ = ["Decoding"]
