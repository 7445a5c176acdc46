"""One embedded Chroma database, several processes.

Embedded Chroma keeps its vector index in the memory of the process that opened it: a process
serving a directory never saw another process's writes there (a deleted chunk was still found,
with text '', and `answer` failed deep in the prompt; a new chunk was counted but never found, even
after re-opening the index). The defect pinned here: a write while another process has the
directory open is refused, before anything changes, with an error that says to stop it or run a
Chroma server; opening while another process writes is refused the same way; a hit without text is
never served. Every test runs real processes (the CLI and small scripts, with the tiny engine).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from langchain_core.embeddings import DeterministicFakeEmbedding
from transformers import PreTrainedTokenizerBase

from fusionrag_core import errors
from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest import chroma, claim
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.paths import chroma_dir
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_integrations.langchain import FusionRAGVectorStore
from tests.ingest_worker import tiny_engine
from tests.lighthouse import QUESTION, TEXTS
from tests.servers import running_chroma_server

REPO_ROOT = Path(__file__).resolve().parents[1]
SHORT = SamplingConfig(max_new_tokens=2)
CONFIG = IngestConfig(chunk_tokens=64, neighbours=2)  # NOTE: fits the tiny engine's 2048 positions

pytestmark = pytest.mark.usefixtures("one_thread")

# The `fusionrag` command with the tiny engine: argv[1] the tokenizer directory, the rest the command.
CLI = """
import sys
from fusionrag_core import cli
from tests.ingest_worker import tiny_engine_at
sys.exit(cli.main(sys.argv[2:], engine_factory=lambda spec: tiny_engine_at(sys.argv[1])))
"""

# Holds an index open (argv: tokenizer, data dir) until its stdin closes; with "write", it blocks
# inside an ingest instead, right after the first cache is stored.
HOLDER = """
import sys
from fusionrag_core.index import FusionIndex
from tests.ingest_worker import tiny_engine_at
index = FusionIndex.open(tiny_engine_at(sys.argv[1]), sys.argv[2])
if sys.argv[3] == "write":
    put, waited = index.store.put, []
    def put_then_wait(chunk_id, kv):
        put(chunk_id, kv)
        if not waited:
            waited.append(chunk_id)
            print("writing", flush=True)
            sys.stdin.readline()
    index.store.put = put_then_wait
    index.add_texts([sys.argv[4]], doc_ids=["written"])
    print("written", flush=True)
else:
    print("open", flush=True)
sys.stdin.readline()
"""

# Claims the directory argv[1], tries to write alone, and says how that went; then waits for stdin.
CLAIM_THEN_WRITE = """
import sys
from fusionrag_core.errors import DatabaseInUseError
from fusionrag_core.ingest import claim
held = claim.claim(sys.argv[1])
try:
    with held.sole("ingest"):
        print("alone", flush=True)
except DatabaseInUseError:
    print("refused", flush=True)
sys.stdin.readline()
"""

# Opens the index (argv: tokenizer, data dir, question) and prints its size and the ids found.
SEARCH = """
import json, sys
from fusionrag_core.index import FusionIndex
from tests.ingest_worker import tiny_engine_at
index = FusionIndex.open(tiny_engine_at(sys.argv[1]), sys.argv[2])
print(json.dumps({"count": len(index), "ids": [h.chunk_id for h in index.search(sys.argv[3], 10)]}))
"""


@pytest.fixture
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


def _python(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)


def _fusionrag(tokenizer_path: Path, db: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return _python(CLI, str(tokenizer_path), "--db", str(db), *argv)


class Holder:
    """A process that holds `db` open (or sits in the middle of an ingest) until `stop()`."""

    def __init__(self, tokenizer_path: Path, db: Path, mode: str = "open", text: str = "") -> None:
        self.process = subprocess.Popen([sys.executable, "-c", HOLDER, str(tokenizer_path), str(db), mode, text],
                                        cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self.pid = self.process.pid

    def wait_for(self, line: str) -> None:
        assert self.process.stdout is not None
        got = self.process.stdout.readline().strip()
        if got != line:
            self.process.kill()
            raise AssertionError(f"holder said {got!r}, not {line!r}: {self.process.communicate()[1][-3000:]}")

    def go_on(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.communicate("\n\n", timeout=120)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.communicate(timeout=60)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for holder in started:
        if holder.process.poll() is None:
            holder.kill()


def _one_line_refusal(run: subprocess.CompletedProcess[str], db: Path, *pids: int) -> str:
    assert run.returncode == 2, f"exit {run.returncode}: {run.stdout[-2000:]} {run.stderr[-3000:]}"
    # NOTE: the other lines are the tiny engine's progress bar (transformers building it)
    lines = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("fusionrag: error:"), run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    line = lines[0]
    assert str(chroma_dir(db).resolve()) in line and "chroma run" in line and "--chroma-url" in line, line
    for pid in pids:
        assert f"pid {pid}" in line, line
    return line


def test_a_write_while_another_process_serves_is_refused(
    engine: FusionEngine, tokenizer_path: Path, tmp_path: Path
) -> None:
    """The issue's scenario: process A (this one) serves; `fusionrag delete`/`ingest` in a shell."""
    db = tmp_path / "db"
    index = FusionIndex.open(engine, db, config=CONFIG)
    index.add_texts(TEXTS[:2], doc_ids=["a", "b"])
    b_chunks = {h.chunk_id for h in index.search(TEXTS[1], 10) if h.text == TEXTS[1]}
    assert b_chunks
    (tmp_path / "new.md").write_text(TEXTS[2])

    _one_line_refusal(_fusionrag(tokenizer_path, db, "delete", "b"), db, os.getpid())
    _one_line_refusal(_fusionrag(tokenizer_path, db, "ingest", "--quiet", str(tmp_path / "new.md")), db, os.getpid())
    checked = _fusionrag(tokenizer_path, db, "verify", "--no-repair")
    assert checked.returncode == 0 and "OK" in checked.stdout, "reading beside a serving process is fine"

    # nothing changed under A, which still answers from both documents
    hits = index.search(QUESTION, 10)
    assert len(index) == 2 and {h.text for h in hits} == set(TEXTS[:2])
    generation, used = index.answer(QUESTION, sampling=SHORT)
    assert generation.text is not None and all(h.text for h in used)

    index.close()
    index.close()  # idempotent
    assert _fusionrag(tokenizer_path, db, "delete", "b").returncode == 0
    ingested = _fusionrag(tokenizer_path, db, "ingest", "--quiet", str(tmp_path / "new.md"))
    assert ingested.returncode == 0, ingested.stderr[-3000:]

    # re-opened in this process: b is gone, the new chunk is found
    with FusionIndex.open(engine, db) as reopened:
        hits = reopened.search(QUESTION, 10)
        assert len(reopened) == 2 and {h.text for h in hits} == {TEXTS[0], TEXTS[2]}
        assert not b_chunks & {h.chunk_id for h in hits}


