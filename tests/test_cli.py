"""The `fusionrag` command: help, one-line errors with exit code 2, ingest/ask/verify/bench/demo end to end.

Commands run through `main(argv, engine_factory=...)` with a tiny random Llama (the real SmolLM2
tokenizer), so no test loads the real model; one test runs the installed entry point in a
subprocess to see what a shell sees.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.cli import EngineSpec, build_parser, main
from fusionrag_core.engine import FusionEngine

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "musique_dev.jsonl"
COMMANDS = ("demo", "ingest", "ask", "verify", "bench")
LIGHTHOUSE = "The Lumen lighthouse on the northern cape was designed by the engineer Ada Vell in 1871."
BIRTH = "Ada Vell was born in the fishing village of Marrow, where her father repaired nets."

pytestmark = pytest.mark.usefixtures("one_thread")


class TinyEngines:
    """An engine factory for `main`: a 2-layer random Llama per seed (4096 positions, enough for the
    default ingest settings), built once; records the specs it was asked for."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.seed = seed
        self.specs: list[EngineSpec] = []
        self._engine: FusionEngine | None = None

    def __call__(self, spec: EngineSpec) -> FusionEngine:
        self.specs.append(spec)
        if self._engine is None:
            config = LlamaConfig(vocab_size=len(self.tokenizer), hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                 max_position_embeddings=4096)
            torch.manual_seed(self.seed)
            self._engine = FusionEngine(LlamaForCausalLM(config).eval(), self.tokenizer, name=f"tiny-{self.seed}")
        return self._engine


@pytest.fixture(scope="module")
def engines(tokenizer: PreTrainedTokenizerBase) -> TinyEngines:
    return TinyEngines(tokenizer)


def _one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fusionrag") and "error:" in lines[0], err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ---- help and usage errors ------------------------------------------------------------------------
def test_help_of_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fusionrag") and all(c in out for c in COMMANDS) and "examples:" in out
    for command in COMMANDS:
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: fusionrag {command}") and "example" in out and "--db" in out



def test_bench_help_lists_every_method_and_its_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from fusionrag_core.bench.methods import DEFAULT_METHODS, METHODS

    assert main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # NOTE: argparse wraps the help text
    for method in METHODS.values():
        assert method.describe() in out
    assert f"(default: {' '.join(DEFAULT_METHODS)};" in out
    assert "(default: 0.05,0.15,0.3)" in out


def test_selector_help_lists_exactly_the_registered_selectors() -> None:
    from fusionrag_core.engine import EngineConfig
    from fusionrag_core.query.select import SELECTORS

    (action,) = [a for a in build_parser(plugins=[])._actions if "--selector" in a.option_strings]
    listed = "; ".join(f"{name} — {(f.__doc__ or '').splitlines()[0].rstrip('.')}" for name, f in SELECTORS.items())
    assert action.help == f"which chunk tokens to recompute: {listed} (default: {EngineConfig().selector})"


def test_the_cli_and_its_method_table_import_no_torch() -> None:
    code = ("import sys, fusionrag_core.cli, fusionrag_core.bench.methods; "
            "print(sorted(m for m in ('torch', 'transformers', 'chromadb') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "COMMAND"),
        (["ask"], "question"),
        (["bench"], "--data"),
        (["bench", "--data", "x.jsonl", "--ratios", "a,b"], "comma-separated"),
        (["bench", "--data", "x.jsonl", "--limit", "0"], "--limit"),
        (["-k", "0", "ask", "q"], "-k"),
        (["frobnicate"], "frobnicate"),
    ],
)
def test_usage_errors_are_one_line_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    _one_line_error(capsys.readouterr().err, needle)


