"""benchmarks/ttft_scale.py (the GPU TTFT-at-scale probe) runs end to end on CPU with a tiny shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.tests.conftest import load_script


@pytest.mark.usefixtures("one_thread")
def test_ttft_scale_tiny_on_cpu(tokenizer_path: Path, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script("ttft_scale", monkeypatch)
    out = tmp_path / "out"
    script.main(["--tokenizer", str(tokenizer_path), "--out", str(out), "--shapes", "tiny", "--tokens", "256,512",
                 "--chunk-tokens", "128", "--repeats", "1", "--device", "cpu"])
    doc = json.loads((out / "ttft_scale.json").read_text())
    check, *timed = doc["results"]
    assert check["ratio_1_check"]["kl"] < 1e-6 and check["ratio_1_check"]["same_argmax"] == 1.0
    attention = check["attention_check"]
    assert attention["max_abs_diff"] < 1e-4 and attention["scores_vs_visible"] < 2  # short prompts: tails weigh more
    assert [r["tokens"] > n for r, n in zip(timed, (256, 512), strict=True)] == [True, True]
    for r in timed:
        assert set(r["ttft_s"]) == {"full_attention", "full_reuse", "query_guided@0.15", "cacheblend@0.15",
                                    "query_guided@0.15 (disk)", "query_guided@0.15 (disk int8)",
                                    "query_guided@0.15 (host tier)", "query_guided@0.15 (GPU tier)"}
        assert all(t > 0 for t in r["ttft_s"].values())
    assert "| tiny |" in (out / "ttft_scale.md").read_text()
