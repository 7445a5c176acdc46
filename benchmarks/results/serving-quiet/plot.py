"""The four runs of this folder side by side: output tokens/s per configuration (runs.png).

Reads each run's results.json; run from the repository root:
`.venv/bin/python benchmarks/results/serving-quiet/plot.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

HERE = Path(__file__).resolve().parent
RUNS = ["budget90", "budget60-a", "budget60-b", "one-user"]
CONFIGS = [("fusionrag", True), ("fusionrag", False), ("full_attention", True), ("full_attention", False)]
COLORS = {"fusionrag": "tab:red", "full_attention": "black"}


def main() -> None:
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    width = 0.2
    for i, run in enumerate(RUNS):
        results = json.loads((HERE / run / "results.json").read_text(encoding="utf-8"))
        by_config = {(c["method"], c["scheduler"]): c for c in results["configurations"]}
        for j, key in enumerate(CONFIGS):
            if key not in by_config:
                continue
            value = by_config[key]["output_tokens_per_s"]
            x = i + (j - 1.5) * width
            ax.bar(x, value, width, color=COLORS[key[0]], alpha=1.0 if key[1] else 0.4,
                   label=f"{key[0]}, scheduler {'on' if key[1] else 'off'}" if i == 0 else None)
            ax.text(x, value, f"{value:.1f}", ha="center", va="bottom", fontsize=7)
    settings = [json.loads((HERE / r / "results.json").read_text(encoding="utf-8"))["settings"] for r in RUNS]
    labels = [f"{r}\n{s['users'][0]} user{'s' if s['users'][0] > 1 else ''}, {s['budget_s']:.0f} s"
              for r, s in zip(RUNS, settings, strict=True)]
    ax.set_xticks(range(len(RUNS)), labels)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Serving at c1b46e8, SmolLM2-135M, 2-core CPU, nothing else running", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "runs.png", dpi=100)


if __name__ == "__main__":
    main()
