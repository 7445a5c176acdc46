"""A request arriving mid-heal: its TTFT beside the same request's on an engine with nothing to heal,
per heal piece size, side by side in one run.

The serving benchmark's corpus and prompts (`serving.py`). One trial, for one piece size and one
pair of rows (the kept conversation `a`, the arrival `b`): two engines on the same weights, each
with its own scheduler and prefix cache (emptied before each trial, nothing left to heal), answer
`a`'s first turn; the healed one
(`HealConfig(piece_tokens)`) then starts healing it, and after a delay drawn uniformly from
[0, the heal's duration) `b`'s first turn arrives on it: it waits for the piece in flight at most.
The other engine (healing off) answers the same `b` with nothing to heal: the baseline. Which of
the two arrivals runs first alternates per trial. The heal's duration per row and piece size is
measured once beforehand (`wait_for_heals` after the first turn, no arrival).

Written to `--out`: results.json (every trial, the summary, the environment) and results.md. The
summary per piece size: the median and 90th percentile of the arrival's TTFT over the baseline's
(the goal: the largest piece within 1.1x at the median), and the heal's duration.

    python benchmarks/heal_arrival.py --data ../shared/datasets/musique_dev.jsonl --rows 4 --pieces 16,32,64,128 \
        --out benchmarks/results/heal-arrival
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fusionrag_core.batching.heal import HealConfig
from fusionrag_core.batching.prefix_cache import PrefixCacheConfig
from fusionrag_core.batching.scheduler import SchedulerConfig
from fusionrag_core.bench.data import load_rows
from fusionrag_core.bench.runner import ANSWER_STOP
from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.ingest import chroma
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.store.base import KVStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # NOTE: the serving benchmark's corpus and conversations, not a copy


def engine_pair(base: FusionEngine, piece_tokens: int) -> tuple[FusionEngine, FusionEngine]:
    """Fresh engines on `base`'s weights: one healing in pieces of `piece_tokens`, one not healing."""
    config = dataclasses.replace(base.config, scheduler=SchedulerConfig(), prefix_cache=PrefixCacheConfig(), heal=None)
    return base.with_config(dataclasses.replace(config, heal=HealConfig(piece_tokens))), base.with_config(config)


def first_turn(engine: FusionEngine, c: serving.Conversation, store: KVStore, sampling: SamplingConfig) -> Generation:
    prompt = engine.prompt_from_messages(c.first_messages(engine.config.instruction))
    return engine.generate(prompt, store=store, sampling=sampling)


def reset(engine: FusionEngine) -> None:
    """Nothing kept, so nothing left to heal: the next trial starts as on a fresh engine (a piece in
    flight ends unpublished; it runs before the next trial's arrival, which waits a first turn)."""
    assert engine.prefix_cache is not None
    engine.prefix_cache.clear()
    if engine.config.heal is not None:
        assert engine.wait_for_heals(60.0), "healing did not stop once the prefix cache was emptied"


def heal_duration(healed: FusionEngine, c: serving.Conversation, store: KVStore, sampling: SamplingConfig) -> float:
    """Seconds from the end of `c`'s first turn until its kept entry is healed, nothing arriving."""
    reset(healed)
    first_turn(healed, c, store, sampling)
    start = time.perf_counter()
    assert healed.wait_for_heals(600.0), "healing did not finish in 10 minutes"
    return time.perf_counter() - start


def trial(pair: tuple[FusionEngine, FusionEngine], kept: serving.Conversation, arrival: serving.Conversation,
          store: KVStore, sampling: SamplingConfig, delay_s: float, healed_first: bool) -> dict[str, Any]:
    """One arrival mid-heal and its baseline (see the module doc)."""
    healed, plain = pair
    assert healed.config.heal is not None
    ttft: dict[str, float] = {}
    stats: dict[str, int] = {}
    for name in (("mid_heal", "no_heal") if healed_first else ("no_heal", "mid_heal")):
        engine = healed if name == "mid_heal" else plain
        reset(engine)
        # NOTE: the engine's counters are totals over its life (the warm-up's and duration runs' heals
        # included): what this trial healed before its arrival is their growth from here
        before = healed.stats()
        first_turn(engine, kept, store, sampling)
        if name == "mid_heal":
            time.sleep(delay_s)
            stats = {k: healed.stats()[k] - before[k] for k in ("heal_pieces", "heals")}
        ttft[name] = first_turn(engine, arrival, store, sampling).ttft_s
    return {"piece_tokens": healed.config.heal.piece_tokens, "kept_row": kept.row, "arrival_row": arrival.row,
            "delay_s": round(delay_s, 4), "pieces_before_arrival": stats["heal_pieces"],
            "healed_before_arrival": stats["heals"] > 0, "ttft_mid_heal_s": round(ttft["mid_heal"], 4),
            "ttft_no_heal_s": round(ttft["no_heal"], 4), "ratio": round(ttft["mid_heal"] / ttft["no_heal"], 3)}


