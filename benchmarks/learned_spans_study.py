"""Learned spans: the quality of a span's cache learned in an earlier prompt, and what reusing it saves.

A chat prompt that arrives without retriever callbacks is cut into content-defined spans
(`fusionrag_core.reuse.spans`); each span's K/V, as that prompt computed it after whatever preceded
it there, is kept as a learned cache and reused by a later prompt holding the same span. Three
figures, in one run, with one engine:

1. **quality**: MuSiQue rows' passages (cut to `--max-passage-tokens`) are ingested into one shared
   corpus (fused after their corpus-wide neighbours, as `fusionrag bench --corpus shared`). For each
   row, a chat prompt holds the question and its context (`--contexts`: "retrieved", the top `-k`
   chunks of the shared corpus; "gold", the row's own passages) in its system message. Before it, in
   a fresh learned directory, an earlier prompt holds the same passages shuffled, among
   `--extra-passages` passages of another row, with another row's question: each span's learned
   cache was computed after other text than it meets now. Then the SAME measured prompt (one
   `FusionPrompt`, the one the learned spans were found in) is answered by full attention, by the
   learned spans (the engine's default selector), by ingested fused caches (`fusionrag_drift`:
   drift_aware) and by CacheBlend (`cacheblend`: kv_deviation over independent caches), each at
   `--ratios`, plus the no-recompute lower bounds of each kind of cache. First-token KL against
   full attention and greedy agreement per row, in an order rotated from row to row. With
   `--learned-drift`, every learned cache also gets a drift of its own before the measured prompt
   (its K/V in the earlier prompt against the span alone after the system prefix, as
   `fusionrag_core.query.drift` measures a fused chunk's), which the default selector then reads.
2. **second ask vs first**: the LangChain v1 two-step chain's messages (a system message with the
   tutorial's instruction and the retrieved passages, then the question, as `create_agent` with a
   `dynamic_prompt` middleware sends them) go to a `ChatFusionRAG` with a fresh learned directory,
   twice. Per pair: the engine's `ttft_s`, the wall time to the first streamed chunk (prompt
   building, span cutting and the content lookup included) and the wall time of the whole call;
   `--rounds` rounds over `--ttft-questions` questions in a rotated order, after one untimed pair.
   The same messages also go to a model with `learn=False`, before or after the pair in turn: the
   second ask against it says what learning saves over not learning at all.
3. **overhead on a prompt with nothing to reuse**: rows never seen before (after the quality
   slice), asked once of a learning model and once of one with `learn=False`, alternating which goes
   first. Learning runs after decoding, so its cost lands in the whole call's time, not in TTFT
   (`*_after_first_chunk_s`); a TTFT difference comes from the prompt's learnable spans being
   computed as uncached chunks rather than as plain text.

    python benchmarks/learned_spans_study.py --data ../shared/datasets/musique_dev.jsonl \\
        --rows 10 --contexts retrieved,gold --ttft-questions 6 --rounds 3 --overhead-repeats 8 \\
        --out bench-out/learned-spans.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from langchain_core.messages import AIMessageChunk, BaseMessage, HumanMessage, SystemMessage

from fusionrag_core.batching.prefix_cache import PrefixCacheConfig
from fusionrag_core.bench.data import BenchRow, load_rows
from fusionrag_core.bench.methods import METHODS
from fusionrag_core.bench.runner import row_passages
from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest import chroma
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.query.divergence import first_token_agree, first_token_kl
from fusionrag_core.query.drift import fusion_drift
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.reuse.learned import content_id
from fusionrag_integrations.langchain import ChatFusionRAG
from fusionrag_integrations.request import RequestOptions
from fusionrag_integrations.session import ReuseConfig, ReuseSession

TUTORIAL_INSTRUCTION = "You are a helpful assistant. Use the following context in your response:"
"""The system prompt of LangChain's v1 RAG tutorial (`dynamic_prompt` + `create_agent`)."""

