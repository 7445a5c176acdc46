"""Healing after a pause: a conversation's follow-up on FusionRAG with healing, without it, and on
full attention, side by side in one run.

The serving benchmark's corpus and prompts (`serving.py`: MuSiQue rows' gold passages in one fused
index, each passage marked with its chunk id, the bench runner's canonical prompt). Three engines on
the same weights, each with its own scheduler and prefix cache:

    fusionrag_healed  the default selector over the fused caches, `EngineConfig.heal` on;
    fusionrag         the same without healing: its follow-up continues approximate K/V;
    full_attention    a plain prefill; its follow-up continues its own exact kept cache.

Per conversation, one at a time: the healed engine's first turn, then the time until its heal is done
(`wait_for_heals`: the pause before its follow-up is at least that long), the other two first turns,
a pause of `--pause-s`, then the three follow-ups in an order that rotates per conversation. Every
follow-up has the same history: the first turn's messages, FusionRAG's first answer (both FusionRAG
engines' first turns are the same computation) and a follow-up question. Per turn: the engine's TTFT,
the greedy tokens, and how many prompt tokens were exact, healed or approximate.

Written to `--out`: results.json (every turn, the summary, the environment) and results.md. The
summary: the median over conversations of each FusionRAG engine's follow-up TTFT over full
attention's (the goal: <= 1.2x with healing), how many greedy follow-up answers equal full
attention's, the first-turn TTFT medians, and the heal times.

    python benchmarks/heal.py --data ../shared/datasets/musique_dev.jsonl --rows 7 --out benchmarks/results/heal
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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

ENGINES = ("fusionrag_healed", "fusionrag", "full_attention")
FOLLOWUP = "Which passage supports that? Answer briefly."


def engines(base: FusionEngine, piece_tokens: int) -> dict[str, FusionEngine]:
    """The three engines on `base`'s weights, each with its own scheduler and prefix cache."""
    config = dataclasses.replace(base.config, scheduler=SchedulerConfig(), prefix_cache=PrefixCacheConfig(), heal=None)
    return {"fusionrag_healed": base.with_config(dataclasses.replace(config, heal=HealConfig(piece_tokens))),
            "fusionrag": base.with_config(config), "full_attention": base.with_config(config)}


def answer(engine: FusionEngine, name: str, messages: Sequence[Mapping[str, str]], store: KVStore,
           sampling: SamplingConfig) -> Generation:
    prompt = engine.prompt_from_messages(messages)
    if name == "full_attention":
        return engine.full_attention(prompt, sampling=sampling).collect()
    return engine.generate(prompt, store=store, sampling=sampling)


def turn_record(g: Generation) -> dict[str, Any]:
    return {"ttft_s": round(g.ttft_s, 4), "token_ids": g.token_ids, "text": g.text, "prompt_tokens": g.prompt_tokens,
            "exact_tokens": g.exact_tokens, "healed_tokens": g.healed_tokens,
            "approximate_tokens": g.approximate_tokens, "kept_prefix_tokens": g.kept_prefix_tokens,
            "recomputed_tokens": g.recomputed_tokens, "cache_misses": len(g.cache_misses)}


def conversation(es: Mapping[str, FusionEngine], c: serving.Conversation, store: KVStore, args: argparse.Namespace,
                 rotation: int) -> dict[str, Any]:
    """One conversation on the three engines (see the module doc)."""
    healed = es["fusionrag_healed"]
    first = {"fusionrag_healed": answer(healed, "fusionrag_healed", c.first_messages(healed.config.instruction),
                                        store, args.sampling)}
    start = time.perf_counter()
    assert healed.wait_for_heals(600.0), "healing did not finish in 10 minutes"
    heal_s = time.perf_counter() - start
    for name in ENGINES[1:]:
        first[name] = answer(es[name], name, c.first_messages(es[name].config.instruction), store, args.sampling)
    time.sleep(args.pause_s)
    history = first["fusionrag_healed"].text
    order = ENGINES[rotation % 3:] + ENGINES[:rotation % 3]
    follow = {name: answer(es[name], name, c.followup_messages(es[name].config.instruction, history), store,
                           args.sampling) for name in order}
    return {"row": c.row, "heal_s": round(heal_s, 3), "followup_order": list(order),
            "first": {n: turn_record(g) for n, g in first.items()},
            "followup": {n: turn_record(g) for n, g in follow.items()}}


