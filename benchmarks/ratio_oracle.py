"""The best any per-request ratio choice could do: an oracle over measured per-row KLs.

Given per-row first-token KLs of one selector at several ratios (`benchmarks/selection_study.py`'s
JSON, or `fusionrag bench`'s results.json `per_row`), it picks for every row the ratio that
minimises the mean KL subject to an average recompute share of at most `--budget` (exact dynamic
programme over the rows; shares in units of 0.25%). A real adaptive signal can only do worse, so
if this misses a target at that average, no adaptive mode over these ratios meets it.

    python benchmarks/ratio_oracle.py benchmarks/results/drift-explore/smol-grid.json --selector drift_aware
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

UNIT = 0.0025


def per_row(doc: dict[str, Any], selector: str) -> list[dict[str, tuple[float, float]]]:
    """Per row: label -> (share, KL) of the selector's plain specs (`selector@ratio`)."""
    out = []
    if "per_row" in doc:  # fusionrag bench results.json: labels are method@ratio
        for row in doc["per_row"]:
            out.append({k: (row["recomputed_fraction"][k], v) for k, v in row["kl_first_token"].items()
                        if k.split("@")[0] == selector and "@" in k})
    else:
        for row in doc["rows"]:
            out.append({k: (row["share"][k], v) for k, v in row["kl"].items()
                        if k.split("@")[0] == selector and ":" not in k})
    if not out or not out[0]:
        raise SystemExit(f"no plain {selector}@ratio results in the file")
    return out


def oracle(rows: list[dict[str, tuple[float, float]]], budget: float) -> tuple[float, float, list[str]]:
    """(mean KL, mean share, label per row) of the best choice at mean share <= budget."""
    cap = round(budget * len(rows) / UNIT)
    best: dict[int, tuple[float, list[str]]] = {0: (0.0, [])}
    for row in rows:
        nxt: dict[int, tuple[float, list[str]]] = {}
        for used, (kl, picks) in best.items():
            for label, (share, k) in row.items():
                u = used + round(share / UNIT)
                if u <= cap and (u not in nxt or nxt[u][0] > kl + k):
                    nxt[u] = (kl + k, [*picks, label])
        best = nxt
    if not best:
        raise SystemExit(f"no choice fits an average share of {budget}")
    used, (kl, picks) = min(best.items(), key=lambda item: item[1][0])
    return kl / len(rows), used * UNIT / len(rows), picks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--selector", default="drift_aware", help="spec prefix (study) or method (bench)")
    ap.add_argument("--budget", type=float, default=0.075, help="largest average recompute share")
    args = ap.parse_args()
    rows = per_row(json.loads(args.results.read_text()), args.selector)
    labels = sorted(rows[0], key=lambda k: rows[0][k][0])
    for label in labels:
        print(f"fixed {label:40s} KL {sum(r[label][1] for r in rows) / len(rows):.4f}")
    kl, share, picks = oracle(rows, args.budget)
    print(f"oracle at <= {args.budget:g} average: KL {kl:.4f} at {share:.4f} "
          f"({', '.join(p.split('@')[1] for p in picks)})")


if __name__ == "__main__":
    main()
