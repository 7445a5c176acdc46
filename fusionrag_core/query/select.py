"""Selectors: which reused chunk tokens to recompute. One function each, one signature.

`selector(stitched, budget, config) -> slots` returns the sorted buffer slots `[K]` (a subset of
`stitched.reusable_slots`, `K <= budget`, except for `all`, which takes every one, and `first_k`,
which rounds up per chunk) whose K/V the recompute pass will compute afresh. Context without a
usable cache is recomputed regardless (`stitched.forced_slots`); it is not part of the budget.

`SELECTORS` names every selector; `get_selector` looks one up. Each selector's docstring opens
with its one-line description, in the registry `selectors.SELECTOR_DESCRIPTIONS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.probe import Probe, masses
from fusionrag_core.query.selectors import SELECTOR_DESCRIPTIONS
from fusionrag_core.query.stitch import Stitched


@dataclass(frozen=True)
class SelectConfig:
    """Knobs of the selectors.

    Attributes:
        ratio: fraction of reused chunk tokens to recompute (the paper's r; 0.15 by default).
        kv_deviation_layer: CacheBlend's probe layer (recomputed fully up to here; 1 = second layer).
        first_k: EPIC's tokens per chunk; None spreads the same budget as `ratio` evenly over chunks.
        seed: seed of the `random` selector.
        probe_depths: relative depths (0 = first layer, 1 = last) of the layers whose question
            attention a query-guided selector aggregates; None = the selector's own (`query_guided`:
            the last layer; `drift_aware`: 3/4 depth). The probe pass stops at the deepest one, so
            shallower probes are cheaper.
        last_token_share: `drift_aware`'s probe: the share of the question's attention taken from
            its last token (the position the answer is generated from); its other tokens share the
            rest equally. None weighs every question token alike, as `query_guided` does (the
            paper's probe, where the last token has 1/Q of the say).
    """

    ratio: float = 0.15
    kv_deviation_layer: int = 1
    first_k: int | None = None
    seed: int = 0
    probe_depths: tuple[float, ...] | None = None
    last_token_share: float | None = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise InvalidRequestError(f"recompute ratio must be in [0, 1], got {self.ratio}")
        if self.first_k is not None and self.first_k < 0:
            raise InvalidRequestError(f"first_k must be >= 0, got {self.first_k}")
        if self.probe_depths is not None and (not self.probe_depths or
                                              any(not 0.0 <= d <= 1.0 for d in self.probe_depths)):
            raise InvalidRequestError(f"probe_depths must be relative depths in [0, 1], got {self.probe_depths}")
        if self.last_token_share is not None and not 0.0 <= self.last_token_share <= 1.0:
            raise InvalidRequestError(f"last_token_share must be in [0, 1] or None, got {self.last_token_share}")

    def budget(self, reusable_tokens: int) -> int:
        """How many of `reusable_tokens` chunk tokens a selector may recompute: `ratio` of them, rounded."""
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
    """Uniformly random tokens across all chunks, seeded by `SelectConfig.seed`."""
    slots = st.reusable_slots
    gen = torch.Generator().manual_seed(config.seed)
    perm = torch.randperm(slots.numel(), generator=gen).to(slots.device)
    return torch.sort(slots[perm[:budget]]).values


def select_first_k(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """EPIC: the first k tokens of every chunk, where attention sinks form in isolation.

    k is `config.first_k`, or else the budget spread evenly over the chunks (rounded up, so up to
    one token per chunk more than the budget).
    """
    if not st.chunk_slots:
        return st.reusable_slots
    k = config.first_k if config.first_k is not None else math.ceil(budget / len(st.chunk_slots))
    picked = [s[:k] for s in st.chunk_slots]
    return torch.cat(picked)


def select_kv_deviation(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """CacheBlend: the tokens whose fresh keys at an early layer deviate most from their cached keys.

    Layers `< config.kv_deviation_layer` are recomputed for every context token, then the tokens
    whose fresh keys at that layer are farthest (L2) from their cached keys win.
    """
    slots = st.reusable_slots
    if budget <= 0 or slots.numel() == 0:
        return slots[:0]
    layer = config.kv_deviation_layer
    if not 0 <= layer < st.decoder.num_layers:
        raise InvalidRequestError(f"kv_deviation_layer {layer} out of range for {st.decoder.num_layers} layers")
    context = torch.sort(torch.cat([slots, st.forced_slots])).values
    fresh = st.decoder.probe_keys(st.buf, st.slot_tokens[context], context, layer)  # [H, N, D], aligned with `context`
    reused = torch.isin(context, slots)
    cached = st.buf.keys[layer][:, context[reused]]  # [H, R, D]
    deviation = (fresh[:, reused].float() - cached.float()).pow(2).sum(dim=(0, 2))  # [R]
    return _top(context[reused], deviation, budget)


def question_attention(st: Stitched, depths: tuple[float, ...], *, last_share: float | None = None) -> torch.Tensor:
    """`[R]` the question's attention on each reusable slot, aggregated over the probe layers.

    The question is prefilled over the stitched cache up to the deepest probe layer; at each probe
    layer its queries score every cached key (softmax per head over the whole visible context,
    summed over heads and question tokens). Each layer's mass on the chunk tokens is normalised to
    sum to 1 before the layers are averaged, so a layer that parks most of its mass on the prefix
    (an attention sink) still has an equal say in which chunk tokens matter.

    Args:
        depths: relative depths of the probe layers (see `probe_layers`).
        last_share: the share of the attention taken from the question's last token (see
            `question_weights`); None weighs every question token alike.
    """
    probe = Probe.at(st, depths, last_share)
    by_layer = masses(probe)
    mass = torch.stack([by_layer[layer] for layer in probe.layers])[:, st.reusable_slots]  # [A, R]
    mass = mass / mass.sum(dim=1, keepdim=True).clamp_min(1e-30)
    return mass.mean(dim=0)


def select_query_guided(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """The paper's FusionRAG: the tokens the question attends to most at the last layer.

    The question is prefilled over the stitched cache; its last-layer queries score every cached
    key (see `question_attention`); the global top-`budget` chunk tokens win, whichever chunk they
    sit in. `config.probe_depths` overrides the last layer.
    """
    slots = st.reusable_slots
    if budget <= 0 or slots.numel() == 0:
        return slots[:0]
    depths, last_share = PROBED["query_guided"](config)
    return _top(slots, question_attention(st, depths, last_share=last_share), budget)


def _inexact(st: Stitched, slots: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots (and their scores) whose cached K/V are not already exact (`Stitched.exact_slots`)."""
    keep = ~torch.isin(slots, st.exact_slots.to(slots.device))
    return slots[keep], scores[keep]


