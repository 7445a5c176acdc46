"""benchmarks/ingest_scale.py (the ingest throughput bench, stage 3 of benchmarks/gpu_bench.sh) runs end to
end on CPU with a tiny random-weight shape, with the GPU stage's flags, and profiles by phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.tests.conftest import load_script
from fusionrag_core.data import sample_corpus_dir


@pytest.mark.usefixtures("one_thread")
def test_ingest_scale_tiny_shape_on_cpu(tokenizer_path: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script("ingest_scale", monkeypatch)
    passages = [{"text": p} for path in sorted(sample_corpus_dir().glob("*.md"))
                for p in path.read_text().split("\n\n") if len(p) > 200]
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"passages": passages}) + "\n")
    out = tmp_path / "out"
    # NOTE: stage 3 of gpu_bench.sh but for the device, the shape and the sizes.
    script.main(["--shape", "tiny", "--tokenizer", str(tokenizer_path), "--device", "cpu", "--dtype", "float32",
                 "--threads", "0", "--chunk-tokens", "48", "--chunks", "12", "--neighbours", "3", "--batches", "1,4",
                 "--prefill-tokens", "4096", "--data", str(data), "--profile", "--out", str(out)])
    doc = json.loads((out / "ingest_scale.json").read_text())
    one, four = doc["results"]
    assert (one["run"], four["run"]) == ("local batch 1", "local batch 4")
    assert one["chunks"] == four["chunks"] >= 12 and one["prefills"] == four["prefills"] == 2 * one["chunks"]
    for row in (one, four):
        phases = row["phases_s"]
        assert phases["all prefills (LLM forward passes)"] > 0 and phases["  of which: fused prefills"] > 0
        assert phases["all prefills (LLM forward passes)"] <= row["wall_s"] + 0.01
    assert doc["meta"]["profiled"] and doc["meta"]["git"]
    text = (out / "ingest_scale.md").read_text()
    assert "| local batch 4 |" in text and "| all prefills (LLM forward passes) |" in text
