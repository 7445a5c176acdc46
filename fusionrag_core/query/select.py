"""Selectors: which reused chunk tokens to recompute. One function each, one signature.

`selector(stitched, budget, config) -> slots` returns the sorted buffer slots `[K]` (a subset of
`stitched.reusable_slots`, `K <= budget`) whose K/V the recompute pass will compute afresh.
Context without a usable cache is recomputed regardless (`stitched.forced_slots`); it is not
part of the budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fusionrag_core.errors import InvalidRequestError
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
            attention a query-guided selector aggregates; None = the selector's own (see each).
            The probe pass stops at the deepest one, so shallower probes are cheaper.
        adaptive_mass: `adaptive`'s target: the share of the question's attention mass on chunk
            tokens that the recomputed tokens must cover.
        adaptive_floor: `adaptive`'s and `two_stage_adaptive`'s smallest ratio (their largest is `ratio`).
        two_stage_share: `two_stage`'s share of the budget spent on stage 1 (the rest after the re-probe).
        adaptive_drop: `two_stage_adaptive`'s attention drop at which it spends all of its budget.
        drift_mass: `drift_adaptive`'s target: the share of the drift-weighted attention on
            inexact chunk tokens that the recomputed tokens must cover.
        last_token_share: the `drift_*` selectors' probe: the share of the question's attention
            taken from its last token (the position the answer is generated from); its other
            tokens share the rest equally. None weighs every question token alike, as the other
            query-guided selectors do (the paper's probe, where the last token has 1/Q of the say).
    """

    ratio: float = 0.15
    kv_deviation_layer: int = 1
    first_k: int | None = None
    seed: int = 0
    probe_depths: tuple[float, ...] | None = None
    adaptive_mass: float = 0.5
    adaptive_floor: float = 0.02
    two_stage_share: float = 0.5
    adaptive_drop: float = 0.2
    drift_mass: float = 0.7
    last_token_share: float | None = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise InvalidRequestError(f"recompute ratio must be in [0, 1], got {self.ratio}")
        if self.first_k is not None and self.first_k < 0:
            raise InvalidRequestError(f"first_k must be >= 0, got {self.first_k}")
        if self.probe_depths is not None and (not self.probe_depths or
                                              any(not 0.0 <= d <= 1.0 for d in self.probe_depths)):
            raise InvalidRequestError(f"probe_depths must be relative depths in [0, 1], got {self.probe_depths}")
        if not 0.0 < self.adaptive_mass <= 1.0:
            raise InvalidRequestError(f"adaptive_mass must be in (0, 1], got {self.adaptive_mass}")
        if not 0.0 <= self.adaptive_floor <= 1.0:
            raise InvalidRequestError(f"adaptive_floor must be in [0, 1], got {self.adaptive_floor}")
        if not 0.0 < self.two_stage_share <= 1.0:
            raise InvalidRequestError(f"two_stage_share must be in (0, 1], got {self.two_stage_share}")
        if not 0.0 < self.drift_mass <= 1.0:
            raise InvalidRequestError(f"drift_mass must be in (0, 1], got {self.drift_mass}")
        if self.last_token_share is not None and not 0.0 <= self.last_token_share <= 1.0:
            raise InvalidRequestError(f"last_token_share must be in [0, 1] or None, got {self.last_token_share}")
        if not self.adaptive_drop > 0.0:
            raise InvalidRequestError(f"adaptive_drop must be > 0, got {self.adaptive_drop}")

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