LEARNED = "learned_spans"
BASELINES = ("fusionrag_drift", "cacheblend")
"""Bench methods (`fusionrag_core.bench.methods.METHODS`) compared with the learned spans at each ratio."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--model", default=None, help="smollm2-135m (default) or gemma3-270m, or a path")
    p.add_argument("--skip", type=int, default=0, help="first row of the quality slice")
    p.add_argument("--rows", type=int, default=10, help="rows of the quality slice (and the shared corpus)")
    p.add_argument("--max-passage-tokens", type=int, default=80)
    p.add_argument("--neighbours", type=int, default=10, help="n of the fused ingest")
    p.add_argument("--contexts", default="retrieved", help="comma-separated: retrieved, gold")
    p.add_argument("-k", type=int, default=10, help="chunks retrieved per question")
    p.add_argument("--ratios", default="0.15", help="comma-separated recompute ratios")
    p.add_argument("--extra-passages", type=int, default=3,
                   help="passages of another row the earlier (learning) prompt holds besides the measured ones")
    p.add_argument("--ttft-questions", type=int, default=6, help="questions of the second-ask study (first rows)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of the second-ask study")
    p.add_argument("--overhead-repeats", type=int, default=8,
                   help="fresh rows (after the quality slice) asked with learning on and off")
    p.add_argument("--answer-tokens", type=int, default=8, help="max tokens of the timed answers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--learned-drift", action="store_true",
                   help="give each learned cache a drift of its own (vs the span alone) before the measured prompt")
    p.add_argument("--quality-only", action="store_true",
                   help="run the quality part alone (no second ask, no overhead rows)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quality_only:
        args.ttft_questions = args.overhead_repeats = 0
    args.contexts = [c for c in args.contexts.split(",") if c]
    if not args.contexts or set(args.contexts) - {"retrieved", "gold"}:
        p.error(f"--contexts takes retrieved and/or gold, got {args.contexts}")
    args.ratios = [float(r) for r in args.ratios.split(",") if r]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    study(FusionEngine.from_pretrained(args.model), args)


def study(engine: FusionEngine, args: argparse.Namespace,
          embedding_function: chroma.EmbeddingFn | None = None) -> dict[str, Any]:
    """Run the three parts; returns (and prints, and writes to `args.out`) the JSON document."""
    load_before = machine_load()
    started = time.perf_counter()
    fresh_needed = 0 if args.quality_only else args.overhead_repeats + 1
    rows = load_rows(args.data, args.skip + args.rows + fresh_needed)[args.skip:]
    if len(rows) < args.rows + fresh_needed:
        raise SystemExit(f"{args.data} has too few rows after --skip {args.skip}: need {args.rows + fresh_needed} "
                         "(--rows, plus --overhead-repeats + 1 unless --quality-only)")
    quality_rows, fresh_rows = rows[:args.rows], rows[args.rows:]
    # NOTE: learned spans are what is studied: the engine's prefix cache stays out of it, except in a
    # second ask measured apart with `shared_documents` (which answers a repeated prompt from its K/V)
    sharing = PrefixCacheConfig(shared_documents=True)
    product = engine.with_config(dataclasses.replace(engine.config, prefix_cache=sharing))
    engine = engine.with_config(dataclasses.replace(engine.config, prefix_cache=None))
    passages = [row_passages(row, engine, args.max_passage_tokens) for row in quality_rows]
    ef = embedding_function if embedding_function is not None else chroma.default_embedding_function()
    with tempfile.TemporaryDirectory(prefix="learned-spans-") as tmp:
        root = Path(tmp)
        index = ingest(engine, passages, root, args.neighbours, ef)
        contexts = {mode: [context_of(index, row, own, mode, args.k) for row, own in zip(quality_rows, passages,
                                                                                           strict=True)]
                    for mode in args.contexts}
        quality = {mode: quality_study(engine, index, quality_rows, passages, contexts[mode], root / mode, args)
                   for mode in args.contexts}
        second_ask = second_ask_product = overhead = None
        if not args.quality_only:
            retrieved = [context_of(index, row, own, "retrieved", args.k) for row, own in zip(
                quality_rows[:args.ttft_questions], passages, strict=False)]
            second_ask = second_ask_study(engine, quality_rows[:args.ttft_questions], retrieved, root / "asks", args)
            second_ask_product = second_ask_study(product, quality_rows[:args.ttft_questions], retrieved,
                                                  root / "asks-shared-documents", args)
        index.close()
        if not args.quality_only:
            fresh = [row_passages(row, engine, args.max_passage_tokens) for row in fresh_rows]
            overhead = overhead_study(engine, fresh_rows, fresh, root / "overhead", args)
    doc = {
        "model": engine.name,
        "device": str(engine.device),
        "dtype": str(engine.decoder.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "load_before": load_before,
        "load_after": machine_load(),
        "seconds": time.perf_counter() - started,
        "quality": quality,
        "second_ask": second_ask,
        "second_ask_shared_documents": second_ask_product,
        "overhead": overhead,
        "goals": goals(quality, second_ask, second_ask_product, overhead, args.ratios),
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return doc


def machine_load() -> dict[str, Any]:
    """The 1/5/15-minute load averages, and `uptime`'s line as printed."""
    line = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    return {"loadavg": list(os.getloadavg()), "uptime": line}