def test_open_while_another_process_writes_is_refused(
    engine: FusionEngine, tokenizer_path: Path, tmp_path: Path, holders: list[Holder]
) -> None:
    db = tmp_path / "db"
    with FusionIndex.open(engine, db, config=CONFIG) as index:
        index.add_texts(TEXTS[:1])
    writer = Holder(tokenizer_path, db, "write", TEXTS[1])
    holders.append(writer)
    writer.wait_for("writing")
    with pytest.raises(errors.FusionRAGError, match=f"pid {writer.pid}") as refused:
        FusionIndex.open(engine, db)
    assert isinstance(refused.value, errors.DatabaseInUseError)
    assert "writing" in str(refused.value) and "--chroma-url" in str(refused.value)
    with pytest.raises(errors.DatabaseInUseError):
        chroma.open_collection(chroma.VectorDBConfig(path=str(chroma_dir(db))))

    writer.go_on()
    writer.wait_for("written")
    # the writer still has it open (shared): a reader may open it, and sees the whole write
    found = json.loads(_python(SEARCH, str(tokenizer_path), str(db), QUESTION).stdout)
    assert found["count"] == 2 and len(found["ids"]) == 2
    writer.stop()
    with FusionIndex.open(engine, db) as index:
        assert {h.text for h in index.search(QUESTION, 10)} == set(TEXTS[:2])


def test_the_refusal_names_live_holders_only_and_a_dead_one_blocks_nothing(
    engine: FusionEngine, tokenizer_path: Path, tmp_path: Path, holders: list[Holder]
) -> None:
    db = tmp_path / "db"
    with FusionIndex.open(engine, db, config=CONFIG) as index:
        index.add_texts(TEXTS[:1])
    dead, alive = Holder(tokenizer_path, db), Holder(tokenizer_path, db)
    holders += [dead, alive]
    dead.wait_for("open")
    alive.wait_for("open")
    dead.kill()

    index = FusionIndex.open(engine, db)
    with pytest.raises(errors.FusionRAGError, match=f"pid {alive.pid}") as refused:
        index.add_texts(TEXTS[1:2])
    assert f"pid {dead.pid}" not in str(refused.value)
    assert f"pid {os.getpid()}" not in str(refused.value), "this process is not another holder"
    assert len(index) == 1, "refused before anything changed"
    with pytest.raises(errors.DatabaseInUseError):
        index.delete([next(iter(index.document_ids()))])

    alive.stop()
    assert index.add_texts(TEXTS[1:2]).new_chunks == 1, "a killed holder's claim died with it"
    index.close()


def test_one_process_may_open_a_database_many_times(engine: FusionEngine, tmp_path: Path) -> None:
    db = tmp_path / "db"
    first = FusionIndex.open(engine, db, config=CONFIG)
    second = FusionIndex.open(engine, db)
    bare = chroma.open_collection(chroma.VectorDBConfig(path=str(chroma_dir(db))))
    first.add_texts(TEXTS[:1])
    second.add_texts(TEXTS[1:2])
    assert len(first) == len(second) == bare.count() == 2
    first.close()
    assert {h.text for h in second.search(QUESTION, 10)} == set(TEXTS[:2]), "the other index still works"
    second.close()
    with pytest.raises(errors.InvalidRequestError, match="closed"):
        second.search(QUESTION)


