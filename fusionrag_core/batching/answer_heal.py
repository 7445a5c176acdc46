"""Answer healing: a decoding request's own inexact K/V made exact between its decode steps.

A request that reused chunk caches decodes over approximate K/V, and so does every answer token
fed back after them. With answer healing (`HealConfig.answers`, or a request's `heal_answer`), the
scheduler plans one piece of its buffer's healing into a decode step whenever no request waits to
be admitted: the next `HealConfig.piece_tokens` slots after its exact head are computed again,
causal by position (as `heal.heal_piece` heals a kept entry), the prompt first and then the
answer tokens already fed back. Once the exact head reaches the buffer's end, every later decode
step reads exact K/V: from that token on, the answer is full attention's continuation of the
tokens generated so far. The first token and the tokens decoded before the heal catches up stay
as they were streamed.

A piece rewrites slots of the request's own buffer, on the leading thread, between decode steps:
nothing else reads or writes that buffer meanwhile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fusionrag_core.query.stitch import Stitched
from fusionrag_core.runtime.decoder import Decoder

log = logging.getLogger(__name__)


@dataclass
class AnswerHeal:
    """One request's answer healing (its own: nothing here is shared).

    Attributes:
        start: leading slots of its buffer that were exact when it began decoding.
        exact: leading slots exact when the last piece ran (`start` grown by the pieces); once it
            has caught up, the decode steps after it are exact too.
        piece_tokens: slots computed per piece.
        healed_at_token: how many answer tokens had been picked when the heal caught up (the
            tokens from this index on decoded over exact K/V); None while it has not.
        failed: a piece failed: it heals no further (its exact head stands).
    """

    start: int
    exact: int
    piece_tokens: int
    healed_at_token: int | None = None
    failed: bool = False

    def pending(self, st: Stitched) -> bool:
        """Whether slots of the buffer in use are past the exact head, healing has not caught up (every
        decode step after it extends the exact head by its own slot) and has not failed."""
        return not self.failed and self.healed_at_token is None and self.exact < st.buf.length

    def healed_slots(self, length: int, head: torch.Tensor | None) -> torch.Tensor | None:
        """`[length]` bool: which of the first `length` slots healing made exact: a piece of this
        request's, or `head` `[n]` (the kept head it continued, healed before it came); None: none."""
        if self.exact <= self.start:
            return head
        healed = torch.zeros(length, dtype=torch.bool)
        if head is not None:
            healed[:head.shape[0]] = head
        healed[self.start:min(self.exact, length)] = True
        return healed


def heal_answer_piece(decoder: Decoder, st: Stitched, answer_ids: list[int], heal: AnswerHeal) -> int:
    """Compute the next piece of `st`'s buffer after `heal`'s exact head again, in place; returns the
    slots it made exact.

    Args:
        decoder: the model passes.
        st: the request's buffer (slot == position for every slot in use).
        answer_ids: the answer tokens picked so far (those fed back hold the slots after the prompt).
        heal: its state; `exact` grows by the piece.
    """
    T, P = st.buf.length, int(st.slot_tokens.shape[0])
    fed = T - P
    assert 0 <= fed <= len(answer_ids), f"{fed} slots after the prompt, {len(answer_ids)} answer tokens"
    E, end = heal.exact, min(T, heal.exact + heal.piece_tokens)
    assert end > E, "heal_answer_piece of a buffer that is exact already"
    device = st.buf.keys.device
    tokens = torch.cat([st.slot_tokens.cpu(), torch.tensor(answer_ids[:fed], dtype=torch.int64)])  # [T]
    # NOTE: the piece's queries see the exact head before them and, masked by position, nothing of
    # the stale K/V after them: the head stays exact after every piece
    decoder.fill(st.buf, tokens[E:end].to(device), torch.arange(E, end, device=device))
    heal.exact = end
    if end == T:
        heal.healed_at_token = len(answer_ids)
    return end - E


__all__ = ["AnswerHeal", "heal_answer_piece"]