# ---- the shared corpus ------------------------------------------------------------------------------

def ingest(engine: FusionEngine, passages: Sequence[Sequence[str]], root: Path, neighbours: int,
           ef: chroma.EmbeddingFn) -> FusionIndex:
    """Every row's passages in one fused index (its store holds both cache variants), one chunk per
    passage, under the default chunking so a chunk's id is its text's content id (the id a learned
    span of the same text gets)."""
    texts = [p for ps in passages for p in ps]
    index = FusionIndex.open(engine, root / "corpus", collection_name="shared", embedding_function=ef,
                             config=IngestConfig(neighbours=min(neighbours, len(set(texts)) - 1)))
    t0 = time.perf_counter()
    report = index.add_texts(texts, doc_ids=[f"row{i}-passage-{j}" for i, ps in enumerate(passages)
                                             for j in range(len(ps))])
    print(f"ingest: {len(texts)} passages in {time.perf_counter() - t0:.0f} s", flush=True)
    ids = [chunks[0] if len(chunks) == 1 else None for chunks in report.chunk_ids]
    wrong = [t[:40] for t, cid in zip(texts, ids, strict=True) if cid != content_id(t, engine.fingerprint)]
    if wrong:
        raise SystemExit(f"{len(wrong)} passage(s) were not ingested as one chunk under their content id "
                         f"(e.g. {wrong[0]!r}); lower --max-passage-tokens")
    for variant in ("independent", "fused"):
        missing = set(ids) - index.store.list_ids(variant)
        if missing:
            raise SystemExit(f"the ingest stored no {variant} cache for {len(missing)} passage(s)")
    return index


def context_of(index: FusionIndex, row: BenchRow, own: Sequence[str], mode: str, k: int) -> list[str]:
    """The passages a question is asked over: its own ("gold") or the top `k` of the corpus."""
    if mode == "gold":
        return list(dict.fromkeys(own))
    return list(dict.fromkeys(hit.text for hit in index.search(row.question, k)))


def chat(instruction: str, question: str, texts: Sequence[str]) -> list[dict[str, str]]:
    """A chat request whose system message holds the passages after the instruction, as chat apps send it."""
    return [{"role": "system", "content": f"{instruction}\n\n" + "\n\n".join(texts)},
            {"role": "user", "content": question}]


# ---- 1. quality -------------------------------------------------------------------------------------