def summarise(trials: Sequence[Mapping[str, Any]], durations: Mapping[int, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for piece, heal_s in durations.items():
        ratios = sorted(t["ratio"] for t in trials if t["piece_tokens"] == piece)
        out[str(piece)] = {"trials": len(ratios), "ratio_median": statistics.median(ratios),
                           "ratio_p90": ratios[min(len(ratios) - 1, int(0.9 * len(ratios)))],
                           "ratio_max": ratios[-1], "heal_s_median": round(statistics.median(heal_s), 3),
                           "arrived_mid_heal": sum(not t["healed_before_arrival"] for t in trials
                                                   if t["piece_tokens"] == piece)}
    within = [int(p) for p, s in out.items() if s["ratio_median"] <= 1.1]
    out["largest_piece_within_1.1x"] = max(within) if within else None
    return out


def table(doc: Mapping[str, Any]) -> str:
    s = doc["summary"]
    lines = [f"# A request arriving mid-heal: {doc['settings']['model']}", "",
             "| piece tokens | trials | arrived mid-heal | TTFT / no heal's, median | p90 | max | heal time p50 (s) |",
             "|---|---|---|---|---|---|---|"]
    for piece in doc["settings"]["pieces"]:
        r = s[str(piece)]
        lines.append(f"| {piece} | {r['trials']} | {r['arrived_mid_heal']} | {r['ratio_median']:.2f}x "
                     f"| {r['ratio_p90']:.2f}x | {r['ratio_max']:.2f}x | {r['heal_s_median']:.2f} |")
    lines += ["", f"Largest piece with the median within 1.1x: {s['largest_piece_within_1.1x']}."]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="musique_dev.jsonl")
    p.add_argument("--rows", type=int, default=4, help="kept conversations (each row's arrival is the next row)")
    p.add_argument("--pieces", default="16,32,64,128", help="HealConfig.piece_tokens values, comma-separated")
    p.add_argument("--corpus-rows", type=int, default=None,
                   help="rows ingested (default: --rows + 1); another run's, with its --db, reuses its corpus")
    p.add_argument("--trials", type=int, default=2, help="arrivals per row and piece size (random delays)")
    p.add_argument("--max-tokens", type=int, default=8, help="answer length limit")
    p.add_argument("--max-passage-tokens", type=int, default=None, help="cut each passage to N tokens")
    p.add_argument("--neighbours", type=int, default=10, help="n of the fused ingest")
    p.add_argument("--seed", type=int, default=0, help="of the arrival delays")
    p.add_argument("--db", type=Path, default=None, help="keep the ingested corpus here (default: a temp dir)")
    p.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M")
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/heal-arrival"))
    args = p.parse_args(argv)
    args.pieces = [int(x) for x in args.pieces.split(",")]
    if min(args.pieces) < 1 or args.rows < 1 or args.trials < 1:
        p.error("--pieces, --rows and --trials must be >= 1")
    args.sampling = SamplingConfig(max_new_tokens=args.max_tokens, stop=ANSWER_STOP)
    return args


def main(argv: Sequence[str] | None = None, engine: FusionEngine | None = None,
         embedding_function: chroma.EmbeddingFn | None = None) -> int:
    """Run the benchmark; 1 when a chunk cache was missed (the arrivals would not be FusionRAG's)."""
    args = parse_args(argv)
    base = engine or FusionEngine.from_pretrained(args.model, device=args.device)
    env = serving.environment(base)
    rows = load_rows(args.data, max(args.rows + 1, args.corpus_rows or 0))
    rng = random.Random(args.seed)
    with serving.opened_corpus(base, rows, args, "fusionrag-heal-arrival-", embedding_function) as corpus:
        pairs: dict[int, tuple[FusionEngine, FusionEngine]] = {}
        try:
            cs = [serving.Conversation(i, i, row.question, corpus.chunks[i], None)
                  for i, row in enumerate(rows[:args.rows + 1])]
            serving.check_prompts(base, cs)
            store = corpus.index.store
            pairs.update((p, engine_pair(base, p)) for p in args.pieces)
            trial(pairs[args.pieces[0]], cs[-1], cs[0], store, args.sampling, 0.0, True)  # NOTE: warm-up, untimed
            durations = {p: [heal_duration(pairs[p][0], c, store, args.sampling) for c in cs[:-1]] for p in args.pieces}
            trials = []
            for k in range(args.trials):
                for i, c in enumerate(cs[:-1]):
                    for p in args.pieces:
                        delay = rng.uniform(0.0, durations[p][i])
                        trials.append(trial(pairs[p], c, cs[i + 1], store, args.sampling, delay, (i + k) % 2 == 0))
                        print(json.dumps(trials[-1]), flush=True)
        finally:
            for engines in pairs.values():
                for e in engines:
                    e.close()  # NOTE: no heal goes on beside whatever runs next
    env["load_end"] = [round(x, 2) for x in os.getloadavg()]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "sampling"}
    settings.update(model=base.name, device=str(base.device))
    doc = {"command": ["benchmarks/heal_arrival.py", *(argv if argv is not None else sys.argv[1:])],
           "settings": settings, "environment": env, "ingest": corpus.ingest,
           "heal_s": {str(p): [round(d, 3) for d in ds] for p, ds in durations.items()},
           "summary": summarise(trials, durations), "trials": trials}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    (args.out / "results.md").write_text(table(doc), encoding="utf-8")
    print(table(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
