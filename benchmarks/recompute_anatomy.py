"""Where a full prefill's and the recompute pass's CPU time goes: GEMMs, attention, everything else.

For one MuSiQue row (as `where_time_goes.py` builds it), it profiles (`torch.profiler`, self CPU
time per op) a full prefill and FusionRAG's recompute pass at `--ratio`, interleaved and repeated,
and splits each into the q/k/v/o projections, the MLP, the LM head, attention kernels, and
everything else (rope, buffer writes, gathers, norms, merges, planning, Python). Next to it:

* per-row GEMM cost at the recompute's row count vs the full prefill's (same weights);
* attention per query-key score: the pass's planned attention (scores it computes, padding
  included) vs the full prefill's causal kernel (`S (S + 1) / 2` scores per head);
* the exact floor: the pass's GEMMs at its token share, its attention at its *visible*-score share
  (`attention_share`), both at the full prefill's own per-row / per-score rates, plus nothing else.

    OMP_NUM_THREADS=1 python benchmarks/recompute_anatomy.py --data ../shared/datasets/musique_dev.jsonl \
        --max-passage-tokens 400 --out bench-out/anatomy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from fusionrag_core.bench.data import load_rows
from fusionrag_core.engine import FusionEngine
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.recompute import recompute
from fusionrag_core.query.select import SelectConfig, get_selector
from fusionrag_core.query.stitch import Stitched, stitch
from fusionrag_core.runtime import attention
from fusionrag_core.runtime.compat import tokenize_plain

ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_efficient_attention",
                 "aten::_scaled_dot_product_flash_attention")
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def gemm_names(engine: FusionEngine) -> dict[tuple[int, int], str]:
    """Weight shape `(in, out)` -> the projection it belongs to (q and o share a shape in SmolLM2)."""
    layer = engine.decoder.parts.layers[0]
    a, m = layer.self_attn, layer.mlp
    names: dict[tuple[int, int], str] = {}
    for name, mod in (("k/v", a.k_proj), ("q/o", a.q_proj), ("o", a.o_proj), ("mlp gate/up", m.gate_proj),
                      ("mlp down", m.down_proj), ("lm_head", engine.decoder.parts.lm_head)):
        names.setdefault((int(mod.in_features), int(mod.out_features)), name)
    return names


def classify(prof: Any, names: dict[tuple[int, int], str]) -> dict[str, float]:
    """Self CPU seconds per category (one profiled pass)."""
    out: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages(group_by_input_shape=True):
        t = evt.self_cpu_time_total / 1e6
        if evt.key in ATTENTION_OPS:
            out["attention"] += t
        elif evt.key in GEMM_OPS and evt.key != "aten::bmm":
            shapes = evt.input_shapes
            w = shapes[-1] if evt.key == "aten::mm" else shapes[2]
            out["gemm " + names.get((int(w[0]), int(w[1])), f"other {w}")] += t
        elif evt.key == "aten::bmm":
            out["bmm"] += t
        else:
            out["other"] += t
            out[f"op {evt.key}"] += t
    return dict(out)


def gemm_rows(prof: Any, names: dict[tuple[int, int], str]) -> dict[str, tuple[int, float]]:
    """Per projection: rows of its GEMM calls and total self seconds."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.key_averages(group_by_input_shape=True):
        if evt.key in ("aten::mm", "aten::addmm"):
            shapes = evt.input_shapes
            x, w = (shapes[0], shapes[1]) if evt.key == "aten::mm" else (shapes[1], shapes[2])
            name = names.get((int(w[0]), int(w[1])), "other")
            acc[name][0] += int(x[0]) * evt.count
            acc[name][1] += evt.self_cpu_time_total / 1e6
    return {k: (int(v[0]), v[1]) for k, v in acc.items()}


def build(engine: FusionEngine, row: Any, max_tokens: int) -> tuple[Any, dict[str, Any]]:
    tok = engine.tokenizer
    passages = [tok.decode(tokenize_plain(tok, p)[:max_tokens]).strip() for p in row.passage_texts()]
    caches = {f"p{j}": engine.chunk_cache(p) for j, p in enumerate(passages)}
    return engine.prompt(row.question, chunks=list(zip(caches, passages, strict=True))), caches