def quality_study(engine: FusionEngine, index: FusionIndex, rows: Sequence[BenchRow],
                  passages: Sequence[Sequence[str]], contexts: Sequence[Sequence[str]], root: Path,
                  args: argparse.Namespace) -> dict[str, Any]:
    """First-token KL and agreement of every method on each row's measured prompt; per row and summed up."""
    rng = random.Random(args.seed)
    instruction = engine.config.instruction
    per_row = []
    for i, (row, context) in enumerate(zip(rows, contexts, strict=True)):
        other = (i + 1) % len(rows)
        extra = [p for p in passages[other] if p not in context][:args.extra_passages]
        earlier = earlier_order(context, extra, rng)
        session = ReuseSession(engine, None, ReuseConfig(learned_dir=root / f"row{i}"))
        one = RequestOptions(sampling=SamplingConfig(max_new_tokens=1))
        learning = answer(session, chat(instruction, rows[other].question, earlier), one)
        sources = session.sources(one)
        prompt = session.prompt(chat(instruction, row.question, context), sources)
        found = sum(1 for s in prompt.segments if s.chunk_id and s.found_by == "content")
        if found != len(context):
            raise SystemExit(f"row {args.skip + i}: {found} of {len(context)} passages were found as learned spans")
        if args.learned_drift:
            add_learned_drift(engine, session, [s.chunk_id for s in prompt.segments if s.found_by == "content"])
        runs = methods(engine, index, session, prompt, args.ratios)
        shift = i % len(runs)
        order = list(runs)[shift:] + list(runs)[:shift]
        generations = {name: runs[name]() for name in order}
        reference = generations["full_attention"].first_token_logits
        per_row.append({
            "row": args.skip + i,
            "prompt_tokens": prompt.num_tokens,
            "passages": len(context),
            "earlier_prompt_tokens": learning.prompt_tokens,
            "earlier_passages": len(earlier),
            "kl": {n: first_token_kl(reference, g.first_token_logits) for n, g in generations.items()},
            "agree": {n: first_token_agree(reference, g.first_token_logits) for n, g in generations.items()},
            "reused_tokens": {n: g.reused_tokens for n, g in generations.items()},
            "recomputed_fraction": {n: g.recomputed_fraction for n, g in generations.items()},
            "selector": {n: g.selector for n, g in generations.items()},
        })
        print(f"row {args.skip + i}: " + " ".join(f"{n}={v:.4f}" for n, v in per_row[-1]["kl"].items()), flush=True)
    return {"summary": quality_summary(per_row, args.ratios), "rows": per_row}


def add_learned_drift(engine: FusionEngine, session: ReuseSession, chunk_ids: Sequence[str | None]) -> None:
    """Store the learned caches `chunk_ids` of `session` again with their drift from the span alone
    after the system prefix (`fusion_drift`): how much their K/V depend on what preceded the span
    when it was learned."""
    learned = session.learned()
    assert learned is not None
    for chunk_id in filter(None, chunk_ids):
        kv = learned.store.get(chunk_id, "fused", fingerprint=engine.fingerprint)
        alone = engine.chunk_cache(kv.token_ids)
        learned.store.put(chunk_id, dataclasses.replace(kv, drift=fusion_drift(kv, alone, engine.decoder.rope)))


def earlier_order(context: Sequence[str], extra: Sequence[str], rng: random.Random) -> list[str]:
    """The earlier prompt's passages: `context`'s and `extra`, shuffled until no passage of `context`
    follows the same passage there as in `context` (nor opens both): every learned span was computed
    after other text than the measured prompt puts before it."""
    before = {p: context[j - 1] if j else None for j, p in enumerate(context)}
    texts = [*context, *extra]
    for _ in range(10_000):
        rng.shuffle(texts)
        if all(before[p] != (texts[j - 1] if j else None) for j, p in enumerate(texts) if p in before):
            return texts
    raise SystemExit(f"no order of {len(texts)} passages puts other text before each of {len(context)}; "
                     "raise --extra-passages or -k")