def probe_layers(windows: Sequence[int | None], depths: tuple[float, ...]) -> tuple[int, ...]:
    """Layer indices at relative `depths` (0 = first layer, 1 = last), shallowest first, deduplicated.

    A depth that lands on a sliding-window layer moves down to the deepest full-attention layer at
    or below it (when there is one): a sliding layer's question queries cannot see the chunk tokens
    outside its window, so its attention cannot rank them (Gemma 3 slides 5 layers in 6 with a
    512-token window: at a ~860-token prompt the first ~40% of the context is invisible there).
    Moving down, not up, keeps the probe as cheap as asked for.

    Args:
        windows: per layer, its sliding window or None for full attention (`Decoder.windows`).
    """
    last = len(windows) - 1

    def full_at_or_below(layer: int) -> int:
        below = [i for i in range(layer, -1, -1) if windows[i] is None]
        return below[0] if below else layer  # NOTE: every layer slides (Mistral-style): keep it

    return tuple(sorted({full_at_or_below(round(d * last)) for d in depths}))


def question_weights(question_tokens: int, last_share: float | None, device: torch.device) -> torch.Tensor | None:
    """`[Q]` each question token's weight in the probe's attention sum: `last_share` on the last
    token, the rest split equally over the others (None: every token 1, the paper's plain sum).

    The answer is generated from the last position on: its query is the one whose reading of the
    context the first answer token comes from, and the decoding positions after it read the
    context much as it does. The question's other tokens read it too (their K/V carry what they
    read into the answer), so they keep a say; in the plain sum the last token has 1/Q of it.
    """
    if last_share is None:
        return None
    if question_tokens == 1:
        return torch.ones(1, device=device)
    rest = (1.0 - last_share) / (question_tokens - 1)
    weights = torch.full((question_tokens,), rest, device=device)  # [Q]
    weights[-1] = last_share
    return weights


def question_attention(st: Stitched, depths: tuple[float, ...], *, fresh: torch.Tensor | None = None,
                       last_share: float | None = None) -> torch.Tensor:
    """`[R]` the question's attention on each reusable slot, aggregated over the probe layers.

    The question is prefilled over the stitched cache up to the deepest probe layer; at each probe
    layer its queries score every cached key (softmax per head over the whole visible context,
    summed over heads and question tokens). Each layer's mass on the chunk tokens is normalised to
    sum to 1 before the layers are averaged, so a layer that parks most of its mass on the prefix
    (an attention sink) still has an equal say in which chunk tokens matter.

    Args:
        fresh: `[K]` sorted reusable slots recomputed in the same pass, before the question (as the
            recompute pass computes them, causal by position): the question then reads a partially
            corrected cache. NOTE: their K/V up to the deepest probe layer are overwritten, so a
            selector that passes them must select them (the recompute pass rewrites every layer).
        last_share: the share of the attention taken from the question's last token (see
            `question_weights`); None weighs every question token alike.
    """
    slots = st.reusable_slots
    layers = probe_layers(st.decoder.windows, depths)
    weights = question_weights(int(st.question_slots.shape[0]), last_share, st.buf.keys.device)
    if fresh is None or fresh.numel() == 0:
        masses = st.decoder.probe(st.buf, st.question_ids, st.question_slots, layers=layers, weights=weights)
    else:
        at = torch.cat([fresh.to(slots.device), st.question_slots])  # [K + Q]
        masses = st.decoder.probe(st.buf, st.slot_tokens[at], at, layers=layers,
                                  readers=int(st.question_slots.shape[0]), weights=weights)
    mass = torch.stack([masses[layer] for layer in layers])[:, slots]  # [A, R]
    mass = mass / mass.sum(dim=1, keepdim=True).clamp_min(1e-30)
    return mass.mean(dim=0)


def _query_guided(st: Stitched, budget: int, config: SelectConfig, depths: tuple[float, ...], *,
                  skip_exact: bool = False) -> torch.Tensor:
    slots = st.reusable_slots
    if budget <= 0 or slots.numel() == 0:
        return slots[:0]
    scores = question_attention(st, config.probe_depths or depths)
    if skip_exact:
        slots, scores = _inexact(st, slots, scores)
    return _top(slots, scores, budget)


