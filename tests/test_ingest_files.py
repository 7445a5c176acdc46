"""Ingesting files: names, unreadable files, and long documents.

- A file reached through a symlink is indexed under the path the user named, so `ingest --sync`
  removes it once that name is gone; documents an earlier version stored under resolved paths
  are still matched.
- A file that is not UTF-8 text, or that the user may not read (a real EACCES: root gives up the
  capabilities that read any file), is skipped with a message and counted (as empty files are),
  and a folder it may not list is skipped with a message, unless `--strict` is given.
- A document with very long lines is chunked in linear time, ordinary documents exactly as before,
  and an ingest that cannot fit is refused on an estimate, before any chunking.

Commands run through `main(argv, engine_factory=...)` with a tiny random Llama and the real
SmolLM2 tokenizer.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from semantic_text_splitter import TextSplitter
from transformers import PreTrainedTokenizerBase

from fusionrag_core import cli
from fusionrag_core.data import sample_corpus_dir
from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InsufficientSpaceError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest import chunking
from fusionrag_core.ingest.chunking import Chunker, ChunkingConfig, chunk_id
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.runtime.compat import tokenize_plain
from tests.ingest_worker import tiny_engine

LIGHTHOUSE = "The Lumen lighthouse on the northern cape was designed by the engineer Ada Vell in 1871."
BIRTH = "Ada Vell was born in the fishing village of Marrow, where her father repaired nets."
HARBOUR = "The harbour of Marrow freezes over in hard winters, and the boats are hauled onto the shingle."

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


@pytest.fixture
def run(engine: FusionEngine, tmp_path: Path) -> Callable[..., int]:
    """`fusionrag --db tmp/db ARGS...` with the tiny engine (new indexes: 64-token chunks)."""
    db = ["--db", str(tmp_path / "db")]

    def run_cli(*argv: str) -> int:
        return cli.main([*db, *argv], engine_factory=lambda _: engine)

    return run_cli


def _doc_ids(engine: FusionEngine, db: Path) -> set[str]:
    with FusionIndex.open(engine, db) as index:
        return index.document_ids()


def _one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusionrag: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ---- symlinks and --sync --------------------------------------------------------------------------
def test_a_symlinked_file_is_indexed_under_its_name_and_sync_removes_it(
    engine: FusionEngine, run: Callable[..., int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pins the defect: the link was stored under its target's path, which --sync never removed."""
    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "elsewhere" / "lighthouse.md"
    target.write_text(LIGHTHOUSE)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "vell.md").write_text(BIRTH)
    link = corpus / "lighthouse.md"
    link.symlink_to(target)

    assert run("ingest", "--quiet", "--chunk-tokens", "64", str(corpus)) == 0
    assert _doc_ids(engine, tmp_path / "db") == {str(link), str(corpus / "vell.md")}

    link.unlink()  # the target stays
    capsys.readouterr()
    assert run("ingest", "--quiet", "--sync", str(corpus)) == 0
    out = capsys.readouterr().out
    assert "--sync: removed 1 document(s)" in out and str(link) in out, out
    assert _doc_ids(engine, tmp_path / "db") == {str(corpus / "vell.md")}


