"""Healing answers in flight: whole-answer identity with full attention against the latency it adds,
side by side in one run.

The serving benchmark's corpus and prompts (`serving.py`: shared-corpus MuSiQue rows, the bench
runner's canonical prompt), over each row's gold passages or, with `--retrieve K`, the K passages
of the whole corpus most similar to its question (the bench's shared corpus with retrieved
context); greedy answers of `--max-tokens` tokens without stop strings, so every
answer is long enough to compare its first 24 and its first `--max-tokens` tokens. Engines on the
same weights, each with its own scheduler and prefix cache (emptied before each answer: every
answer is a first turn):

    fusionrag            the default selector over the fused caches, no answer healing;
    healed_<N>           the same, healing its answer in flight in pieces of N tokens
                         (`HealConfig(piece_tokens=N, answers=True)`), one per `--pieces` value;
    full_attention       a plain prefill: the reference.

Per row, the engines in an order that rotates per row: the greedy tokens, TTFT, the whole answer's
time, the mean time per token after the first (inter-token latency), and the token from which the
healed answer decoded over exact K/V. The summary per engine: how many answers equal full
attention's over their first token, their first 24 and their first `--max-tokens` tokens (healing
starts after the first token, so the first decides what it can reach), and the medians of TTFT, of
inter-token latency and of answer time over FusionRAG's without healing.

Written to `--out`: results.json, results.md and identity.png (identity against added inter-token
latency; a table only when matplotlib is missing).

    python benchmarks/heal_answer.py --data ../shared/datasets/musique_dev.jsonl --rows 12 --pieces 64,256 \
        --out benchmarks/results/heal-answer
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fusionrag_core.batching.heal import HealConfig
from fusionrag_core.batching.prefix_cache import PrefixCacheConfig
from fusionrag_core.batching.scheduler import SchedulerConfig
from fusionrag_core.bench.data import load_rows
from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.ingest import chroma
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.store.base import KVStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # NOTE: the serving benchmark's corpus and conversations, not a copy

SHORT = 24  # NOTE: the whole-answer length


def engines(base: FusionEngine, pieces: Sequence[int]) -> dict[str, FusionEngine]:
    """FusionRAG without answer healing, with it per piece size, and full attention, on `base`'s weights."""
    config = dataclasses.replace(base.config, scheduler=SchedulerConfig(), prefix_cache=PrefixCacheConfig(), heal=None)
    out = {"fusionrag": base.with_config(config)}
    for p in pieces:
        out[f"healed_{p}"] = base.with_config(dataclasses.replace(config, heal=HealConfig(p, answers=True)))
    out["full_attention"] = base.with_config(config)
    return out


def answer(engine: FusionEngine, name: str, c: serving.Conversation, store: KVStore,
           sampling: SamplingConfig) -> dict[str, Any]:
    """One first turn on `engine`, its prefix cache emptied first; its tokens and timings."""
    assert engine.prefix_cache is not None
    engine.prefix_cache.clear()
    prompt = engine.prompt_from_messages(c.first_messages(engine.config.instruction))
    g: Generation = (engine.full_attention(prompt, sampling=sampling).collect() if name == "full_attention"
                     else engine.generate(prompt, store=store, sampling=sampling))
    n = len(g.token_ids)
    return {"token_ids": g.token_ids, "ttft_s": round(g.ttft_s, 4), "total_s": round(g.total_s, 4),
            "itl_s": round((g.total_s - g.ttft_s) / max(1, n - 1), 5), "answer_healed_at": g.answer_healed_at,
            "approximate_tokens": g.approximate_tokens, "cache_misses": len(g.cache_misses)}


def context(corpus: serving.Corpus, i: int, question: str, k: int | None) -> tuple[tuple[str, str], ...]:
    """Row `i`'s passages: its gold ones, or the `k` of the corpus most similar to `question`."""
    if k is None:
        return corpus.chunks[i]
    return tuple((hit.chunk_id, hit.text) for hit in corpus.index.search(question, k))


def row_record(es: Mapping[str, FusionEngine], c: serving.Conversation, store: KVStore, sampling: SamplingConfig,
               rotation: int) -> dict[str, Any]:
    names = list(es)
    order = names[rotation % len(names):] + names[:rotation % len(names)]
    answers = {name: answer(es[name], name, c, store, sampling) for name in order}
    full = answers["full_attention"]["token_ids"]
    for a in answers.values():
        a["same_first_token"] = a["token_ids"][:1] == full[:1]
        a["same_first_24"] = a["token_ids"][:SHORT] == full[:SHORT]
        a["same_whole"] = a["token_ids"] == full
    return {"row": c.row, "chunks": [cid for cid, _ in c.chunks], "order": order, "answers": answers}


