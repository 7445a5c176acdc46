"""`benchmarks/learned_spans_study.py` end to end on a tiny random Llama (real tokenizer, real ingest
and chat paths): every method answers the same prompt, learned spans are reused on the second ask
and never on a fresh prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from benchmarks.tests.conftest import load_script
from tests.ingest_worker import tiny_engine

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "datasets" / "musique_dev.jsonl"

pytestmark = [
    pytest.mark.skipif(not DATA.is_file(), reason=f"benchmark dataset not found at {DATA}"),
    pytest.mark.usefixtures("one_thread"),
]


def test_learned_spans_study_tiny(tokenizer: PreTrainedTokenizerBase, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script("learned_spans_study", monkeypatch)
    out = tmp_path / "study.json"
    args = script.parse_args(["--data", str(DATA), "--rows", "2", "--max-passage-tokens", "40", "--neighbours", "4",
                              "--contexts", "retrieved,gold", "-k", "4", "--ratios", "0.15,1", "--extra-passages", "2",
                              "--ttft-questions", "2", "--rounds", "1", "--overhead-repeats", "2",
                              "--answer-tokens", "2", "--out", str(out)])
    script.study(tiny_engine(tokenizer), args)
    doc = json.loads(out.read_text())
    for mode in ("retrieved", "gold"):
        summary, rows = doc["quality"][mode]["summary"], doc["quality"][mode]["rows"]
        assert len(rows) == 2 and summary["full_attention"]["kl_mean"] == 0
        # every method answered the same prompt: recomputing everything gives full attention's answer
        for name in ("learned_spans@1", "fusionrag_drift@1", "cacheblend@1"):
            assert summary[name]["kl_mean"] < 1e-6 and summary[name]["agreement"] == 1, (name, summary[name])
        for r in rows:
            # the learned spans were reused: computed after other text, so not the exact K/V
            assert r["reused_tokens"]["learned_spans@0.15"] > 0 and r["kl"]["learned_spans_full_reuse"] > 0
            assert r["selector"]["learned_spans@0.15"] == "drift_aware"
            assert r["selector"]["cacheblend@0.15"] == "kv_deviation"
        assert summary["learned_spans_over_cacheblend@0.15"]["kl_mean_ratio"] is not None
    ask = doc["second_ask"]
    assert len(ask["pairs"]) == 2
    for pair in ask["pairs"]:
        assert pair["first"]["reused_tokens"] == 0 < pair["second"]["reused_tokens"]
        assert pair["second"]["cache_misses"] == 0 and pair["ttft_s_ratio"] > 0
        assert pair["learn_off"]["reused_tokens"] == 0 and pair["ttft_s_second_over_learn_off"] > 0
    product = doc["second_ask_shared_documents"]
    assert len(product["pairs"]) == 2
    for pair in product["pairs"]:
        # the second ask repeats the first's prompt: answered from the K/V the first left
        assert pair["first"]["prefix_cached_tokens"] < pair["second"]["prefix_cached_tokens"]
        assert pair["second"]["recomputed_tokens"] == 0 and pair["second"]["cache_misses"] == 0
    overhead = doc["overhead"]
    assert len(overhead["pairs"]) == 2 and overhead["summary"]["learned_spans"] > 0
    assert all(p[m]["reused_tokens"] == 0 for p in overhead["pairs"] for m in ("learn_on", "learn_off"))
    assert set(doc["goals"]) == {"quality_retrieved@0.15", "quality_retrieved@1", "quality_gold@0.15",
                                 "quality_gold@1", "second_ask_ttft_learned_spans",
                                 "second_ask_ttft_shared_documents", "overhead_ttft"}
    assert doc["load_before"]["loadavg"] and doc["threads"] >= 1


def test_quality_only_runs_the_quality_part_alone(tokenizer: PreTrainedTokenizerBase, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script("learned_spans_study", monkeypatch)
    out = tmp_path / "study.json"
    args = script.parse_args(["--data", str(DATA), "--rows", "2", "--max-passage-tokens", "40", "--neighbours", "4",
                              "--contexts", "gold", "-k", "4", "--extra-passages", "2", "--quality-only",
                              "--out", str(out)])
    script.study(tiny_engine(tokenizer), args)
    doc = json.loads(out.read_text())
    assert len(doc["quality"]["gold"]["rows"]) == 2
    assert doc["second_ask"] is None and doc["second_ask_shared_documents"] is None and doc["overhead"] is None
    assert set(doc["goals"]) == {"quality_gold@0.15"}


def test_learned_drift_is_the_spans_drift_from_itself_alone(tokenizer: PreTrainedTokenizerBase, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`--learned-drift`: a learned span's cache gets `fusion_drift` against the span alone after the
    system prefix: zero for none of its tokens, since it was learned after another passage."""
    script = load_script("learned_spans_study", monkeypatch)
    engine = tiny_engine(tokenizer)
    session = script.ReuseSession(engine, None, script.ReuseConfig(learned_dir=tmp_path / "learned"))
    one = script.RequestOptions(sampling=script.SamplingConfig(max_new_tokens=1))
    passages = ["The keeper of the north light logged forty storms in one winter.",
                "Gull Point's lighthouse was designed by an engineer from the harbour town."]
    script.answer(session, script.chat("Answer.", "Who designed it?", passages), one)
    prompt = session.prompt(script.chat("Answer.", "Who kept it?", passages[::-1]), session.sources(one))
    ids = [s.chunk_id for s in prompt.segments if s.found_by == "content"]
    assert len(ids) == 2
    script.add_learned_drift(engine, session, ids)
    learned = session.learned()
    for chunk_id in ids:
        kv = learned.store.get(chunk_id, "fused", fingerprint=engine.fingerprint)
        assert kv.drift is not None and kv.drift.shape == (kv.num_tokens,)
    second = learned.store.get(ids[0], "fused", fingerprint=engine.fingerprint)  # learned after the other passage
    assert bool((second.drift > 0).all())
