"""The LlamaIndex cookbook notebook runs top to bottom, offline, and its query engines really reuse caches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install nbformat nbclient ipykernel")
nbclient = pytest.importorskip("nbclient", reason="pip install nbformat nbclient ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[1] / "cookbook" / "llamaindex_query_engine.ipynb"


@pytest.mark.slow
def test_llamaindex_cookbook_runs_and_reuses_caches(tmp_path: Path) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # NOTE: run from a scratch directory, so a stray relative path could not touch the checkout.
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()

    summary_cell = next(c for c in notebook.cells if "summary" in c.metadata.get("tags", []))
    summary = json.loads("".join(o["text"] for o in summary_cell.outputs if o.get("name") == "stdout"))
    assert summary["rows"], "the TTFT comparison produced no rows"
    for row in summary["rows"]:
        assert row["reused_tokens"] > 0 and row["full_reused_tokens"] == 0
        assert row["fusion_ttft_s"] > 0 and row["full_ttft_s"] > 0
        assert row["fusion_answer"].strip() and row["full_answer"].strip()
    assert summary["query_engine_reused_tokens"] > 0 and summary["query_engine_answer"].strip()
    assert summary["streamed_equals_answer"] is True
    assert summary["standard_reused_tokens"] > 0 and summary["plain_reused_tokens"] == 0
    assert list(tmp_path.iterdir()) == [], "the notebook must write only to its own temporary directory"