def test_sync_still_matches_documents_stored_under_resolved_paths(
    engine: FusionEngine, run: Callable[..., int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A corpus an earlier version built (doc ids = resolved paths), ingested again through a
    symlinked folder: the new ids are the names given, a resolved id whose file is gone is synced
    away, and one whose file is still there is kept and reported (it may be a direct ingest)."""
    real = tmp_path / "real"
    real.mkdir()
    for name, text in (("lighthouse.md", LIGHTHOUSE), ("vell.md", BIRTH), ("harbour.md", HARBOUR)):
        (real / name).write_text(text)
    named = tmp_path / "named"
    named.symlink_to(real, target_is_directory=True)
    with FusionIndex.open(engine, tmp_path / "db", config=IngestConfig(chunk_tokens=64)) as index:
        files = sorted(real.glob("*.md"))
        index.add_texts([f.read_text() for f in files], metadatas=[{"source": str(f)} for f in files],
                        doc_ids=[str(f) for f in files])

    (real / "harbour.md").unlink()
    assert run("ingest", "--quiet", "--sync", str(named)) == 0
    out = capsys.readouterr().out
    assert "--sync: removed 1 document(s)" in out and str(real / "harbour.md") in out, out
    assert str(real / "lighthouse.md") in out and "resolved path" in out, "the kept resolved ids are reported"
    assert _doc_ids(engine, tmp_path / "db") == {
        str(named / "lighthouse.md"), str(named / "vell.md"), str(real / "lighthouse.md"), str(real / "vell.md")}


def test_delete_finds_a_document_by_the_name_it_was_ingested_under(
    engine: FusionEngine, run: Callable[..., int], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target = tmp_path / "target.md"
    target.write_text(LIGHTHOUSE)
    link = tmp_path / "link.md"
    link.symlink_to(target)
    assert run("ingest", "--quiet", "--chunk-tokens", "64", str(link)) == 0
    monkeypatch.chdir(tmp_path)
    assert run("delete", "link.md") == 0, capsys.readouterr().err
    assert _doc_ids(engine, tmp_path / "db") == set()


# ---- files that are not UTF-8 text ----------------------------------------------------------------
@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    """A folder with one good file, one Latin-1 file and one empty file."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "good.md").write_text(LIGHTHOUSE)
    (folder / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    (folder / "empty.md").write_text("\n")
    return folder


def test_a_file_that_is_not_utf8_is_skipped_and_counted(
    run: Callable[..., int], mixed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pins the defect: one Latin-1 file aborted the whole folder's ingest."""
    assert run("ingest", "--quiet", "--chunk-tokens", "64", str(mixed)) == 0
    captured = capsys.readouterr()
    (line,) = [x for x in captured.err.splitlines() if "latin1.txt" in x]
    assert line.startswith(f"fusionrag: skipping {mixed / 'latin1.txt'}: not UTF-8 text"), line
    assert "byte 0xe9 at offset 3" in line, line
    assert "ingested 1 document(s)" in captured.out
    assert "skipped 2 file(s) (1 empty, 1 not UTF-8 text)" in captured.out, captured.out


def test_strict_refuses_a_file_it_would_skip(
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path, mixed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loads: list[object] = []

    def engines(spec: object) -> FusionEngine:
        loads.append(spec)
        return tiny_engine(tokenizer)

    db = ["--db", str(tmp_path / "db")]
    assert cli.main([*db, "ingest", "--strict", str(mixed / "good.md"), str(mixed / "latin1.txt")],
                    engine_factory=engines) == 2
    _one_line_error(capsys.readouterr().err, str(mixed / "latin1.txt"), "byte 0xe9 at offset 3", "--strict")
    assert cli.main([*db, "ingest", "--strict", str(mixed / "good.md"), str(mixed / "empty.md")],
                    engine_factory=engines) == 2
    _one_line_error(capsys.readouterr().err, str(mixed / "empty.md"), "no text", "--strict")
    assert loads == [], "refused before loading a model"


# ---- files this process may not read ----------------------------------------------------------------
# `fusionrag ARGS...` with the tiny engine: argv[1] the tokenizer directory.
CLI = """
import sys
from fusionrag_core import cli
from tests.ingest_worker import tiny_engine_at
sys.exit(cli.main(sys.argv[2:], engine_factory=lambda spec: tiny_engine_at(sys.argv[1])))
"""
_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


def _as_root_without_read_override() -> None:
    """In the child, before exec: drop the capabilities that let root read any file from the bounding
    set, so the command run has neither and a mode-000 file denies it as it denies any user (EACCES)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _fusionrag_denied(tokenizer_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`fusionrag ARGS...` in a process for which a mode-000 file is unreadable (root gives up the
    capabilities that would read it anyway)."""
    try:
        return subprocess.run([sys.executable, "-c", CLI, str(tokenizer_path), *argv], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=300,
                              preexec_fn=_as_root_without_read_override if os.geteuid() == 0 else None)
    except subprocess.SubprocessError as e:
        pytest.skip(f"cannot drop root's file-read capabilities here ({e})")


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[Path]:
    """A folder with one good file, one this process's commands may not read and a subfolder they may
    not list (mode 000)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    (folder / "good.md").write_text(LIGHTHOUSE)
    (folder / "secret.md").write_text(BIRTH)
    (folder / "secret.md").chmod(0)
    (folder / "private").mkdir()
    (folder / "private" / "notes.md").write_text(HARBOUR)
    (folder / "private").chmod(0)
    yield folder
    (folder / "secret.md").chmod(0o644)
    (folder / "private").chmod(0o755)


def test_a_file_that_cannot_be_read_is_skipped_and_counted(tokenizer_path: Path, tmp_path: Path,
                                                           locked: Path) -> None:
    """Pins the defect: one unreadable file (EACCES) ended the whole folder's ingest."""
    db = ["--db", str(tmp_path / "db")]
    run = _fusionrag_denied(tokenizer_path, *db, "ingest", "--quiet", "--chunk-tokens", "64", str(locked))
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [x for x in run.stderr.splitlines() if "secret.md" in x]
    assert line.startswith(f"fusionrag: skipping {locked / 'secret.md'}: not readable (Permission denied)"), line
    assert "ingested 1 document(s)" in run.stdout and "skipped 1 file(s) (1 not readable)" in run.stdout, run.stdout
    (line,) = [x for x in run.stderr.splitlines() if "private" in x]  # NOTE: a folder it may not list
    assert line.startswith(f"fusionrag: skipping the folder {locked / 'private'}: Permission denied"), line
    for named, refused in ((locked / "secret.md", "Permission denied"), (locked, "private cannot be listed")):
        strict = _fusionrag_denied(tokenizer_path, *db, "ingest", "--strict", str(named))
        assert strict.returncode == 2, strict.stderr[-3000:]
        assert "--strict" in strict.stderr and refused in strict.stderr, strict.stderr


# ---- chunking in linear time ----------------------------------------------------------------------
# NOTE: sha256 of the space-joined chunk ids (fingerprint "fp") of the sample corpus's documents,
# recorded with the splitter run on whole documents before long lines were cut into windows.
SAMPLE_CORPUS_IDS = {
    (256, 0): "e5e52144ec593d28",
    (64, 0): "1ff1ca71ea3c3882",
    (64, 16): "1e09d01247b814ea",
    (32, 8): "2bb109a5800e6f29",
    (16, 0): "764262b8a6bd148d",
}


def _reference(tokenizer: PreTrainedTokenizerBase, config: ChunkingConfig) -> TextSplitter:
    """The splitter on the whole text, as chunking always ran it (quadratic on long lines)."""
    return TextSplitter.from_callback(lambda t: len(tokenize_plain(tokenizer, t)), config.chunk_tokens,
                                      overlap=config.chunk_overlap)


@pytest.mark.parametrize(("tokens", "overlap"), list(SAMPLE_CORPUS_IDS))
def test_ordinary_documents_chunk_exactly_as_before(tokenizer: PreTrainedTokenizerBase, tokens: int,
                                                    overlap: int) -> None:
    """Existing corpora are keyed by content ids: the sample corpus must cut into the same chunks."""
    config = ChunkingConfig(tokens, overlap)
    chunker = Chunker(tokenizer, config)
    reference = _reference(tokenizer, config)
    ids = []
    for path in sorted(sample_corpus_dir().glob("*.md")):
        text = path.read_text()
        pieces = chunker.split(text)
        assert pieces == [c for c in reference.chunks(text) if c.strip()], path.name
        ids += [chunk_id(piece, "fp", config) for piece in pieces]
    assert hashlib.sha256(" ".join(ids).encode()).hexdigest()[:16] == SAMPLE_CORPUS_IDS[(tokens, overlap)]


def _one_line(chars: int, seed: int = 0) -> str:
    """English-like text without a newline: words and sentences."""
    rng = random.Random(seed)
    words = ("the", "lighthouse", "keeper", "walked", "along", "northern", "cape", "while", "storms", "gathered",
             "over", "sea", "and", "nets")
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(words)
        out.append(word + ("." if rng.random() < 0.07 else ""))
        size += len(out[-1]) + 1
    return " ".join(out)[:chars]


class SplitterSpy:
    """Records the length of every text the chunker hands to the splitter."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lengths: list[int] = []
        real = TextSplitter.from_callback
        spy = self

        class Recording:
            def __init__(self, splitter: TextSplitter) -> None:
                self.splitter = splitter

            def chunks(self, text: str) -> list[str]:
                spy.lengths.append(len(text))
                return list(self.splitter.chunks(text))

            def chunk_indices(self, text: str) -> list[tuple[int, str]]:
                spy.lengths.append(len(text))
                return list(self.splitter.chunk_indices(text))

        class Factory:
            @staticmethod
            def from_callback(*args: Any, **kwargs: Any) -> Recording:
                return Recording(real(*args, **kwargs))

        monkeypatch.setattr(chunking, "TextSplitter", Factory)

    def take(self) -> list[int]:
        lengths, self.lengths = self.lengths, []
        return lengths


@pytest.mark.parametrize("overlap", [0, 8])
def test_a_long_line_reaches_the_splitter_in_bounded_windows(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch, overlap: int
) -> None:
    """Pins the defect: the splitter's work per chunk grows with the rest of the line, so a 20 MB
    single-line file took over an hour. The chunker now hands it windows of bounded size (a
    deterministic proxy for linear time), and cuts the same chunks."""
    config = ChunkingConfig(32, overlap)
    spy = SplitterSpy(monkeypatch)
    chunker = Chunker(tokenizer, config)
    small, large = _one_line(40_000), _one_line(160_000, seed=1)

    pieces = chunker.split(small)
    seen_small = spy.take()
    assert pieces == [c for c in _reference(tokenizer, config).chunks(small) if c.strip()]
    chunker.split(large, on_progress=lambda at: None)
    seen_large = spy.take()
    assert max(seen_large) == max(seen_small) < len(small) / 2, (max(seen_small), max(seen_large))
    assert sum(seen_large) < 1.2 * len(large), "each character is handed to the splitter about once"


# ---- the space check runs on an estimate before chunking ------------------------------------------
@pytest.fixture
def spied_index(engine: FusionEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[
        tuple[FusionIndex, list[int]]]:
    """An index (no fusion, 64-token chunks) and the lengths of the texts its chunker was given."""
    with FusionIndex.open(engine, tmp_path / "db", config=IngestConfig(chunk_tokens=64, fuse=False)) as index:
        split = index.ingestor.chunker.split
        chunked: list[int] = []

        def spied(text: str, on_progress: Callable[[int], None] | None = None) -> list[str]:
            chunked.append(len(text))
            return split(text, on_progress)

        monkeypatch.setattr(index.ingestor.chunker, "split", spied)
        yield index, chunked


def test_an_ingest_too_large_is_refused_before_chunking(
    spied_index: tuple[FusionIndex, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pins the defect: the space check ran only after every document was chunked (minutes for a
    large file), so a hopeless ingest was refused late."""
    index, chunked = spied_index
    monkeypatch.setattr(index.store, "free_bytes", lambda: 200_000)
    with pytest.raises(InsufficientSpaceError, match=r"estimated before chunking") as refused:
        index.add_texts([_one_line(20_000), BIRTH])
    assert chunked == [], "refused before chunking"
    assert "more than fits" in str(refused.value) and "--no-space-check" in str(refused.value)
    assert len(index) == 0


def test_the_estimate_leaves_out_documents_already_indexed(
    spied_index: tuple[FusionIndex, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ingesting the same documents again writes nothing, so a full disk must not refuse it."""
    index, chunked = spied_index
    texts, ids = [_one_line(3_000), BIRTH], ["long", "birth"]
    assert index.add_texts(texts, doc_ids=ids).new_chunks > 2
    monkeypatch.setattr(index.store, "free_bytes", lambda: 1000)
    report = index.add_texts(texts, doc_ids=ids)
    assert report.new_chunks == 0 and len(chunked) == 4
    with pytest.raises(InsufficientSpaceError, match=r"estimated before chunking"):
        index.add_texts([HARBOUR], doc_ids=["harbour"])
