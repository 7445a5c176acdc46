"""`benchmarks/serving.py` end to end on a tiny random Llama (real tokenizer, real ingest, both engine
paths): every method x scheduler x users configuration is measured and reported, follow-up turns are
recorded against their first turn, and work the budget leaves undone is counted, not dropped."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest
from transformers import PreTrainedTokenizerBase

from benchmarks.tests.conftest import load_script
from tests.ingest_worker import tiny_engine

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "datasets" / "musique_dev.jsonl"

pytestmark = [
    pytest.mark.skipif(not DATA.is_file(), reason=f"benchmark dataset not found at {DATA}"),
    pytest.mark.usefixtures("one_thread"),
]
METHODS = ("full_attention", "cacheblend", "fusionrag")


@pytest.fixture()
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_script("serving", monkeypatch)


def _argv(out: Path, *extra: str) -> list[str]:
    return ["--data", str(DATA), "--rows", "3", "--max-passage-tokens", "24", "--neighbours", "2",
            "--max-tokens", "4", "--no-stop", "--out", str(out), *extra]


def test_every_configuration_is_measured(script: ModuleType, tokenizer: PreTrainedTokenizerBase,
                                         tmp_path: Path) -> None:
    out = tmp_path / "out"
    # 3 requests at a 0.5 follow-up share: conversation 0 has a follow-up, conversation 1 not
    argv = _argv(out, "--users", "1,2", "--requests", "3", "--followups", "0.5", "--goal-users", "2")
    assert script.main(argv, engine=tiny_engine(tokenizer)) == 0
    doc = json.loads((out / "results.json").read_text())
    configs = doc["configurations"]
    assert [(c["users"], c["method"], c["scheduler"]) for c in configs] == [
        (u, m, s) for u in (1, 2) for m in METHODS for s in (True, False)]
    for c in configs:
        assert c["warmup"] == "ok" and c["errors"] == {} and c["cache_misses"] == 0
        assert c["requests"] == c["completed"] == 3 and c["cut"] == c["not_run"] == 0
        turns = c["turns"]
        first_rows = [t["row"] for t in turns if t["turn"] == 0]
        assert sorted(first_rows) == [0, 1]  # fresh questions: each row asked once, the warm-up row never
        assert c["output_tokens"] == sum(t["output_tokens"] for t in turns) == 3 * 4  # --no-stop: 4 tokens each
        assert 0 < c["ttft_first_turn_s"]["p50"] <= c["ttft_first_turn_s"]["p95"] <= c["wall_s"]
        assert c["requests_per_s"] == pytest.approx(3 / c["wall_s"], rel=1e-2)
        assert c["itl_s"]["n"] == 3 and c["itl_s"]["p50"] > 0
        followups = c["followups"]
        assert followups["planned"] == followups["completed"] == 1 and followups["ttft_ratio_median"] > 0
        (later,) = [t for t in turns if t["turn"] == 1]
        (before,) = [t for t in turns if t["turn"] == 0 and t["conversation"] == later["conversation"]]
        assert followups["ttft_ratios"] == [pytest.approx(later["ttft_s"] / before["ttft_s"], rel=1e-3)]
        # the follow-up's prompt holds the whole first prompt, then (re-tokenized) the answer, then more
        assert later["prompt_tokens"] > later["first_prompt_and_answer_tokens"] == before["prompt_tokens"] + 4
        assert later["shared_prefix_tokens"] >= before["prompt_tokens"]
        assert ("mean_batch" in c) == c["scheduler"] == ("mean_pack" in c)
        if c["scheduler"]:
            assert c["sparse_passes"] >= 1 and c["mean_pack"] >= 1
        # the reuse methods serve the passages from their chunk caches; full attention computes them
        if c["method"] != "full_attention":
            plain = next(p for p in configs if (p["method"], p["scheduler"], p["users"]) == (
                "full_attention", c["scheduler"], c["users"]))
            assert c["reuse_ratio_first_turn"] > plain["reuse_ratio_first_turn"] + 0.5
    assert doc["settings"]["selectors"] == {"full_attention": "full_attention", "cacheblend": "kv_deviation",
                                            "fusionrag": "drift_aware"}
    measured = [g for g in doc["goals"] if g["met"] is not None]
    assert len(doc["goals"]) == len(measured) == 3 + len(configs)  # 1 and 2 users ran: every ratio is measured
    tps = {(c["method"], c["scheduler"], c["users"]): c["output_tokens_per_s"] for c in configs}
    assert doc["goals"][0]["value"] == pytest.approx(tps[("fusionrag", True, 2)] / tps[("fusionrag", False, 2)],
                                                     abs=1e-3)
    assert all(s["compared"] == 3 for s in doc["same_answers_scheduler_on_off"])
    env = doc["environment"]
    assert env["cpus"] >= 1 and env["torch_threads"] == 1 and len(env["load_start"]) == len(env["load_end"]) == 3
    assert doc["command"][1:] == argv
    assert "| 2 | fusionrag | off | off | 3 / 3 |" in (out / "results.md").read_text()
    assert (out / "throughput.png").stat().st_size > 0 and (out / "ttft.png").stat().st_size > 0


def test_healing_on_and_off_are_configurations_of_one_run(script: ModuleType, tokenizer: PreTrainedTokenizerBase,
                                                          tmp_path: Path) -> None:
    """`--heal off,8` with think time: the scheduler's configuration runs healing off and on (the engine
    heals kept turns in the pause), the scheduler-off one once; the healing goal is their ratio."""
    out = tmp_path / "out"
    argv = _argv(out, "--users", "2", "--requests", "4", "--followups", "1", "--think-s", "0.5,1",
                 "--methods", "fusionrag", "--heal", "off,8", "--goal-users", "2")
    assert script.main(argv, engine=tiny_engine(tokenizer)) == 0
    doc = json.loads((out / "results.json").read_text())
    configs = doc["configurations"]
    assert [(c["scheduler"], c["heal"]) for c in configs] == [(True, None), (True, 8), (False, None)]
    off, healed, _ = configs
    assert "heal_stats" not in off and healed["heal_stats"]["heals"] >= 1 and healed["heal_stats"]["heal_pieces"] >= 1
    assert all(c["completed"] == c["requests"] == 4 for c in configs)
    (goal,) = [g for g in doc["goals"] if "healing in 8-token pieces on / off" in g["goal"]]
    assert goal["value"] == pytest.approx(healed["output_tokens_per_s"] / off["output_tokens_per_s"], abs=1e-3)
    assert "| 2 | fusionrag | on | 8 | 4 / 4 |" in (out / "results.md").read_text()


def test_undone_work_is_counted(script: ModuleType, tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # more requests than rows (stop at the rows, say so), and a budget over before the first request
    argv = _argv(out, "--users", "1", "--requests", "10", "--followups", "0.3", "--methods", "fusionrag",
                 "--schedulers", "on", "--budget-s", "1e-9")
    assert script.main(argv, engine=tiny_engine(tokenizer)) == 0
    doc = json.loads((out / "results.json").read_text())
    assert "3 rows" in doc["note"]
    (c,) = doc["configurations"]
    assert c["conversations"] == 3 and c["requests"] == 3 + 1  # conversation 0 has the only follow-up
    assert c["not_run"] == c["requests"] and c["completed"] == 0 and c["requests_per_s"] == 0
    assert c["ttft_first_turn_s"]["p50"] is None and all(g["met"] is None for g in doc["goals"])
    assert "| 1 | fusionrag | on | off | 0 / 4 | 0 | 4 |" in (out / "results.md").read_text()


def test_an_answer_past_the_deadline_is_cut(script: ModuleType, tokenizer: PreTrainedTokenizerBase) -> None:
    engine = tiny_engine(tokenizer)
    serving = script.Serving(engine, script.SERVED["full_attention"], 0.15, None,
                             script.SamplingConfig(max_new_tokens=8))
    turn = script.Turn(0, 0, 0)
    script.run_turn(serving, turn, [{"role": "user", "content": "Where is the lighthouse?"}], deadline=-math.inf)
    assert turn.status == "cut" and turn.output_tokens == 1 and turn.answer and turn.tpot_s is None
    # its slot was given back: the scheduler serves the next request to the end
    again = script.Turn(0, 0, 0)
    script.run_turn(serving, again, [{"role": "user", "content": "Where is the lighthouse?"}], deadline=math.inf)
    assert again.status == "ok" and again.output_tokens == 8 and again.answer.startswith(turn.answer)
