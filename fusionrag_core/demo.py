"""`fusionrag demo`: the packaged sample corpus, answered with FusionRAG and with full attention,
side by side, over the same retrieved chunks.

What it shows is what the method promises and a tiny model can show: FusionRAG gives (nearly) the
answer full attention gives, sooner. Per question: both answers, whether they are the same tokens,
the first-token KL between them, where each prompt token's K/V came from (reused, recomputed,
prefilled, memoised prefix) and each TTFT with the speedup; then a summary. It prints no score
against gold answers: a 135M model is mostly wrong with either method, and a score would credit
(or blame) reuse for what the model knows.

It is a command of the `fusionrag` CLI added through the `fusionrag.commands` entry point in
pyproject.toml (the CLI layer below it never imports it).
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusionrag_core.cli import Command, open_index, positive_int, where

if TYPE_CHECKING:
    from fusionrag_core.engine import FusionEngine, Generation, GenerationStream
    from fusionrag_core.index import FusionIndex
    from fusionrag_core.query.prompt import FusionPrompt
    from fusionrag_core.query.sampling import SamplingConfig

WIDTH = 100
"""Every line the demo prints fits a terminal this wide."""
# NOTE: --db in the command: an index holds one model's caches, so the default one (built with
# SmolLM2) refuses another model.
PACKAGED_MODEL_LINE = ("The packaged model, SmolLM2-135M, is tiny; a larger one answers better "
                       "(a new --db per model):\n  fusionrag --model <hf-id-or-dir> --db <new-dir> demo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's own options (the global ones, --db, --model, -k ..., are added by the CLI)."""
    parser.add_argument("--questions", type=positive_int, default=None, metavar="N",
                        help="answer only the first N sample questions (default: all)")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="answer length limit (default: 32)")


# ---- what is compared -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    """One method's answer: its text (stripped) and the engine's Generation."""

    text: str
    generation: Generation


@dataclass(frozen=True)
class Comparison:
    """One question answered by both methods over the same retrieved chunks (so the same prompt)."""

    question: str
    fusion: Answer
    full: Answer

    @property
    def same_answer(self) -> bool:
        """Whether both methods generated exactly the same tokens."""
        return self.fusion.generation.token_ids == self.full.generation.token_ids

    @property
    def first_difference(self) -> int | None:
        """0-based index of the first generated token that differs (one answer ending early counts
        as a difference there); None when the answers are the same tokens."""
        a, b = self.fusion.generation.token_ids, self.full.generation.token_ids
        if a == b:
            return None
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    @property
    def kl(self) -> float:
        """KL(full attention || FusionRAG) of the first generated token's distribution, in nats (>= 0)."""
        from fusionrag_core.query.divergence import first_token_kl

        return first_token_kl(self.full.generation.first_token_logits, self.fusion.generation.first_token_logits)

    @property
    def speedup(self) -> float:
        """Full attention's TTFT over FusionRAG's (> 1: FusionRAG answered sooner)."""
        return self.full.generation.ttft_s / self.fusion.generation.ttft_s


# One way to answer: (prompt, max_tokens or None for the demo's default) -> Answer.
Ask = Callable[["FusionPrompt", "int | None"], Answer]


@dataclass(frozen=True)
class Methods:
    """What the demo runs: the prompt of a question over its retrieved chunks, and the two ways
    to answer it."""

    prompt: Callable[[str], FusionPrompt]
    fusion: Ask
    full: Ask


def compare(methods: Methods, question: str, *, fusion_first: bool) -> Comparison:
    """Build the question's prompt once, then answer it with both methods back to back, in the
    order asked for: the caller alternates it, so load noise and whatever the first call leaves
    warm fall on both."""
    prompt = methods.prompt(question)
    if fusion_first:
        fusion = methods.fusion(prompt, None)
        full = methods.full(prompt, None)
    else:
        full = methods.full(prompt, None)
        fusion = methods.fusion(prompt, None)
    return Comparison(question, fusion, full)


