"""Writes that stop part-way: a delete killed before it re-fuses, and writes refused (or interrupted)
before they write anything."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core import cli
from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.lock import JOURNAL_FILE
from fusionrag_core.ingest.records import NEIGHBOURS_KEY, PENDING_KEY
from fusionrag_core.store import DiskKVStore
from tests.ingest_worker import tiny_engine, tokenizer_dir

CONFIG = IngestConfig(chunk_tokens=32, neighbours=2)
CORPUS = [
    "The Lumen lighthouse on the northern cape was designed by the engineer Ada Vell in 1871.",
    "Ada Vell was born in the fishing village of Marrow, where her father repaired nets.",
    "Marrow salt was sold in markets all along the coast and was famous for its pale pink colour.",
]
QUESTION = "Who designed the Lumen lighthouse?"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


def _doc_id(text: str) -> str:
    """The id `add_texts` gives a document passed without one (a hash of its text)."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _journal(index: FusionIndex) -> Path:
    assert isinstance(index.store, DiskKVStore)
    return index.store.root / JOURNAL_FILE


def _killed_mid_delete(tmp_path: Path, request: pytest.FixtureRequest, engine: FusionEngine) -> FusionIndex:
    """A corpus whose delete of `CORPUS[1]` was SIGKILLed right after its Chroma entry was deleted,
    before the chunks fused after it were re-fused (in a real process)."""
    (tmp_path / "calls.json").write_text(json.dumps([CORPUS]))
    data_dir = tmp_path / "killed"
    config = {"chunk_tokens": CONFIG.chunk_tokens, "neighbours": CONFIG.neighbours}
    worker = subprocess.run(
        [sys.executable, "-m", "tests.ingest_worker", "--data-dir", str(data_dir),
         "--tokenizer", str(tokenizer_dir(request.config.cache.mkdir("fusionrag-tokenizer"))),
         "--texts", str(tmp_path / "calls.json"), "--config", json.dumps(config),
         "--die-deleting", _doc_id(CORPUS[1])],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
    )
    assert worker.returncode == -signal.SIGKILL, worker.stderr[-3000:]
    index = FusionIndex.open(engine, data_dir)
    assert _doc_id(CORPUS[1]) not in index.document_ids() and len(index) == 2, "killed after the Chroma delete"
    rows = index.collection.get(include=["metadatas"])
    assert all(m[PENDING_KEY] for m in rows["metadatas"] or []), "killed before the re-fusion"
    return index


def _pending(index: FusionIndex) -> list[str]:
    rows = index.collection.get(include=["metadatas"])
    return [cid for cid, m in zip(rows["ids"], rows["metadatas"] or [], strict=True) if m.get(PENDING_KEY)]


def _assert_finished(index: FusionIndex) -> None:
    """The delete is complete: no pending chunk, no neighbour that is gone, every blob has its entry."""
    assert _pending(index) == []
    rows = index.collection.get(include=["metadatas"])
    for m in rows["metadatas"] or []:
        assert set(str(m[NEIGHBOURS_KEY]).split()) <= set(rows["ids"]), "re-fused on the neighbours left"
    assert index.store.list_ids() == set(rows["ids"])
    assert not _journal(index).exists()
    assert index.verify(repair=False).ok


