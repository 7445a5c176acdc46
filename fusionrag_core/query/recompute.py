"""The sparse pass: recompute selected chunk tokens and prefill the question, in one pass.

Selected tokens (plus forced ones: context with no cache) run through every layer at their true
positions; at each layer their fresh K/V overwrite the cached ones in place *before* attention,
and they attend causally by position over the whole stitched buffer. The question's tokens come
after every context token, so folding the question into the same pass is exact: a query costs
this pass (+ the selector's probe pass), not a separate re-prefill.
"""

from __future__ import annotations

import torch

from fusionrag_core.query.stitch import Stitched


def recompute(st: Stitched, selected: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run the sparse pass; returns the last position's `[V]` fp32 logits and the tokens recomputed.

    Args:
        st: the stitched request.
        selected: `[K]` sorted slots chosen by a selector (subset of `st.reusable_slots`).

    NOTE: after this pass every prompt slot is valid and holds the K/V decoding will attend to.
    """
    context = torch.sort(torch.cat([selected.to(st.forced_slots.device), st.forced_slots])).values  # [K + F]
    slots = torch.cat([context, st.question_slots])  # [K + F + Q]
    logits = st.decoder.prefill(st.buf, st.slot_tokens[slots], slots)
    st.buf.valid[slots] = True
    return logits, int(context.shape[0])
