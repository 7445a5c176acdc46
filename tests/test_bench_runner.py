"""Benchmark runner end to end on a tiny random Llama (real tokenizer, real ingest path), and its report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from fusionrag_core.bench.data import DatasetFormatError, load_rows
from fusionrag_core.bench.report import load_results, markdown, write_report
from fusionrag_core.bench.runner import (
    DEFAULT_METHODS,
    METHODS,
    BenchConfig,
    label,
    row_passages,
    run_benchmark,
    same_prompt_neighbour_share,
)
from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import ContextLengthError, InvalidRequestError
from fusionrag_core.runtime.compat import tokenize_plain
from tests.ingest_worker import tiny_engine

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "musique_dev.jsonl"
RATIOS = (0.15, 0.5)
SUMMARY_KEYS = {
    "method", "ratio", "f1", "em", "normalized_f1", "kl_first_token", "first_token_agreement",
    "f1_vs_full_attention", "ttft_median_s", "ttft_ratio_vs_full_attention", "recomputed_fraction",
    "kv_bytes_loaded",
}

pytestmark = [
    pytest.mark.skipif(not DATA.is_file(), reason=f"benchmark dataset not found at {DATA}"),
    pytest.mark.usefixtures("one_thread"),
]


@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


@pytest.fixture(scope="module")
def run(engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One small benchmark (2 rows, 40-token passages, every method) and its written report."""
    config = BenchConfig(data=DATA, limit=2, ratios=RATIOS, max_passage_tokens=40, max_new_tokens=4, neighbours=10)
    results = run_benchmark(config, engine, progress=False, command=["fusionrag", "bench", "--limit", "2"])
    out = tmp_path_factory.mktemp("bench")
    write_report(results, out)
    return results, out


def test_results_cover_every_method_and_ratio(run: tuple[dict[str, Any], Path]) -> None:
    results, _ = run
    expected = {(m, None if not METHODS[m].recomputes else r) for m in DEFAULT_METHODS for r in RATIOS}
    got = {(s["method"], s["ratio"]) for s in results["results"]}
    assert got == expected
    assert results["rows"] == 2 and len(results["per_row"]) == 2
    for summary in results["results"]:
        assert set(summary) >= SUMMARY_KEYS
        for key in SUMMARY_KEYS - {"method", "ratio", "normalized_f1"}:
            assert math.isfinite(summary[key]), (summary["method"], key, summary[key])
    for row in results["per_row"]:
        assert set(row["outputs"]) == {label(m, r) for m, r in expected}


def test_full_attention_is_the_reference(run: tuple[dict[str, Any], Path]) -> None:
    by_key = {(s["method"], s["ratio"]): s for s in run[0]["results"]}
    fa = by_key[("full_attention", None)]
    assert fa["ttft_ratio_vs_full_attention"] == 1.0
    assert fa["kl_first_token"] == 0.0 and fa["first_token_agreement"] == 1.0 and fa["f1_vs_full_attention"] == 1.0
    assert fa["recomputed_fraction"] == 1.0 and fa["kv_bytes_loaded"] == 0
    # every reuse method really reused caches loaded from the store
    for (method, ratio), s in by_key.items():
        if method == "full_attention":
            continue
        assert s["kv_bytes_loaded"] > 0, method
        if ratio is None:
            assert s["recomputed_fraction"] == 0.0, method
        else:
            assert 0.0 < s["recomputed_fraction"] <= ratio + 0.05, (method, ratio, s["recomputed_fraction"])


def test_fused_caches_differ_from_independent_ones(run: tuple[dict[str, Any], Path]) -> None:
    """FusionRAG and query_guided share the selector; only the ingest differs, so their logits must differ."""
    by_key = {(s["method"], s["ratio"]): s for s in run[0]["results"]}
    assert by_key[("fusionrag", 0.15)]["kl_first_token"] != by_key[("query_guided", 0.15)]["kl_first_token"]
    ingest = run[0]["ingest"]
    assert ingest["independent_chunks"] == ingest["fused_chunks"] == 20  # 2 rows x 10 passages
    assert ingest["independent_chunks_per_min"] > 0 and ingest["fused_chunks_per_min"] > 0


def test_report_files(run: tuple[dict[str, Any], Path]) -> None:
    results, out = run
    saved = json.loads((out / "results.json").read_text())
    assert saved["results"] == results["results"] and saved["command"] == ["fusionrag", "bench", "--limit", "2"]
    assert load_results(out / "results.json")["model"] == results["model"]
    md = (out / "results.md").read_text()
    assert md == markdown(results)
    # header + separator + one line per (method, ratio)
    assert sum(line.startswith("| ") for line in md.splitlines()) == 1 + len(results["results"])
    assert "| fusionrag | 0.15 |" in md and "chunks/min" in md
    for png in ("quality.png", "ttft.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_passages_are_truncated_with_the_model_tokenizer(engine: FusionEngine) -> None:
    row = load_rows(DATA, 1)[0]
    cut = row_passages(row, engine, 40)
    whole = row_passages(row, engine, None)
    assert len(cut) == len(row.passages) == len(whole)
    for short, full in zip(cut, whole, strict=True):
        assert full.startswith(short) and len(short) < len(full)
        assert len(tokenize_plain(engine.tokenizer, short)) <= 42  # re-tokenising may merge differently


def test_a_row_too_long_for_the_model_is_refused_before_ingest(engine: FusionEngine) -> None:
    # 10 whole MuSiQue passages (~6K tokens) exceed the tiny model's 2048 positions
    with pytest.raises(ContextLengthError, match="--max-passage-tokens"):
        run_benchmark(BenchConfig(data=DATA, limit=1), engine, progress=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"methods": ("fusionrag", "nope")}, "unknown method"),
        ({"ratios": (1.5,)}, "ratio"),
        ({"ratios": ()}, "no recompute ratio"),
        ({"limit": 0}, "limit"),
        ({"skip": -1}, "skip"),
        ({"neighbours": -1}, "neighbours must be"),
        ({"max_passage_tokens": 0}, "max_passage_tokens"),
        ({"corpus": "everything"}, "corpus mode"),
        ({"context": "retrieved"}, "corpus='shared'"),
        ({"corpus": "shared", "context": "retrieved", "k": 0}, "k must be"),
    ],
)
def test_bad_configs_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        BenchConfig(data=DATA, **kwargs)