def drift_weighted_attention(st: Stitched, depths: tuple[float, ...],
                             last_share: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The inexact reusable slots `[R']` and their score: the question's attention (see
    `question_attention`) times the token's fusion drift (`Stitched.drift`, `fusionrag_core.query.drift`).

    Attention says where the question reads; drift says how much that token's cached K/V depends on
    what came before it, so how wrong it can be in this prompt. A token the question reads hard but
    whose K/V fusion did not move gains little from recompute; one that moved a lot and is read is
    where the cache misleads the question most. `last_share`: see `question_weights`.
    """
    attention = question_attention(st, depths, last_share=last_share)
    return _inexact(st, st.reusable_slots, attention * st.drift())  # [R] * [R]


def select_drift_aware(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """FusionRAG's default: the question's attention times each token's fusion drift, exact tokens skipped.

    The question is prefilled over the stitched cache up to 3/4 depth (or `config.probe_depths`;
    on sliding-window models the deepest full-attention layer at or below it, see `probe_layers`),
    a cheaper probe than the last layer. Its attention on each chunk token, `last_token_share` of
    it from the question's last token (`question_weights`), is weighted by the token's fusion drift
    (`drift_weighted_attention`), and the top-`budget` tokens win. Tokens whose cached context is
    exactly the prompt's (`Stitched.exact_slots`: the first chunk's independent cache right after
    the prefix it was computed after) are never picked: recomputing them yields the same K/V, so
    the budget goes to the next-best tokens elsewhere.

    A chunk cache without drift (independent, learned, or written before drift was stored) counts
    as the prompt's mean drift (`Generation.chunks_without_drift` says how many).
    """
    if budget <= 0 or st.reusable_slots.numel() == 0:
        return st.reusable_slots[:0]
    slots, scores = drift_weighted_attention(st, *PROBED["drift_aware"](config))
    return _top(slots, scores, budget)


# The selectors that read the question's attention: name -> (probe depths, last token's share) for a config.
PROBED: dict[str, Callable[[SelectConfig], tuple[tuple[float, ...], float | None]]] = {
    "drift_aware": lambda config: (config.probe_depths or (0.75,), config.last_token_share),
    "query_guided": lambda config: (config.probe_depths or (1.0,), None),
}


def probe_for(name: str, st: Stitched, budget: int, config: SelectConfig) -> Probe | None:
    """The probe selector `name` will run on `st` with `budget` (None: it runs none), so that a
    scheduler can run it beforehand with other requests' (`probe.run_probes`); the selector then
    reads its masses from `st.probed`."""
    if name not in PROBED or budget <= 0 or st.reusable_slots.numel() == 0:
        return None
    return Probe.at(st, *PROBED[name](config))


# NOTE: derived from the registry, never listed by hand: a name without its `select_<name>`
# function fails at import.
SELECTORS: dict[str, Selector] = {name: globals()[f"select_{name}"] for name in SELECTOR_DESCRIPTIONS}
"""Every selector by name, in the registry's order (the default first)."""


def get_selector(name: str) -> Selector:
    """The selector registered as `name` in `SELECTORS`.

    Raises:
        InvalidRequestError: no selector has that name (the message lists them).
    """
    if name not in SELECTORS:
        raise InvalidRequestError(f"unknown selector {name!r}; choose one of {', '.join(SELECTORS)}")
    return SELECTORS[name]