def stitched(engine: FusionEngine, prompt: Any, caches: dict[str, Any] | None) -> Stitched:
    if caches is None:  # full attention: nothing reused, every token forced (what `full_attention` runs)
        flat = FusionPrompt(prompt.prefix[:0], (), prompt.token_ids())
        return stitch(engine.decoder, flat, None, lambda _c, _f: None, extra_capacity=1)
    prefix = engine.system_prefix(prompt.prefix)
    return stitch(engine.decoder, prompt, prefix, lambda cid, _first: caches.get(cid), extra_capacity=1)


def timed(fn: Any, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls (after one warm-up)."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def kernels(engine: FusionEngine, rows: torch.Tensor, T: int, repeats: int) -> dict[str, float]:  # noqa: N803
    """One layer's pieces at the pass's shapes, timed alone: GEMMs per row, attention per score."""
    d = engine.decoder
    layer = d.parts.layers[0]
    G = d.num_heads // d.num_kv_heads
    out: dict[str, float] = {}
    with torch.inference_mode():
        for name, mod in (("q", layer.self_attn.q_proj), ("k", layer.self_attn.k_proj),
                          ("gate", layer.mlp.gate_proj), ("down", layer.mlp.down_proj)):
            for n in (int(rows.shape[0]), T):
                x = torch.randn(1, n, mod.in_features)
                out[f"gemm {name} per row @{n} (us)"] = timed(lambda x=x, mod=mod: mod(x), repeats) / n * 1e6
            out[f"gemm {name} per-row ratio"] = (out[f"gemm {name} per row @{int(rows.shape[0])} (us)"]
                                                 / out[f"gemm {name} per row @{T} (us)"])
        q_full = torch.randn(d.num_heads, T, d.head_dim)
        k, v = torch.randn(d.num_kv_heads, T, d.head_dim), torch.randn(d.num_kv_heads, T, d.head_dim)
        causal = attention.plan(attention.MaskSpec(torch.arange(T), torch.arange(T), torch.ones(T, dtype=torch.bool)),
                                group=G, dtype=torch.float32)
        t_causal = timed(lambda: attention.attend(q_full, k, v, causal, scale=d.scaling), repeats)
        spec = attention.MaskSpec(rows, torch.arange(T), torch.ones(T, dtype=torch.bool))
        p = attention.plan(spec, group=G, dtype=torch.float32)
        q = torch.randn(d.num_heads, int(rows.shape[0]), d.head_dim)
        t_plan = timed(lambda: attention.attend(q, k, v, p, scale=d.scaling), repeats)
        t_planning = timed(lambda: attention.plan(spec, group=G, dtype=torch.float32), repeats)
        causal_scores = T * (T + 1) / 2
        visible = float((rows.double() + 1).sum())
        out.update({"causal attention (ms)": t_causal * 1e3, "planned attention (ms)": t_plan * 1e3,
                    "planning (ms)": t_planning * 1e3,
                    "planned/causal time": t_plan / t_causal, "visible/causal scores": visible / causal_scores,
                    "planned/causal scores": p.scores(int(rows.shape[0]), T) / causal_scores,
                    "per visible score vs causal": (t_plan / visible) / (t_causal / causal_scores)})
        qg = q.view(d.num_kv_heads, G, -1, d.head_dim)
        t_body = timed(lambda: attention._bodies(qg, k, v, p, d.scaling), repeats)
        body_scores = sum((c.r1 - c.r0) * sum(hi - lo for lo, hi in c.runs) for c in p.calls)
        out.update({"bodies (ms)": t_body * 1e3, "body calls": len(p.calls), "tail runs": len(p.tails),
                    "body per score vs causal": (t_body / body_scores) / (t_causal / causal_scores),
                    "tails and merges (ms)": (t_plan - t_body) * 1e3})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--row", type=int, default=0)
    p.add_argument("--max-passage-tokens", type=int, default=400)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--kernels-only", action="store_true", help="skip the profiled passes")
    args = p.parse_args(argv)
    engine = FusionEngine.from_pretrained(args.model, device="cpu", dtype=torch.float32)
    row = list(load_rows(args.data, args.row + 1))[args.row]
    prompt, caches = build(engine, row, args.max_passage_tokens)
    names = gemm_names(engine)
    st = stitched(engine, prompt, caches)
    cfg = SelectConfig(args.ratio)
    selected = get_selector("query_guided")(st, cfg.budget(st.num_reused_tokens), cfg)  # deterministic
    rows = torch.cat([selected, st.forced_slots, st.question_slots]).sort().values
    T = int(st.slot_tokens.shape[0])
    spec = attention.MaskSpec(rows, torch.arange(T), torch.ones(T, dtype=torch.bool))
    pl = attention.plan(spec, group=engine.decoder.num_heads // engine.decoder.num_kv_heads, dtype=torch.float32)
    info: dict[str, Any] = {
        "rows": int(rows.shape[0]), "tokens": T, "visible_scores": float((rows.double() + 1).sum()),
        "causal_scores": T * (T + 1) / 2, "planned_scores": float(pl.scores(int(rows.shape[0]), T)),
        "blocks": len(pl.blocks), "tail_scores": float(sum((t.r1 - t.r0) * (t.hi - t.lo) for t in pl.tails)),
    }
    info["kernels"] = kernels(engine, rows, T, max(3, args.repeats))
    if args.kernels_only:
        print(json.dumps(info, indent=1))
        return
    runs: dict[str, list[dict[str, float]]] = {"full": [], "recompute": []}
    rows_of: dict[str, dict[str, tuple[int, float]]] = {}
    for i in range(args.repeats + 1):  # the first round warms up
        for name in ("full", "recompute"):
            st = stitched(engine, prompt, None if name == "full" else caches)
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                recompute(st, st.forced_slots.new_zeros(0) if name == "full" else selected)
            if i:
                cat = classify(prof, names)
                cat["total"] = sum(v for k, v in cat.items() if not k.startswith("op "))
                runs[name].append(cat)
                rows_of[name] = gemm_rows(prof, names)
    med = {name: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in rs[0]} for name, rs in runs.items()}
    full, rec = med["full"], med["recompute"]
    share = info["rows"] / info["tokens"]
    att_share = info["visible_scores"] / info["causal_scores"]
    gemm = lambda d: sum(v for k, v in d.items() if k.startswith("gemm") and "lm_head" not in k)  # noqa: E731
    rate = {name: {k: t / n for k, (n, t) in r.items()} for name, r in rows_of.items()}  # seconds per GEMM row
    per_row = {k: rate["recompute"][k] / rate["full"][k] for k in rate["full"]
               if k in rate["recompute"] and k != "lm_head"}
    per_score = (rec["attention"] / info["planned_scores"]) / (full["attention"] / info["causal_scores"])
    # NOTE: two floors at the full prefill's own rates: GEMMs at the token share and attention at the
    # visible-score share, with everything else free (lower) or also at the token share (it is
    # per-row work: norms, rope, activations, residual adds).
    floor = (gemm(full) * share + full["attention"] * att_share) / full["total"]
    floor_rows = floor + full["other"] * share / full["total"]
    summary = {
        **info, "token_share": share, "attention_share": att_share,
        "planned_share": info["planned_scores"] / info["causal_scores"],
        "full_s": full, "recompute_s": rec,
        "recompute_vs_full": rec["total"] / full["total"], "recompute_vs_share": rec["total"] / full["total"] / share,
        "gemm_vs_full": gemm(rec) / gemm(full), "attention_vs_full": rec["attention"] / full["attention"],
        "other_vs_full": rec["other"] / full["other"],
        "gemm_per_row_vs_full": per_row, "attention_per_score_vs_full": per_score,
        "exact_floor_vs_full": floor, "exact_floor_vs_share": floor / share, "ttft_floor": 1 / floor,
        "floor_other_per_row_vs_full": floor_rows, "floor_other_per_row_vs_share": floor_rows / share,
        "threads": torch.get_num_threads(),
    }
    for k, v in summary.items():
        if isinstance(v, dict):
            print(f"{k}:")
            for kk, vv in sorted(v.items(), key=lambda kv: -kv[1] if isinstance(kv[1], float) else 0):
                if not kk.startswith("op ") or vv > 0.02 * rec["total"]:
                    print(f"   {kk:60s} {vv:.4f}" if isinstance(vv, float) else f"   {kk} {vv}")
        else:
            print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
