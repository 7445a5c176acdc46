"""Tests of fusionrag_core.bench.metrics: SQuAD answer metrics, normalized F1, KL, summarize."""

from __future__ import annotations

import math

import pytest
import torch

from fusionrag_core.bench.metrics import (
    RowResult,
    answer_em,
    answer_f1,
    exact_match,
    f1_score,
    max_over_ground_truths,
    median,
    normalize_answer,
    normalized_f1,
    summarize,
)
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.divergence import first_token_agree, first_token_kl


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  an   apple,  a PEAR! ", "apple pear"),
        ("Theatre of the Absurd", "theatre of absurd"),  # "the" inside "theatre" is not an article
        ("U.S.A.", "usa"),
        ("rock-n-roll's", "rocknrolls"),
        ("the a an", ""),
        ("", ""),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_f1_partial_overlap() -> None:
    # pred tokens {exeter, college, oxford}, gold {exeter, college}: P = 2/3, R = 1, F1 = 0.8.
    assert f1_score("Exeter College, Oxford", "the Exeter College") == pytest.approx(0.8)


def test_f1_counts_repeated_tokens_once_per_occurrence() -> None:
    # pred "paris paris" vs gold "paris": 1 common token, P = 1/2, R = 1 -> F1 = 2/3.
    assert f1_score("paris paris", "Paris") == pytest.approx(2 / 3)


def test_f1_no_overlap_and_empty_answers() -> None:
    assert f1_score("London", "Paris") == 0.0
    assert f1_score("", "Paris") == 0.0
    assert f1_score("the", "a") == 1.0  # both normalise to nothing


def test_exact_match_uses_normalisation() -> None:
    assert exact_match("The  Charles County.", "charles county") == 1.0
    assert exact_match("Charles", "Charles County") == 0.0


def test_max_over_ground_truths_picks_best_gold() -> None:
    golds = ["New York City", "NYC"]
    assert max_over_ground_truths(exact_match, "nyc", golds) == 1.0
    assert answer_f1("New York", golds) == pytest.approx(0.8)  # P = 1, R = 2/3
    assert answer_em("New York", golds) == 0.0


def test_answer_metrics_reject_empty_or_bare_string_golds() -> None:
    with pytest.raises(InvalidRequestError, match="empty list of gold"):
        answer_f1("x", [])
    with pytest.raises(InvalidRequestError, match="empty list of gold"):
        answer_em("x", [])
    with pytest.raises(InvalidRequestError, match="wrap it"):
        answer_f1("paris", "paris")


def test_normalized_f1_typical_value() -> None:
    assert normalized_f1(0.5, 0.3, 0.7) == pytest.approx(0.5)
    assert normalized_f1(0.7, 0.3, 0.7) == pytest.approx(1.0)
    assert normalized_f1(0.2, 0.3, 0.7) == pytest.approx(-0.25)  # worse than full reuse


def test_normalized_f1_undefined_when_baselines_tie() -> None:
    assert normalized_f1(0.5, 0.4, 0.4) is None
    assert normalized_f1(0.5, 0.4, 0.4 + 1e-12) is None


def test_first_token_kl_identical_is_zero() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    assert first_token_kl(logits, logits.clone()) == 0.0
    # Precision of the inputs must not matter: bf16 copy of the same values is still identical.
    assert first_token_kl(logits.bfloat16(), logits.bfloat16()) == 0.0
    # Adding a constant to all logits does not change the distribution.
    assert first_token_kl(logits, logits + 7.0) == pytest.approx(0.0, abs=1e-12)


def test_first_token_kl_matches_closed_form_and_is_asymmetric() -> None:
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    expected_pq = float((p * (p / q).log()).sum())
    expected_qp = float((q * (q / p).log()).sum())
    kl_pq = first_token_kl(p.log(), q.log())
    kl_qp = first_token_kl(q.log(), p.log())
    assert kl_pq > 0
    assert kl_pq == pytest.approx(expected_pq, rel=1e-12)
    assert kl_qp == pytest.approx(expected_qp, rel=1e-12)
    assert abs(kl_pq - kl_qp) > 1e-3


def test_first_token_kl_handles_masked_logits() -> None:
    ref = torch.tensor([1.0, float("-inf"), 0.0])
    assert first_token_kl(ref, ref.clone()) == 0.0  # no nan from 0 * log 0
    assert math.isinf(first_token_kl(torch.tensor([1.0, 1.0, 0.0]), ref))


def test_logit_shape_errors() -> None:
    with pytest.raises(InvalidRequestError, match="1-D"):
        first_token_kl(torch.zeros(1, 5), torch.zeros(1, 5))
    with pytest.raises(InvalidRequestError, match="same model"):
        first_token_agree(torch.zeros(5), torch.zeros(6))


def test_first_token_agree() -> None:
    assert first_token_agree(torch.tensor([0.1, 3.0, 1.0]), torch.tensor([0.0, 2.0, 1.9]))
    assert not first_token_agree(torch.tensor([0.1, 3.0, 1.0]), torch.tensor([0.0, 2.0, 2.1]))


def test_median() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(InvalidRequestError, match="empty"):
        median([])