def test_a_hit_without_text_is_never_served(
    engine: FusionEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with FusionIndex.open(engine, tmp_path / "db", config=CONFIG) as index:
        index.add_texts(TEXTS[:2])
        hit = index.search(TEXTS[1], 1)[0]
        # NOTE: an entry whose text is gone, as a stale vector index finds it (the embedding is kept)
        kept = index.collection.get(ids=[hit.chunk_id], include=["embeddings"])["embeddings"]
        index.collection.update(ids=[hit.chunk_id], documents=[""], embeddings=kept)
        with caplog.at_level(logging.WARNING):
            hits = index.search(QUESTION, 10)
            generation, used = index.answer(QUESTION, sampling=SHORT)
        assert [h.text for h in hits] == [TEXTS[0]] and [h.text for h in used] == [TEXTS[0]]
        assert generation.text is not None
        assert hit.chunk_id in caplog.text and "no text" in caplog.text


def test_a_refused_write_keeps_its_claim(tmp_path: Path) -> None:
    """Upgrading to a sole claim fails without losing the shared one (else two refused writers could
    let a third process write under the first)."""
    mine = claim.claim(tmp_path)
    other = subprocess.Popen([sys.executable, "-c", CLAIM_THEN_WRITE, str(tmp_path)], cwd=REPO_ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "refused"
        with pytest.raises(errors.DatabaseInUseError, match=f"pid {other.pid}"), mine.sole("delete"):
            pass
    finally:
        other.communicate("\n", timeout=60)
    with mine.sole("delete"):
        assert claim.holders(tmp_path) == []
    mine.release()
    mine.release()


@pytest.mark.servers
def test_processes_share_a_corpus_through_a_chroma_server(
    engine: FusionEngine, tokenizer_path: Path, tmp_path: Path
) -> None:
    """The way the refusal points to: a Chroma server; nothing is claimed, and A sees B's writes."""
    db = tmp_path / "db"
    with running_chroma_server(tmp_path / "server") as url, \
            FusionIndex.open(engine, db, chroma_url=url, config=CONFIG) as index:
        index.add_texts(TEXTS[:2], doc_ids=["a", "b"])
        deleted = _fusionrag(tokenizer_path, db, "--chroma-url", url, "delete", "b")
        assert deleted.returncode == 0, deleted.stderr[-3000:]
        assert {h.text for h in index.search(QUESTION, 10)} == {TEXTS[0]} and len(index) == 1
        assert not (chroma_dir(db) / claim.CLAIM_FILE).exists()


# Claims the directory argv[1] as opening an index does (no waiting), says whether it could, and lets go.
TRY_TO_OPEN = """
import sys
from fusionrag_core.errors import DatabaseInUseError
from fusionrag_core.ingest import claim
try:
    claim.claim(sys.argv[1]).release()
    print("open", flush=True)
except DatabaseInUseError:
    print("refused", flush=True)
"""


def _vector_store(engine: FusionEngine, db: Path) -> FusionRAGVectorStore:
    store = FusionRAGVectorStore(collection_name="corpus", persist_directory=chroma_dir(db), engine=engine,
                                 config=CONFIG, embedding_function=DeterministicFakeEmbedding(size=8),
                                 writer_wait_s=0.0)  # NOTE: the default waits for the other processes
    store.add_texts(TEXTS[:2], ids=["a", "b"])
    return store


def test_a_langchain_delete_collection_is_refused_while_another_process_has_the_database_open(
    engine: FusionEngine, tokenizer_path: Path, tmp_path: Path, holders: list[Holder]
) -> None:
    db = tmp_path / "db"
    store = _vector_store(engine, db)
    FusionIndex.open(engine, db, config=CONFIG).close()  # NOTE: the collection the holder serves
    holder = Holder(tokenizer_path, db)
    holders.append(holder)
    holder.wait_for("open")
    with pytest.raises(errors.DatabaseInUseError, match=f"pid {holder.pid}"):
        store.delete_collection()
    assert store.index.document_ids() == {"a", "b"}, "refused before anything changed"
    holder.stop()
    store.delete_collection()
    with pytest.raises(errors.InvalidRequestError, match="reset_collection"):
        store.similarity_search(TEXTS[0])


def test_a_langchain_delete_collection_keeps_the_database_to_itself_until_the_collection_is_gone(
    engine: FusionEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE: the documents were deleted alone, then the collection dropped with the door open: a real
    # process that tried to open the database right between the two got in.
    db = tmp_path / "db"
    store = _vector_store(engine, db)
    delete, tried = FusionIndex.delete, []

    def delete_then_try_to_open(index: FusionIndex, doc_ids: Sequence[str]) -> int:
        removed = delete(index, doc_ids)
        tried.append(_python(TRY_TO_OPEN, str(chroma_dir(db))).stdout.strip())
        return removed

    monkeypatch.setattr(FusionIndex, "delete", delete_then_try_to_open)
    store.delete_collection()
    assert tried == ["refused"]
    assert _python(TRY_TO_OPEN, str(chroma_dir(db))).stdout.strip() == "open"
