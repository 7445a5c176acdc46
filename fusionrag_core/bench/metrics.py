"""Quality and speed metrics of the benchmark, and their aggregation into results.json rows.

Answer metrics follow the official SQuAD v1.1 evaluation script (normalisation, token F1, exact
match, max over gold answers), which is what LongBench and CacheBlend report on this dataset.
They are re-implemented here (about 30 lines) rather than pulled from `evaluate`, which would add
a large dependency and a network download of the metric script for the same arithmetic.

`normalized_f1` and the first-token KL / agreement are the FusionRAG paper's measures of how much
of the quality gap between full KV reuse and full attention a method closes.
"""

from __future__ import annotations

import re
import statistics
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fusionrag_core.bench.methods import FULL_ATTENTION, FULL_REUSE
from fusionrag_core.errors import InvalidRequestError

#: Baselines that have no recompute ratio; every other method must carry one.
BASELINE_METHODS: tuple[str, ...] = (FULL_ATTENTION, FULL_REUSE)

#: |F1_FA - F1_FR| below this means the two baselines tie and normalized F1 is undefined.
_NORMALIZED_F1_EPS = 1e-9

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Normalises an answer the SQuAD way before comparing it with a gold answer.

    Lower-cases, removes ASCII punctuation, removes the articles "a", "an", "the" and collapses
    whitespace, in that order (the order of the official script, so scores are comparable).

    Args:
        text: A predicted or gold answer.

    Returns:
        The normalised answer; "" when nothing but punctuation, articles and spaces was given.
    """
    lowered = text.lower()
    no_punct = "".join(ch for ch in lowered if ch not in _PUNCTUATION)
    no_articles = _ARTICLES.sub(" ", no_punct)
    return " ".join(no_articles.split())


def f1_score(prediction: str, gold: str) -> float:
    """Token-level F1 between a prediction and one gold answer, after `normalize_answer`.

    When either side normalises to no tokens, the score is 1.0 if both are empty and 0.0
    otherwise (SQuAD v2 convention); SQuAD v1.1 would divide by zero there.

    Args:
        prediction: The model's answer.
        gold: One reference answer.

    Returns:
        F1 in [0, 1].
    """
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    # Multiset intersection: a repeated token counts as many times as it occurs on both sides.
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when prediction and gold are equal after `normalize_answer`, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def max_over_ground_truths(metric: Callable[[str, str], float], prediction: str, golds: Sequence[str]) -> float:
    """Best score of `prediction` against any of several acceptable gold answers.

    Args:
        metric: `f1_score`, `exact_match` or any `(prediction, gold) -> float`.
        prediction: The model's answer.
        golds: All acceptable answers (aliases) for the question.

    Returns:
        The maximum of `metric(prediction, gold)` over `golds`.

    Raises:
        InvalidRequestError: `golds` is empty (a question without a gold answer cannot be scored;
            drop the row or fix the dataset).
    """
    if isinstance(golds, str):
        # A bare string is a Sequence[str] of characters; scoring against letters is always a bug.
        raise InvalidRequestError("golds must be a list of answers, not a single string; wrap it: [gold]")
    if not golds:
        raise InvalidRequestError(
            "cannot score an answer against an empty list of gold answers; drop the row or fix its 'answers'"
        )
    return max(metric(prediction, gold) for gold in golds)


def answer_f1(prediction: str, golds: Sequence[str]) -> float:
    """Token F1 of `prediction` against the best-matching of `golds` (must be non-empty)."""
    return max_over_ground_truths(f1_score, prediction, golds)


def answer_em(prediction: str, golds: Sequence[str]) -> float:
    """Exact match of `prediction` against any of `golds` (must be non-empty)."""
    return max_over_ground_truths(exact_match, prediction, golds)


def normalized_f1(f1_method: float, f1_full_reuse: float, f1_full_attention: float) -> float | None:
    """Share of the full-reuse → full-attention F1 gap that a method recovers.

    `(F1 - F1_FR) / (F1_FA - F1_FR)`, computed from dataset-mean F1s (not per row, where the
    denominator is usually 0). 1.0 means as good as full attention, 0.0 as bad as full reuse;
    values outside [0, 1] are legitimate (a method can beat full attention on a small sample).

    Args:
        f1_method: Mean F1 of the method.
        f1_full_reuse: Mean F1 of full KV reuse on the same rows.
        f1_full_attention: Mean F1 of full attention on the same rows.

    Returns:
        The normalised F1, or None when full attention and full reuse score the same (within
        1e-9): the ratio is then undefined (0/0 or ±inf), and the report prints "n/a" rather than
        a misleading number.
    """
    gap = f1_full_attention - f1_full_reuse
    if abs(gap) < _NORMALIZED_F1_EPS:
        return None
    return (f1_method - f1_full_reuse) / gap


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence (mean of the two middle values for an even count).

    Raises:
        InvalidRequestError: `values` is empty.
    """
    if len(values) == 0:
        raise InvalidRequestError("median of an empty sequence is undefined; run at least one row")
    return float(statistics.median(values))


