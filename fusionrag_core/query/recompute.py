"""The sparse pass: recompute selected chunk tokens and prefill the question, in one pass.

Selected tokens (plus forced ones: context with no cache) run through every layer at their true
positions; at each layer their fresh K/V overwrite the cached ones in place *before* attention,
and they attend causally by position over the whole stitched buffer. The question's tokens come
after every context token, so folding the question into the same pass is exact: a query costs
this pass (+ the selector's probe pass), not a separate re-prefill.

Several requests' sparse passes can run as one (`run_passes`): their rows share each product,
each attends over its own buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fusionrag_core.query.stitch import Stitched
from fusionrag_core.runtime.decoder import Decoder
from fusionrag_core.runtime.kv import KVBuffer


@dataclass(frozen=True)
class SparsePass:
    """One request's sparse pass, ready to run.

    Attributes:
        buf: the request's stitched buffer.
        token_ids: `[N]` int64 tokens the pass computes (context, then the question).
        slots: `[N]` their slots in `buf`, in position order.
        recomputed: how many of them are context (selected and forced chunk tokens).
    """

    buf: KVBuffer
    token_ids: torch.Tensor
    slots: torch.Tensor
    recomputed: int


def sparse_pass(st: Stitched, selected: torch.Tensor) -> SparsePass:
    """The sparse pass of `st` with `selected` `[K]` sorted slots (a subset of `st.reusable_slots`)."""
    context = torch.sort(torch.cat([selected.to(st.forced_slots.device), st.forced_slots])).values  # [K + F]
    slots = torch.cat([context, st.question_slots])  # [K + F + Q]
    return SparsePass(st.buf, st.slot_tokens[slots], slots, int(context.shape[0]))


def run_passes(decoder: Decoder, passes: Sequence[SparsePass]) -> torch.Tensor:
    """Run sparse passes as one (`Decoder.prefill_batch`); returns each one's last-position logits `[B, V]`.

    NOTE: after it, every prompt slot of each buffer is valid and holds the K/V decoding attends to.
    """
    logits = decoder.prefill_batch([p.buf for p in passes], [p.token_ids for p in passes],
                                   [p.slots for p in passes])  # [B, V]
    for p in passes:
        p.buf.valid[p.slots] = True
    return logits


def recompute(st: Stitched, selected: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run the sparse pass of one request; returns the last position's `[V]` fp32 logits and the
    context tokens recomputed.

    Args:
        st: the stitched request.
        selected: `[K]` sorted slots chosen by a selector (subset of `st.reusable_slots`).
    """
    last = sparse_pass(st, selected)
    return run_passes(st.decoder, [last])[0], last.recomputed