def summarise(records: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    def values(name: str, key: str) -> list[Any]:
        return [r["answers"][name][key] for r in records]

    out: dict[str, Any] = {"rows": len(records)}
    base = {k: values("fusionrag", k) for k in ("ttft_s", "itl_s", "total_s")}
    for name in names:
        s: dict[str, Any] = {"same_first_token": sum(values(name, "same_first_token")),
                             "same_first_24": sum(values(name, "same_first_24")),
                             "same_whole": sum(values(name, "same_whole"))}
        for key in ("ttft_s", "itl_s", "total_s"):
            mine = values(name, key)
            s[f"{key}_median"] = round(statistics.median(mine), 4)
            s[f"{key}_ratio_median"] = round(statistics.median(a / b for a, b in zip(mine, base[key], strict=True)), 3)
        healed_at = [h for h in values(name, "answer_healed_at") if h is not None]
        s["healed_answers"] = len(healed_at)
        s["healed_at_median"] = statistics.median(healed_at) if healed_at else None
        out[name] = s
    return out


def table(doc: Mapping[str, Any]) -> str:
    s, n, long = doc["summary"], doc["summary"]["rows"], doc["settings"]["max_tokens"]
    lines = [f"# Healing answers in flight: {n} rows, {doc['settings']['model']}", "",
             f"| engine | first token = full attention's | first {SHORT} tokens = full attention's "
             f"| first {long} = full attention's | TTFT / fusionrag's | inter-token latency / fusionrag's "
             "| answer time / fusionrag's | answers healed | healed at token (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in doc["engines"]:
        r = s[name]
        at = "-" if r["healed_at_median"] is None else f"{r['healed_at_median']:g}"
        lines.append(f"| {name} | {r['same_first_token']}/{n} | {r['same_first_24']}/{n} | {r['same_whole']}/{n} "
                     f"| {r['ttft_s_ratio_median']:.2f}x "
                     f"| {r['itl_s_ratio_median']:.2f}x | {r['total_s_ratio_median']:.2f}x | {r['healed_answers']}/{n} "
                     f"| {at} |")
    return "\n".join(lines) + "\n"


def plot(doc: Mapping[str, Any], path: Path) -> bool:
    """Identity against added inter-token latency, one point per engine; False without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, n, long = doc["summary"], doc["summary"]["rows"], doc["settings"]["max_tokens"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for name in doc["engines"]:
        if name == "full_attention":
            continue
        x = s[name]["itl_s_ratio_median"]
        ax.scatter([x], [s[name]["same_first_24"] / n], marker="o", color="C0")
        ax.scatter([x], [s[name]["same_whole"] / n], marker="s", color="C1")
        ax.annotate(name, (x, s[name]["same_first_24"] / n), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.scatter([], [], marker="o", color="C0", label=f"first {SHORT} tokens")
    ax.scatter([], [], marker="s", color="C1", label=f"first {long} tokens")
    ax.set_xlabel("inter-token latency / FusionRAG without healing (median)")
    ax.set_ylabel("answers equal to full attention's")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"Answer healing: {n} rows, {doc['settings']['model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="musique_dev.jsonl")
    p.add_argument("--rows", type=int, default=12, help="rows answered (one more row warms up)")
    p.add_argument("--corpus-rows", type=int, default=None,
                   help="rows ingested (default: --rows + 1); another run's, with its --db, reuses its corpus")
    p.add_argument("--retrieve", type=int, default=None, metavar="K",
                   help="answer over the K passages of the whole corpus most similar to each question "
                        "(default: the row's gold passages)")
    p.add_argument("--pieces", default="64,256", help="HealConfig.piece_tokens of the healing engines, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64, help="answer length (no stop strings)")
    p.add_argument("--max-passage-tokens", type=int, default=None, help="cut each passage to N tokens")
    p.add_argument("--neighbours", type=int, default=10, help="n of the fused ingest")
    p.add_argument("--db", type=Path, default=None, help="keep the ingested corpus here (default: a temp dir)")
    p.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M")
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/heal-answer"))
    args = p.parse_args(argv)
    args.pieces = [int(x) for x in args.pieces.split(",")]
    if args.retrieve is not None and args.retrieve < 1:
        p.error("--retrieve must be >= 1")
    if min(args.pieces) < 1 or args.rows < 1 or args.max_tokens < SHORT:
        p.error(f"--pieces and --rows must be >= 1, --max-tokens >= {SHORT}")
    args.sampling = SamplingConfig(max_new_tokens=args.max_tokens)
    return args


def main(argv: Sequence[str] | None = None, engine: FusionEngine | None = None,
         embedding_function: chroma.EmbeddingFn | None = None) -> int:
    """Run the benchmark; 1 when a chunk cache was missed (the answers would not be FusionRAG's)."""
    args = parse_args(argv)
    base = engine or FusionEngine.from_pretrained(args.model, device=args.device)
    env = serving.environment(base)
    rows = load_rows(args.data, max(args.rows + 1, args.corpus_rows or 0))
    es = engines(base, args.pieces)
    with serving.opened_corpus(base, rows, args, "fusionrag-heal-answer-", embedding_function) as corpus:
        cs = [serving.Conversation(i, i, row.question, context(corpus, i, row.question, args.retrieve), None)
              for i, row in enumerate(rows[:args.rows + 1])]
        serving.check_prompts(base, cs)
        row_record(es, cs[-1], corpus.index.store, args.sampling, 0)  # NOTE: the warm-up, untimed
        records = []
        for i, c in enumerate(cs[:-1]):
            records.append(row_record(es, c, corpus.index.store, args.sampling, i))
            print(json.dumps({k: [a["same_whole"], a["itl_s"]] for k, a in records[-1]["answers"].items()}),
                  flush=True)
    env["load_end"] = [round(x, 2) for x in os.getloadavg()]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "sampling"}
    settings.update(model=base.name, device=str(base.device))
    doc = {"command": ["benchmarks/heal_answer.py", *(argv if argv is not None else sys.argv[1:])],
           "settings": settings, "environment": env, "ingest": corpus.ingest, "engines": list(es),
           "summary": summarise(records, list(es)), "rows": records}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    (args.out / "results.md").write_text(table(doc), encoding="utf-8")
    plot(doc, args.out / "identity.png")
    print(table(doc), flush=True)
    missed = any(a["cache_misses"] for r in records for a in r["answers"].values())
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