def methods(engine: FusionEngine, index: FusionIndex, session: ReuseSession, prompt: FusionPrompt,
            ratios: Sequence[float]) -> dict[str, Callable[[], Generation]]:
    """Each method's run of the same `prompt`, by label; a reuse method that prefilled a chunk fails."""
    one = SamplingConfig(max_new_tokens=1)

    def learned(ratio: float | None, selector: str | None = None) -> Callable[[], Generation]:
        options = RequestOptions(sampling=one, ratio=ratio, selector=selector)
        return lambda: checked(answer(session, prompt, options), {"fused"})

    def ingested(name: str, ratio: float | None) -> Callable[[], Generation]:
        method = METHODS[name]
        return lambda: checked(engine.generate(prompt, store=index.store, sampling=one, selector=method.selector,
                                               ratio=ratio, variant=method.variant), {method.variant})

    runs: dict[str, Callable[[], Generation]] = {
        "full_attention": lambda: engine.full_attention(prompt, sampling=one).collect(),
        f"{LEARNED}_full_reuse": learned(None, "none"),
        "fused_full_reuse": lambda: checked(engine.generate(prompt, store=index.store, sampling=one, selector="none",
                                                            variant="fused"), {"fused"}),
        "full_reuse": ingested("full_reuse", None),
    }
    for ratio in ratios:
        runs[f"{LEARNED}@{ratio:g}"] = learned(ratio)
        for name in BASELINES:
            runs[f"{name}@{ratio:g}"] = ingested(name, ratio)
    return runs


def answer(session: ReuseSession, request: FusionPrompt | Sequence[Mapping[str, str]],
           options: RequestOptions) -> Generation:
    """`request` answered as `ChatFusionRAG` answers it: through the session, learning on."""
    sources = session.sources(options)
    prompt = request if isinstance(request, FusionPrompt) else session.prompt(request, sources)
    *_, generation = session.run(prompt, options, sources)
    assert isinstance(generation, Generation)  # NOTE: `run` ends with the Generation
    return generation


def checked(generation: Generation, variants: set[str | None]) -> Generation:
    """`generation`, once it is known to have reused a cache of `variants` for every chunk."""
    if generation.cache_misses or set(generation.cache_variants) - variants:
        raise SystemExit(f"a reuse method prefilled chunks or read other caches than {variants}: "
                         f"{generation.cache_misses or generation.cache_variants}")
    return generation


def quality_summary(per_row: Sequence[Mapping[str, Any]], ratios: Sequence[float]) -> dict[str, Any]:
    """Mean and median KL, agreement and recompute share per method; the learned / CacheBlend KL ratios."""
    summary: dict[str, Any] = {
        name: {"kl_mean": statistics.mean(r["kl"][name] for r in per_row),
               "kl_median": statistics.median(r["kl"][name] for r in per_row),
               "agreement": statistics.mean(r["agree"][name] for r in per_row),
               "recomputed_fraction": statistics.mean(r["recomputed_fraction"][name] for r in per_row),
               "n": len(per_row)}
        for name in per_row[0]["kl"]
    }
    for ratio in ratios:
        learned, blend = summary[f"{LEARNED}@{ratio:g}"], summary[f"cacheblend@{ratio:g}"]
        summary[f"{LEARNED}_over_cacheblend@{ratio:g}"] = {
            "kl_mean_ratio": learned["kl_mean"] / blend["kl_mean"] if blend["kl_mean"] > 0 else None,
            "kl_median_ratio": learned["kl_median"] / blend["kl_median"] if blend["kl_median"] > 0 else None,
        }
    return summary


# ---- 2. second ask vs first -------------------------------------------------------------------------

def tutorial_messages(question: str, texts: Sequence[str]) -> list[BaseMessage]:
    """What `create_agent` sends after a `dynamic_prompt` that joins the retrieved passages (LangChain v1)."""
    return [SystemMessage(f"{TUTORIAL_INSTRUCTION}\n\n" + "\n\n".join(texts)), HumanMessage(question)]


