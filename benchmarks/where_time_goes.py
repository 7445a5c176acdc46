"""Where FusionRAG's time to first token goes, phase by phase, next to a full prefill (CPU or GPU).

For each MuSiQue row (passages cut to `--max-passage-tokens`), with independent chunk caches
already in memory (the query path of fused and independent caches costs the same), it times,
interleaved and repeated (median kept):

* `full`: full attention's TTFT (a plain prefill of every prompt token);
* `stitch`: prefix cache + chunk caches re-rotated into the request buffer;
* `probe`: the query-guided selector's probe pass (question over the stitched cache);
* `recompute`: the sparse pass (selected tokens + question);
* `ttft`: the engine's own TTFT for the same request (all of the above);
* `decode`: decoding tokens/s after the first token.

`cpu_*` are the same figures in this process's CPU time (the wall-clock ones include whatever the
shared machine's other processes took; with one torch thread CPU time does not).
`recompute_vs_share` is the recompute pass over full attention, divided by the fraction of prompt
tokens it computes (1.0 = costs exactly its token share). `attention_share` is the fraction of a
full prefill's causal query-key scores the pass's queries may see: its linear layers cost the
token share, its exact attention at least this share (query-guided picks sit late in the prompt,
where rows see more keys, so it exceeds the token share). Run it before and after a change on
the same machine, in the same minutes: the machine is shared, so only ratios mean anything.

    OMP_NUM_THREADS=1 python benchmarks/where_time_goes.py --data ../shared/datasets/musique_dev.jsonl \
        --rows 2 --max-passage-tokens 400 --out bench-out/wtg.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fusionrag_core.bench.data import load_rows
from fusionrag_core.engine import FusionEngine
from fusionrag_core.query.recompute import recompute
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.query.select import SelectConfig, get_selector
from fusionrag_core.query.stitch import stitch
from fusionrag_core.runtime.compat import tokenize_plain


def clocks() -> tuple[float, float]:
    """(wall, this process's CPU) seconds: with one torch thread, CPU time is what a run computes,
    without the time the shared machine's other processes took the core away."""
    return time.perf_counter(), time.process_time()


def phases(engine: FusionEngine, prompt: Any, caches: dict[str, Any], ratio: float) -> dict[str, float]:
    """One timed run of stitch / probe / recompute (seconds), as `FusionEngine` runs them."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    t0 = clocks()
    prefix = engine.system_prefix(prompt.prefix)
    st = stitch(engine.decoder, prompt, prefix, lambda cid, _first: caches.get(cid), extra_capacity=1)
    sync()
    t1 = clocks()
    cfg = SelectConfig(ratio)
    selected = get_selector("query_guided")(st, cfg.budget(st.num_reused_tokens), cfg)
    sync()
    t2 = clocks()
    _, recomputed = recompute(st, selected)
    sync()
    t3 = clocks()
    rows = torch.cat([selected.to(st.forced_slots.device), st.forced_slots, st.question_slots]).double()
    return {"stitch": t1[0] - t0[0], "probe": t2[0] - t1[0], "recompute": t3[0] - t2[0],
            "cpu_stitch": t1[1] - t0[1], "cpu_probe": t2[1] - t1[1], "cpu_recompute": t3[1] - t2[1],
            "recomputed_tokens": recomputed + int(st.question_slots.shape[0]),
            "visible_keys": float((rows + 1).sum())}  # slot == position: row i sees i + 1 keys


def measure_row(engine: FusionEngine, row: Any, max_tokens: int, ratio: float, repeats: int,
                decode_tokens: int) -> dict[str, float]:
    tok = engine.tokenizer
    passages = [tok.decode(tokenize_plain(tok, p)[:max_tokens]).strip() for p in row.passage_texts()]
    caches = {f"p{j}": engine.chunk_cache(p) for j, p in enumerate(passages)}
    prompt = engine.prompt(row.question, chunks=list(zip(caches, passages, strict=True)))
    one = SamplingConfig(max_new_tokens=1)
    names = ("full", "stitch", "probe", "recompute", "ttft")
    runs: dict[str, list[float]] = {k: [] for k in names + tuple(f"cpu_{k}" for k in names)}
    recomputed = visible = 0.0
    for i in range(repeats + 1):  # the first round warms up
        c0 = time.process_time()
        full = engine.full_attention(prompt, sampling=one).collect().ttft_s
        c1 = time.process_time()
        ph = phases(engine, prompt, caches, ratio)
        c2 = time.process_time()
        ttft = engine.generate(prompt, caches=caches, selector="query_guided", ratio=ratio, sampling=one).ttft_s
        c3 = time.process_time()  # NOTE: one new token: the whole call's CPU time is its time to first token
        if i:
            runs["full"].append(full)
            runs["ttft"].append(ttft)
            runs["cpu_full"].append(c1 - c0)
            runs["cpu_ttft"].append(c3 - c2)
            for k in ("stitch", "probe", "recompute"):
                runs[k].append(ph[k])
                runs[f"cpu_{k}"].append(ph[f"cpu_{k}"])
        recomputed, visible = ph["recomputed_tokens"], ph["visible_keys"]
    gen = engine.generate(prompt, caches=caches, selector="query_guided", ratio=ratio,
                          sampling=SamplingConfig(max_new_tokens=decode_tokens))
    steps = max(len(gen.token_ids) - 1, 1)
    out = {k: statistics.median(v) for k, v in runs.items()}
    share = recomputed / prompt.num_tokens
    T = prompt.num_tokens
    out.update(prompt_tokens=T, recomputed_share=share, attention_share=visible / (T * (T + 1) / 2),
               recompute_vs_share=out["recompute"] / out["full"] / share,
               speedup=out["full"] / out["ttft"],
               cpu_recompute_vs_share=out["cpu_recompute"] / out["cpu_full"] / share,
               cpu_speedup=out["cpu_full"] / out["cpu_ttft"], decode_tok_s=steps / (gen.total_s - gen.ttft_s))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--max-passage-tokens", type=int, default=400)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    engine = FusionEngine.from_pretrained(args.model, device="cpu", dtype=torch.float32)
    results = []
    for i, row in enumerate(load_rows(args.data, args.rows)):
        r = measure_row(engine, row, args.max_passage_tokens, args.ratio, args.repeats, args.decode_tokens)
        results.append(r)
        print(f"row {i}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    keys = results[0].keys()
    summary = {k: statistics.median(r[k] for r in results) for k in keys}
    print("median: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    if args.out:
        args.out.write_text(json.dumps({"rows": results, "median": summary, "threads": torch.get_num_threads()},
                                       indent=1))


if __name__ == "__main__":
    main()
