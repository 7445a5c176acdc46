"""Serving under load: N simulated users over one shared corpus, full attention vs CacheBlend vs
FusionRAG, with the engine's scheduler (continuous batching) on and off.

The corpus: the passages of `--rows` MuSiQue rows (cut to `--max-passage-tokens`, as `fusionrag bench`
cuts them), plus one more row for the warm-ups, ingested once into ONE fused FusionIndex (its store
holds each passage's independent and fused cache; a temporary directory unless `--db`), one chunk
per passage, as the bench runner ingests a shared corpus.

A conversation asks one row's question over that row's passages (the gold context), through the
engine's messages API: a system message with the engine's instruction, then a user message with each
passage marked with its chunk id (`mark_chunk`) and the question line. That prompt equals the bench
runner's canonical one token for token (checked for every conversation), so the chunk caches are
found by chunk id exactly as `fusionrag bench` finds them. A share `--followups` of conversations get
a second turn: the first turn's messages, the assistant's answer, and a templated follow-up question;
its token prefix is the first turn's prompt and answer (recorded per follow-up: what an exact prefix
cache across turns would reuse). No question is asked twice in one configuration: with more requests
than rows, the run stops at the rows (and says so).

A configuration is one method x scheduler on/off x number of users:
    full_attention: a plain prefill of the whole prompt (`engine.full_attention`);
    cacheblend:     kv_deviation over the independent caches at `--ratio` (the bench's `cacheblend`);
    fusionrag:      the engine's default selector over the fused caches at `--ratio`;
    scheduler on:   the default `EngineConfig()` (every request goes through `engine.scheduler`);
    scheduler off:  `EngineConfig(scheduler=None)`: each request runs alone on its user's thread.
Each configuration gets a fresh engine sharing the same model weights, so nothing one configuration
computed (the memoised prefix, an exact prefix cache across turns) serves another's requests; one
untimed warm-up request (the extra row) runs before it. Configurations run one after the other.

Users are threads in a closed loop: each takes the next conversation from a shared queue and runs its
turns, streaming (`engine.stream`); with `--think-s MIN,MAX` a user pauses before a follow-up (drawn
per conversation), and `--heal off,N` runs each configuration with healing off and with the
engines that have a scheduler healing kept turns while idle (`HealConfig(piece_tokens=N)`; such a
configuration records the engine's heal totals), side by side in one run.
Per turn: TTFT (from building the prompt to the first text piece,
queueing included), the engine's own TTFT, inter-token latency ((last piece - first piece) / (tokens - 1)
and the gaps between pieces), output tokens. Per configuration (`--requests` turns at most, follow-ups
included, and `--budget-s` seconds from the first request): requests/s and output tokens/s over the
wall time, TTFT p50/p95 of first turns and follow-ups, the median follow-up/first-turn TTFT ratio of
the conversations that finished both. Past the deadline, an answer is cut at its next piece ("cut":
its pieces count as output; a request still waiting for its first token runs to it, so a configuration
can overrun its budget by about one TTFT) and turns not started are "not run"; both are counted, never
dropped.

Written to `--out`: results.json (every configuration, the goal ratios, the environment: cores, torch
threads, load average at start and end, the command line), results.md, throughput.png and ttft.png.
The exit status is 1 when a request failed or a chunk cache was missed.

    python benchmarks/serving.py --data ../shared/datasets/musique_dev.jsonl --rows 40 --users 1,4,16 \\
        --requests 32 --max-passage-tokens 80 --out benchmarks/results/serving
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from fusionrag_core.batching.heal import HealConfig
from fusionrag_core.batching.scheduler import SchedulerConfig
from fusionrag_core.bench.data import BenchRow, load_rows
from fusionrag_core.bench.methods import FULL_ATTENTION, METHODS, Method
from fusionrag_core.bench.runner import ANSWER_STOP, _check_caches, _check_fits, _chunk_records, _doc_ids, row_passages
from fusionrag_core.engine import FusionEngine, Generation, GenerationStream
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest import chroma
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.query.prompt import QUESTION_TEMPLATE, FusionPrompt
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.query.selectors import DEFAULT_SELECTOR
from fusionrag_core.recognise.marks import mark_chunk
from fusionrag_core.runtime.compat import tokenize_plain
from fusionrag_core.store.base import KVStore

SERVED: dict[str, Method] = {
    FULL_ATTENTION: METHODS[FULL_ATTENTION],
    "cacheblend": METHODS["cacheblend"],
    # NOTE: what a deployment serves: the engine's default selector (the bench names it `fusionrag_drift`;
    # the bench's `fusionrag` is the paper's query_guided).
    "fusionrag": Method("fusionrag", DEFAULT_SELECTOR, "fused", True),
}
FOLLOWUPS = (
    "Which passage supports that? Answer briefly.",
    "How sure are you? Answer briefly.",
    "Say that again as one short sentence.",
)
"""Follow-up questions, taken in turn by the conversations that have one."""
SCHEDULERS = {"on": True, "off": False}


# ---- the corpus and the conversations ---------------------------------------------------------------------
@dataclass(frozen=True)
class Conversation:
    """One user's conversation: a row's question over its passages, maybe one follow-up turn."""

    index: int
    row: int
    question: str
    chunks: tuple[tuple[str, str], ...]  # (chunk id, text as ingested), in the row's order
    followup: str | None

    def first_messages(self, instruction: str) -> list[dict[str, str]]:
        """The first turn: the passages, each marked with its chunk id, then the question line (the
        bench runner's canonical prompt, rendered by the chat template)."""
        context = "".join(mark_chunk(cid, text) for cid, text in self.chunks)
        return [{"role": "system", "content": instruction},
                {"role": "user", "content": context + QUESTION_TEMPLATE.format(question=self.question)}]

    def followup_messages(self, instruction: str, answer: str) -> list[dict[str, str]]:
        """The second turn: the first turn, the assistant's answer, the follow-up question."""
        assert self.followup is not None
        return [*self.first_messages(instruction), {"role": "assistant", "content": answer},
                {"role": "user", "content": self.followup}]


@dataclass
class Corpus:
    """The ingested rows: each row's `(chunk id, text)` pairs; the index whose store every method reads."""

    index: FusionIndex
    chunks: list[tuple[tuple[str, str], ...]]
    ingest: dict[str, Any]


def build_corpus(engine: FusionEngine, rows: Sequence[BenchRow], args: argparse.Namespace, data_dir: Path,
                 embedding_function: chroma.EmbeddingFn | None) -> Corpus:
    """Every row's passages in one fused index, one chunk per passage (the bench runner's shared corpus,
    but one index: a fused ingest stores the independent caches CacheBlend reads too)."""
    passages = [row_passages(row, engine, args.max_passage_tokens) for row in rows]
    for i, (row, ps) in enumerate(zip(rows, passages, strict=True)):
        _check_fits(engine, row, ps, args.sampling, i)
    texts = [p for ps in passages for p in ps]
    # NOTE: the chunk budget is the longest passage, so no passage is split (as the runner ingests).
    chunk_tokens = max(len(tokenize_plain(engine.tokenizer, p)) for p in texts)
    config = IngestConfig(chunk_tokens=chunk_tokens, neighbours=min(args.neighbours, len(texts) - 1))
    ef = embedding_function if embedding_function is not None else chroma.default_embedding_function()
    index = FusionIndex.open(engine, data_dir, collection_name="serving", config=config, embedding_function=ef)
    try:
        report = index.add_texts(texts, doc_ids=_doc_ids(passages))
        if any(len(c) != 1 for c in report.chunk_ids):
            raise SystemExit("a passage was cut into several chunks; the benchmark needs one chunk per passage")
        ids = [c[0] for c in report.chunk_ids]
        _check_caches({"independent": index, "fused": index}, ids, "serving corpus")
        by_id, _ = _chunk_records(index, ids)
    except BaseException:
        index.close()
        raise
    chunks, at = [], 0
    for ps in passages:
        chunks.append(tuple((cid, by_id[cid]) for cid in ids[at:at + len(ps)]))
        at += len(ps)
    ingest = {"passages": len(texts), "new_chunks": report.new_chunks, "skipped_chunks": report.skipped_chunks,
              "seconds": round(report.seconds, 2), "chunk_tokens": chunk_tokens, "neighbours": config.neighbours}
    return Corpus(index, chunks, ingest)


@contextlib.contextmanager
def opened_corpus(engine: FusionEngine, rows: Sequence[BenchRow], args: argparse.Namespace, prefix: str,
                  embedding_function: chroma.EmbeddingFn | None) -> Iterator[Corpus]:
    """`build_corpus` in `args.db`, else in a temporary directory named with `prefix` (removed after);
    its index closed when the block ends."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        corpus = build_corpus(engine, rows, args, args.db or Path(tmp), embedding_function)
        try:
            yield corpus
        finally:
            corpus.index.close()


def has_followup(i: int, share: float) -> bool:
    """Whether conversation `i` gets a follow-up: `share` of them, evenly spread, the first one included."""
    # NOTE: rounded before `ceil`: 10 * 0.3 is 3.0000000000000004 in floats.
    return math.ceil(round((i + 1) * share, 9)) > math.ceil(round(i * share, 9))


def plan(rows: Sequence[BenchRow], corpus: Corpus, requests: int, share: float) -> tuple[list[Conversation], str]:
    """The conversations of one configuration: one per row, in order, until their turns reach `requests`
    (a follow-up that would exceed it is left out); a note when the rows ran out first."""
    conversations: list[Conversation] = []
    turns = 0
    for i, row in enumerate(rows):
        if turns >= requests:
            return conversations, ""
        followup = None
        if has_followup(i, share) and turns + 2 <= requests:
            followup = FOLLOWUPS[sum(c.followup is not None for c in conversations) % len(FOLLOWUPS)]
        conversations.append(Conversation(i, i, row.question, corpus.chunks[i], followup))
        turns += 1 + (followup is not None)
    if turns >= requests:
        return conversations, ""
    return conversations, (f"--requests {requests} needs more conversations than the {len(rows)} rows: stopping at "
                           f"{turns} requests ({len(rows)} conversations), no question is asked twice")


def check_prompts(engine: FusionEngine, conversations: Sequence[Conversation]) -> None:
    """Each first turn's prompt from messages equals the bench runner's canonical prompt."""
    for c in conversations:
        ours = engine.prompt_from_messages(c.first_messages(engine.config.instruction))
        canonical = engine.prompt(c.question, chunks=list(c.chunks))
        if not torch.equal(ours.token_ids(), canonical.token_ids()) or \
                [s.chunk_id for s in ours.segments] != [s.chunk_id for s in canonical.segments]:
            raise SystemExit(f"row {c.row}: the prompt from messages differs from the bench runner's prompt")


# ---- one turn ---------------------------------------------------------------------------------------------
@dataclass
class Turn:
    """One request of a conversation. `status`: "ok", "cut" (the deadline came mid-answer), "not run",
    or the class name of the error it failed with."""

    conversation: int
    row: int
    turn: int  # 0: first, 1: follow-up
    status: str = "not run"
    ttft_s: float | None = None
    engine_ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    tpot_s: float | None = None  # (last piece - first piece) / (tokens - 1)
    prompt_tokens: int = 0
    reuse_ratio: float | None = None
    cache_misses: int = 0
    answer: str = ""
    error: str = ""
    shared_prefix_tokens: int | None = None  # follow-ups: leading prompt tokens equal to first prompt + answer
    first_prompt_and_answer_tokens: int | None = None
    gaps_s: list[float] = field(default_factory=list, repr=False)  # between pieces, pooled in the summary

    def record(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "gaps_s"}


@dataclass(frozen=True)
class Serving:
    """What every turn of one configuration is answered with."""

    engine: FusionEngine
    method: Method
    ratio: float
    store: KVStore
    sampling: SamplingConfig
    think_s: tuple[float, float] | None = None  # a user's pause before a follow-up, drawn from this range


def open_stream(s: Serving, prompt: FusionPrompt) -> GenerationStream:
    """The method's stream of `prompt` (nothing runs until it is iterated)."""
    if s.method.selector is None:
        return s.engine.full_attention(prompt, sampling=s.sampling)
    return s.engine.stream(prompt, sampling=s.sampling, selector=s.method.selector, ratio=s.ratio,
                           variant=s.method.variant, store=s.store)


def run_turn(s: Serving, turn: Turn, messages: Sequence[Mapping[str, str]],
             deadline: float) -> tuple[FusionPrompt | None, Generation | None]:
    """Answer `messages` into `turn`; returns the prompt and, when the answer finished, its Generation."""
    start = time.perf_counter()
    prompt: FusionPrompt | None = None
    try:
        prompt = s.engine.prompt_from_messages(messages)
        stream = open_stream(s, prompt)
        pieces, last = iter(stream), 0.0
        text: list[str] = []
        try:
            for piece in pieces:
                now = time.perf_counter()
                if turn.ttft_s is None:
                    turn.ttft_s = now - start
                else:
                    turn.gaps_s.append(now - last)
                last = now
                text.append(piece)
                if now > deadline:
                    turn.status = "cut"
                    break
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()  # NOTE: a cut answer leaves the batch now (its ticket is cancelled), not when collected
    except Exception as e:  # NOTE: counted by class name in the summary; the run goes on
        turn.status, turn.error = type(e).__name__, str(e)[:300]
        return prompt, None
    turn.answer, turn.latency_s = "".join(text), time.perf_counter() - start
    if turn.status == "cut":
        turn.output_tokens = len(text)  # NOTE: no Generation for a cut answer: its pieces (<= its tokens)
        return prompt, None
    generation = stream.result
    assert generation is not None
    turn.status, turn.output_tokens = "ok", len(generation.token_ids)
    turn.engine_ttft_s, turn.prompt_tokens = generation.ttft_s, generation.prompt_tokens
    turn.reuse_ratio, turn.cache_misses = generation.reuse_ratio, len(generation.cache_misses)
    if turn.output_tokens >= 2 and turn.ttft_s is not None:
        turn.tpot_s = (last - start - turn.ttft_s) / (turn.output_tokens - 1)
    return prompt, generation


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run_conversation(s: Serving, c: Conversation, turns: list[Turn], deadline: float) -> None:
    """The conversation's turns, in order; the follow-up runs only after a finished first turn."""
    instruction = s.engine.config.instruction
    if time.perf_counter() > deadline:
        return
    prompt, generation = run_turn(s, turns[0], c.first_messages(instruction), deadline)
    if c.followup is None or generation is None or prompt is None or time.perf_counter() > deadline:
        return
    before = prompt.token_ids().tolist() + generation.token_ids
    if s.think_s is not None:  # NOTE: a person reads the answer first: drawn per conversation, reproducibly
        time.sleep(random.Random(c.index).uniform(*s.think_s))
    followup, _ = run_turn(s, turns[1], c.followup_messages(instruction, generation.text), deadline)
    if followup is not None:
        turns[1].shared_prefix_tokens = shared_prefix(followup.token_ids().tolist(), before)
        turns[1].first_prompt_and_answer_tokens = len(before)


# ---- one configuration ------------------------------------------------------------------------------------
def engine_for(base: FusionEngine, scheduler: bool, heal_pieces: int | None,
               args: argparse.Namespace) -> FusionEngine:
    """A fresh engine on `base`'s weights, with the scheduler or without (healing in pieces of
    `heal_pieces` tokens, if not None, with it)."""
    config = SchedulerConfig(max_running=args.max_running) if scheduler else None
    heal = HealConfig(piece_tokens=heal_pieces) if heal_pieces is not None and scheduler else None
    return FusionEngine(base.model, base.tokenizer, name=base.name,
                        config=dataclasses.replace(base.config, scheduler=config, heal=heal))


def run_users(s: Serving, conversations: Sequence[Conversation], users: int,
              budget_s: float) -> tuple[list[list[Turn]], float]:
    """`users` threads answering `conversations` (each takes the next one); every planned turn, and the
    wall time from the first request to the last user's end."""
    turns = [[Turn(c.index, c.row, t) for t in range(1 + (c.followup is not None))] for c in conversations]
    pending: queue.SimpleQueue[Conversation] = queue.SimpleQueue()
    for c in conversations:
        pending.put(c)
    clock: dict[str, float] = {}

    def started() -> None:  # NOTE: run once, by the last user to arrive: the deadline starts with the requests
        clock["start"] = time.perf_counter()
        clock["deadline"] = clock["start"] + budget_s

    barrier = threading.Barrier(users, action=started)
    ends = [0.0] * users

    def user(u: int) -> None:
        barrier.wait()
        while True:
            try:
                c = pending.get_nowait()
            except queue.Empty:
                break
            run_conversation(s, c, turns[c.index], clock["deadline"])
        ends[u] = time.perf_counter()

    threads = [threading.Thread(target=user, args=(u,), name=f"user-{u}") for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return turns, max(ends) - clock["start"]


def run_configuration(base: FusionEngine, corpus: Corpus, method: str, scheduler: bool, heal: int | None,
                      users: int, conversations: Sequence[Conversation], warmup: Conversation,
                      args: argparse.Namespace) -> dict[str, Any]:
    """One configuration on a fresh engine: an untimed warm-up turn, then the users; its summary."""
    engine = engine_for(base, scheduler, heal, args)
    try:
        s = Serving(engine, SERVED[method], args.ratio, corpus.index.store, args.sampling, args.think_s)
        warm = Turn(-1, warmup.row, 0)
        run_turn(s, warm, warmup.first_messages(engine.config.instruction), math.inf)
        before = scheduler_counts(engine)
        turns, wall = run_users(s, conversations, users, args.budget_s)
        summary = {"method": method, "scheduler": scheduler, "heal": heal if scheduler else None, "users": users,
                   "warmup": warm.status,
                   **summarise([t for ts in turns for t in ts], wall)}
        if engine.scheduler is not None:
            steps, rows, passes, packed = (b - a for a, b in zip(before, scheduler_counts(engine), strict=True))
            summary["decode_steps"], summary["mean_batch"] = steps, round(rows / steps, 2) if steps else None
            summary["sparse_passes"], summary["mean_pack"] = passes, round(packed / passes, 2) if passes else None
        if engine.config.heal is not None:
            summary["heal_stats"] = {k: v for k, v in engine.stats().items() if k.startswith("heal")}
        summary["turns"] = [t.record() for ts in turns for t in ts]
        return summary
    finally:
        # NOTE: a healing engine would heal its kept turns beside the next configuration's requests
        engine.close()


def scheduler_counts(engine: FusionEngine) -> tuple[int, int, int, int]:
    """The engine scheduler's decode steps, their rows, its sparse passes and their requests (0s without one)."""
    stats = engine.stats()
    return (stats.get("decode_steps", 0), stats.get("decode_rows", 0), stats.get("sparse_passes", 0),
            stats.get("sparse_pass_requests", 0))


# ---- the summaries ----------------------------------------------------------------------------------------
def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p95 (nearest rank), max and mean; None when there are no values."""
    if not values:
        return {"p50": None, "p95": None, "max": None, "mean": None, "n": 0}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return round(ordered[max(0, math.ceil(p * len(ordered)) - 1)], 4)
    return {"p50": rank(0.5), "p95": rank(0.95), "max": round(ordered[-1], 4),
            "mean": round(statistics.fmean(ordered), 4), "n": len(ordered)}


def summarise(turns: Sequence[Turn], wall: float) -> dict[str, Any]:
    """Counts, throughput, latencies and follow-up ratios of one configuration's turns."""
    ok = [t for t in turns if t.status == "ok"]
    served = [t for t in turns if t.status in ("ok", "cut")]
    first = {t.conversation: t for t in ok if t.turn == 0}
    later = [t for t in ok if t.turn == 1]
    pairs = [(t.ttft_s, first[t.conversation].ttft_s) for t in later]
    ratios = [a / b for a, b in pairs if a is not None and b]
    tokens = sum(t.output_tokens for t in served)
    timed = [t for t in ok if t.ttft_s is not None]

    def ttft(kind: int) -> dict[str, float | None]:
        return percentiles([t.ttft_s for t in timed if t.turn == kind and t.ttft_s is not None])

    return {
        "requests": len(turns), "conversations": len({t.conversation for t in turns}), "completed": len(ok),
        "cut": sum(t.status == "cut" for t in turns), "not_run": sum(t.status == "not run" for t in turns),
        "errors": dict(Counter(t.status for t in turns if t.status not in ("ok", "cut", "not run"))),
        "error_examples": sorted({t.error for t in turns if t.error})[:3],
        "empty_answers": sum(t.ttft_s is None for t in ok),
        "cache_misses": sum(t.cache_misses for t in ok),
        "wall_s": round(wall, 4),
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "ttft_s": percentiles([t.ttft_s for t in timed if t.ttft_s is not None]),
        "ttft_first_turn_s": ttft(0), "ttft_followup_s": ttft(1),
        "engine_ttft_s": percentiles([t.engine_ttft_s for t in ok if t.engine_ttft_s is not None]),
        "itl_s": percentiles([t.tpot_s for t in ok if t.tpot_s is not None]),
        "piece_gap_s": percentiles([g for t in served for g in t.gaps_s]),
        "prompt_tokens_first_turn": _mean([t.prompt_tokens for t in ok if t.turn == 0]),
        "prompt_tokens_followup": _mean([t.prompt_tokens for t in later]),
        "reuse_ratio_first_turn": _mean([t.reuse_ratio for t in ok if t.turn == 0]),
        "reuse_ratio_followup": _mean([t.reuse_ratio for t in later]),
        "followups": {
            "planned": sum(t.turn == 1 for t in turns), "completed": len(later),
            "ttft_ratio_median": round(statistics.median(ratios), 4) if ratios else None,
            "ttft_ratios": [round(r, 4) for r in ratios],
            "prompt_starts_with_first_prompt_and_answer": sum(
                t.shared_prefix_tokens == t.first_prompt_and_answer_tokens for t in later),
        },
    }


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.fmean(present), 4) if present else None


def find(configs: Sequence[Mapping[str, Any]], method: str, scheduler: bool, users: int,
         heal: int | None = None) -> Mapping[str, Any] | None:
    key = (method, scheduler, heal if scheduler else None, users)
    return next((c for c in configs if (c["method"], c["scheduler"], c["heal"], c["users"]) == key), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def goals(configs: Sequence[Mapping[str, Any]], goal_users: int) -> list[dict[str, Any]]:
    """The issues' goals as measured ratios: value, target, met (None: not measured in this run)."""
    def get(method: str, scheduler: bool, users: int, *path: str, heal: int | None = None) -> float | None:
        value: Any = find(configs, method, scheduler, users, heal)
        for key in path:
            value = None if value is None else value[key]
        return value

    def goal(name: str, value: float | None, target: float, at_least: bool) -> dict[str, Any]:
        met = None if value is None else (value >= target if at_least else value <= target)
        return {"goal": name, "value": value, "target": f"{'>=' if at_least else '<='} {target:g}", "met": met}

    tps, ttft = ("output_tokens_per_s",), ("ttft_first_turn_s", "p50")
    out = [
        goal(f"fusionrag output tokens/s, scheduler on / off, {goal_users} users",
             _ratio(get("fusionrag", True, goal_users, *tps), get("fusionrag", False, goal_users, *tps)), 3, True),
        goal("fusionrag first-turn TTFT p50, scheduler on / off, 1 user",
             _ratio(get("fusionrag", True, 1, *ttft), get("fusionrag", False, 1, *ttft)), 1.05, False),
        goal(f"output tokens/s, fusionrag / full_attention, scheduler on, {goal_users} users",
             _ratio(get("fusionrag", True, goal_users, *tps), get(FULL_ATTENTION, True, goal_users, *tps)), 2, True),
    ]
    for heal in sorted({c["heal"] for c in configs if c["heal"] is not None}):
        out.append(goal(f"fusionrag output tokens/s, healing in {heal}-token pieces on / off, scheduler on, "
                        f"{goal_users} users",
                        _ratio(get("fusionrag", True, goal_users, *tps, heal=heal),
                               get("fusionrag", True, goal_users, *tps)), 0.95, True))
    for c in configs:
        name = f"follow-up / first-turn TTFT median, {c['method']}, {label(c)}, {c['users']} users"
        out.append(goal(name, c["followups"]["ttft_ratio_median"], 0.3, False))
    return out


def same_answers(configs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per method and users: how many turns finished with the scheduler and without answered alike."""
    out = []
    for on in (c for c in configs if c["scheduler"] and c["heal"] is None):
        off = find(configs, on["method"], False, on["users"])
        if off is None:
            continue
        theirs = {(t["conversation"], t["turn"]): t["answer"] for t in off["turns"] if t["status"] == "ok"}
        pairs = [(t["answer"], theirs[key]) for t in on["turns"]
                 if t["status"] == "ok" and (key := (t["conversation"], t["turn"])) in theirs]
        out.append({"method": on["method"], "users": on["users"], "compared": len(pairs),
                    "equal": sum(a == b for a, b in pairs)})
    return out


# ---- the outputs ------------------------------------------------------------------------------------------
def table(doc: Mapping[str, Any]) -> str:
    """results.md: the settings, one row per configuration, the goals."""
    s, env = doc["settings"], doc["environment"]
    lines = [f"# Serving: {s['model']} on {s['device']}, {env['cpus']} cores, {env['torch_threads']} torch threads",
             "", f"`{' '.join(doc['command'])}`", "",
             f"{s['rows']} rows, {s['requests']} requests per configuration at most ({s['followups']:g} with a "
             f"follow-up), {s['budget_s']:g} s budget each, ratio {s['ratio']:g}, {s['max_tokens']} tokens max; "
             f"load average {env['load_start']} at start, {env['load_end']} at end.", ""]
    if doc["note"]:
        lines += [f"Note: {doc['note']}", ""]
    lines += ["| users | method | scheduler | heal | done / planned | cut | not run | errors | req/s | out tok/s "
              "| TTFT p50 | TTFT p95 | follow-up TTFT p50 | follow-up / first | ITL p50 | ITL p95 | mean batch "
              "| mean pack |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in doc["configurations"]:
        errors = ", ".join(f"{k}: {v}" for k, v in c["errors"].items()) or "0"
        lines.append(
            f"| {c['users']} | {c['method']} | {'on' if c['scheduler'] else 'off'} | {c['heal'] or 'off'} | "
            f"{c['completed']} / "
            f"{c['requests']} | {c['cut']} | {c['not_run']} | {errors} | {c['requests_per_s']} | "
            f"{c['output_tokens_per_s']} | {_s(c['ttft_first_turn_s']['p50'])} | {_s(c['ttft_first_turn_s']['p95'])} | "
            f"{_s(c['ttft_followup_s']['p50'])} | {_x(c['followups']['ttft_ratio_median'])} | "
            f"{_s(c['itl_s']['p50'])} | {_s(c['itl_s']['p95'])} | {c.get('mean_batch') or '-'} | "
            f"{c.get('mean_pack') or '-'} |")
    lines += ["", "TTFT: first turns, from building the prompt to the first streamed piece (queueing included); "
              "ITL: per request, (last piece - first piece) / (tokens - 1); mean batch: rows per decode step; "
              "mean pack: requests per sparse pass.", "", "## Goals", "",
              "| goal | value | target | met |", "|---|---|---|---|"]
    for g in doc["goals"]:
        met = "not measured" if g["met"] is None else ("yes" if g["met"] else "no")
        lines.append(f"| {g['goal']} | {_x(g['value'])} | {g['target']} | {met} |")
    return "\n".join(lines) + "\n"


def label(c: Mapping[str, Any]) -> str:
    """A configuration's scheduler and healing, as the tables and plots name them."""
    heal = f", healing in {c['heal']}-token pieces" if c["heal"] is not None else ""
    return f"scheduler {'on' if c['scheduler'] else 'off'}{heal}"


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def plot(configs: Sequence[Mapping[str, Any]], key: Sequence[str], ylabel: str, path: Path, log_y: bool) -> None:
    """One line per method x scheduler x healing of `key` (a path into a configuration) against users."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    colours = dict(zip(SERVED, ("black", "tab:blue", "tab:red"), strict=True))
    for method in SERVED:
        for scheduler, heal in sorted({(c["scheduler"], c["heal"]) for c in configs}, key=str):
            points = []
            for c in configs:
                if (c["method"], c["scheduler"], c["heal"]) == (method, scheduler, heal):
                    value: Any = c
                    for k in key:
                        value = value[k]
                    if value is not None:
                        points.append((c["users"], value))
            if points:
                xs, ys = zip(*sorted(points), strict=True)
                style = ":" if heal is not None else "-" if scheduler else "--"
                ax.plot(xs, ys, marker="o", color=colours[method], linestyle=style,
                        label=f"{method}, {label({'scheduler': scheduler, 'heal': heal})}")
    users = sorted({c["users"] for c in configs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(users, [str(u) for u in users])
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("simulated users")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def write_outputs(doc: Mapping[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    (out / "results.md").write_text(table(doc), encoding="utf-8")
    plot(doc["configurations"], ("output_tokens_per_s",), "output tokens/s", out / "throughput.png", log_y=False)
    plot(doc["configurations"], ("ttft_first_turn_s", "p50"), "first-turn TTFT p50 (s)", out / "ttft.png", log_y=True)


# ---- running ----------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="musique_dev.jsonl")
    p.add_argument("--rows", type=int, default=40,
                   help="rows whose questions the users ask (one more row is ingested for the warm-ups)")
    p.add_argument("--users", default="1,4,16,64", help="comma-separated numbers of simulated users")
    p.add_argument("--requests", type=int, default=64, help="requests per configuration, follow-ups included")
    p.add_argument("--followups", type=float, default=0.3, help="share of conversations with a follow-up turn")
    p.add_argument("--budget-s", type=float, default=120.0, help="seconds each configuration may run")
    p.add_argument("--methods", default=",".join(SERVED), help=f"comma-separated, of {', '.join(SERVED)}")
    p.add_argument("--schedulers", default="on,off", help="comma-separated: on, off")
    p.add_argument("--ratio", type=float, default=0.15, help="recompute ratio of cacheblend and fusionrag")
    p.add_argument("--max-tokens", type=int, default=32, help="answer length limit")
    p.add_argument("--no-stop", action="store_true", help="do not end answers at a newline (the bench does)")
    p.add_argument("--max-passage-tokens", type=int, default=None, help="cut each passage to N tokens")
    p.add_argument("--neighbours", type=int, default=10, help="n of the fused ingest")
    p.add_argument("--max-running", type=int, default=SchedulerConfig().max_running,
                   help="the scheduler's max_running")
    p.add_argument("--think-s", default=None, metavar="MIN,MAX",
                   help="a user's pause before a follow-up, drawn uniformly from MIN..MAX seconds (default: none)")
    p.add_argument("--heal", default="off", metavar="off,PIECE_TOKENS",
                   help="comma-separated: off and/or piece sizes; engines with a scheduler heal kept turns while "
                        "idle in pieces of that many tokens (HealConfig), each a configuration (default: off)")
    p.add_argument("--goal-users", type=int, default=16, help="users of the throughput goals")
    p.add_argument("--db", type=Path, default=None, help="keep the ingested corpus here (default: a temp dir)")
    p.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M")
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/serving"))
    args = p.parse_args(argv)
    try:
        args.users = [int(u) for u in args.users.split(",") if u]
    except ValueError:
        p.error(f"--users takes comma-separated integers, got {args.users!r}")
    args.methods = [m for m in args.methods.split(",") if m]
    args.schedulers = [x for x in args.schedulers.split(",") if x]
    if not args.users or min(args.users) < 1:
        p.error("--users needs numbers >= 1")
    if not args.methods or set(args.methods) - set(SERVED):
        p.error(f"--methods takes {', '.join(SERVED)}; got {args.methods}")
    if not args.schedulers or set(args.schedulers) - set(SCHEDULERS):
        p.error(f"--schedulers takes on, off; got {args.schedulers}")
    for flag in ("rows", "requests", "max_tokens", "max_running"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not 0 <= args.followups <= 1 or args.budget_s <= 0:
        p.error("--followups must be in [0, 1] and --budget-s > 0")
    if args.think_s is not None:
        try:
            low, high = (float(x) for x in args.think_s.split(","))
        except ValueError:
            p.error(f"--think-s takes MIN,MAX seconds, got {args.think_s!r}")
        if not 0 <= low <= high:
            p.error("--think-s needs 0 <= MIN <= MAX")
        args.think_s = (low, high)
    try:
        args.heal = [None if h == "off" else int(h) for h in args.heal.split(",") if h]
    except ValueError:
        p.error(f"--heal takes off and/or piece sizes in tokens, comma-separated; got {args.heal!r}")
    if not args.heal or any(h is not None and h < 1 for h in args.heal):
        p.error("--heal needs off or piece sizes >= 1")
    args.sampling = SamplingConfig(max_new_tokens=args.max_tokens, stop=() if args.no_stop else ANSWER_STOP)
    return args


def environment(engine: FusionEngine) -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                            cwd=Path(__file__).parent).stdout.strip()
    return {"cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "load_start": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "torch": torch.__version__, "git": commit or None, "dtype": str(engine.decoder.dtype)}


def run(engine: FusionEngine, args: argparse.Namespace, command: Sequence[str],
        embedding_function: chroma.EmbeddingFn | None = None) -> dict[str, Any]:
    """Ingest, run every configuration, write the outputs; returns the results.json document."""
    env = environment(engine)
    rows = load_rows(args.data, args.rows + 1)
    if len(rows) < args.rows + 1:
        raise SystemExit(f"{args.data} has {len(rows)} rows; --rows {args.rows} needs {args.rows + 1} "
                         "(one more for the warm-ups)")
    with opened_corpus(engine, rows, args, "fusionrag-serving-", embedding_function) as corpus:
        print(f"ingest: {corpus.ingest}", flush=True)
        conversations, note = plan(rows[:args.rows], corpus, args.requests, args.followups)
        warmup = Conversation(-1, args.rows, rows[args.rows].question, corpus.chunks[args.rows], None)
        check_prompts(engine, [*conversations, warmup])
        if note:
            print(f"note: {note}", flush=True)
        configs = []
        for users in args.users:
            for method in args.methods:
                for name, heal in configurations(args):
                    c = run_configuration(engine, corpus, method, SCHEDULERS[name], heal, users, conversations,
                                          warmup, args)
                    print(progress_line(c), flush=True)
                    configs.append(c)
    env["load_end"] = [round(x, 2) for x in os.getloadavg()]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k not in ("sampling", "out", "db")}
    settings.update(model=engine.name, device=str(engine.device), stop=list(args.sampling.stop),
                    selectors={m: SERVED[m].selector or "full_attention" for m in args.methods},
                    variants={m: SERVED[m].variant for m in args.methods})
    doc: dict[str, Any] = {
        "command": list(command), "settings": settings, "environment": env, "ingest": corpus.ingest, "note": note,
        "goals": goals(configs, args.goal_users), "same_answers_scheduler_on_off": same_answers(configs),
        "configurations": configs}
    write_outputs(doc, args.out)
    for g in doc["goals"]:
        met = "not measured" if g["met"] is None else ("MET" if g["met"] else "NOT MET")
        print(f"goal: {g['goal']}: {_x(g['value'])} (target {g['target']}): {met}", flush=True)
    return doc


def configurations(args: argparse.Namespace) -> list[tuple[str, int | None]]:
    """(scheduler, healing) pairs in run order; healing needs the scheduler, so off runs once."""
    return [(name, heal) for name in args.schedulers for heal in (args.heal if SCHEDULERS[name] else [None])]


def progress_line(c: Mapping[str, Any]) -> str:
    return (f"{c['users']:>3} users  {c['method']:<14} {label(c)}  "
            f"{c['completed']}/{c['requests']} done ({c['cut']} cut, {c['not_run']} not run, errors {c['errors']})  "
            f"{c['requests_per_s']} req/s  {c['output_tokens_per_s']} tok/s  "
            f"TTFT p50 {_s(c['ttft_first_turn_s']['p50'])}  follow-up/first {_x(c['followups']['ttft_ratio_median'])}")


def main(argv: Sequence[str] | None = None, engine: FusionEngine | None = None,
         embedding_function: chroma.EmbeddingFn | None = None) -> int:
    """Run the benchmark; 1 when a request failed or a chunk cache was missed.

    Args:
        argv: the command line (default `sys.argv[1:]`).
        engine: the model (default: `--model` loaded on `--device`; tests pass a tiny one).
        embedding_function: for the corpus's Chroma collection (default: the offline MiniLM).
    """
    args = parse_args(argv)
    engine = engine or FusionEngine.from_pretrained(args.model, device=args.device)
    command = sys.argv if argv is None else ["benchmarks/serving.py", *argv]
    doc = run(engine, args, command, embedding_function)
    failed = any(c["errors"] or c["cache_misses"] for c in doc["configurations"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
