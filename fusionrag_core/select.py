"""Selectors: which reused chunk tokens to recompute. One function each, one signature.

`selector(stitched, budget, config) -> slots` returns the sorted buffer slots `[K]` (a subset of
`stitched.reusable_slots`, `K <= budget`) whose K/V the recompute pass will compute afresh.
Context without a usable cache is recomputed regardless (`stitched.forced_slots`); it is not
part of the budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.stitch import Stitched


@dataclass(frozen=True)
class SelectConfig:
    """Knobs of the selectors.

    Attributes:
        ratio: fraction of reused chunk tokens to recompute (the paper's r; 0.15 by default).
        kv_deviation_layer: CacheBlend's probe layer (recomputed fully up to here; 1 = second layer).
        first_k: EPIC's tokens per chunk; None spreads the same budget as `ratio` evenly over chunks.
        seed: seed of the `random` selector.
    """

    ratio: float = 0.15
    kv_deviation_layer: int = 1
    first_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise InvalidRequestError(f"recompute ratio must be in [0, 1], got {self.ratio}")
        if self.first_k is not None and self.first_k < 0:
            raise InvalidRequestError(f"first_k must be >= 0, got {self.first_k}")

    def budget(self, reusable_tokens: int) -> int:
        return min(reusable_tokens, round(self.ratio * reusable_tokens))


Selector = Callable[[Stitched, int, SelectConfig], torch.Tensor]


def _top(slots: torch.Tensor, scores: torch.Tensor, budget: int) -> torch.Tensor:
    """The `budget` best-scored slots, sorted by slot. Ties break towards the earlier slot."""
    if budget <= 0 or slots.numel() == 0:
        return slots[:0]
    # NOTE: stable sort on -score keeps equal scores in slot order, so a selection is reproducible.
    order = torch.sort(-scores.float(), stable=True).indices[:budget]
    return torch.sort(slots[order]).values


def select_none(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """Full reuse: recompute nothing."""
    return st.reusable_slots[:0]


def select_all(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """Full recompute of every chunk token (equals a plain prefill; the prefix stays cached)."""
    return st.reusable_slots


def select_random(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """Uniformly random tokens across all chunks (seeded)."""
    slots = st.reusable_slots
    gen = torch.Generator().manual_seed(config.seed)
    perm = torch.randperm(slots.numel(), generator=gen).to(slots.device)
    return torch.sort(slots[perm[:budget]]).values


def select_first_k(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """EPIC-style: the first k tokens of every chunk (where attention sinks form in isolation)."""
    if not st.chunk_slots:
        return st.reusable_slots
    k = config.first_k if config.first_k is not None else math.ceil(budget / len(st.chunk_slots))
    picked = [s[:k] for s in st.chunk_slots]
    return torch.cat(picked)


def select_query_guided(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """FusionRAG: the tokens the question attends to most at the last layer.

    The question is prefilled over the stitched cache; its last-layer queries score every cached
    key (softmax per head over the whole visible context, summed over heads and question tokens);
    the global top-`budget` chunk tokens win, whichever chunk they sit in.
    """
    slots = st.reusable_slots
    if budget <= 0 or slots.numel() == 0:
        return slots[:0]
    out = st.decoder.forward(st.buf, st.question_ids, st.question_slots, logits=False, attention_from=0)
    assert out.attention is not None
    return _top(slots, out.attention[slots], budget)


def select_kv_deviation(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """CacheBlend: recompute layers `< l` for all context tokens, then pick the tokens whose fresh
    keys at layer `l` deviate most (L2) from their cached keys."""
    slots = st.reusable_slots
    if budget <= 0 or slots.numel() == 0:
        return slots[:0]
    layer = config.kv_deviation_layer
    if not 0 <= layer < st.decoder.num_layers:
        raise InvalidRequestError(f"kv_deviation_layer {layer} out of range for {st.decoder.num_layers} layers")
    context = torch.sort(torch.cat([slots, st.forced_slots])).values
    out = st.decoder.forward(st.buf, st.slot_tokens[context], context, logits=False, probe_layer=layer)
    assert out.probe_keys is not None
    fresh = out.probe_keys  # [H, N, D], aligned with `context`
    reused = torch.isin(context, slots)
    cached = st.buf.keys[layer][:, context[reused]]  # [H, R, D]
    deviation = (fresh[:, reused].float() - cached.float()).pow(2).sum(dim=(0, 2))  # [R]
    return _top(context[reused], deviation, budget)


SELECTORS: dict[str, Selector] = {
    "query_guided": select_query_guided,
    "kv_deviation": select_kv_deviation,
    "first_k": select_first_k,
    "random": select_random,
    "none": select_none,
    "all": select_all,
}


def get_selector(name: str) -> Selector:
    if name not in SELECTORS:
        raise InvalidRequestError(f"unknown selector {name!r}; choose one of {', '.join(SELECTORS)}")
    return SELECTORS[name]
