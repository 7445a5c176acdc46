"""A damaged content index, and data directories that cannot be written.

Defects pinned (each test failed before its fix):

* a content index whose SQLite file was overwritten, or whose hash array (`anchors.<gen>.i64`)
  is gone, made every LangChain lookup raise (DatabaseError / FileNotFoundError), `ingest` and
  `verify` print tracebacks, and nothing repaired it;
* a corrupt blob in a read-only store raised EROFS out of the request instead of being a miss;
  `fusionrag --db RO ...` printed a chromadb traceback; the LangChain vector store's errors did not
  name the directory; a content index in a read-only directory could not be opened at all.

Read-only directories are real: a read-only bind mount (tests run as root, whom file modes do not
stop); without mount rights, as another user, file modes; else the tests are skipped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from transformers import PreTrainedTokenizerBase

from fusionrag_core import cli
from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import FusionRAGError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.recognise.content_index import ContentIndex
from fusionrag_core.runtime.kv import VARIANTS
from fusionrag_core.store import DiskKVStore, KVStore, content_index
from fusionrag_integrations.langchain import ChatFusionRAG, FusionRAGRetriever, FusionRAGVectorStore
from tests.ingest_worker import tiny_engine
from tests.lighthouse import QUESTION, TEXTS
from tests.servers import running_chroma_server

CONFIG = IngestConfig(chunk_tokens=48, neighbours=2)
INGEST = ["ingest", "--quiet", "--chunk-tokens", "48", "--neighbours", "2"]
GREEDY = SamplingConfig(max_new_tokens=4)
CONTENT_LOGGER = content_index.__name__
PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Use the following pieces of retrieved context to answer the question.\n\n{context}"),
    ("human", "{question}"),
])

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


def _format_docs(docs: list[Document]) -> str:
    """The user's own, as in LangChain's RAG tutorial: plain text, no marks (found by content)."""
    return "\n\n".join(doc.page_content for doc in docs)


def _asker(index: FusionIndex) -> Callable[[], dict[str, Any]]:
    """A LangChain RAG chain over `index` (learning off: reuse comes from the content index alone)."""
    retriever = FusionRAGRetriever(index=index, k=3)
    llm = ChatFusionRAG(index=index, max_tokens=3, learn=False)
    chain = {"context": retriever | _format_docs, "question": RunnablePassthrough()} | PROMPT | llm
    return lambda: dict(chain.invoke(QUESTION).response_metadata)


def _in_a_new_process(store: KVStore) -> None:
    """Close `store`'s open content index (its connection and mapped hash array), as a process
    started now would not have it open: its next use reads the files afresh."""
    index = store.content_index()
    if index is not None:
        index.close()


def _damage(root: Path, how: str) -> None:
    if how == "overwritten":
        for suffix in ("-wal", "-shm"):
            (root / f"anchors.sqlite{suffix}").unlink(missing_ok=True)
        (root / "anchors.sqlite").write_bytes(b"not a database at all " * 400)
    else:
        arrays = list(root.glob("anchors.*.i64"))
        assert arrays
        for path in arrays:
            path.unlink()


def _content_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == CONTENT_LOGGER and r.levelno >= logging.WARNING]


# ---- a damaged content index -------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["overwritten", "array_missing"])
def test_a_damaged_content_index_is_a_reported_miss_until_verify_rebuilds_it(
    engine: FusionEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str], how: str,
) -> None:
    # NOTE: the hash array is published past _MAX_PENDING rows (16,384); 1 publishes it at the second.
    monkeypatch.setattr(content_index, "_MAX_PENDING", 1)
    docs, db = tmp_path / "docs", tmp_path / "db"
    docs.mkdir()
    for i, text in enumerate(TEXTS[:3]):
        (docs / f"d{i}.md").write_text(text)

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["--db", str(db), *argv], engine_factory=lambda _: engine)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    assert run(*INGEST, str(docs))[0] == 0
    index = FusionIndex.open(engine, db)
    assert isinstance(index.store, DiskKVStore)
    root = index.store.root / ".content"
    assert list(root.glob("anchors.*.i64")), "the test needs a published hash array"
    ask = _asker(index)
    assert ask()["reused_tokens"] > 0
    intact = index.answer(QUESTION, k=3, sampling=GREEDY)[0]

    _in_a_new_process(index.store)
    _damage(root, how)
    with caplog.at_level(logging.WARNING):
        damaged = [ask(), ask()]  # NOTE: on main: DatabaseError / FileNotFoundError out of invoke
        by_id = index.answer(QUESTION, k=3, sampling=GREEDY)[0]
    assert [m["reused_tokens"] for m in damaged] == [0, 0], "nothing is found by content: a miss"
    warnings = _content_warnings(caplog)
    assert len(warnings) == 1 and str(root) in warnings[0] and "fusionrag verify" in warnings[0], warnings
    no_reuse = [r.getMessage() for r in caplog.records if "reused no KV cache" in r.getMessage()]
    assert len(no_reuse) == 1 and str(root) in no_reuse[0], "the no-reuse warning names the cause"
    assert by_id.cache_misses == {} and by_id.text == intact.text, "chunks named by id do not need the index"

    # ingest and verify: one line each, no traceback; the repair rebuilds the index from Chroma
    (docs / "d3.md").write_text(TEXTS[3])
    _in_a_new_process(index.store)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        code, out, err = run(*INGEST, str(docs))
    assert code == 0 and "Traceback" not in err, err
    assert len(_content_warnings(caplog)) == 1, caplog.text
    code, out, err = run("verify", "--no-repair")
    assert code == 1 and "content index" in out and str(root) in out and "Traceback" not in err, out + err
    code, out, err = run("verify")
    assert code == 0 and "content index rebuilt from 4 chunk text(s)" in out, out + err

    everything = index.store.content_index()  # NOTE: the long-lived one, rebuilt by verify's own store
    assert everything is not None
    found = everything.find("\n\n".join(TEXTS))
    assert everything.problem is None
    assert sorted(m.chunk_id for m in found) == sorted(index.collection.get()["ids"]), "the new chunk too"
    assert ask()["reused_tokens"] > 0
    assert index.verify(repair=False).ok
    assert not list(root.glob(".anchors.*")), "no staging file is left behind"


_REBUILD_THEN_DIE = """
import os, signal, sys, json
from fusionrag_core.recognise.content_index import ContentIndex
root, die, entries = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
replace = os.replace

