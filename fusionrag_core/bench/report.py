"""The benchmark's outputs: results.json, a markdown table and matplotlib plots.

Everything here reads the results document that `runner.run_benchmark` returns (the content of
results.json), so a report can be re-drawn from a saved results.json without re-running anything.

Plots are drawn on `matplotlib.figure.Figure` objects, not through pyplot: no global figure state,
no GUI backend, and nothing to close.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from fusionrag_core.bench.methods import FULL_ATTENTION, FULL_REUSE

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
QUALITY_PNG = "quality.png"
TTFT_PNG = "ttft.png"

_BASELINE_STYLE = {FULL_ATTENTION: ("black", "--"), FULL_REUSE: ("grey", ":")}


def write_report(results: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """Write results.json, results.md, quality.png and ttft.png into `out_dir` (created if needed).

    Args:
        results: the document `run_benchmark` returned.
        out_dir: the output directory.

    Returns:
        The paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / RESULTS_JSON, out / RESULTS_MD, out / QUALITY_PNG, out / TTFT_PNG]
    paths[0].write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(results), encoding="utf-8")
    plot_quality(results["results"], paths[2])
    plot_ttft(results["results"], paths[3])
    return paths


def load_results(path: str | Path) -> dict[str, Any]:
    """A results.json written by `write_report` (to re-draw its table and plots)."""
    return dict(json.loads(Path(path).read_text(encoding="utf-8")))


# ---- markdown -------------------------------------------------------------------------------------
_COLUMNS = (
    "method", "ratio", "F1", "EM", "norm. F1", "KL(FA‖m) 1st token", "1st-token agree", "F1 vs FA",
    "TTFT median (ms)", "TTFT / FA", "recomputed", "KV loaded (MB)",
)


def _num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """The per-(method, ratio) summaries as a markdown table, in their given order."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for s in summaries:
        cells = [
            s["method"],
            "–" if s["ratio"] is None else f"{s['ratio']:g}",
            _num(s["f1"]),
            _num(s["em"]),
            _num(s["normalized_f1"]),
            _num(s["kl_first_token"], 4),
            _pct(s["first_token_agreement"]),
            _num(s["f1_vs_full_attention"]),
            _num(1000 * s["ttft_median_s"], 1),
            _num(s["ttft_ratio_vs_full_attention"], 2),
            _pct(s["recomputed_fraction"]),
            _num(s["kv_bytes_loaded"] / 1e6, 2),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _rows(results: Mapping[str, Any]) -> str:
    """`10 rows` or, for a slice that does not start at row 0, `rows 10-14`."""
    first, n = int(results.get("first_row") or 0), int(results["rows"])
    return f"rows {first}-{first + n - 1}" if first else f"{n} rows"


def markdown(results: Mapping[str, Any]) -> str:
    """results.md: a heading naming model and data, the table, ingest throughput and how it was run."""
    ingest = results["ingest"]
    ind, fused = ingest["independent_chunks_per_min"], ingest["fused_chunks_per_min"]
    parts = [
        f"# FusionRAG benchmark: {results['model']} on {Path(results['dataset']).name} "
        f"({_rows(results)}, {results['device']} {results['dtype']})\n",
        _corpus_line(results.get("corpus")),
        table(results["results"]),
        f"Ingest throughput: independent caches {_num(ind, 1)} chunks/min, fused caches {_num(fused, 1)} chunks/min"
        + (f" ({ind / fused:.1f}× slower)" if ind and fused else "") + ".\n",
        "KL is KL(full attention ‖ method) of the first generated token's distribution; normalized F1 is "
        "(F1 − F1 full reuse) / (F1 full attention − F1 full reuse); TTFT is "
        f"{results['ttft']}.\n",
    ]
    if results.get("command"):
        parts.append("Command: `" + " ".join(results["command"]) + "`\n")
    return "\n".join(parts)


def _corpus_line(corpus: Mapping[str, Any] | None) -> str:
    """How the prompts' passages were ingested and chosen (results.json from before corpus modes: per row)."""
    if not corpus:
        return "Corpus: one per row (each row's passages ingested alone).\n"
    where = ("one shared corpus of every row's passages" if corpus["mode"] == "shared"
             else "one corpus per row")
    what = (f"the top-{corpus['k']} retrieved chunks (gold-passage recall {_pct(corpus['gold_passage_recall'])})"
            if corpus["context"] == "retrieved" else "each row's own passages")
    return (f"Corpus: {where} ({corpus['passages']} passages); prompts hold {what}; "
            f"{_pct(corpus['same_prompt_neighbour_share'])} of a prompt chunk's fused neighbours are chunks of "
            "the same prompt.\n")


# ---- plots ----------------------------------------------------------------------------------------
def _by_method(summaries: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for s in summaries:
        groups.setdefault(s["method"], []).append(s)
    return groups


def _quality_panel(ax: Axes, summaries: Sequence[Mapping[str, Any]], key: str, title: str) -> None:
    """One quality metric against the recompute ratio: a line per method, baselines as horizontal lines."""
    if all(s[key] is None for s in summaries):
        ax.text(0.5, 0.5, "n/a (full attention and full reuse\nscore the same, or one was not run)",
                ha="center", va="center", transform=ax.transAxes)
    for method, group in _by_method(summaries).items():
        points = [(s["ratio"], s[key]) for s in group if s[key] is not None and math.isfinite(s[key])]
        if not points:
            continue
        if group[0]["ratio"] is None:  # NOTE: a baseline has one value, at no ratio.
            color, style = _BASELINE_STYLE.get(method, ("grey", "-."))
            ax.axhline(points[0][1], color=color, linestyle=style, label=method)
        else:
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
    ax.set_title(title)
    ax.set_xlabel("recompute ratio")
    ax.grid(alpha=0.3)


def plot_quality(summaries: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    """F1, normalized F1 and first-token KL against the recompute ratio, per method."""
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    axes = fig.subplots(1, 3)
    _quality_panel(axes[0], summaries, "f1", "answer F1")
    _quality_panel(axes[1], summaries, "normalized_f1", "normalized F1 (FR = 0, FA = 1)")
    _quality_panel(axes[2], summaries, "kl_first_token", "first-token KL(FA ‖ method)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center")
    fig.savefig(path, dpi=110)


def plot_ttft(summaries: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    """Median TTFT of every (method, ratio), with full attention's as a reference line."""
    names = [s["method"] if s["ratio"] is None else f"{s['method']} @ {s['ratio']:g}" for s in summaries]
    values = [1000 * s["ttft_median_s"] for s in summaries]
    colors = {m: f"C{i}" for i, m in enumerate(_by_method(summaries))}
    fig = Figure(figsize=(8, 0.35 * len(names) + 1.5), layout="constrained")
    ax = fig.subplots()
    ax.barh(range(len(names)), values, color=[colors[s["method"]] for s in summaries])
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    for s, v in zip(summaries, values, strict=True):
        if s["method"] == FULL_ATTENTION:
            ax.axvline(v, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("median time to first token (ms)")
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=110)


__all__ = ["QUALITY_PNG", "RESULTS_JSON", "RESULTS_MD", "TTFT_PNG", "load_results", "markdown", "plot_quality",
           "plot_ttft", "table", "write_report"]