# ---- running ----------------------------------------------------------------------------------------
def run(args: argparse.Namespace, engine: Callable[[], FusionEngine], argv: Sequence[str]) -> int:
    """`fusionrag demo`: ingest the sample corpus, answer its questions with FusionRAG and full attention."""
    from fusionrag_core.data import load_sample_questions, sample_corpus_dir

    files = sorted(sample_corpus_dir().glob("*.md"))
    questions = load_sample_questions()[: args.questions]
    index = open_index(args, engine())
    print(f"Ingesting the sample corpus ({len(files)} documents about a fictional harbour town) into {where(args)}")
    report = index.add_texts([f.read_text(encoding="utf-8") for f in files],
                             metadatas=[{"source": f.name} for f in files],
                             doc_ids=[f"fusionrag-sample/{f.name}" for f in files], progress=True)
    print(f"  {report.new_chunks} new chunk(s), {report.skipped_chunks} already there, in {report.seconds:.1f} s\n")

    methods = _methods(index, args)
    # NOTE: untimed warm-up of both methods: the first generation of a process pays one-time costs
    # (lazy imports, allocator growth, weight packing) that no question should be charged with.
    warm_prompt = methods.prompt(questions[0].question)
    warm = methods.fusion(warm_prompt, 1).generation
    methods.full(warm_prompt, 1)
    print(_preamble(len(questions), args, warm), flush=True)
    rows: list[Comparison] = []
    for i, q in enumerate(questions, 1):
        rows.append(compare(methods, q.question, fusion_first=i % 2 == 1))
        print(question_block(i, rows[-1]), flush=True)
    print(summary(rows, packaged=packaged_model(args.model)))
    return 0


def packaged_model(model: str | None) -> bool:
    """Whether --model names the packaged default (None or its alias), the tiny SmolLM2-135M."""
    from fusionrag_core.runtime.loading import DEFAULT_MODEL

    return (model or DEFAULT_MODEL) == DEFAULT_MODEL


def _methods(index: FusionIndex, args: argparse.Namespace) -> Methods:
    """The demo's methods on `index`: the canonical prompt over the `-k` chunks retrieved for a
    question; FusionRAG reuses their stored caches, full attention prefills all of it."""
    from fusionrag_core.query.sampling import SamplingConfig  # NOTE: here: `fusionrag --help` loads no torch

    def sampling(max_tokens: int | None) -> SamplingConfig:
        return SamplingConfig(max_new_tokens=max_tokens or args.max_tokens, stop=("\n",))

    def answer(stream: GenerationStream) -> Answer:
        generation = stream.collect()
        return Answer(generation.text.strip(), generation)

    return Methods(
        prompt=lambda question: index.prompt_for(question, index.search(question, args.k)),
        fusion=lambda prompt, max_tokens: answer(index.stream(prompt, sampling=sampling(max_tokens),
                                                              selector=args.selector, ratio=args.ratio)),
        full=lambda prompt, max_tokens: answer(index.engine.full_attention(prompt, sampling=sampling(max_tokens))),
    )


# ---- printing -----------------------------------------------------------------------------------
def _fill(text: str, indent: str = "") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent)


def _preamble(questions: int, args: argparse.Namespace, warm: Generation) -> str:
    """What is about to be compared and what the columns mean (selector and ratio as the engine
    reported them in the warm-up, so defaults show as what actually runs)."""
    how = warm.selector if warm.ratio is None else f"{warm.selector} recomputing {100 * warm.ratio:g}%"
    return "\n".join([
        _fill(f"Answering {questions} two-hop question(s) through FusionIndex, each over the same k={args.k} "
              f"retrieved chunks, greedy, at most {args.max_tokens} tokens: with FusionRAG (stored fused chunk "
              f"caches, {how} of their tokens) and with full attention (a plain prefill of the whole prompt), "
              "timed alternately (FusionRAG first on odd-numbered questions) after one untimed warm-up."),
        _fill("Token columns, where each prompt token's K/V came from: reused (stored cache kept), recomputed "
              "(stored, but computed again: the tokens the question attends to most), prefilled (computed "
              "afresh: the question, text without a cache), prefix (the system prompt, computed once and kept)."),
        "",
    ])