def timed_ask(llm: ChatFusionRAG, messages: Sequence[BaseMessage]) -> dict[str, Any]:
    """One streamed call: the engine's TTFT, the wall time to the first chunk and of the whole call."""
    t0 = time.perf_counter()
    first_chunk: float | None = None
    meta: Mapping[str, Any] = {}
    for chunk in llm.stream(list(messages)):
        if first_chunk is None:
            first_chunk = time.perf_counter() - t0
        if isinstance(chunk, AIMessageChunk) and chunk.response_metadata.get("ttft_s") is not None:
            meta = chunk.response_metadata
    total = time.perf_counter() - t0
    return {"ttft_s": meta["ttft_s"], "engine_total_s": meta["total_s"], "wall_first_chunk_s": first_chunk,
            "wall_total_s": total, "prompt_tokens": meta["prompt_tokens"], "reused_tokens": meta["reused_tokens"],
            "recomputed_tokens": meta["recomputed_tokens"], "prefix_cached_tokens": meta["prefix_cached_tokens"],
            "cache_misses": meta["cache_misses"]}


TIMES = ("ttft_s", "wall_first_chunk_s", "wall_total_s")


def second_ask_study(engine: FusionEngine, rows: Sequence[BenchRow], contexts: Sequence[Sequence[str]], root: Path,
                     args: argparse.Namespace) -> dict[str, Any]:
    """The same question over the same retrieved passages asked twice of a model with a fresh learned directory.

    With the engine's prefix cache, it is emptied before every ask but the second, so that only the
    pair's first ask is kept when the second comes (what a user asking twice meets).
    """
    def forget() -> None:
        if engine.prefix_cache is not None:
            engine.prefix_cache.clear()

    def model(name: str) -> ChatFusionRAG:
        return ChatFusionRAG(engine=engine, max_tokens=args.answer_tokens, learned_dir=str(root / name))

    off = ChatFusionRAG(engine=engine, max_tokens=args.answer_tokens, learn=False)
    warm = model("warm-up")
    for llm in (warm, warm, off):
        timed_ask(llm, tutorial_messages(rows[0].question, contexts[0]))
    forget()
    pairs = []
    for rnd in range(args.rounds):
        shift = rnd % len(rows)
        for j, q in enumerate(list(range(len(rows)))[shift:] + list(range(len(rows)))[:shift]):
            llm = model(f"round{rnd}-q{q}")
            messages = tutorial_messages(rows[q].question, contexts[q])
            # NOTE: the same messages asked of a model that learns nothing, before or after the pair in turn
            forget()
            before = timed_ask(off, messages) if j % 2 == 0 else None
            forget()
            first, second = timed_ask(llm, messages), timed_ask(llm, messages)
            forget()
            learn_off = before if before is not None else timed_ask(off, messages)
            pairs.append({"round": rnd, "question": q, "first": first, "second": second, "learn_off": learn_off,
                          **{f"{t}_ratio": second[t] / first[t] for t in TIMES},
                          **{f"{t}_second_over_learn_off": second[t] / learn_off[t] for t in TIMES}})
            print(f"ask round {rnd} q{q}: TTFT {first['ttft_s'] * 1e3:.0f} -> {second['ttft_s'] * 1e3:.0f} ms "
                  f"(reused {second['reused_tokens']} of {second['prompt_tokens']}); learning off "
                  f"{learn_off['ttft_s'] * 1e3:.0f} ms", flush=True)
    summary = {f"{t}_ratio": quartiles([p[f"{t}_ratio"] for p in pairs]) for t in TIMES}
    summary.update({f"{t}_second_over_learn_off": quartiles([p[f"{t}_second_over_learn_off"] for p in pairs])
                    for t in TIMES})
    for t in TIMES:
        for ask in ("first", "second", "learn_off"):
            summary[f"{ask}_{t}"] = quartiles([p[ask][t] for p in pairs])
    summary["second_reused_share"] = statistics.mean(p["second"]["reused_tokens"] / p["second"]["prompt_tokens"]
                                                     for p in pairs)
    return {"summary": summary, "pairs": pairs}


# ---- 3. overhead on a prompt with nothing to reuse --------------------------------------------------