def test_errors_fail_fast_before_loading_a_model(
    engines: TinyEngines, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loads = len(engines.specs)
    (tmp_path / "report.docx").write_text("x")
    cases = [
        (["ingest", str(tmp_path / "missing.md")], "does not exist"),
        (["ingest", str(tmp_path / "report.docx")], "unsupported file type"),
        (["--db", str(tmp_path / "nothing"), "ask", "Who?"], "no index"),
        (["--db", str(tmp_path / "nothing"), "verify"], "no index"),
        (["bench", "--data", str(tmp_path / "none.jsonl")], "not found"),
        (["bench", "--data", str(DATA), "--methods", "fusionrag,nope"], "unknown method"),
        (["bench", "--data", str(DATA), "--ratios", "1.5"], "ratio"),
    ]
    for argv, needle in cases:
        assert main(argv, engine_factory=engines) == 2, argv
        _one_line_error(capsys.readouterr().err, needle)
    assert len(engines.specs) == loads, "a model was loaded for a request that could not succeed"


def test_entry_point_in_a_subprocess(tmp_path: Path) -> None:
    """What a shell sees: exit code 2 and one line on stderr, no traceback."""
    script = "import sys; from fusionrag_core.cli import main; sys.exit(main())"
    run = subprocess.run([sys.executable, "-c", script, "ingest", str(tmp_path / "nope.md")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    _one_line_error(run.stderr, "does not exist")


def test_pdf_without_pypdf(
    engines: TinyEngines, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pypdf", None)  # NOTE: makes `import pypdf` fail as if not installed.
    (tmp_path / "paper.pdf").write_bytes(b"%PDF-1.4\n")
    assert main(["ingest", str(tmp_path / "paper.pdf")], engine_factory=engines) == 2
    _one_line_error(capsys.readouterr().err, "pip install pypdf")


# ---- a corpus end to end --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "nested").mkdir()
    (root / "lighthouse.md").write_text(f"# The lighthouse\n\n{LIGHTHOUSE}\n")
    (root / "nested" / "vell.txt").write_text(BIRTH)
    (root / "nested" / "empty.md").write_text("  \n")
    (root / "image.png").write_bytes(b"\x89PNG")
    return root


def test_ingest_ask_verify(
    engines: TinyEngines, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = ["--db", str(tmp_path / "db")]
    assert main([*db, "--model", "tiny", "ingest", str(corpus), "--quiet", "--chunk-tokens", "64"],
                engine_factory=engines) == 0
    captured = capsys.readouterr()
    assert "ingested 2 document(s)" in captured.out and "2 new chunk(s)" in captured.out
    assert "empty.md" in captured.err  # skipped, and said so
    assert engines.specs[-1] == EngineSpec(model="tiny")

    # the same files again: nothing new (the collection's own settings are used without options)
    assert main([*db, "ingest", str(corpus), "--quiet"], engine_factory=engines) == 0
    assert "0 new chunk(s), 2 already indexed" in capsys.readouterr().out

    # global options may follow the subcommand
    assert main(["ask", "Who designed the Lumen lighthouse?", "--max-tokens", "3", "-k", "2", *db],
                engine_factory=engines) == 0
    out = capsys.readouterr().out
    assert "TTFT" in out and "cache misses 0" in out and "drift_aware @ ratio 0.15" in out
    assert "sources: [1] " in out and "[3]" not in out and "lighthouse.md" in out

    assert main([*db, "--selector", "none", "ask", "Where was Ada Vell born?", "--max-tokens", "2"],
                engine_factory=engines) == 0
    assert "recomputed 0 (0.0%)" in capsys.readouterr().out
    assert main([*db, "ask", "Where was Ada Vell born?", "--max-tokens", "2", "--full-attention"],
                engine_factory=engines) == 0
    assert "full attention" in capsys.readouterr().out

    assert main([*db, "verify"], engine_factory=engines) == 0
    assert "OK" in capsys.readouterr().out

    # lose a cache: found without repair (exit 1), then repaired
    blob = next((tmp_path / "db" / "kv" / "fusionrag").rglob("*.safetensors"))
    blob.unlink()
    assert main([*db, "verify", "--no-repair"], engine_factory=engines) == 1
    assert "1 missing" in capsys.readouterr().out
    assert main([*db, "verify"], engine_factory=engines) == 0
    assert "repaired" in capsys.readouterr().out
    assert main([*db, "verify", "--no-repair"], engine_factory=engines) == 0
    assert "OK" in capsys.readouterr().out


def test_core_errors_are_one_line_exit_2(
    engines: TinyEngines, tokenizer: PreTrainedTokenizerBase, corpus: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    db = ["--db", str(tmp_path / "db")]
    assert main([*db, "ingest", str(corpus / "lighthouse.md"), "--quiet"], engine_factory=engines) == 0
    capsys.readouterr()
    # another model cannot read this index (CacheMismatchError from the core)
    assert main([*db, "ask", "Who?"], engine_factory=TinyEngines(tokenizer, seed=1)) == 2
    _one_line_error(capsys.readouterr().err, "was built with model")
    # settings that differ from the collection's (InvalidRequestError)
    assert main([*db, "ingest", str(corpus / "lighthouse.md"), "--neighbours", "3"], engine_factory=engines) == 2
    _one_line_error(capsys.readouterr().err, "ingest settings")
    assert main([*db, "--selector", "best", "ask", "Who?"], engine_factory=engines) == 2
    _one_line_error(capsys.readouterr().err, "unknown selector")


@pytest.mark.skipif(not DATA.is_file(), reason=f"benchmark dataset not found at {DATA}")
def test_bench_command(engines: TinyEngines, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "--data", str(DATA), "--limit", "1", "--max-passage-tokens", "20", "--methods", "full_reuse",
            "fusionrag", "--ratios", "0.2", "--neighbours", "3", "--max-new-tokens", "2", "--out", str(out),
            "--no-progress"]
    assert main(argv, engine_factory=engines) == 0
    printed = capsys.readouterr().out
    assert "| fusionrag | 0.2 |" in printed and "| full_attention |" in printed and "chunks/min" in printed
    assert {p.name for p in out.iterdir()} == {"results.json", "results.md", "quality.png", "ttft.png"}
    results = (out / "results.json").read_text()
    assert '"neighbours": 3' in results and '"--neighbours"' in results  # the config and the command line


def test_demo(
    engines: TinyEngines, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both answers per question, agreement, first-token KL, token counts, TTFTs and speedup as
    measured (see tests/test_demo.py), and no score against gold answers."""
    from tests.test_demo import check_demo_run

    check_demo_run(engines(EngineSpec()), tmp_path / "db", capsys, monkeypatch, questions=3, max_tokens=3)


def test_demo_needs_no_framework(
    engines: TinyEngines, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo runs on the core alone: without LangChain, LlamaIndex or the integrations."""
    for module in ("fusionrag_integrations", "langchain_core", "llama_index"):
        monkeypatch.setitem(sys.modules, module, None)
    assert main(["--db", str(tmp_path / "db"), "demo", "--questions", "1", "--max-tokens", "2"],
                engine_factory=engines) == 0
    assert "same answer:" in capsys.readouterr().out


def test_parser_is_usable_as_a_library() -> None:
    args = build_parser().parse_args(["bench", "--data", "d.jsonl", "--ratios", "0.1,0.2", "--model", "gemma3-270m"])
    assert args.ratios == (0.1, 0.2) and args.model == "gemma3-270m" and args.db == "./fusionrag-data"