def test_missing_dataset(engine: FusionEngine, tmp_path: Path) -> None:
    with pytest.raises(DatasetFormatError, match="not found"):
        run_benchmark(BenchConfig(data=tmp_path / "none.jsonl"), engine, progress=False)


def test_full_attention_always_runs_first() -> None:
    plan = BenchConfig(data=DATA, methods=("fusionrag",), ratios=(0.1, 0.2)).plan()
    assert [(m.name, r) for m, r in plan] == [("full_attention", None), ("fusionrag", 0.1), ("fusionrag", 0.2)]


# ---- corpus modes -------------------------------------------------------------------------------
SHARED = {"limit": 2, "methods": ("full_attention", "full_reuse", "fusionrag"), "ratios": (0.15,),
          "max_passage_tokens": 40, "max_new_tokens": 2, "neighbours": 10, "warmup": False}


def test_a_row_corpus_fuses_each_chunk_after_its_own_prompts_passages(run: tuple[dict[str, Any], Path]) -> None:
    corpus = run[0]["corpus"]
    assert corpus["mode"] == "row" and corpus["context"] == "gold" and corpus["passages"] == 20
    # 10 passages a row, n = 10 capped at 9: every neighbour is another passage of the prompt
    assert corpus["same_prompt_neighbour_share"] == 1.0
    assert "one corpus per row" in markdown(run[0])


def test_a_shared_corpus_finds_neighbours_across_rows(engine: FusionEngine) -> None:
    results = run_benchmark(BenchConfig(data=DATA, corpus="shared", **SHARED), engine, progress=False)  # type: ignore[arg-type]
    corpus = results["corpus"]
    assert corpus["mode"] == "shared" and corpus["passages"] == 20
    assert results["ingest"]["fused_chunks"] == 20  # one ingest of both rows' passages, not one per row
    # 10 neighbours among 19 others, only 9 of them in the same prompt: at most 90% can be the prompt's own
    assert 0.0 <= corpus["same_prompt_neighbour_share"] <= 0.9
    for row in results["per_row"]:
        assert row["prompt_chunks"] == 10 and row["gold_passage_recall"] == 1.0
    assert {(s["method"], s["ratio"]) for s in results["results"]} == {
        ("full_attention", None), ("full_reuse", None), ("fusionrag", 0.15)}
    assert "one shared corpus" in markdown(results)


def test_skip_runs_a_later_slice_and_rows_keep_their_kl(engine: FusionEngine) -> None:
    config = BenchConfig(data=DATA, corpus="shared", **{**SHARED, "limit": 1}, skip=3)  # type: ignore[arg-type]
    results = run_benchmark(config, engine, progress=False)
    assert results["rows"] == 1 and results["first_row"] == 3
    assert [r["question"] for r in results["per_row"]] == [load_rows(DATA, 4)[3].question]
    assert "rows 3-3" in markdown(results)
    row = results["per_row"][0]
    assert set(row["kl_first_token"]) == {"full_attention", "full_reuse", "fusionrag@0.15"}
    assert row["kl_first_token"]["full_attention"] == 0.0
    means = {(s["method"], s["ratio"]): s["kl_first_token"] for s in results["results"]}
    assert row["kl_first_token"]["fusionrag@0.15"] == pytest.approx(means[("fusionrag", 0.15)])
    assert row["recomputed_fraction"]["full_reuse"] == 0.0


def test_a_shared_corpus_answers_over_retrieved_chunks(engine: FusionEngine) -> None:
    config = BenchConfig(data=DATA, corpus="shared", context="retrieved", k=4, **SHARED)  # type: ignore[arg-type]
    results = run_benchmark(config, engine, progress=False)
    corpus = results["corpus"]
    assert corpus["context"] == "retrieved" and corpus["k"] == 4
    assert all(row["prompt_chunks"] == 4 for row in results["per_row"])
    assert 0.0 <= corpus["gold_passage_recall"] <= 1.0
    assert "top-4 retrieved" in markdown(results)


def test_same_prompt_neighbour_share() -> None:
    neighbours = {"a": ["b", "x"], "b": ["a", "c"], "c": [], "x": ["a"]}
    assert same_prompt_neighbour_share(["a", "b", "c"], neighbours) == pytest.approx((0.5 + 1.0) / 2)
    assert same_prompt_neighbour_share(["c"], neighbours) is None
    assert same_prompt_neighbour_share(["a", "a", "x"], neighbours) == pytest.approx((0.5 + 1.0) / 2)


def test_default_methods_include_the_engines_default_selection() -> None:
    from fusionrag_core.engine import EngineConfig

    engine_default = [m for m in DEFAULT_METHODS if METHODS[m].selector == EngineConfig().selector]
    assert [METHODS[m].variant for m in engine_default] == ["fused"], engine_default


def test_every_methods_selector_is_a_registered_selector() -> None:
    from fusionrag_core.query.select import SELECTORS

    assert {m.selector for m in METHODS.values() if m.selector is not None} <= set(SELECTORS)
