"""`benchmarks/heal.py` end to end on a tiny random Llama (real tokenizer, real ingest): each
conversation's first turns and follow-ups run on the three engines, and the healed engine's
follow-up continues exact K/V and answers as full attention does."""

from __future__ import annotations

import json
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


@pytest.fixture()
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    load_script("serving", monkeypatch)  # NOTE: heal.py imports it by name
    return load_script("heal", monkeypatch)


def test_a_healed_follow_up_is_measured_beside_full_attention(script: ModuleType, tokenizer: PreTrainedTokenizerBase,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--data", str(DATA), "--rows", "2", "--max-passage-tokens", "24", "--neighbours", "2",
            "--max-tokens", "4", "--pause-s", "0", "--piece-tokens", "32", "--out", str(out)]
    assert script.main(argv, engine=tiny_engine(tokenizer)) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["summary"]["conversations"] == len(doc["conversations"]) == 2
    for record in doc["conversations"]:
        healed, plain, full = (record["followup"][n] for n in script.ENGINES)
        assert healed["healed_tokens"] > 0 and healed["approximate_tokens"] == 0
        assert plain["healed_tokens"] == 0 and plain["approximate_tokens"] > 0
        assert full["approximate_tokens"] == 0 and healed["token_ids"] == full["token_ids"]
        assert record["heal_s"] > 0 and sorted(record["followup_order"]) == sorted(script.ENGINES)
    assert doc["summary"]["same_greedy_followup_as_full_attention_fusionrag_healed"] == 2
    assert doc["heal_stats"]["heals"] >= 3  # the warm-up's and each conversation's first turn
    assert (out / "results.md").read_text().startswith("# Healing after a pause")


def test_an_arrival_mid_heal_is_measured_beside_one_with_nothing_to_heal(tokenizer: PreTrainedTokenizerBase,
                                                                          tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    load_script("serving", monkeypatch)
    script = load_script("heal_arrival", monkeypatch)
    out = tmp_path / "out"
    argv = ["--data", str(DATA), "--rows", "2", "--max-passage-tokens", "24", "--neighbours", "2",
            "--max-tokens", "2", "--pieces", "8,32", "--trials", "1", "--out", str(out)]
    assert script.main(argv, engine=tiny_engine(tokenizer)) == 0
    doc = json.loads((out / "results.json").read_text())
    assert [t["piece_tokens"] for t in doc["trials"]] == [8, 32, 8, 32]
    for t in doc["trials"]:
        assert t["ttft_mid_heal_s"] > 0 and t["ttft_no_heal_s"] > 0 and t["arrival_row"] == t["kept_row"] + 1
    assert all(d > 0 for ds in doc["heal_s"].values() for d in ds)
    assert doc["summary"]["8"]["trials"] == doc["summary"]["32"]["trials"] == 2
    assert (out / "results.md").read_text().startswith("# A request arriving mid-heal")


@pytest.mark.parametrize("context", [[], ["--retrieve", "3"]], ids=["gold", "retrieved"])
def test_answers_healed_in_flight_are_measured_beside_full_attention(tokenizer: PreTrainedTokenizerBase,
                                                                     tmp_path: Path, context: list[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    load_script("serving", monkeypatch)
    script = load_script("heal_answer", monkeypatch)
    out = tmp_path / "out"
    argv = ["--data", str(DATA), "--rows", "2", "--max-passage-tokens", "24", "--neighbours", "2",
            "--max-tokens", "24", "--pieces", "32,64", "--out", str(out), *context]
    assert script.main(argv, engine=tiny_engine(tokenizer)) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["engines"] == ["fusionrag", "healed_32", "healed_64", "full_attention"]
    for record in doc["rows"]:
        answers = record["answers"]
        assert answers["full_attention"]["same_whole"] and answers["fusionrag"]["answer_healed_at"] is None
        assert all(len(a["token_ids"]) == 24 and a["itl_s"] > 0 for a in answers.values())
        for name in ("healed_32", "healed_64"):
            at = answers[name]["answer_healed_at"]
            assert at is not None and 0 < at < 24  # the tiny prompts heal within the answer
    assert doc["summary"]["full_attention"]["same_whole"] == 2 == doc["summary"]["rows"]
    assert doc["summary"]["full_attention"]["same_first_token"] == 2
    if context:  # NOTE: 3 passages of the whole corpus per question, not the row's own
        assert all(len(record["chunks"]) == 3 for record in doc["rows"])
    assert (out / "results.md").read_text().startswith("# Healing answers in flight")
    assert (out / "identity.png").stat().st_size > 0
