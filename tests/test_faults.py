"""Faults a corpus must survive (issue #12): corpora sharing servers, bad blobs at query time,
servers going away, ingests too large for the disk, two writers at once.

Every test here failed on the main branch it was written against; each says which defect it pins.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core import cli
from fusionrag_core.data import sample_corpus_dir
from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import CorpusLockedError, InsufficientSpaceError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.chroma import RetrievedChunk
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.corpus import CORPUS_ID_KEY, corpus_id_of
from fusionrag_core.ingest.records import NEIGHBOURS_KEY
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.runtime.kv import VARIANTS, ChunkKV, neighbours_digest
from fusionrag_core.store import DiskKVStore
from fusionrag_core.store.disk import QUARANTINE_DIR
from tests.ingest_worker import tiny_engine, tokenizer_dir
from tests.servers import running_chroma_server, running_redis_server

CONFIG = IngestConfig(chunk_tokens=32, neighbours=2)
CORPUS_A = [
    "The Lumen lighthouse on the northern cape was designed by the engineer Ada Vell in 1871.",
    "Ada Vell was born in the fishing village of Marrow, where her father repaired nets.",
    "Marrow salt was sold in markets all along the coast and was famous for its pale pink colour.",
]
CORPUS_B = [
    "The river Tell floods every spring and feeds the orchards of the lower valley.",
    "Orchards of the lower valley grow a bitter green apple used only for cider.",
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with running_redis_server() as url:
        yield url


# ---- defect 2: corpora sharing one Redis -------------------------------------------------------------
@pytest.mark.servers
def test_two_data_dirs_on_one_redis_keep_their_caches(engine: FusionEngine, tmp_path: Path, redis_url: str) -> None:
    a = FusionIndex.open(engine, tmp_path / "a", redis_url=redis_url, config=CONFIG)
    a.add_texts(CORPUS_A)
    b = FusionIndex.open(engine, tmp_path / "b", redis_url=redis_url, config=CONFIG)
    b.add_texts(CORPUS_B)  # NOTE: its orphan sweep deleted a's blobs while both shared a namespace
    assert a.verify(repair=False).ok and b.verify(repair=False).ok
    generation, _ = a.answer("Who designed the Lumen lighthouse?", k=2)
    assert generation.cache_misses == {}
    assert corpus_id_of(a.collection.metadata) != corpus_id_of(b.collection.metadata)
    assert a.store.namespace != b.store.namespace  # type: ignore[attr-defined]


@pytest.mark.servers
def test_a_corpus_from_before_ids_keeps_its_namespace_and_is_warned_about(
    engine: FusionEngine, tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    index = FusionIndex.open(engine, tmp_path, redis_url=redis_url, collection_name="old-corpus", config=CONFIG)
    index.add_texts(CORPUS_A)
    # NOTE: what an older fusionrag left: the same collection, no corpus id, caches keyed by name.
    metadata = {k: v for k, v in (index.collection.metadata or {}).items() if k != CORPUS_ID_KEY}
    index.collection.modify(metadata=metadata)
    legacy = FusionIndex.open(engine, tmp_path, redis_url=redis_url, collection_name="old-corpus")
    with caplog.at_level(logging.WARNING, logger="fusionrag_core.index"):
        legacy = FusionIndex.open(engine, tmp_path, redis_url=redis_url, collection_name="old-corpus")
    assert corpus_id_of(legacy.collection.metadata) is None, "an existing corpus is not re-keyed behind its back"
    assert legacy.store.namespace == "fusionrag.old-corpus"  # type: ignore[attr-defined]
    assert "built before corpus ids" in caplog.text and "--collection" in caplog.text


# ---- defect 5: a bad blob at query time -----------------------------------------------------------
QUESTION = "Where was the designer of the Lumen lighthouse born?"
GREEDY = SamplingConfig(max_new_tokens=4)


def _damage(index: FusionIndex, victim: str, donor: str, how: str) -> None:
    store = index.store
    assert isinstance(store, DiskKVStore)
    for variant in VARIANTS:
        path = store.path_for(victim, variant)
        blob = path.read_bytes()
        if how == "truncated":
            path.write_bytes(blob[: len(blob) // 2])
        elif how == "bitflip":
            path.write_bytes(blob[:-9] + bytes([blob[-9] ^ 0x10]) + blob[-8:])
        else:  # NOTE: a blob of another chunk under this chunk's name
            path.write_bytes(store.path_for(donor, variant).read_bytes())


@pytest.mark.parametrize("how", ["truncated", "bitflip", "foreign"])
def test_a_corrupt_blob_is_a_reported_miss_set_aside_and_recomputed(
    engine: FusionEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    index = FusionIndex.open(engine, tmp_path, config=CONFIG)
    index.add_texts(CORPUS_A)
    hits = index.search(QUESTION, 3)
    victim, donor = hits[1].chunk_id, hits[2].chunk_id
    intact = index.answer(QUESTION, k=3, sampling=GREEDY)[0]
    intact_exact = index.answer(QUESTION, k=3, sampling=GREEDY, ratio=1.0)[0]
    _damage(index, victim, donor, how)

    with caplog.at_level(logging.WARNING):
        damaged = index.answer(QUESTION, k=3, sampling=GREEDY)[0]
        damaged_exact = index.answer(QUESTION, k=3, sampling=GREEDY, ratio=1.0)[0]
    assert set(damaged.cache_misses) == {victim} and "set aside" in damaged.cache_misses[victim]
    assert damaged_exact.text == intact_exact.text, "ratio 1.0 equals a full prefill, bad blob or not"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("fusionrag verify" in w and str(tmp_path) in w for w in warnings), warnings
    assert not any(index.store.has(victim, v) for v in VARIANTS)
    assert len(list((tmp_path / "kv" / "fusionrag" / QUARANTINE_DIR).iterdir())) == 2

    # NOTE: the chunk is prefilled where its cache went: exactly as if it had never had one.
    absent = index.answer(QUESTION, k=3, sampling=GREEDY)[0]
    assert absent.cache_misses == {victim: "no cache stored for this chunk id"}
    assert absent.text == damaged.text and torch.equal(absent.first_token_logits, damaged.first_token_logits)

    report = index.add_texts(CORPUS_A)  # NOTE: the next ingest recomputes what was set aside
    assert report.prefills == 2 and all(index.store.has(victim, v) for v in VARIANTS)
    repaired = index.answer(QUESTION, k=3, sampling=GREEDY)[0]
    assert repaired.cache_misses == {} and repaired.text == intact.text
    assert torch.allclose(repaired.first_token_logits, intact.first_token_logits, atol=1e-5)


def test_a_blob_of_another_model_is_a_miss_logged_once_and_kept(
    engine: FusionEngine, tokenizer: PreTrainedTokenizerBase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    index = FusionIndex.open(engine, tmp_path, config=CONFIG)
    index.add_texts(CORPUS_A)
    victim = index.search(QUESTION, 3)[1].chunk_id
    other = tiny_engine(tokenizer, seed=1)
    for variant in VARIANTS:
        kv = other.chunk_cache(index.collection.get(ids=[victim])["documents"][0])  # type: ignore[index]
        index.store.put(victim, replace(kv, variant=variant))
    with caplog.at_level(logging.WARNING):
        first = index.answer(QUESTION, k=3, sampling=GREEDY)[0]
        index.answer(QUESTION, k=3, sampling=GREEDY)
    assert "another model" in first.cache_misses[victim]
    assert len([r for r in caplog.records if victim in r.getMessage()]) == 2, "once per variant, not per request"
    assert all(index.store.has(victim, v) for v in VARIANTS), "a reader with the wrong model destroys nothing"


# ---- defect 7: the Chroma server going away mid-command ------------------------------------------
@pytest.mark.servers
def test_chroma_outage_mid_command_is_one_line_exit_2(
    engine: FusionEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "lamp.md"
    doc.write_text(CORPUS_A[0])
    with contextlib.ExitStack() as server:
        url = server.enter_context(running_chroma_server())
        common = ["--chroma-url", url, "--db", str(tmp_path / "db")]
        ingest = [*common, "ingest", "--quiet", "--chunk-tokens", "32", "--neighbours", "2", str(doc)]
        assert cli.main(ingest, engine_factory=lambda _: engine) == 0
        search = FusionIndex.search

        def search_after_outage(self: FusionIndex, query: str, k: int = 4) -> list[RetrievedChunk]:
            server.close()  # NOTE: the server stops after the index was opened, before the query reaches it
            return search(self, query, k)

        monkeypatch.setattr(FusionIndex, "search", search_after_outage)
        capsys.readouterr()
        code = cli.main([*common, "ask", "Who designed the Lumen lighthouse?"], engine_factory=lambda _: engine)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("fusionrag: error: lost the connection to the Chroma server at " + url), err


# ---- defect 3: one writer per corpus; fused caches on the recorded neighbours --------------------
def test_a_second_writer_is_refused_or_waits_and_nothing_is_lost(engine: FusionEngine, tmp_path: Path) -> None:
    first = FusionIndex.open(engine, tmp_path, config=CONFIG)
    second = FusionIndex.open(engine, tmp_path, config=CONFIG)
    entered, go_on = threading.Event(), threading.Event()
    put = first.store.put

    def slow_put(chunk_id: str, kv: ChunkKV) -> None:
        put(chunk_id, kv)
        entered.set()
        go_on.wait(30)  # NOTE: the first ingest holds here, blobs stored, Chroma entries not yet added

    first.store.put = slow_put  # type: ignore[method-assign]
    writer = threading.Thread(target=first.add_texts, args=(CORPUS_A,))
    writer.start()
    assert entered.wait(30)
    with pytest.raises(CorpusLockedError, match=r"cannot ingest: pid .* is writing to this corpus"):
        second.add_texts(CORPUS_B)  # NOTE: on main it ran, and its orphan sweep took the first's blobs
    with pytest.raises(CorpusLockedError):
        second.verify()
    second.writer_wait_s = 60
    waiter = threading.Thread(target=second.add_texts, args=(CORPUS_B,))
    waiter.start()
    time.sleep(0.5)
    go_on.set()
    writer.join()
    waiter.join()
    first.store.put = put  # type: ignore[method-assign]
    assert len(second) == len(CORPUS_A) + len(CORPUS_B)
    assert second.verify(repair=False).ok


def test_verify_finds_a_fused_cache_built_on_other_neighbours(engine: FusionEngine, tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path, config=CONFIG)
    index.add_texts(CORPUS_A + CORPUS_B)
    row = index.collection.get(limit=1, include=["documents", "metadatas"])
    victim, text = row["ids"][0], row["documents"][0]  # type: ignore[index]
    recorded = str(row["metadatas"][0][NEIGHBOURS_KEY]).split()  # type: ignore[index]
    others = [cid for cid in index.collection.get()["ids"] if cid not in recorded and cid != victim][:2]
    # NOTE: what a second writer left: a fused cache prefilled after another neighbour list
    wrong = index.ingestor.builder.fused([(victim, text, [(cid, 0.5) for cid in others])])[0]
    index.store.put(victim, replace(wrong, fused_after=neighbours_digest(others)))
    report = index.verify(repair=False)
    assert report.wrong_neighbours == 1 and not report.ok
    repaired = index.verify()
    assert repaired.repaired and repaired.recomputed == 1 and index.verify(repair=False).ok


# ---- defect 4: verify after a killed ingest ------------------------------------------------------
def test_verify_after_a_killed_ingest_says_incomplete_and_keeps_the_work(
    engine: FusionEngine, tmp_path: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = [p.read_text(encoding="utf-8") for p in sorted(sample_corpus_dir().glob("*.md"))[:3]]
    config = {"chunk_tokens": 40, "neighbours": 2, "batch_size": 4}
    (tmp_path / "calls.json").write_text(json.dumps([texts]))
    data_dir = tmp_path / "killed"
    worker = subprocess.run(
        [sys.executable, "-m", "tests.ingest_worker", "--data-dir", str(data_dir),
         "--tokenizer", str(tokenizer_dir(request.config.cache.mkdir("fusionrag-tokenizer"))),
         "--texts", str(tmp_path / "calls.json"), "--config", json.dumps(config), "--die-after-fused", "6"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
    )
    assert worker.returncode == -signal.SIGKILL, worker.stderr[-3000:]
    index = FusionIndex.open(engine, data_dir)
    blobs = {v: index.store.list_ids(v) for v in VARIANTS}
    capsys.readouterr()

    def verify(*flags: str) -> tuple[int, str]:
        code = cli.main(["--db", str(data_dir), "verify", *flags], engine_factory=lambda _: engine)
        return code, capsys.readouterr().out

    code, out = verify()
    assert code == 1 and "INCOMPLETE" in out and "ingest by pid" in out and "Re-run" in out, out
    assert {v: index.store.list_ids(v) for v in VARIANTS} == blobs, "the killed run's blobs are kept for the resume"
    resumed = index.add_texts(texts)
    assert resumed.prefills == resumed.new_chunks - 2, "only the fused caches the killed run had not stored"
    code, out = verify("--no-repair")
    assert code == 0 and "OK" in out, out


# ---- defect 5b: ingest recomputes a corrupt blob -------------------------------------------------
def test_reingest_recomputes_a_corrupt_blob_instead_of_skipping_it(engine: FusionEngine, tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path, config=CONFIG)
    index.add_texts(CORPUS_A)
    victim = index.search(QUESTION, 1)[0].chunk_id
    store = index.store
    assert isinstance(store, DiskKVStore)
    path = store.path_for(victim, "independent")
    path.write_bytes(path.read_bytes()[:100])
    report = index.add_texts(CORPUS_A)
    assert report.prefills >= 2 and report.skipped_chunks == len(CORPUS_A) - 1
    assert index.verify(repair=False).ok


# ---- defect 8: delete and sync ------------------------------------------------------------------
def test_cli_delete_and_ingest_sync(engine: FusionEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, text in enumerate(CORPUS_A):
        (folder / f"d{i}.md").write_text(text)
    db = ["--db", str(tmp_path / "db")]

    def run(*argv: str) -> int:
        return cli.main([*db, *argv], engine_factory=lambda _: engine)

    assert run("ingest", "--quiet", "--chunk-tokens", "32", "--neighbours", "2", str(folder)) == 0
    index = FusionIndex.open(engine, tmp_path / "db")
    assert len(index.document_ids()) == 3
    assert run("delete", str(folder / "d0.md")) == 0
    assert index.document_ids() == {str((folder / f"d{i}.md").resolve()) for i in (1, 2)}
    assert run("delete", "no-such-doc") == 2
    (folder / "d1.md").unlink()
    capsys.readouterr()
    assert run("ingest", "--quiet", "--sync", str(folder)) == 0
    assert "--sync: removed 1 document(s)" in capsys.readouterr().out
    assert index.document_ids() == {str((folder / f"d{i}.md").resolve()) for i in (0, 2)}, "d0 is back: it exists"
    assert index.verify(repair=False).ok and index.store.list_ids() == set(index.collection.get()["ids"])


# ---- defect 9: the disk-space check in ingest ----------------------------------------------------
def test_an_ingest_too_large_for_the_store_is_refused_before_writing(
    engine: FusionEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = FusionIndex.open(engine, tmp_path, config=CONFIG)
    monkeypatch.setattr(index.store, "free_bytes", lambda: 1000)
    with pytest.raises(InsufficientSpaceError, match=r"KV caches \(3 chunk\(s\).*\(0\.0 MB free\)"):
        index.add_texts(CORPUS_A)
    assert len(index) == 0 and index.store.list_ids() == set()
    assert index.verify(repair=False).ok, "a refused ingest is not an interrupted one"
    assert index.add_texts(CORPUS_A, space_check=False).new_chunks == 3