def replace_then_maybe_die(src, dst):
    if die == "before_switch" and str(dst).endswith("anchors.sqlite"):
        os.kill(os.getpid(), signal.SIGKILL)  # the new database is whole, not yet renamed over the old one
    replace(src, dst)
    if die == "before_commit" and str(dst).endswith(".i64"):
        os.kill(os.getpid(), signal.SIGKILL)  # the new array is written, the rows' transaction not committed

os.replace = replace_then_maybe_die
ContentIndex(root).rebuild(entries)
"""


@pytest.mark.parametrize("how, die", [("overwritten", "before_switch"), ("array_missing", "before_commit")])
def test_a_rebuild_killed_midway_leaves_the_old_index_and_a_rebuild_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, die: str
) -> None:
    monkeypatch.setattr(content_index, "_MAX_PENDING", 1)
    old = ContentIndex(tmp_path)
    old.add((f"old{i}", text) for i, text in enumerate(TEXTS))
    old.close()
    _damage(tmp_path, how)
    new = [(f"new{i}", text) for i, text in enumerate(TEXTS)]
    killed = subprocess.run([sys.executable, "-c", _REBUILD_THEN_DIE, str(tmp_path), die, json.dumps(new)],
                            cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]

    after = ContentIndex(tmp_path)
    problem = after.check()
    assert problem is not None and str(tmp_path) in problem, "the old index, still reported"
    if how == "array_missing":
        with contextlib.closing(sqlite3.connect(tmp_path / "anchors.sqlite")) as db:
            rows = {cid for (cid,) in db.execute("SELECT chunk_id FROM anchors")}
        assert rows == {f"old{i}" for i in range(len(TEXTS))}, "the old rows, untouched"
    assert after.find("\n\n".join(TEXTS)) == []
    assert after.rebuild(new) == len(TEXTS)
    assert after.check() is None
    assert [m.chunk_id for m in after.find("\n\n".join(TEXTS))] == [cid for cid, _ in new]


def test_a_reader_follows_a_rebuild_made_by_another_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(content_index, "_MAX_PENDING", 1)
    prompt = "\n\n".join(TEXTS)
    every = [(f"c{i}", text) for i, text in enumerate(TEXTS)]
    reader = ContentIndex(tmp_path)  # a long-lived server's
    reader.add(every[:3])
    assert [m.chunk_id for m in reader.find(prompt)] == ["c0", "c1", "c2"]
    _damage(tmp_path, "array_missing")  # NOTE: the reader has the array mapped: it does not notice
    verifier = ContentIndex(tmp_path)
    assert verifier.check() is not None
    verifier.rebuild(every)  # NOTE: the database is readable: rewritten in place, in one transaction
    assert [m.chunk_id for m in reader.find(prompt)] == ["c0", "c1", "c2", "c3"]

    verifier.close()
    reader.close()
    _damage(tmp_path, "overwritten")
    assert reader.find(prompt) == [] and reader.problem is not None
    ContentIndex(tmp_path).rebuild(every[1:])  # NOTE: unreadable: a new file is renamed over it
    assert [m.chunk_id for m in reader.find(prompt)] == ["c1", "c2", "c3"]
    assert reader.problem is None


# ---- read-only data directories ------------------------------------------------------------------------
@contextlib.contextmanager
def read_only(source: Path, view: Path) -> Iterator[Path]:
    """`source` as seen read-only at `view`: a read-only bind mount, unmounted on exit.

    As root without mount rights the test is skipped; as another user, file modes make `source`
    itself read-only (EACCES instead of EROFS) and it is returned.
    """
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [source, *source.rglob("*")]}
        for p, mode in modes.items():
            p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        try:
            yield source
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    view.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(source), str(view)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a read-only directory needs a bind mount here, and mount refused: {mounted.stderr.strip()}")
    try:
        remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True, text=True)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount read-only: {remount.stderr.strip()}")
        yield view
    finally:
        # NOTE: lazy: this process may still hold files under it open (a cached content index).
        subprocess.run(["umount", "-l", str(view)], check=True)


def test_a_corrupt_blob_in_a_read_only_store_is_a_miss_left_in_place_that_says_why(
    engine: FusionEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    index = FusionIndex.open(engine, tmp_path / "data", config=CONFIG)
    index.add_texts(TEXTS)
    victim = index.search(QUESTION, 3)[1].chunk_id
    store = index.store
    assert isinstance(store, DiskKVStore)
    for variant in VARIANTS:
        path = store.path_for(victim, variant)
        path.write_bytes(path.read_bytes()[:100])

    with read_only(tmp_path / "data" / "kv", tmp_path / "ro") as kv:
        # NOTE: the collection stays where it can be opened (in production: a Chroma server).
        served = FusionIndex(engine, index.collection, DiskKVStore(kv / "fusionrag"))
        with caplog.at_level(logging.WARNING):
            first = served.answer(QUESTION, k=3, sampling=GREEDY)[0]  # NOTE: on main: OSError EROFS
            second = served.answer(QUESTION, k=3, sampling=GREEDY)[0]
        for generation in (first, second):
            assert set(generation.cache_misses) == {victim}, generation.cache_misses
            reason = generation.cache_misses[victim]
            assert "left in place" in reason and "read-only" in reason and str(kv / "fusionrag") in reason, reason
        logged = [r.getMessage() for r in caplog.records if victim in r.getMessage()]
        assert len(logged) == len(VARIANTS), "once per blob, not per request"
        assert all("read-only" in m and str(kv / "fusionrag") in m for m in logged), logged
        assert all(served.store.has(victim, v) for v in VARIANTS), "nothing was moved"
        assert _asker(served)()["reused_tokens"] > 0, "the read-only content index finds the chunks"

    store.delete(victim)
    absent = index.answer(QUESTION, k=3, sampling=GREEDY)[0]
    assert absent.text == first.text and torch.allclose(absent.first_token_logits, first.first_token_logits)


def test_the_cli_on_a_read_only_data_dir_refuses_in_one_line_naming_it(
    engine: FusionEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "lamp.md"
    doc.write_text(TEXTS[0])
    assert cli.main(["--db", str(tmp_path / "db"), *INGEST, str(doc)], engine_factory=lambda _: engine) == 0
    capsys.readouterr()
    with read_only(tmp_path / "db", tmp_path / "ro") as ro:
        for argv in (["ask", QUESTION], [*INGEST, str(doc)], ["verify"], ["delete", str(doc)]):
            code = cli.main(["--db", str(ro), *argv], engine_factory=lambda _: engine)
            err = capsys.readouterr().err.strip()
            assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (argv, err)
            assert err.startswith("fusionrag: error:") and str((ro / "chroma").resolve()) in err, err
            assert "read-only" in err and "chroma run" in err, err


def test_a_langchain_vector_store_in_a_read_only_directory_names_it(engine: FusionEngine, tmp_path: Path) -> None:
    def open_store(directory: Path) -> FusionRAGVectorStore:
        return FusionRAGVectorStore(collection_name="docs", persist_directory=str(directory), engine=engine,
                                    config=CONFIG)

    open_store(tmp_path / "db" / "chroma")
    with read_only(tmp_path / "db", tmp_path / "ro") as ro:
        for _ in range(2):  # NOTE: a second open used to fail inside chromadb (AttributeError)
            with pytest.raises(FusionRAGError, match="read-only") as raised:
                open_store(ro / "chroma")
            assert str((ro / "chroma").resolve()) in str(raised.value)
        with pytest.raises(FusionRAGError, match="read-only") as raised:
            open_store(ro / "new")
        assert str((ro / "new").resolve()) in str(raised.value)


@pytest.mark.servers
def test_a_read_only_data_dir_serves_through_a_chroma_server_and_refuses_writes_in_one_line(
    engine: FusionEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "lamp.md"
    doc.write_text(TEXTS[0])
    db = tmp_path / "db"
    assert cli.main(["--db", str(db), *INGEST, str(doc)], engine_factory=lambda _: engine) == 0
    capsys.readouterr()
    with read_only(db, tmp_path / "ro") as ro, running_chroma_server(db / "chroma") as url:
        served = ["--db", str(ro), "--chroma-url", url]
        assert cli.main([*served, "ask", QUESTION], engine_factory=lambda _: engine) == 0
        assert "cache misses 0" in capsys.readouterr().out
        code = cli.main([*served, *INGEST, str(doc)], engine_factory=lambda _: engine)
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and str(ro / "kv") in err, err
