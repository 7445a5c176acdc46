"""`fusionrag demo`: the packaged sample corpus, answered through the LangChain chain with FusionRAG
and with full attention, side by side (answers, TTFT, speedup).

It lives here, not in `fusionrag_core.cli`, because it runs through the LangChain integration and the
core never imports the integrations; the `fusionrag.commands` entry point in pyproject.toml adds
it to the `fusionrag` command. LangChain is imported only when the demo runs (`--help` is instant,
and without LangChain the demo says how to install it).
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fusionrag_core.cli import Command, open_index, positive_int, where
from fusionrag_core.errors import InvalidRequestError

if TYPE_CHECKING:
    from fusionrag_core.engine import FusionEngine
    from fusionrag_core.index import FusionIndex


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's own options (the global ones, --db, --model, -k ..., are added by the CLI)."""
    parser.add_argument("--questions", type=positive_int, default=None, metavar="N",
                        help="answer only the first N sample questions (default: all)")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="answer length limit (default: 32)")


@dataclass(frozen=True)
class _DemoRow:
    question: str
    gold: str
    fusion: tuple[str, float]
    full: tuple[str, float]


def run(args: argparse.Namespace, engine: Callable[[], FusionEngine], argv: Sequence[str]) -> int:
    """`fusionrag demo`: ingest the sample corpus, answer its questions with FusionRAG and full attention."""
    from tqdm.auto import tqdm

    from fusionrag_core.data import load_sample_questions, sample_corpus_dir

    chains = _langchain()
    files = sorted(sample_corpus_dir().glob("*.md"))
    questions = load_sample_questions()[: args.questions]
    index = open_index(args, engine())
    print(f"Ingesting the sample corpus ({len(files)} documents about a fictional harbour town) into {where(args)}")
    report = index.add_texts([f.read_text(encoding="utf-8") for f in files],
                             metadatas=[{"source": f.name} for f in files],
                             doc_ids=[f"fusionrag-sample/{f.name}" for f in files], progress=True)
    print(f"  {report.new_chunks} new chunk(s), {report.skipped_chunks} already there, in {report.seconds:.1f} s\n")

    retriever, fusion, full = chains(index, args)
    # NOTE: untimed warm-up: the first generation of a process pays one-time costs.
    first = retriever.invoke(questions[0].question)
    full.invoke({"question": questions[0].question, "documents": first}, max_tokens=1)
    print(f"Answering {len(questions)} two-hop question(s) through the LangChain chain, k={args.k}:")
    rows = []
    for q in tqdm(questions, desc="questions", unit="question", leave=False):
        docs = retriever.invoke(q.question)
        request = {"question": q.question, "documents": docs}
        answers = [chain.invoke(request) for chain in (fusion, full)]
        fused, plain = ((str(a.content).strip(), float(a.response_metadata["ttft_s"])) for a in answers)
        rows.append(_DemoRow(q.question, q.answer, fused, plain))
    print(_demo_table(rows))
    return 0


def _langchain() -> Callable[[FusionIndex, argparse.Namespace], tuple[Any, Any, Any]]:
    """A builder of (retriever, FusionRAG chain, full-attention chain) from the LangChain integration."""
    try:
        from fusionrag_integrations.langchain import ChatFusionRAG, FusionRAGChain, FusionRAGRetriever
    except ImportError as e:
        raise InvalidRequestError(
            f"the demo runs through LangChain, which is not installed ({e}); pip install 'fusionrag[langchain]'"
        ) from e

    def build(index: FusionIndex, args: argparse.Namespace) -> tuple[Any, Any, Any]:
        options: dict[str, Any] = {"index": index, "max_tokens": args.max_tokens, "stop": ["\n"]}
        fusion = ChatFusionRAG(**options, selector=args.selector, ratio=args.ratio)
        full = ChatFusionRAG(**options, full_attention=True)
        return FusionRAGRetriever(index=index, k=args.k), FusionRAGChain(llm=fusion), FusionRAGChain(llm=full)

    return build


def _demo_table(rows: Sequence[_DemoRow]) -> str:
    """Per question: the question and gold answer, then each method's answer with its TTFT, and the
    speedup; a check mark where the gold answer is in the answer."""
    from fusionrag_core.bench.metrics import median, normalize_answer

    def found(gold: str, answer: str) -> bool:
        return normalize_answer(gold) in normalize_answer(answer)

    def line(method: str, answer: str, gold: str, seconds: float) -> str:
        text = textwrap.shorten(answer or "(empty)", 56, placeholder=" …")
        return f"    {method:<15} {'✓' if found(gold, answer) else ' '} {text:<56} {seconds:>7.2f} s"

    head = f"{'#':>2}  {'question, then each answer (✓: contains the gold answer)':<74} {'TTFT':>9}"
    lines = ["", head, "-" * (len(head) + 13)]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i:>2}  {textwrap.shorten(r.question, 70, placeholder=' …')}  (gold: {r.gold})")
        lines.append(line("FusionRAG", r.fusion[0], r.gold, r.fusion[1])
                     + f"  speedup {r.full[1] / r.fusion[1]:.1f}x")
        lines.append(line("full attention", r.full[0], r.gold, r.full[1]))
    fused_ttft, full_ttft = median([r.fusion[1] for r in rows]), median([r.full[1] for r in rows])
    fused_hits = sum(found(r.gold, r.fusion[0]) for r in rows)
    full_hits = sum(found(r.gold, r.full[0]) for r in rows)
    lines += [
        "-" * (len(head) + 13),
        f"median TTFT: FusionRAG {fused_ttft:.2f} s, full attention {full_ttft:.2f} s "
        f"(speedup {full_ttft / fused_ttft:.1f}x)",
        f"answers containing the gold answer: FusionRAG {fused_hits}/{len(rows)}, "
        f"full attention {full_hits}/{len(rows)}",
    ]
    return "\n".join(lines)


COMMAND = Command(
    name="demo",
    help="ingest the packaged sample corpus and answer its questions (FusionRAG vs full attention)",
    description="Ingest the packaged sample corpus (a fictional harbour town, 7 documents) into --db, then "
                "answer its two-hop questions through the LangChain chain, with FusionRAG and with full "
                "attention, and print answers, TTFT and speedup side by side.",
    epilog="example:\n  fusionrag demo --questions 3",
    add_arguments=add_arguments,
    run=run,
)

__all__ = ["COMMAND", "add_arguments", "run"]