def _inexact(st: Stitched, slots: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots (and their scores) whose cached K/V are not already exact (`Stitched.exact_slots`)."""
    keep = ~torch.isin(slots, st.exact_slots.to(slots.device))
    return slots[keep], scores[keep]


def select_query_guided(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """FusionRAG: the tokens the question attends to most at the last layer.

    The question is prefilled over the stitched cache; its last-layer queries score every cached
    key (see `question_attention`); the global top-`budget` chunk tokens win, whichever chunk they
    sit in. `config.probe_depths` overrides the last layer.
    """
    return _query_guided(st, budget, config, (1.0,))


def select_query_guided_layers(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """Query-guided over several layers: the question's attention at depths 1/3, 2/3 and the last
    layer, averaged (evidence a middle layer reads can be invisible at the last one).

    Chosen on MuSiQue dev rows 20-29 (shared corpus, 80-token passages, 15%): first-token KL vs
    full attention 0.040 (SmolLM2) / 0.042 (gemma3-270m) against the last layer's 0.042 / 0.046.
    """
    return _query_guided(st, budget, config, (1 / 3, 2 / 3, 1.0))


def select_query_guided_early(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """Query-guided with a cheaper probe: the question runs through the first three quarters of
    the layers only, and their deepest one's attention ranks the tokens (on sliding-window models
    the deepest full-attention layer at or below 3/4 depth: see `probe_layers`).

    Chosen on MuSiQue dev rows 20-29 (as above): KL 0.038 / 0.044 against the last layer's 0.042 /
    0.046 (half depth was worse on gemma3-270m: 0.059), and the probe skips a quarter of the layers
    (gemma3-270m: a third, since it reads full-attention layer 11 of 18, not sliding layer 13: KL
    0.044 either way on those rows).
    """
    return _query_guided(st, budget, config, (0.75,))


def select_fusion_aware(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """Query-guided (last layer, or `probe_depths`), spending the budget only where the cache can be
    wrong: tokens whose cached context is exactly the prompt's (`Stitched.exact_slots`: the first
    chunk's independent cache right after the prefix it was computed after) are skipped, since
    recomputing them yields the same K/V; the freed budget goes to the next-best tokens elsewhere.

    MuSiQue dev rows 20-29 (shared corpus, 80-token passages, 15%): KL 0.046 (SmolLM2) / 0.038
    (gemma3-270m) against `query_guided`'s 0.042 / 0.046: mixed.
    """
    return _query_guided(st, budget, config, (1.0,), skip_exact=True)


def select_fusion_aware_early(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """`fusion_aware` with `query_guided_early`'s cheaper probe (3/4 depth, or the deepest
    full-attention layer below it on sliding-window models).

    MuSiQue dev rows 20-29 (as above): KL 0.037 (SmolLM2) / 0.042 (gemma3-270m) against
    `query_guided`'s 0.042 / 0.046, with the cheaper probe.
    """
    return _query_guided(st, budget, config, (0.75,), skip_exact=True)


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
    """`fusion_aware_early` (3/4-depth probe, or `probe_depths`; exact tokens skipped) with the
    question's attention weighted by each token's fusion drift (`drift_weighted_attention`), and
    `last_token_share` (0.5) of that attention taken from the question's last token, the position
    the answer is generated from (`question_weights`).

    A chunk cache without drift (independent, learned, or written before drift was stored) counts
    as the prompt's mean drift (`Generation.chunks_without_drift` says how many); with none at all
    and `last_token_share=None` this is `fusion_aware_early`.
    """
    if budget <= 0 or st.reusable_slots.numel() == 0:
        return st.reusable_slots[:0]
    slots, scores = drift_weighted_attention(st, config.probe_depths or (0.75,), config.last_token_share)
    return _top(slots, scores, budget)


def select_drift_adaptive(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """Adaptive ratio over `drift_aware`'s scores: the fewest top tokens covering `drift_mass` of
    their total (attention times drift: the staleness the question reads), at least
    `adaptive_floor` and at most `budget` (= `ratio`) of the reusable tokens.

    A prompt whose stale, read tokens are few is served with few recomputed; one whose question
    reads many context-sensitive tokens gets up to the ceiling.

    MuSiQue dev, shared corpus, held-out rows 0-9 (ceiling 15%): SmolLM2 KL 0.0216 at 9.8% average
    against `drift_aware`'s fixed 15% 0.0165. On gemma3-270m the score is so concentrated (2% of
    the tokens hold ~99% of it) that every `drift_mass` from 0.5 to 0.9 is met by the floor: KL
    0.0750 at 2.1%. Prefer `drift_aware` there (`Generation.recomputed_tokens` shows the ratio chosen).
    """
    if budget <= 0 or st.reusable_slots.numel() == 0:
        return st.reusable_slots[:0]
    slots, scores = drift_weighted_attention(st, config.probe_depths or (0.75,), config.last_token_share)
    return _top(slots, scores, _covering(scores, config.drift_mass, st.num_reused_tokens, budget, config))


def _covering(scores: torch.Tensor, mass: float, reusable: int, budget: int, config: SelectConfig) -> int:
    """How many of the top `scores` cover `mass` of their sum, clamped to [floor, budget]."""
    floor = min(budget, math.ceil(config.adaptive_floor * reusable))
    if scores.numel() == 0 or float(scores.sum()) <= 0.0:
        return floor
    covered = torch.cumsum(torch.sort(scores.float(), descending=True).values, dim=0)  # [R']
    need = int(torch.searchsorted(covered, covered[-1:] * mass)[0]) + 1
    return max(floor, min(need, budget))


def select_adaptive(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """Adaptive ratio: the fewest top tokens covering `config.adaptive_mass` of the question's
    (last-layer, or `probe_depths`) attention on chunk tokens, at least `adaptive_floor` of them
    and at most `budget` (= `ratio` of them).

    Attention concentrated on a few tokens needs few recomputed; spread-out attention gets the
    whole budget.
    """
    slots = st.reusable_slots
    if budget <= 0 or slots.numel() == 0:
        return slots[:0]
    scores = question_attention(st, config.probe_depths or (1.0,))  # [R], sums to 1
    return _top(slots, scores, _covering(scores, config.adaptive_mass, slots.numel(), budget, config))


def _ranked_inexact(st: Stitched, depths: tuple[float, ...], fresh: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inexact reusable slots `[R']` and the question's attention on them (see `question_attention`)."""
    return _inexact(st, st.reusable_slots, question_attention(st, depths, fresh=fresh))