def overhead_study(engine: FusionEngine, rows: Sequence[BenchRow], passages: Sequence[Sequence[str]], root: Path,
                   args: argparse.Namespace) -> dict[str, Any]:
    """Never-seen prompts asked with learning on and off, alternating which goes first; the first row warms up."""
    on = ChatFusionRAG(engine=engine, max_tokens=args.answer_tokens, learned_dir=str(root / "learned"))
    off = ChatFusionRAG(engine=engine, max_tokens=args.answer_tokens, learn=False)
    models = {"learn_on": on, "learn_off": off}
    pairs = []
    for r, (row, texts) in enumerate(zip(rows, passages, strict=True)):
        messages = tutorial_messages(row.question, texts)
        order = ["learn_on", "learn_off"] if r % 2 == 0 else ["learn_off", "learn_on"]
        asks = {name: timed_ask(models[name], messages) for name in order}
        if r == 0:
            continue  # NOTE: the warm-up row: first calls of each model pay one-time costs
        pairs.append({"row": args.skip + args.rows + r, "first": order[0], **asks,
                      **{f"{t}_ratio": asks["learn_on"][t] / asks["learn_off"][t] for t in TIMES}})
        print(f"overhead row {r}: TTFT on {asks['learn_on']['ttft_s'] * 1e3:.0f} off "
              f"{asks['learn_off']['ttft_s'] * 1e3:.0f} ms; total on {asks['learn_on']['wall_total_s'] * 1e3:.0f} "
              f"off {asks['learn_off']['wall_total_s'] * 1e3:.0f} ms", flush=True)
    learned = on.reuse_session().learned()
    summary: dict[str, Any] = {f"{t}_ratio": quartiles([p[f"{t}_ratio"] for p in pairs]) for t in TIMES}
    for t in TIMES:
        for name in models:
            summary[f"{name}_{t}"] = quartiles([p[name][t] for p in pairs])
        summary[f"{t}_overhead_pct_of_medians"] = 100 * (summary[f"learn_on_{t}"]["median"]
                                                         / summary[f"learn_off_{t}"]["median"] - 1)
    for name in models:  # NOTE: learning runs after the last token: it lands here, not in TTFT
        summary[f"{name}_after_first_chunk_s"] = quartiles([p[name]["wall_total_s"] - p[name]["wall_first_chunk_s"]
                                                             for p in pairs])
    summary["learn_on_reused_tokens"] = sum(p["learn_on"]["reused_tokens"] for p in pairs)
    summary["learned_spans"] = len(learned) if learned is not None else 0
    return {"summary": summary, "pairs": pairs}


# ---- goals ------------------------------------------------------------------------------------------

def quartiles(xs: Sequence[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "min": min(xs), "max": max(xs), "n": len(xs)}


def goals(quality: Mapping[str, Any], second_ask: Mapping[str, Any] | None,
          second_ask_product: Mapping[str, Any] | None, overhead: Mapping[str, Any] | None,
          ratios: Sequence[float]) -> dict[str, Any]:
    """The issue's three goals, each with the figure it is judged on (those of the parts that ran)."""
    out: dict[str, Any] = {}
    for mode, q in quality.items():
        for ratio in ratios:
            value = q["summary"][f"{LEARNED}_over_cacheblend@{ratio:g}"]["kl_mean_ratio"]
            out[f"quality_{mode}@{ratio:g}"] = {"learned_over_cacheblend_kl_mean": value, "goal": "<= 0.5",
                                                "met": value is not None and value <= 0.5}
    for name, asks in (("learned_spans", second_ask), ("shared_documents", second_ask_product)):
        if asks is not None:
            ttft = asks["summary"]["ttft_s_ratio"]["median"]
            out[f"second_ask_ttft_{name}"] = {"median_ratio": ttft, "goal": "<= 0.45", "met": ttft <= 0.45}
    if overhead is not None:
        pct = 100 * (overhead["summary"]["ttft_s_ratio"]["median"] - 1)
        out["overhead_ttft"] = {"median_paired_pct": pct, "goal": "<= 3%", "met": pct <= 3}
    return out


if __name__ == "__main__":
    main()
