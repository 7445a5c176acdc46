"""TTFT of the selectors side by side at the same recompute ratio (CPU or GPU), with the probe split out.

For each MuSiQue row of a slice (passages cut to `--max-passage-tokens`, ~800-token prompts at 10
passages of 80 tokens), with the chunk caches already in memory (independent ones; `--fused`: each
passage fused after the row's other passages, with its fusion drift, as `drift_aware` reads it;
the store load is the same for all selectors), it times every selector in `--selectors` at
`--ratio` in rounds: each round runs every selector once, in an order rotated from round to round,
so machine drift hits them alike. Per request it keeps

* `ttft`: the engine's own time to first token (stitch + select + recompute + first sample);
* `select`: the selector alone (the query-guided probe, CacheBlend's early-layer pass), timed
  on a separately stitched buffer in the same round;
* `recompute`: the sparse pass alone, on that buffer.

The figure that matters is the paired ratio `ttft(selector) / ttft(reference)` of the same round
and row (the reference is `--reference`, default CacheBlend's `kv_deviation`): its median and
interquartile range over all rows x rounds say whether a difference is outside the noise of a
shared machine.

    python benchmarks/ttft_selectors.py --data ../shared/datasets/musique_dev.jsonl \
        --skip 0 --rows 4 --rounds 8 --out bench-out/ttft_selectors.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fusionrag_core.bench.data import load_rows
from fusionrag_core.bench.runner import row_passages
from fusionrag_core.engine import EngineConfig, FusionEngine
from fusionrag_core.query.drift import fusion_drift
from fusionrag_core.query.recompute import recompute
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.query.select import SelectConfig, get_selector
from fusionrag_core.query.stitch import stitch
from fusionrag_core.runtime.kv import ChunkKV


def quartiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "n": len(xs)}


def phases(engine: FusionEngine, prompt: Any, caches: dict[str, Any], selector: str,
           ratio: float) -> tuple[float, float]:
    """(select, recompute) seconds of one request, run as `FusionEngine` runs them."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    exact = torch.equal(prompt.prefix.cpu(), engine.layout.prefix_ids(engine.config.instruction))
    st = stitch(engine.decoder, prompt, engine.system_prefix(prompt.prefix), lambda cid, _first: caches.get(cid),
                extra_capacity=1, exact_prefix=exact)
    cfg = SelectConfig(ratio)
    sync()
    t0 = time.perf_counter()
    selected = get_selector(selector)(st, cfg.budget(st.num_reused_tokens), cfg)
    sync()
    t1 = time.perf_counter()
    recompute(st, selected)
    sync()
    return t1 - t0, time.perf_counter() - t1


def row_caches(engine: FusionEngine, passages: list[str], r: int, fused: bool) -> dict[str, ChunkKV]:
    """The row's chunk caches: independent, or each fused after the others (with its drift)."""
    alone = {f"r{r}p{j}": engine.chunk_cache(text) for j, text in enumerate(passages)}
    if not fused:
        return alone
    out = {}
    for j, (cid, text) in enumerate(zip(alone, passages, strict=True)):
        kv = replace(engine.chunk_cache(text, [c for i, c in enumerate(alone.values()) if i != j]), variant="fused")
        out[cid] = replace(kv, drift=fusion_drift(kv, alone[cid], engine.decoder.rope))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--model", default=None, help="smollm2-135m (default) or gemma3-270m, or a path")
    p.add_argument("--skip", type=int, default=0, help="first row of the slice")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--max-passage-tokens", type=int, default=80)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--rounds", type=int, default=8, help="timed rounds per row (after one warm-up round)")
    p.add_argument("--selectors", default="kv_deviation,query_guided,drift_aware",
                   help="comma-separated selector names, each optionally @ratio; default ratio: --ratio")
    p.add_argument("--reference", default="kv_deviation")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--fused", action="store_true",
                   help="fuse each passage after the row's other passages (with its drift), not independent caches")
    p.add_argument("--mkl-linears", action="store_true",
                   help="projections on torch's F.linear (MKL), not packed oneDNN weights (EngineConfig)")
    args = p.parse_args(argv)
    selectors = [s for s in args.selectors.split(",") if s]
    ratios = {s: float(s.split("@")[1]) if "@" in s else args.ratio for s in selectors}
    if args.reference not in selectors:
        raise SystemExit(f"--reference {args.reference} must be one of --selectors")
    engine = FusionEngine.from_pretrained(args.model, config=EngineConfig(packed_linears=not args.mkl_linears))
    one = SamplingConfig(max_new_tokens=1)
    rows = load_rows(args.data, args.skip + args.rows)[args.skip:]
    ttft: dict[str, list[float]] = {s: [] for s in selectors}
    select_s: dict[str, list[float]] = {s: [] for s in selectors}
    recompute_s: dict[str, list[float]] = {s: [] for s in selectors}
    paired: dict[str, list[float]] = {s: [] for s in selectors}
    share: dict[str, list[float]] = {s: [] for s in selectors}  # recomputed / reused chunk tokens
    prompt_tokens = []
    for r, row in enumerate(rows):
        passages = row_passages(row, engine, args.max_passage_tokens)
        caches = row_caches(engine, passages, r, args.fused)
        prompt = engine.prompt(row.question, chunks=list(zip(caches, passages, strict=True)))
        prompt_tokens.append(prompt.num_tokens)
        for k in range(args.rounds + 1):  # round 0 warms up
            shift = (k + r) % len(selectors)
            this: dict[str, float] = {}
            for s in selectors[shift:] + selectors[:shift]:
                gen = engine.generate(prompt, caches=caches, selector=s.split("@")[0], ratio=ratios[s], sampling=one)
                this[s] = gen.ttft_s
                share[s].append(gen.recomputed_tokens / (gen.recomputed_tokens + gen.reused_tokens))
                sel, rec = phases(engine, prompt, caches, s.split("@")[0], ratios[s])
                if k:
                    select_s[s].append(sel)
                    recompute_s[s].append(rec)
            if k:
                for s in selectors:
                    ttft[s].append(this[s])
                    paired[s].append(this[s] / this[args.reference])
    out = {
        "model": engine.name,
        "device": str(engine.device),
        "threads": torch.get_num_threads(),
        "packed_linears": engine.config.packed_linears,
        "fused": args.fused,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "rows": f"{args.skip}-{args.skip + len(rows) - 1}",
        "ratio": args.ratio,
        "rounds": args.rounds,
        "prompt_tokens_mean": statistics.mean(prompt_tokens),
        "reference": args.reference,
        "selectors": {
            s: {"ttft_ms": {k: v * 1e3 if k != "n" else v for k, v in quartiles(ttft[s]).items()},
                "select_ms": statistics.median(select_s[s]) * 1e3,
                "recompute_ms": statistics.median(recompute_s[s]) * 1e3,
                "recomputed_share_mean": statistics.mean(share[s]),
                f"ttft_over_{args.reference}": quartiles(paired[s])}
            for s in selectors
        },
        "uptime": os.getloadavg(),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