def test_a_pending_chunk_never_serves_a_fused_cache_built_on_a_deleted_neighbour(
    engine: FusionEngine, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Defect: between the kill and a repair, the survivors served fused caches built with the deleted chunk."""
    index = _killed_mid_delete(tmp_path, request, engine)
    rows = index.collection.get(include=["documents"])
    chunks = list(zip(rows["ids"], rows["documents"] or [], strict=True))
    prompt = index.engine.prompt(QUESTION, chunks=chunks)
    generation = index.stream(prompt).collect()
    assert generation.cache_variants == {"independent": 2}, generation.cache_variants
    second = chunks[1][0]  # NOTE: the first chunk reuses its (exact) independent cache anyway
    assert "fused" in generation.cache_fallbacks[second], generation.cache_fallbacks
    assert generation.stats()["cache_fallbacks"] == 1
    independent = index.stream(prompt, variant="independent").collect()
    assert torch.equal(generation.first_token_logits, independent.first_token_logits)


def test_verify_finishes_a_delete_killed_before_re_fusion(
    engine: FusionEngine, tmp_path: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    """Defect: verify said INCOMPLETE forever and repaired nothing."""
    index = _killed_mid_delete(tmp_path, request, engine)
    capsys.readouterr()
    code = cli.main(["--db", str(tmp_path / "killed"), "verify"], engine_factory=lambda _: engine)
    out = capsys.readouterr().out
    assert code == 0 and "finished the interrupted delete" in out and "INCOMPLETE" not in out, out
    _assert_finished(index)


def test_verify_without_repair_reports_a_killed_delete_and_keeps_it(
    engine: FusionEngine, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    index = _killed_mid_delete(tmp_path, request, engine)
    report = index.verify(repair=False)
    assert report.incomplete.startswith("delete of 1 document(s)") and not report.ok, report.incomplete
    assert _journal(index).exists() and len(_pending(index)) == 2
    index.add_texts(CORPUS[:1])  # NOTE: the next write finishes the delete before its own work
    _assert_finished(index)
    assert _doc_id(CORPUS[1]) not in index.document_ids()


def test_rerunning_a_killed_delete_finishes_it(
    engine: FusionEngine, tmp_path: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    """Defect: re-running the advised delete failed with "no document ..."."""
    index = _killed_mid_delete(tmp_path, request, engine)
    capsys.readouterr()
    code = cli.main(["--db", str(tmp_path / "killed"), "delete", _doc_id(CORPUS[1])], engine_factory=lambda _: engine)
    captured = capsys.readouterr()
    assert code == 0 and "deleted 1 document(s)" in captured.out, captured.err
    _assert_finished(index)


# ---- a write refused before it writes leaves no trace ------------------------------------------
def test_a_write_refused_for_list_metadata_leaves_no_journal(engine: FusionEngine, tmp_path: Path) -> None:
    """Defect: the refused add_texts left `.writer.journal`, and verify said INCOMPLETE."""
    index = FusionIndex.open(engine, tmp_path, config=CONFIG)
    with pytest.raises(InvalidRequestError, match=r"metadata of document .* has 'tags'=list"):
        index.add_texts(CORPUS, metadatas=[{"tags": ["x", "y"]}, None, None])
    assert not _journal(index).exists()
    report = index.verify(repair=False)
    assert report.ok and not report.incomplete and len(index) == 0 and index.store.list_ids() == set()


def test_a_delete_refused_for_its_arguments_leaves_no_journal(engine: FusionEngine, tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path, config=CONFIG)
    index.add_texts(CORPUS[:2], doc_ids=["a", "b"])
    with pytest.raises(InvalidRequestError, match="not one string"):
        index.delete("a")  # type: ignore[arg-type]
    assert not _journal(index).exists() and index.verify(repair=False).ok and len(index) == 2


def test_an_interrupt_while_chunking_leaves_no_journal(
    engine: FusionEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: Ctrl-C during chunking (nothing written yet) left a journal, as a killed write does."""
    index = FusionIndex.open(engine, tmp_path, config=CONFIG)

    def interrupted(*_: object) -> list[str]:
        raise KeyboardInterrupt

    monkeypatch.setattr(index.ingestor.chunker, "split", interrupted)
    with pytest.raises(KeyboardInterrupt):
        index.add_texts(CORPUS)
    assert not _journal(index).exists()
    monkeypatch.undo()
    assert index.verify(repair=False).ok
    assert index.add_texts(CORPUS).new_chunks == 3 and not _journal(index).exists()