def _mean(values: Sequence[float]) -> float:
    # Callers only pass non-empty groups; fmean is exact-sum based and returns a float.
    return statistics.fmean(values)


@dataclass(frozen=True)
class RowResult:
    """What one method produced on one benchmark row; the input of `summarize`.

    Attributes:
        method: Method name, e.g. "full_attention", "full_reuse", "fusionrag".
        ratio: Recompute ratio of the method, or None for the baselines full_attention / full_reuse.
        answer: The generated answer.
        golds: Acceptable gold answers of the row (non-empty).
        reference_answer: Full attention's answer on the same row (for agreement with FA).
        kl_first_token: `first_token_kl(full_attention_logits, method_logits)`; 0 for FA itself.
        first_token_agree: `first_token_agree(...)` against full attention; True for FA itself.
        ttft_s: Time to first token, seconds (load/stitch/recompute/prefill included).
        recomputed_fraction: Share of context tokens whose KV was recomputed, in [0, 1].
        kv_bytes_loaded: Bytes of KV cache read from the store for this row.
    """

    method: str
    ratio: float | None
    answer: str
    golds: list[str]
    reference_answer: str
    kl_first_token: float
    first_token_agree: bool
    ttft_s: float
    recomputed_fraction: float
    kv_bytes_loaded: int


def summarize(rows: Sequence[RowResult]) -> list[dict[str, Any]]:
    """Aggregates per-row results into one summary dict per (method, ratio), for results.json.

    Each dict has the keys `method`, `ratio`, `f1`, `em` (means of `answer_f1` / `answer_em`),
    `normalized_f1` (from the group mean F1 and the full_reuse / full_attention group means; None
    when either baseline is missing or they tie), `kl_first_token` (mean), `first_token_agreement`
    (fraction of rows that agree), `f1_vs_full_attention` (mean token F1 of the answer against
    full attention's answer), `ttft_median_s`, `ttft_ratio_vs_full_attention` (group median TTFT /
    full_attention median TTFT; None without a full_attention group or if its median is 0),
    `recomputed_fraction` (mean) and `kv_bytes_loaded` (mean).

    Groups come out in the order their first row appears in `rows`.

    Args:
        rows: Per-row results of every method; baselines must have `ratio=None`.

    Returns:
        One summary dict per (method, ratio).

    Raises:
        InvalidRequestError: `rows` is empty, a row has no golds, a baseline carries a ratio, or a
            non-baseline method has none.
    """
    if not rows:
        raise InvalidRequestError("no rows to summarize; run the benchmark on at least one row")
    groups: dict[tuple[str, float | None], list[RowResult]] = {}
    for row in rows:
        if row.method in BASELINE_METHODS and row.ratio is not None:
            raise InvalidRequestError(
                f"method {row.method!r} is a baseline and takes no recompute ratio (got {row.ratio}); set ratio=None"
            )
        if row.method not in BASELINE_METHODS and row.ratio is None:
            raise InvalidRequestError(
                f"method {row.method!r} needs a recompute ratio so its rows can be grouped; set ratio"
            )
        groups.setdefault((row.method, row.ratio), []).append(row)

    f1_by_group = {key: _mean([answer_f1(r.answer, r.golds) for r in group]) for key, group in groups.items()}
    f1_fa = f1_by_group.get((FULL_ATTENTION, None))
    f1_fr = f1_by_group.get((FULL_REUSE, None))
    fa_rows = groups.get((FULL_ATTENTION, None))
    ttft_fa = median([r.ttft_s for r in fa_rows]) if fa_rows else None

    summaries: list[dict[str, Any]] = []
    for (method, ratio), group in groups.items():
        f1 = f1_by_group[(method, ratio)]
        ttft = median([r.ttft_s for r in group])
        summaries.append(
            {
                "method": method,
                "ratio": ratio,
                "f1": f1,
                "em": _mean([answer_em(r.answer, r.golds) for r in group]),
                "normalized_f1": (normalized_f1(f1, f1_fr, f1_fa) if f1_fa is not None and f1_fr is not None else None),
                "kl_first_token": _mean([r.kl_first_token for r in group]),
                "first_token_agreement": _mean([float(r.first_token_agree) for r in group]),
                "f1_vs_full_attention": _mean([f1_score(r.answer, r.reference_answer) for r in group]),
                "ttft_median_s": ttft,
                "ttft_ratio_vs_full_attention": ttft / ttft_fa if ttft_fa else None,
                "recomputed_fraction": _mean([r.recomputed_fraction for r in group]),
                "kv_bytes_loaded": _mean([float(r.kv_bytes_loaded) for r in group]),
            }
        )
    return summaries
