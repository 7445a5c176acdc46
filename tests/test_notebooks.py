"""The cookbook notebooks run top to bottom, offline, and their chains/query engines really reuse caches.

Each notebook prints a JSON summary in a cell tagged "summary"; the tests read it back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fusionrag_core.recognise.marks import MARK_CHARS

nbformat = pytest.importorskip("nbformat", reason="pip install nbformat nbclient ipykernel")
nbclient = pytest.importorskip("nbclient", reason="pip install nbformat nbclient ipykernel")

COOKBOOK = Path(__file__).resolve().parents[1] / "cookbook"


def run_notebook(name: str, workdir: Path, *, ttft_rows: bool = True) -> dict[str, Any]:
    """Execute `cookbook/<name>` in `workdir`; returns the JSON its "summary" cell printed.

    With `ttft_rows`, the summary's "rows" (a FusionRAG vs full-attention TTFT comparison) are checked.
    """
    notebook = nbformat.read(COOKBOOK / name, as_version=4)
    # NOTE: run from a scratch directory, so a stray relative path could not touch the checkout.
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}}).execute()
    summary_cell = next(c for c in notebook.cells if "summary" in c.metadata.get("tags", []))
    summary: dict[str, Any] = json.loads(
        "".join(o["text"] for o in summary_cell.outputs if o.get("name") == "stdout"))
    if ttft_rows:
        assert_ttft_rows(summary)
    assert list(workdir.iterdir()) == [], "the notebook must write only to its own temporary directory"
    return summary


def assert_ttft_rows(summary: dict[str, Any]) -> None:
    """Every TTFT row reused chunk caches (full attention none) and answered with clean text."""
    assert summary["rows"], "the TTFT comparison produced no rows"
    for row in summary["rows"]:
        assert row["reused_tokens"] > 0 and row["full_reused_tokens"] == 0
        assert row["fusion_ttft_s"] > 0 and row["full_ttft_s"] > 0
        assert row["fusion_answer"].strip() and not any(m in row["fusion_answer"] for m in MARK_CHARS)


@pytest.mark.slow
def test_langchain_cookbook_runs_and_reuses_caches(tmp_path: Path) -> None:
    summary = run_notebook("langchain_rag.ipynb", tmp_path)
    assert summary["explicit_reused_tokens"] > 0 and summary["explicit_answer"].strip()


@pytest.mark.slow
def test_llamaindex_cookbook_runs_and_reuses_caches(tmp_path: Path) -> None:
    summary = run_notebook("llamaindex_query_engine.ipynb", tmp_path)
    assert all(row["full_answer"].strip() for row in summary["rows"])
    assert summary["query_engine_reused_tokens"] > 0 and summary["query_engine_answer"].strip()
    assert summary["streamed_equals_answer"] is True
    # the plain synthesizer's prompt carries no marks: its chunks are found by content
    assert summary["standard_reused_tokens"] > 0 and summary["plain_reused_tokens"] > 0


@pytest.mark.slow
def test_agentic_cookbook_runs_and_reuses_caches(tmp_path: Path) -> None:
    summary = run_notebook("agentic_rag.ipynb", tmp_path, ttft_rows=False)
    # the forced first call is a valid call of the retrieval tool; the second answers in text
    assert summary["tool_called"] is True
    assert set(summary["tool_args"]) == {"query"} and isinstance(summary["tool_args"]["query"], str)
    assert [call["tool_calls"] for call in summary["calls"]] == [["retrieve_context"], []]
    assert summary["final_answer"].strip() and not any(m in summary["final_answer"] for m in MARK_CHARS)
    # every retrieved passage was found in the tool message and served from its stored cache
    assert summary["final_cache_misses"] == 0 and summary["final_chunks_found"] == summary["retrieved_documents"] > 0
    assert summary["final_chunk_tokens"] > 0
    assert summary["final_reused_tokens"] >= 0.7 * summary["final_chunk_tokens"]


@pytest.mark.slow
def test_openai_server_cookbook_runs_and_reuses_caches(tmp_path: Path) -> None:
    summary = run_notebook("openai_server.ipynb", tmp_path, ttft_rows=False)
    # ChatOpenAI got a clean answer from the server, the same one twice (greedy) and when streamed
    answer = summary["answer"]
    assert answer.strip() and not any(m in answer for m in MARK_CHARS)
    assert summary["second_answer"] == answer and summary["streamed_equals_answer"] is True
    # the retrieved chunks were found by content in the prompt and served from their stored caches
    assert summary["first_cached_tokens"] > 0 and summary["second_cached_tokens"] > 0
    assert summary["second_cached_tokens"] < summary["prompt_tokens"] and summary["streamed_cached_tokens"] > 0
    stats = summary["stats"]
    assert stats["cache_misses"] == 0 and len(stats["chunk_found_by"]) == summary["retrieved_chunks"] == 2
    assert set(stats["chunk_found_by"].values()) == {"content"} and stats["reused_tokens"] > 0
    # usage counts the reused chunk tokens and the prefix cache, nothing else
    assert summary["streamed_cached_tokens"] == stats["reused_tokens"] + stats["prefix_cached_tokens"]
    # /metrics counted the four calls of the same prompt
    assert summary["metrics_reused_tokens"] == 4 * stats["reused_tokens"]
    assert summary["server_stopped"] is True


@pytest.mark.slow
def test_agents_file_search_cookbook_runs_and_reuses_caches(tmp_path: Path) -> None:
    summary = run_notebook("agents_file_search.ipynb", tmp_path, ttft_rows=False)
    # the search ran on the server with the question, and the answer cites the files it returned
    assert summary["queries"] == ["Who designed the Lumen lighthouse?"] and summary["results"]
    assert set(summary["citations"]) == set(summary["results"]) and summary["answer"].strip()
    assert not any(m in summary["answer"] for m in MARK_CHARS)
    # every retrieved chunk was found by its mark and >= 80% of its tokens were read from caches
    stats = summary["stats"]
    assert set(stats["chunk_found_by"].values()) == {"mark"} and stats["cache_misses"] == 0
    assert stats["reused_tokens"] >= 0.8 * (stats["reused_tokens"] + stats["recomputed_tokens"]) > 0
    assert stats["fused_chunks"] >= 1
    # the follow-up continued the first turn's kept K/V
    assert summary["follow_cached_tokens"] >= summary["first_input_tokens"]
    assert summary["server_stopped"] is True