def _row(
    method: str,
    ratio: float | None,
    answer: str,
    gold: str,
    reference: str,
    *,
    kl: float = 0.0,
    agree: bool = True,
    ttft: float = 1.0,
    recomputed: float = 0.0,
    kv_bytes: int = 0,
) -> RowResult:
    return RowResult(
        method=method,
        ratio=ratio,
        answer=answer,
        golds=[gold],
        reference_answer=reference,
        kl_first_token=kl,
        first_token_agree=agree,
        ttft_s=ttft,
        recomputed_fraction=recomputed,
        kv_bytes_loaded=kv_bytes,
    )


def _example_rows() -> list[RowResult]:
    g1, g2 = "Exeter College", "Charles County"
    # Full attention answers both rows right, so it is also the reference answer.
    fa1, fa2 = "Exeter College", "Charles County"
    return [
        _row("full_attention", None, fa1, g1, fa1, ttft=1.0, recomputed=1.0, kv_bytes=0),
        _row("full_reuse", None, "Oxford", g1, fa1, kl=0.9, agree=False, ttft=0.2, kv_bytes=1000),
        _row("fusionrag", 0.15, "Exeter College, Oxford", g1, fa1, kl=0.1, agree=True, ttft=0.5,
             recomputed=0.15, kv_bytes=100),
        _row("full_attention", None, fa2, g2, fa2, ttft=3.0, recomputed=1.0, kv_bytes=0),
        _row("full_reuse", None, "Charles", g2, fa2, kl=0.5, agree=True, ttft=0.4, kv_bytes=3000),
        _row("fusionrag", 0.15, "Charles County", g2, fa2, kl=0.3, agree=False, ttft=0.7,
             recomputed=0.17, kv_bytes=201),
    ]  # fmt: skip


def test_summarize_constructed_example() -> None:
    out = {(s["method"], s["ratio"]): s for s in summarize(_example_rows())}
    assert list(out) == [("full_attention", None), ("full_reuse", None), ("fusionrag", 0.15)]
    expected_keys = {
        "method", "ratio", "f1", "em", "normalized_f1", "kl_first_token", "first_token_agreement",
        "f1_vs_full_attention", "ttft_median_s", "ttft_ratio_vs_full_attention", "recomputed_fraction",
        "kv_bytes_loaded",
    }  # fmt: skip
    assert all(set(s) == expected_keys for s in out.values())

    fa = out[("full_attention", None)]
    assert fa["f1"] == 1.0 and fa["em"] == 1.0
    assert fa["normalized_f1"] == pytest.approx(1.0)
    assert fa["ttft_median_s"] == 2.0  # median of 1.0 and 3.0
    assert fa["ttft_ratio_vs_full_attention"] == 1.0
    assert fa["f1_vs_full_attention"] == 1.0

    fr = out[("full_reuse", None)]
    # Row 1: "oxford" vs "exeter college" -> 0; row 2: "charles" vs "charles county" -> P 1, R 1/2, F1 2/3.
    assert fr["f1"] == pytest.approx(1 / 3)
    assert fr["em"] == 0.0
    assert fr["normalized_f1"] == pytest.approx(0.0)
    assert fr["kl_first_token"] == pytest.approx(0.7)
    assert fr["first_token_agreement"] == 0.5
    assert fr["f1_vs_full_attention"] == pytest.approx(1 / 3)
    assert fr["ttft_median_s"] == pytest.approx(0.3)
    assert fr["ttft_ratio_vs_full_attention"] == pytest.approx(0.15)
    assert fr["kv_bytes_loaded"] == 2000.0

    fu = out[("fusionrag", 0.15)]
    # Row 1: 3 predicted tokens, 2 gold, 2 common -> F1 0.8; row 2 exact -> mean 0.9.
    assert fu["f1"] == pytest.approx(0.9)
    assert fu["em"] == 0.5
    # (0.9 - 1/3) / (1 - 1/3) = 0.85
    assert fu["normalized_f1"] == pytest.approx(0.85)
    assert fu["kl_first_token"] == pytest.approx(0.2)
    assert fu["first_token_agreement"] == 0.5
    assert fu["f1_vs_full_attention"] == pytest.approx(0.9)
    assert fu["ttft_median_s"] == pytest.approx(0.6)
    assert fu["ttft_ratio_vs_full_attention"] == pytest.approx(0.3)
    assert fu["recomputed_fraction"] == pytest.approx(0.16)
    assert fu["kv_bytes_loaded"] == pytest.approx(150.5)


def test_summarize_without_baselines_leaves_relative_metrics_none() -> None:
    rows = [r for r in _example_rows() if r.method == "fusionrag"]
    (only,) = summarize(rows)
    assert only["normalized_f1"] is None
    assert only["ttft_ratio_vs_full_attention"] is None
    assert only["f1"] == pytest.approx(0.9)


def test_summarize_ties_give_none_normalized_f1() -> None:
    rows = [
        _row("full_attention", None, "a b", "a b", "a b"),
        _row("full_reuse", None, "a b", "a b", "a b"),
        _row("fusionrag", 0.1, "a", "a b", "a b"),
    ]
    assert all(s["normalized_f1"] is None for s in summarize(rows))


def test_summarize_validates_ratios_and_input() -> None:
    with pytest.raises(InvalidRequestError, match="set ratio=None"):
        summarize([_row("full_reuse", 0.1, "x", "x", "x")])
    with pytest.raises(InvalidRequestError, match="needs a recompute ratio"):
        summarize([_row("fusionrag", None, "x", "x", "x")])
    with pytest.raises(InvalidRequestError, match="at least one row"):
        summarize([])