def _second_stage(st: Stitched, depths: tuple[float, ...], first: torch.Tensor, more: int) -> torch.Tensor:
    """Re-probe with `first` recomputed, then the `more` best of the other inexact slots; returns all, sorted."""
    if more <= 0:
        return first
    slots, scores = _ranked_inexact(st, depths, fresh=first)
    return _with_best_others(first, slots, scores, more)


def _with_best_others(first: torch.Tensor, slots: torch.Tensor, scores: torch.Tensor, more: int) -> torch.Tensor:
    """`first` and the `more` best-scored `slots` not in it, sorted."""
    rest = ~torch.isin(slots, first)
    return torch.sort(torch.cat([first, _top(slots[rest], scores[rest], more)])).values


def select_two_stage(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """Two-stage query-guided selection (after ProphetKV's two-stage, query-driven recompute).

    Stage 1 is `fusion_aware_early`: the question's attention at 3/4 depth (or `probe_depths`) over
    the stitched cache, exact tokens skipped; its best `two_stage_share` of the budget are kept.
    Stage 2 probes again with those tokens recomputed in the same pass (before the question, up to
    the probe layer): the question now reads a partially corrected cache, where stale tokens that
    drew its attention only because they were stale lose it and tokens that matter once their
    neighbours are right gain it; the rest of the budget goes to stage 2's best other tokens.

    Cost: a second probe pass of (stage-1 tokens + question) through the probe's layers.

    MuSiQue dev, shared corpus, 80-token passages: no better than `fusion_aware_early` at equal
    budget (held-out rows 0-9 at 15%: KL 0.027 vs 0.025 on SmolLM2, 0.034 vs 0.035 on gemma3-270m)
    and +21-42% TTFT, so not the default.
    """
    if budget <= 0 or st.reusable_slots.numel() == 0:
        return st.reusable_slots[:0]
    depths = config.probe_depths or (0.75,)
    slots, scores = _ranked_inexact(st, depths)
    budget = min(budget, int(slots.numel()))
    first = _top(slots, scores, round(config.two_stage_share * budget))
    return _second_stage(st, depths, first, budget - int(first.numel()))


def attention_drop(before: torch.Tensor, after: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> float:
    """Share of the question's chunk attention that the `fresh` slots lose once recomputed.

    `before` / `after`: `[R']` the question's attention on `slots` over the stale cache and after the
    re-probe (`question_attention(..., fresh=fresh)`), each normalised here to sum to 1.
    """
    picked = torch.isin(slots, fresh)
    lost = before[picked].sum() / before.sum().clamp_min(1e-30) - after[picked].sum() / after.sum().clamp_min(1e-30)
    return float(lost)


def select_two_stage_adaptive(st: Stitched, budget: int, config: SelectConfig) -> torch.Tensor:
    """Adaptive ratio from the re-probe: `two_stage` whose second stage spends what the cache's
    staleness asks for, between `adaptive_floor` and `ratio` of the reusable tokens.

    Stage 1 recomputes `adaptive_floor` of the tokens (the probe's best inexact ones) and re-probes
    (see `select_two_stage`). The signal is `attention_drop`: how much of the question's chunk
    attention those tokens lose once their K/V are right. Attention that a token draws only because
    its cached K/V are stale is attention misdirected by the cache; the more of it the question's
    best tokens had, the more the rest of the cache misleads it too. Stage 2 spends the share
    `min(1, drop / adaptive_drop)` of the budget left (up to `ratio`), by the re-probe's ranking.

    The ratio it chose is what it returns: the engine recomputes exactly these tokens and reports
    them (`Generation.recomputed_tokens`).

    `adaptive_drop` 0.2 was chosen on MuSiQue dev rows 20-29 (SmolLM2, ceiling 30%): fixed-15% KL
    at 10.7% average (0.036 vs 0.037). It did not hold out (rows 0-9: 0.060 at 9.1% vs 0.025), and
    on gemma3-270m every drop is above it (the ceiling is always spent).
    """
    if budget <= 0 or st.reusable_slots.numel() == 0:
        return st.reusable_slots[:0]
    depths = config.probe_depths or (0.75,)
    slots, before = _ranked_inexact(st, depths)
    budget = min(budget, int(slots.numel()))
    first = _top(slots, before, min(budget, math.ceil(config.adaptive_floor * st.num_reused_tokens)))
    more = budget - int(first.numel())
    if more <= 0:
        return first
    slots, after = _ranked_inexact(st, depths, fresh=first)
    drop = attention_drop(before, after, slots, first)
    more = round(more * min(1.0, max(0.0, drop) / config.adaptive_drop))
    return _with_best_others(first, slots, after, more)


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
    fresh = st.decoder.probe_keys(st.buf, st.slot_tokens[context], context, layer)  # [H, N, D], aligned with `context`
    reused = torch.isin(context, slots)
    cached = st.buf.keys[layer][:, context[reused]]  # [H, R, D]
    deviation = (fresh[:, reused].float() - cached.float()).pow(2).sum(dim=(0, 2))  # [R]
    return _top(context[reused], deviation, budget)


SELECTORS: dict[str, Selector] = {
    "query_guided": select_query_guided,
    "query_guided_layers": select_query_guided_layers,
    "query_guided_early": select_query_guided_early,
    "fusion_aware": select_fusion_aware,
    "fusion_aware_early": select_fusion_aware_early,
    "two_stage": select_two_stage,
    "two_stage_adaptive": select_two_stage_adaptive,
    "adaptive": select_adaptive,
    "drift_aware": select_drift_aware,
    "drift_adaptive": select_drift_adaptive,
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
