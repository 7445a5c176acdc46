"""Conversations with K/V memory reused (`EngineConfig.idle_kv_bytes`) and without, side by side.

One user asks the serving benchmark's conversations (a first turn, then a follow-up that continues
the first turn's kept prefix) one after another, on two engines over the same weights and corpus:
one that carves request buffers from the memory finished requests left (`runtime.memory`), one
that allocates each buffer afresh (`idle_kv_bytes=0`). The two alternate conversation by
conversation, so a drift of the machine's speed reaches both alike. Each engine's prefix cache is
bounded by `--prefix-mb` so that, after the first few conversations, the run is in the steady
state of a long-running server: the cache full, every new entry evicting an old one. Reported per
engine, over the conversations after `--warm`: TTFT medians of first turns and follow-ups, the
follow-up / first-turn median ratio, and the memory's reuse counts.

    python benchmarks/kv_memory.py --data musique_dev.jsonl --db serving-db --conversations 24
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fusionrag_core.engine import FusionEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # NOTE: the serving benchmark's corpus, conversations and turns, not a copy


def engines(base: FusionEngine, prefix_mb: int) -> dict[str, FusionEngine]:
    """Both engines without a scheduler (one user), each with its own decoder, memory and prefix cache."""
    assert base.config.prefix_cache is not None
    prefix = dataclasses.replace(base.config.prefix_cache, max_bytes=prefix_mb << 20)
    out = {}
    for name, idle in (("reused", base.config.idle_kv_bytes), ("fresh", 0)):
        config = dataclasses.replace(base.config, scheduler=None, prefix_cache=prefix, idle_kv_bytes=idle)
        out[name] = FusionEngine(base.model, base.tokenizer, name=base.name, config=config)
    return out


def converse(s: serving.Serving, c: serving.Conversation) -> tuple[float | None, float | None]:
    """A conversation's first-turn and follow-up TTFTs (None where it did not finish)."""
    turns = [serving.Turn(c.index, c.row, t) for t in range(2)]
    serving.run_conversation(s, c, turns, math.inf)
    return turns[0].ttft_s, turns[1].ttft_s


def summary(ttfts: Sequence[tuple[float | None, float | None]], engine: FusionEngine) -> dict[str, Any]:
    first = [a for a, _ in ttfts if a is not None]
    later = [b for _, b in ttfts if b is not None]
    memory = engine.decoder.memory
    return {"first_turn_ttft_p50_s": statistics.median(first), "followup_ttft_p50_s": statistics.median(later),
            "followup_over_first": statistics.median(later) / statistics.median(first),
            "conversations": len(ttfts), "memory": memory.stats() if memory is not None else None}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="musique_dev.jsonl")
    p.add_argument("--db", type=Path, required=True, help="the serving benchmark's corpus (ingested if missing)")
    p.add_argument("--rows", type=int, default=99, help="rows of the corpus (as ingested by serving.py)")
    p.add_argument("--conversations", type=int, default=24, help="conversations per engine")
    p.add_argument("--warm", type=int, default=8, help="conversations left out of the medians (cache filling)")
    p.add_argument("--prefix-mb", type=int, default=256, help="each engine's prefix cache bound")
    p.add_argument("--max-passage-tokens", type=int, default=80)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if not 0 <= args.warm < args.conversations:
        p.error("--warm must be >= 0 and below --conversations")
    sargs = serving.parse_args(["--data", str(args.data), "--rows", str(args.rows), "--db", str(args.db),
                                "--max-passage-tokens", str(args.max_passage_tokens), "--followups", "1"])
    base = FusionEngine.from_pretrained(None)
    rows = serving.load_rows(args.data, args.rows + 1)
    corpus = serving.build_corpus(base, rows, sargs, args.db, None)
    conversations, _ = serving.plan(rows[:args.rows], corpus, 2 * args.conversations, 1.0)
    served = {name: serving.Serving(e, serving.SERVED["fusionrag"], 0.15, corpus.index.store, sargs.sampling)
              for name, e in engines(base, args.prefix_mb).items()}
    ttfts: dict[str, list[tuple[float | None, float | None]]] = {name: [] for name in served}
    start = time.perf_counter()
    for i, c in enumerate(conversations[:args.conversations]):
        order = list(served) if i % 2 == 0 else list(reversed(served))
        for name in order:
            ttfts[name].append(converse(served[name], c))
    results = {name: summary(t[args.warm:], served[name].engine) for name, t in ttfts.items()}
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "seconds": time.perf_counter() - start,
           "results": results,
           "followup_ttft_reused_over_fresh": results["reused"]["followup_ttft_p50_s"]
           / results["fresh"]["followup_ttft_p50_s"],
           "first_turn_ttft_reused_over_fresh": results["reused"]["first_turn_ttft_p50_s"]
           / results["fresh"]["first_turn_ttft_p50_s"]}
    print(json.dumps(doc, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
