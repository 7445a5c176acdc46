"""Selection study: first-token KL vs full attention of many (selector, ratio, knobs) specs per row.

`fusionrag bench` measures a few methods end to end; this measures many selection specs on the
same stitched requests cheaply, for exploring selectors (their TTFT is `benchmarks/ttft_selectors.py`'s
job, their confirmation the bench's). It ingests the rows' passages into one shared corpus (as
`fusionrag bench --corpus shared`: one chunk per passage, fused after its corpus-wide neighbours),
loads each prompt's caches once (fused; the first chunk's independent one, exact after the prefix,
as the engine does), then per row runs full attention once and every spec as the engine runs it
(stitch -> select -> recompute), keeping per row the KL, agreement and recompute share.

`--answer-tokens N` also scores beyond the first token: full attention's greedy answer (up to N
tokens) is fed through each spec's cache after its recompute pass (teacher-forced), and the mean
KL vs full attention over answer positions 2..N is kept as `answer_kl` (a selector tuned to the
first token's distribution must not pay for it later in the answer).

    OMP_NUM_THREADS=1 python benchmarks/selection_study.py \\
        --data ../shared/datasets/musique_dev.jsonl --skip 20 --rows 10 \\
        --specs query_guided@0.15,drift_aware@0.05,drift_aware@0.15 --out bench-out/study.json

A spec is `selector@ratio` optionally followed by `:knob=value` SelectConfig overrides
(`drift_aware@0.15:probe_depths=0.5/1.0`); `none` sets a knob to None (`drift_aware@0.15:last_token_share=none`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from fusionrag_core.bench.data import load_rows
from fusionrag_core.bench.runner import BenchConfig, _ingest, _IngestTotals, row_passages
from fusionrag_core.engine import FusionEngine
from fusionrag_core.ingest import chroma
from fusionrag_core.query.divergence import first_token_agree, first_token_kl
from fusionrag_core.query.recompute import recompute
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.query.select import SelectConfig, get_selector
from fusionrag_core.query.stitch import Stitched, stitch
from fusionrag_core.runtime.kv import ChunkKV


def parse_spec(spec: str) -> tuple[str, SelectConfig]:
    head, *knobs = spec.split(":")
    name, ratio = head.split("@")
    types = {f.name: f.type for f in fields(SelectConfig)}
    kwargs: dict[str, Any] = {"ratio": float(ratio)}
    for knob in knobs:
        key, value = knob.split("=")
        if key not in types:
            raise SystemExit(f"unknown SelectConfig knob {key!r} in {spec!r}")
        if value == "none":
            kwargs[key] = None
            continue
        kwargs[key] = tuple(float(v) for v in value.split("/")) if key == "probe_depths" else (
            int(value) if "int" in str(types[key]) and "float" not in str(types[key]) else float(value))
    get_selector(name)
    return name, SelectConfig(**kwargs)


def stitched(engine: FusionEngine, prompt: Any, caches: dict[str, tuple[ChunkKV, ChunkKV]],
             extra_capacity: int = 1) -> Stitched:
    def lookup(cid: str, first: bool) -> ChunkKV | None:
        pair = caches.get(cid)
        return None if pair is None else pair[0 if first else 1]

    return stitch(engine.decoder, prompt, engine.system_prefix(prompt.prefix), lookup,
                  extra_capacity=extra_capacity, exact_prefix=True)


def decode_at(engine: FusionEngine, st: Stitched, token: int, position: int) -> torch.Tensor:
    """Write `token`'s K/V at `position` (a new slot of `st`'s buffer); its `[V]` logits (as the
    engine's decode loop does)."""
    slot = st.buf.reserve(torch.tensor([position], device=engine.device), valid=True)
    return engine.decoder.decode_step(st.buf, token, slot)


def forced_logits(engine: FusionEngine, st: Stitched, prompt: Any, first: torch.Tensor,
                  tokens: list[int]) -> list[torch.Tensor]:
    """`[V]` logits at each answer position: `first` (the recompute pass's), then after each of
    `tokens[:-1]` is decoded over `st`'s buffer (teacher forcing)."""
    return [first, *(decode_at(engine, st, token, prompt.num_tokens + j) for j, token in enumerate(tokens[:-1]))]


def full_attention_answer(engine: FusionEngine, prompt: Any, caches: dict[str, tuple[ChunkKV, ChunkKV]],
                          n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Full attention's greedy answer (up to `n` tokens, to its end of sequence) and its logits at
    each position: a recompute of every slot, which equals a plain prefill (tested)."""
    st = stitched(engine, prompt, caches, extra_capacity=n)
    logits, _ = recompute(st, st.reusable_slots)
    tokens, out = [], [logits]
    while True:
        tokens.append(int(out[-1].argmax()))
        if tokens[-1] in engine.eos_ids or len(tokens) == n:
            return tokens, out
        out.append(decode_at(engine, st, tokens[-1], prompt.num_tokens + len(tokens) - 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--rows", type=int, default=10)
    ap.add_argument("--max-passage-tokens", type=int, default=80)
    ap.add_argument("--neighbours", type=int, default=10)
    ap.add_argument("--specs", required=True, help="comma-separated selector@ratio[:knob=value...]")
    ap.add_argument("--answer-tokens", type=int, default=0,
                    help="also keep the teacher-forced KL over full attention's answer positions 2..N")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    specs = [(s, *parse_spec(s)) for s in args.specs.split(",") if s]
    engine = FusionEngine.from_pretrained(args.model)
    rows = load_rows(args.data, args.skip + args.rows)[args.skip:]
    passages = [row_passages(row, engine, args.max_passage_tokens) for row in rows]
    config = BenchConfig(data=args.data, neighbours=args.neighbours, corpus="shared")
    ef = chroma.default_embedding_function()
    one = SamplingConfig(max_new_tokens=1)
    out_rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="selection-study-") as tmp:
        t0 = time.perf_counter()
        doc_ids = [f"row{i}-passage-{j}" for i, ps in enumerate(passages) for j in range(len(ps))]
        corpus = _ingest(engine, [p for ps in passages for p in ps], doc_ids, "shared", Path(tmp), config, ef,
                         _IngestTotals())
        print(f"ingest {time.perf_counter() - t0:.0f} s", flush=True)
        store = corpus.indexes["fused"].store
        offset = 0
        for i, row in enumerate(rows):
            own = corpus.chunks[offset:offset + len(passages[i])]
            offset += len(passages[i])
            prompt = engine.prompt(row.question, chunks=list(own))
            caches = {cid: tuple(store.get(cid, v, fingerprint=engine.fingerprint, shape=engine.kv_shape,
                                           device=engine.device, dtype=engine.decoder.dtype)
                                 for v in ("independent", "fused")) for cid, _ in own}
            reference = engine.full_attention(prompt, sampling=one).collect().first_token_logits
            record: dict[str, Any] = {"row": args.skip + i, "prompt_tokens": prompt.num_tokens,
                                      "kl": {}, "agree": {}, "share": {}, "select_s": {}, "answer_kl": {}}
            if args.answer_tokens:
                answer, answer_logits = full_attention_answer(engine, prompt, caches, args.answer_tokens)
            for label, name, cfg in specs:
                st = stitched(engine, prompt, caches, extra_capacity=max(1, args.answer_tokens))
                t = time.perf_counter()
                picked = get_selector(name)(st, cfg.budget(st.num_reused_tokens), cfg)
                record["select_s"][label] = time.perf_counter() - t
                logits, _ = recompute(st, picked)
                record["kl"][label] = first_token_kl(reference, logits)
                if args.answer_tokens and len(answer) > 1:
                    later = zip(answer_logits[1:], forced_logits(engine, st, prompt, logits, answer)[1:], strict=True)
                    record["answer_kl"][label] = statistics.mean(first_token_kl(r, m) for r, m in later)
                record["agree"][label] = bool(first_token_agree(reference, logits))
                record["share"][label] = int(picked.numel()) / st.num_reused_tokens
            out_rows.append(record)
            print(f"row {args.skip + i}: " + " ".join(f"{k}={v:.3f}" for k, v in record["kl"].items()), flush=True)
    summary = {label: {"kl": statistics.mean(r["kl"][label] for r in out_rows),
                       "agree": statistics.mean(r["agree"][label] for r in out_rows),
                       "share": statistics.mean(r["share"][label] for r in out_rows),
                       "select_ms": 1000 * statistics.median(r["select_s"][label] for r in out_rows),
                       "answer_kl": statistics.mean(answer_kl) if (answer_kl := [
                           r["answer_kl"][label] for r in out_rows if label in r["answer_kl"]]) else None}
               for label, _, _ in specs}
    for label, s in summary.items():
        later = f"  answer KL {s['answer_kl']:.4f}" if s["answer_kl"] is not None else ""
        print(f"{label:50s} KL {s['kl']:.4f}  agree {s['agree']:.0%}  share {s['share']:.3f}  "
              f"select {s['select_ms']:.0f} ms{later}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": engine.name, "args": {k: str(v) for k, v in vars(args).items()},
                                    "summary": summary, "rows": out_rows}, indent=1))


if __name__ == "__main__":
    main()
