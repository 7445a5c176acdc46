"""Generated tokens' log-probabilities in OpenAI's shapes (the server's responses, LangChain's
`response_metadata["logprobs"]`).

    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
                  "refusal": None}
    completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}

A token's text is its own decode, and its bytes that text's UTF-8, as vLLM writes them (a token
that holds part of a character decodes to U+FFFD). A logprob of -inf (a token the model rules out)
is written as -9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from fusionrag_core.query.logprobs import TokenLogprob

LOWEST_LOGPROB = -9999.0
"""What a logprob of -inf is written as (vLLM's value)."""


def chat_logprobs(entries: Sequence[TokenLogprob], tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """A chat choice's `logprobs` object for `entries` (one per generated token)."""
    return {"content": chat_logprob_content(entries, tokenizer), "refusal": None}


def chat_logprob_content(entries: Sequence[TokenLogprob], tokenizer: PreTrainedTokenizerBase) -> list[dict[str, Any]]:
    """The `content` list of a chat choice's (or a stream delta's) `logprobs`."""
    return [{**_token(e.token_id, e.logprob, tokenizer),
             "top_logprobs": [_token(i, lp, tokenizer) for i, lp in e.top]} for e in entries]


def completion_logprobs(entries: Sequence[TokenLogprob], tokenizer: PreTrainedTokenizerBase,
                        text_offset: int = 0) -> dict[str, Any]:
    """A completion choice's `logprobs` object; `text_offset` is where the first token's text starts
    in the choice's text (a stream's later chunks start after the text already sent)."""
    tokens = [_text(e.token_id, tokenizer) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [{_text(i, tokenizer): _finite(lp) for i, lp in e.top} for e in entries],
            "text_offset": offsets}


def _token(token_id: int, logprob: float, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    text = _text(token_id, tokenizer)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _text(token_id: int, tokenizer: PreTrainedTokenizerBase) -> str:
    return str(tokenizer.decode([token_id]))


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOWEST_LOGPROB


__all__ = ["LOWEST_LOGPROB", "chat_logprob_content", "chat_logprobs", "completion_logprobs"]
