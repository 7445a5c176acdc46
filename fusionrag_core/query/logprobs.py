"""The log-probability of each generated token, and of its most likely alternatives.

As vLLM reports them by default (`logprobs_mode="raw_logprobs"`): the log-softmax of the model's
own logits at that position, before any logits processor (repetition penalty, temperature,
top-k/top-p/min-p, a grammar's mask). So a token's logprob says how likely the model found it,
whatever the request's sampling did with that distribution; with greedy decoding and no processor
the sampled token is the top alternative.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
"""Most alternatives one token may report: OpenAI's limit on `top_logprobs` (and vLLM's default)."""


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability.

    Attributes:
        token_id: the token generated.
        logprob: its log-probability under the model's distribution at that position.
        top: the most likely tokens there, `(token_id, logprob)`, most likely first (as many as asked).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
    """`token_id`'s log-probability under `[V]` raw `logits`, with the `top` most likely tokens.

    Args:
        logits: `[V]` the model's logits at the position `token_id` was picked for (any dtype).
        token_id: the token picked.
        top: how many alternatives to report (0..`MAX_TOP_LOGPROBS`).
    """
    assert logits.dim() == 1, f"logits must be [V], got {tuple(logits.shape)}"
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [V]
    best = torch.topk(logprobs, top) if top else None
    alternatives = tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best is not None else ()
    return TokenLogprob(int(token_id), float(logprobs[token_id]), alternatives)


class TextPiece(str):
    """A piece of answer text that carries the log-probabilities of the tokens decoded since the
    previous piece (a token whose text is still held back reports with the next piece).

    A `str` in every other respect: readers that want only text never see the difference.
    """

    logprobs: tuple[TokenLogprob, ...]

    def __new__(cls, text: str, logprobs: tuple[TokenLogprob, ...]) -> TextPiece:
        piece = super().__new__(cls, text)
        piece.logprobs = logprobs
        return piece


def piece_logprobs(piece: str) -> tuple[TokenLogprob, ...]:
    """The log-probabilities a piece carries (none for plain text)."""
    return piece.logprobs if isinstance(piece, TextPiece) else ()


def with_text(piece: str, text: str) -> str:
    """`text` (e.g. `piece` cleaned) carrying `piece`'s log-probabilities, if it carried any."""
    return TextPiece(text, piece.logprobs) if isinstance(piece, TextPiece) else text


__all__ = ["MAX_TOP_LOGPROBS", "TextPiece", "TokenLogprob", "piece_logprobs", "token_logprob", "with_text"]