def summarise(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    def ttft(turn: str, name: str) -> list[float]:
        return [r[turn][name]["ttft_s"] for r in records]

    full = ttft("followup", "full_attention")
    out: dict[str, Any] = {"conversations": len(records),
                           "heal_s_median": statistics.median(r["heal_s"] for r in records)}
    for name in ENGINES:
        out[f"first_ttft_s_median_{name}"] = statistics.median(ttft("first", name))
        out[f"followup_ttft_s_median_{name}"] = statistics.median(ttft("followup", name))
        out[f"same_greedy_followup_as_full_attention_{name}"] = sum(
            r["followup"][name]["token_ids"] == r["followup"]["full_attention"]["token_ids"] for r in records)
    for name in ENGINES[:2]:
        out[f"followup_ttft_ratio_median_{name}"] = round(statistics.median(
            a / b for a, b in zip(ttft("followup", name), full, strict=True)), 3)
    return out


def table(doc: Mapping[str, Any]) -> str:
    s, n = doc["summary"], doc["summary"]["conversations"]
    lines = [f"# Healing after a pause: {n} conversations, {doc['settings']['model']}", "",
             "| engine | first-turn TTFT p50 (s) | follow-up TTFT p50 (s) | follow-up / full attention's (median) "
             "| greedy follow-up = full attention's |", "|---|---|---|---|---|"]
    for name in ENGINES:
        ratio = s.get(f"followup_ttft_ratio_median_{name}", 1.0)
        lines.append(f"| {name} | {s[f'first_ttft_s_median_{name}']:.3f} | {s[f'followup_ttft_s_median_{name}']:.3f} "
                     f"| {ratio:.2f}x | {s[f'same_greedy_followup_as_full_attention_{name}']}/{n} |")
    lines += ["", f"Heal time per conversation, median: {s['heal_s_median']:.2f} s (pause before the follow-ups: "
              f"that, plus the other engines' first turns, plus {doc['settings']['pause_s']} s)."]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="musique_dev.jsonl")
    p.add_argument("--rows", type=int, default=7, help="conversations (one row each; one more row warms up)")
    p.add_argument("--max-tokens", type=int, default=24, help="answer length limit")
    p.add_argument("--max-passage-tokens", type=int, default=None, help="cut each passage to N tokens")
    p.add_argument("--neighbours", type=int, default=10, help="n of the fused ingest")
    p.add_argument("--piece-tokens", type=int, default=HealConfig().piece_tokens, help="HealConfig.piece_tokens")
    p.add_argument("--pause-s", type=float, default=1.0, help="pause before the follow-ups, after the heal")
    p.add_argument("--db", type=Path, default=None, help="keep the ingested corpus here (default: a temp dir)")
    p.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M")
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/heal"))
    args = p.parse_args(argv)
    args.sampling = SamplingConfig(max_new_tokens=args.max_tokens, stop=ANSWER_STOP)
    return args


def main(argv: Sequence[str] | None = None, engine: FusionEngine | None = None,
         embedding_function: chroma.EmbeddingFn | None = None) -> int:
    """Run the benchmark; 1 when a chunk cache was missed (the comparison would not be FusionRAG's)."""
    args = parse_args(argv)
    base = engine or FusionEngine.from_pretrained(args.model, device=args.device)
    env = serving.environment(base)
    rows = load_rows(args.data, args.rows + 1)
    es = engines(base, args.piece_tokens)
    with serving.opened_corpus(base, rows, args, "fusionrag-heal-", embedding_function) as corpus:
        conversations = [serving.Conversation(i, i, row.question, corpus.chunks[i], FOLLOWUP)
                         for i, row in enumerate(rows)]
        serving.check_prompts(base, conversations)
        conversation(es, conversations[-1], corpus.index.store, args, 0)  # NOTE: the warm-up, untimed
        records = []
        for i, c in enumerate(conversations[:-1]):
            records.append(conversation(es, c, corpus.index.store, args, i))
            print(json.dumps({k: records[-1]["followup"][k]["ttft_s"] for k in ENGINES}), flush=True)
    env["load_end"] = [round(x, 2) for x in os.getloadavg()]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("sampling",)}
    settings.update(model=base.name, device=str(base.device))
    doc = {"command": ["benchmarks/heal.py", *(argv if argv is not None else sys.argv[1:])], "settings": settings,
           "environment": env, "ingest": corpus.ingest, "summary": summarise(records),
           "heal_stats": es["fusionrag_healed"].stats(), "conversations": records}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    (args.out / "results.md").write_text(table(doc), encoding="utf-8")
    print(table(doc), flush=True)
    missed = any(t["cache_misses"] for r in records for turn in ("first", "followup") for t in r[turn].values())
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