def _kl_text(kl: float) -> str:
    return f"{kl:.4f}" if kl >= 1e-4 or kl == 0 else f"{kl:.1e}"


COLUMNS = f"{'':19}{'TTFT':>8}{'reused':>9}{'recomputed':>12}{'prefilled':>11}{'prefix':>8}{'= prompt':>10}"


def _counts_row(name: str, g: Generation) -> str:
    """A method's TTFT and token counts under `COLUMNS`: the four parts of the prompt
    (`Generation.token_partition`); prefix is the memoised system prefix, which only the reusing
    path keeps."""
    return (f"{'':4}{name:<15}{g.ttft_s:>6.3f} s{g.reused_tokens:>9}{g.recomputed_tokens:>12}"
            f"{g.prefilled_tokens:>11}{g.prefix_cached_tokens:>8}{g.prompt_tokens:>10}")


def _answer_lines(name: str, text: str) -> str:
    """`name: text`, wrapped, continuation lines aligned with the text."""
    label = f"{'':4}{name + ':':<17}"
    return textwrap.fill(text or "(empty)", WIDTH, initial_indent=label, subsequent_indent=" " * len(label))


def question_block(number: int, row: Comparison) -> str:
    """One question: its counts rows, both answers, then agreement, first-token KL and speedup."""
    diff = row.first_difference
    same = f"yes, all {len(row.full.generation.token_ids)} tokens" if diff is None else (
        f"no, they differ from token {diff + 1}")
    return "\n".join([
        f"{number:>2}  " + textwrap.shorten(row.question, WIDTH - 4, placeholder=" …"),
        COLUMNS,
        _counts_row("FusionRAG", row.fusion.generation),
        _counts_row("full attention", row.full.generation),
        _answer_lines("FusionRAG", row.fusion.text),
        _answer_lines("full attention", row.full.text),
        f"{'':4}same answer: {same} | first-token KL {_kl_text(row.kl)} | speedup {row.speedup:.1f}x",
        "",
    ])


def summary(rows: Sequence[Comparison], *, packaged: bool) -> str:
    """Agreement count, median first-token KL, median TTFTs and speedup; with the packaged model,
    the line saying it is tiny and how to run a larger one."""
    from fusionrag_core.bench.metrics import median

    fused = median([r.fusion.generation.ttft_s for r in rows])
    full = median([r.full.generation.ttft_s for r in rows])
    lines = [
        f"Summary of {len(rows)} question(s), both methods measured side by side in this run:",
        f"  same answer as full attention (identical tokens): {sum(r.same_answer for r in rows)} of {len(rows)}",
        f"  median first-token KL from full attention: {_kl_text(median([r.kl for r in rows]))} nats "
        "(0: the same next-token distribution)",
        f"  median TTFT: FusionRAG {fused:.3f} s, full attention {full:.3f} s; "
        f"median speedup {median([r.speedup for r in rows]):.1f}x",
    ]
    if packaged:
        lines.append(PACKAGED_MODEL_LINE)
    return "\n".join(lines)


COMMAND = Command(
    name="demo",
    help="ingest the packaged sample corpus and answer its questions (FusionRAG vs full attention)",
    description="Ingest the packaged sample corpus (a fictional harbour town, 7 documents) into --db, then "
                "answer its two-hop questions with FusionRAG and with full "
                "attention, and print both answers, whether they are the same tokens, the first-token KL "
                "between them, reused / recomputed / prefilled token counts, TTFT and speedup, side by side.",
    epilog="examples:\n  fusionrag demo --questions 3\n  fusionrag --model <hf-id-or-dir> --db ./demo-large demo",
    add_arguments=add_arguments,
    run=run,
)

__all__ = ["COMMAND", "Answer", "Comparison", "Methods", "add_arguments", "compare", "packaged_model", "question_block",
           "run", "summary"]
