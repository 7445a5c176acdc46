"""`fusionrag demo` (fusionrag_core/demo.py): what it prints must match what it measured.

`check_demo_run` runs the demo through `main(..., engine_factory=...)`, keeps the comparisons it
printed (by wrapping `demo.summary`) and every engine call, and checks each printed number against
the Generations: the agree flag against the token ids, the KL against `first_token_kl` recomputed
from the first-token logits, the token counts against the prompt, TTFTs and speedups, the summary,
the warm-up and the alternating order. `tests/test_cli.py::test_demo` runs it with a tiny random
model; `test_demo_with_the_packaged_model` with the real one (slow). The rendering tests below
need no model.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import torch

from fusionrag_core import demo
from fusionrag_core.cli import EngineSpec, main
from fusionrag_core.data import load_sample_questions
from fusionrag_core.demo import Answer, Comparison
from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.query.divergence import first_token_kl

COUNTS = re.compile(r"^    (FusionRAG|full attention) +(\d+\.\d{3}) s +(\d+) +(\d+) +(\d+) +(-?\d+) +(\d+)$")
VERDICT = re.compile(r"^    same answer: (?:yes, all (\d+) tokens|no, they differ from token (\d+)) \| "
                     r"first-token KL (\S+) \| speedup (\d+\.\d)x$")


def _shows(printed: str, value: float) -> bool:
    """Whether `printed` is `value` rounded to the digits printed (half a unit of the last one)."""
    if math.isinf(value):
        return printed == "inf"
    exponent = Decimal(printed).as_tuple().exponent
    assert isinstance(exponent, int), printed
    return abs(float(printed) - value) <= 0.5 * 10.0 ** exponent * (1 + 1e-9)


class Calls:
    """Records the engine's generation calls in order: ("fusion" | "full", max_new_tokens)."""

    def __init__(self, engine: FusionEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, int]] = []
        for name, method in (("fusion", "stream"), ("full", "full_attention")):
            monkeypatch.setattr(engine, method, self._spy(name, getattr(engine, method)))

    def _spy(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def spy(prompt: Any, **kwargs: Any) -> Any:
            self.log.append((name, kwargs["sampling"].max_new_tokens))
            return original(prompt, **kwargs)

        return spy


def check_demo_run(
    engine: FusionEngine, db: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    *, questions: int, max_tokens: int,
) -> list[Comparison]:
    """Run `fusionrag --db DB demo --questions N --max-tokens M` on `engine` and check its output
    (see the module docstring); returns the comparisons it printed."""
    rows: list[Comparison] = []
    order: list[bool] = []
    summary, compare = demo.summary, demo.compare

    def keep_rows(found: list[Comparison], *, packaged: bool) -> str:
        rows.extend(found)
        return summary(found, packaged=packaged)

    def keep_order(methods: demo.Methods, question: str, *, fusion_first: bool) -> Comparison:
        order.append(fusion_first)
        return compare(methods, question, fusion_first=fusion_first)

    monkeypatch.setattr(demo, "summary", keep_rows)
    monkeypatch.setattr(demo, "compare", keep_order)
    calls = Calls(engine, monkeypatch)
    argv = ["--db", str(db), "demo", "--questions", str(questions), "--max-tokens", str(max_tokens)]
    assert main(argv, engine_factory=lambda spec: engine) == 0
    out = capsys.readouterr().out

    assert [r.question for r in rows] == [q.question for q in load_sample_questions()[:questions]]
    assert order == [i % 2 == 0 for i in range(questions)], "methods alternate which goes first"
    # the warm-up (one token each) comes before any timed call; then two calls per question
    assert calls.log[:2] == [("fusion", 1), ("full", 1)]
    assert sorted(calls.log[2:]) == sorted([("fusion", max_tokens), ("full", max_tokens)] * questions)
    assert "Ingesting the sample corpus (7 documents" in out
    assert "gold" not in out.lower() and "✓" not in out, "no score against gold answers"
    table = out[out.index("Answering "):].splitlines()  # NOTE: the ingest lines above quote paths
    assert max(map(len, table)) <= demo.WIDTH, "fits the terminal"
    prefix = int(engine.layout.prefix_ids(engine.config.instruction).numel())
    for number, row in enumerate(rows, 1):
        _check_block(_block(out, number, row.question), row, prefix)
    _check_summary(out, rows)
    return rows


def _block(out: str, number: int, question: str) -> list[str]:
    """The printed lines of question `number`: from its title to the blank line after it."""
    lines = out.splitlines()
    start = lines.index(f"{number:>2}  {question}")
    return lines[start: lines.index("", start)]


def _check_block(block: list[str], row: Comparison, prefix: int) -> None:
    fusion, full = row.fusion.generation, row.full.generation
    assert block[1] == demo.COLUMNS
    for line, (name, g) in zip(block[2:4], (("FusionRAG", fusion), ("full attention", full)), strict=True):
        match = COUNTS.match(line)
        assert match, line
        assert match[1] == name and _shows(match[2], g.ttft_s)
        assert [int(v) for v in match.groups()[2:]] == [
            g.reused_tokens, g.recomputed_tokens, g.prefilled_tokens,
            g.prompt_tokens - g.reused_tokens - g.recomputed_tokens - g.prefilled_tokens, g.prompt_tokens]
    # the same prompt for both; the baseline computes all of it, FusionRAG reuses stored caches,
    # recomputes at most its ratio of them, and the rest is prefilled or the memoised prefix
    assert fusion.prompt_tokens == full.prompt_tokens
    assert (full.reused_tokens, full.recomputed_tokens, full.prefilled_tokens) == (0, 0, full.prompt_tokens)
    assert fusion.reused_tokens > 0 and fusion.ratio is not None
    assert 0 < fusion.recomputed_tokens <= round(fusion.ratio * (fusion.reused_tokens + fusion.recomputed_tokens))
    assert fusion.prompt_tokens - fusion.reused_tokens - fusion.recomputed_tokens - fusion.prefilled_tokens in (
        0, prefix)
    # the answers shown are the recorded generations' (wrapped, nothing dropped)
    answers = " ".join(block[4:-1])
    assert row.fusion.text == fusion.text.strip() and row.full.text == full.text.strip()
    shown = answers.split("full attention:", 1)
    assert " ".join(shown[0].split()) == " ".join(f"FusionRAG: {row.fusion.text or '(empty)'}".split())
    assert " ".join(shown[1].split()) == " ".join((row.full.text or "(empty)").split())
    _check_verdict(block[-1], fusion, full)


def _check_verdict(line: str, fusion: Generation, full: Generation) -> None:
    match = VERDICT.match(line)
    assert match, line
    same = fusion.token_ids == full.token_ids
    assert (match[1] is not None) == same
    if same:
        assert int(match[1]) == len(full.token_ids)
    else:
        pairs = list(zip(fusion.token_ids, full.token_ids, strict=False))
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        assert int(match[2]) == first + 1
    kl = first_token_kl(full.first_token_logits, fusion.first_token_logits)
    assert kl >= 0 and float(match[3]) >= 0
    assert _shows(match[3], kl), (match[3], kl)
    assert _shows(match[4], full.ttft_s / fusion.ttft_s)


def _check_summary(out: str, rows: list[Comparison]) -> None:
    tail = out[out.index(f"Summary of {len(rows)} question(s), both methods measured side by side in this run:"):]
    agree = sum(r.fusion.generation.token_ids == r.full.generation.token_ids for r in rows)
    assert f"same answer as full attention (identical tokens): {agree} of {len(rows)}" in tail
    kls = [first_token_kl(r.full.generation.first_token_logits, r.fusion.generation.first_token_logits) for r in rows]
    median_kl = re.search(r"median first-token KL from full attention: (\S+) nats", tail)
    assert median_kl and _shows(median_kl[1], statistics.median(kls)), (median_kl, kls)
    ttft = re.search(r"median TTFT: FusionRAG (\d+\.\d+) s, full attention (\d+\.\d+) s; median speedup (\d+\.\d)x",
                     tail)
    assert ttft, tail
    assert _shows(ttft[1], statistics.median(r.fusion.generation.ttft_s for r in rows))
    assert _shows(ttft[2], statistics.median(r.full.generation.ttft_s for r in rows))
    assert _shows(ttft[3], statistics.median(r.full.generation.ttft_s / r.fusion.generation.ttft_s for r in rows))
    assert "SmolLM2-135M, is tiny" in tail and "fusionrag --model <hf-id-or-dir>" in tail and "demo" in tail


@pytest.mark.slow
def test_demo_with_the_packaged_model(
    default_engine: FusionEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_demo_run(default_engine, tmp_path / "db", capsys, monkeypatch, questions=2, max_tokens=6)


def test_demo_loads_the_model_the_global_options_name(tmp_path: Path) -> None:
    specs: list[EngineSpec] = []

    def factory(spec: EngineSpec) -> FusionEngine:
        specs.append(spec)
        raise KeyboardInterrupt  # NOTE: stop before anything is ingested

    argv = ["--model", "gemma3-270m", "--device", "cpu", "--dtype", "float32", "--db", str(tmp_path), "demo"]
    assert main(argv, engine_factory=factory) == 130
    assert specs == [EngineSpec("gemma3-270m", "cpu", "float32")]


def test_the_tiny_model_line_is_for_the_packaged_model_only() -> None:
    assert [demo.packaged_model(m) for m in (None, "smollm2-135m", "gemma3-270m", "org/Llama-8B")] == [
        True, True, False, False]
    rows = [_row([1, 2], [1, 2])]
    assert demo.PACKAGED_MODEL_LINE in demo.summary(rows, packaged=True)
    assert demo.PACKAGED_MODEL_LINE not in demo.summary(rows, packaged=False)


# ---- rendering, no model --------------------------------------------------------------------------
def _generation(token_ids: list[int], logits: list[float], *, ttft: float, text: str = "an answer") -> Generation:
    return Generation(text=text, token_ids=token_ids, finish_reason="length", ttft_s=ttft, total_s=ttft,
                      prompt_tokens=100, reused_tokens=70, recomputed_tokens=12, selector="drift_aware", ratio=0.15,
                      kv_bytes_loaded=0, first_token_logits=torch.tensor(logits), prefilled_tokens=10)


def _row(fusion_ids: list[int], full_ids: list[int], *, text: str = "an answer",
         question: str = "Where?") -> Comparison:
    fusion = _generation(fusion_ids, [2.0, 0.5, -1.0], ttft=0.2, text=text)
    full = _generation(full_ids, [2.1, 0.4, -1.0], ttft=0.9, text=text)
    return Comparison(question, Answer(text, fusion), Answer(text, full))


@pytest.mark.parametrize(("fusion_ids", "full_ids", "difference"), [
    ([5, 6, 7], [5, 6, 7], None), ([5, 6, 7], [5, 9, 7], 1), ([5, 6], [5, 6, 7], 2), ([], [1], 0),
])
def test_first_difference(fusion_ids: list[int], full_ids: list[int], difference: int | None) -> None:
    row = _row(fusion_ids, full_ids)
    assert row.first_difference == difference and row.same_answer == (difference is None)
    _check_verdict(demo.question_block(1, row).split("\n")[-2], row.fusion.generation, row.full.generation)


def _long_rows() -> Iterator[Comparison]:
    long = " ".join(f"word{i}" for i in range(60))
    yield _row([1, 2], [1, 3], text=long, question="Why " + "really " * 30 + "?")
    yield _row([1], [1], text="")


def test_blocks_fit_the_terminal_and_drop_no_answer_text() -> None:
    for row in _long_rows():
        block = demo.question_block(3, row).split("\n")
        assert max(map(len, block)) <= demo.WIDTH and block[0].startswith(" 3  ") and block[-1] == ""
        answers = " ".join(" ".join(block[4:-2]).split())
        text = row.fusion.text or "(empty)"
        assert answers == f"FusionRAG: {text} full attention: {text}"
        assert 0 < row.kl < 0.1 and row.speedup == pytest.approx(4.5)
