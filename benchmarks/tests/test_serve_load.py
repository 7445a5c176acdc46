"""`benchmarks/serve_load.py` end to end with the packaged model on the sample corpus, tiny counts:
every streamed answer is compared with its in-process answer, reuse shows in `cached_tokens`, and
a refused or unfinished request is counted as an error (by status), never dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.tests.conftest import load_script
from fusionrag_core.engine import FusionEngine

pytestmark = pytest.mark.slow


def test_serve_load_small_run(default_engine: FusionEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script("serve_load", monkeypatch)
    args = script.parse_args(["--requests", "6", "--clients", "3", "--max-tokens", "6", "--questions", "2",
                              "--hostile-clients", "1", "--out", str(tmp_path / "out")])
    assert script.run(default_engine, args) == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    server, local = doc["server"], doc["in_process"]
    assert doc["settings"]["requests"] == 6 and doc["settings"]["clients"] == 3
    assert server["requests"] == 6 and server["ok"] == 6 and server["errors"] == {}
    # every streamed answer is its in-process answer, and not an empty one
    assert server["answers_equal"] == 6 and server["mismatches"] == []
    assert all(a.strip() for a in doc["reference_answers"])
    assert 0 < server["ttft_s"]["p50"] <= server["ttft_s"]["p95"] <= server["ttft_s"]["max"]
    assert server["ttft_s"]["p95"] <= server["latency_s"]["max"]
    # the RAG prompts' chunks were served from their stored caches, over HTTP as in-process
    assert 0 < server["cached_tokens"] < server["prompt_tokens"] and 0 < server["cached_share"] < 1
    assert local["requests"] == 6 and local["cached_tokens"] == server["cached_tokens"]
    assert server["output_tokens"] == local["output_tokens"] > 0 and server["requests_per_s"] > 0
    # the server's own metrics counted the same requests
    assert doc["metrics"]["fusionrag_requests_total"] == 6
    assert doc["metrics"]["fusionrag_completion_tokens_total"] == server["output_tokens"]
    assert "/tmp/" not in json.dumps(doc["settings"])  # no machine path in what the docs cite
    # with a hostile client beside them, the same requests got the same answers; every hostile
    # request was refused as the client's error (4xx in OpenAI's shape) or cut off, none was a 5xx
    hostile = doc["hostile"]
    for run in (hostile["server"], hostile["server_after"]):
        assert run["ok"] == 6 and run["answers_equal"] == 6 and run["errors"] == {}
    statuses = [status for counts in hostile["statuses"].values() for status in counts]
    assert hostile["sent"] >= 1 and statuses
    assert all(s.startswith(("400 ", "404 ", "408 ", "closed", "held")) for s in statuses), statuses
    assert hostile["ttft_p95_ratio"] is not None and hostile["ttft_p95_ratio"] > 0


def test_serve_load_counts_refused_and_unfinished_requests(default_engine: FusionEngine, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script("serve_load", monkeypatch)
    # one generating, none waiting: of 4 concurrent clients, those that find the slot taken get 429
    args = script.parse_args(["--requests", "4", "--clients", "4", "--max-tokens", "24", "--questions", "1",
                              "--max-running", "1", "--max-waiting", "0", "--out", str(tmp_path / "out")])
    assert script.run(default_engine, args) == 1  # errors fail the run
    server = json.loads((tmp_path / "out" / "results.json").read_text())["server"]
    assert server["errors"].get("429", 0) >= 1
    assert server["ok"] + sum(server["errors"].values()) == server["requests"] == 4
    assert server["answers_equal"] == server["ok"]


def test_serve_load_stops_at_its_time_bound(default_engine: FusionEngine, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script("serve_load", monkeypatch)
    # the bound has passed before the in-process pass: its one reference answer is still computed,
    # the rest is not run, and every request of the load is counted as timed out, none left out
    args = script.parse_args(["--requests", "50", "--clients", "2", "--max-tokens", "4", "--questions", "1",
                              "--timeout", "0", "--out", str(tmp_path / "out")])
    assert script.run(default_engine, args) == 1
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    server, local = doc["server"], doc["in_process"]
    assert local["requests"] == 50 and local["ok"] == 1 and local["not_run"] == 49 and local["errors"] == {}
    assert server["requests"] == 50 and server["ok"] == 0 and server["errors"] == {"timeout": 50}
    assert len(doc["reference_answers"]) == 1
