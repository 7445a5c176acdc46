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
