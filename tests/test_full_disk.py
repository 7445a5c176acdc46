"""A real full filesystem never costs an answer, and leaves nothing half-written.

The learned caches and the ingest write to a 2 MB tmpfs the test mounts and fills (root only;
skipped otherwise). Defects pinned here:

* a LangChain chain whose `learned_dir` was on a full disk answered its first request (the failed
  open was reported) but left an empty `lru.sqlite`; every later request then opened it, SQLite's
  `PRAGMA journal_mode=WAL` raised "database or disk is full" outside the best-effort path, and the
  invoke failed;
* learned caches made while there was room, reopened once the disk was full (a new process), failed
  the same way ("disk I/O error": SQLite cannot make the WAL's shared-memory file).

A disk that fills while learning (the blob write meets ENOSPC) was already handled; it is pinned
here on a real full disk too.

A 2-layer random Llama over the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import AIMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InsufficientSpaceError
from fusionrag_core.index import FusionIndex, IngestConfig
from fusionrag_core.reuse import learned as learned_module
from fusionrag_core.reuse.learned import LearnedCaches
from fusionrag_integrations.langchain import ChatFusionRAG
from tests.filesystems import files_under, fill, small_tmpfs
from tests.ingest_worker import tiny_engine
from tests.lighthouse import QUESTION, TEXTS

PROMPT = ChatPromptTemplate.from_messages([("system", "Answer from the context.\n\n{context}"),
                                           ("human", "{question}")])


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MB tmpfs, empty (fill it with `fill`)."""
    with small_tmpfs(tmp_path / "disk") as root:
        yield root


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's open learned caches start empty and are closed after the test (as a process
    that ends closes them), so the tmpfs holds no open file when it is unmounted."""
    opened: OrderedDict[Path, LearnedCaches] = OrderedDict()
    monkeypatch.setattr(learned_module, "_open", opened)
    yield
    for learned in list(opened.values()):
        learned.close()


def _chain(chat: ChatFusionRAG, texts: Sequence[str]) -> Any:
    vector_store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    vector_store.add_documents([Document(page_content=t) for t in texts])
    retriever = vector_store.as_retriever(search_kwargs={"k": len(texts)})
    return ({"context": retriever | (lambda docs: "\n\n".join(d.page_content for d in docs)),
             "question": RunnablePassthrough()} | PROMPT | chat)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _consistent(learned: LearnedCaches) -> None:
    """Every learned blob has its LRU row and its content-index row, and no row lacks its blob."""
    blobs = learned.store.list_ids()
    with learned._lock:
        rows = {c for (c,) in learned._db.execute("SELECT chunk_id FROM learned")}
    assert blobs == rows == learned.index.chunk_ids(), (blobs, rows, learned.index.chunk_ids())
    assert [p for p in learned.store.root.rglob("*.tmp")] == []


def test_a_chain_learning_on_a_full_disk_answers_warns_once_leaves_nothing_and_learns_once_freed(
        engine: FusionEngine, disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    filler = fill(disk)
    chat = ChatFusionRAG(engine=engine, max_tokens=2, learned_dir=str(disk / "learned"))
    chain = _chain(chat, TEXTS[:3])
    with caplog.at_level(logging.WARNING):
        answers = [chain.invoke(QUESTION) for _ in range(3)]
    assert all(isinstance(a, AIMessage) and a.response_metadata["cache_misses"] == 3 for a in answers)
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "database or disk is full" in warnings[0] and str((disk / "learned").resolve()) in warnings[0]
    assert files_under(disk) == []  # NOTE: no empty lru.sqlite that the next request would open
    filler.unlink()  # room again: the next request learns, the one after reuses
    chain.invoke(QUESTION)
    assert chain.invoke(QUESTION).response_metadata["kv_learned_hits"] == 3


def test_learned_caches_reopened_on_a_full_disk_cost_no_answer_and_are_reused_once_freed(
        engine: FusionEngine, disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = ChatFusionRAG(engine=engine, max_tokens=2, learned_dir=str(disk / "learned"))
    _chain(first, TEXTS[:3]).invoke(QUESTION)
    learned = first.reuse_session().learned()
    assert learned is not None and len(learned) == 3
    learned.close()  # NOTE: as the process that learned them ends
    learned_module._open.clear()
    kept = files_under(disk)
    filler = fill(disk)
    chat = ChatFusionRAG(engine=engine, max_tokens=2, learned_dir=str(disk / "learned"))
    chain = _chain(chat, TEXTS[:3])
    with caplog.at_level(logging.WARNING):
        answers = [chain.invoke(QUESTION) for _ in range(3)]
    assert all(isinstance(a, AIMessage) for a in answers)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and str((disk / "learned").resolve()) in warnings[0], warnings
    # NOTE: SQLite's own empty -wal/-shm files may stay (it removes them at the next clean close)
    assert [p for p in files_under(disk) if not p.name.endswith(("-wal", "-shm"))] == kept
    filler.unlink()
    assert chain.invoke(QUESTION).response_metadata["kv_learned_hits"] == 3


def test_a_disk_that_fills_while_learning_costs_no_answer_and_leaves_no_cache_without_its_rows(
        engine: FusionEngine, disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    chat = ChatFusionRAG(engine=engine, max_tokens=2, learned_dir=str(disk / "learned"))
    _chain(chat, TEXTS[:2]).invoke(QUESTION)
    learned = chat.reuse_session().learned()
    assert learned is not None and len(learned) == 2
    filler = fill(disk)
    chain = _chain(chat, TEXTS[2:])
    with caplog.at_level(logging.WARNING):
        answers = [chain.invoke(QUESTION) for _ in range(3)]
    assert all(isinstance(a, AIMessage) and a.response_metadata["cache_misses"] == 2 for a in answers)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and str((disk / "learned").resolve()) in warnings[0], warnings
    assert len(learned) == 2
    _consistent(learned)
    filler.unlink()
    chain.invoke(QUESTION)
    assert len(learned) == 4
    _consistent(learned)


# ---- ingest onto a full disk ---------------------------------------------------------------------------
CORPUS = [f"{text} Copy {i}." for i in range(10) for text in TEXTS]
"""40 documents: ~0.9 MB of caches of the tiny model, which a 2 MB tmpfs holds beside Chroma's files."""


def _open_index(engine: FusionEngine, data_dir: Path) -> FusionIndex:
    return FusionIndex.open(engine, data_dir, collection_name="docs",
                            config=IngestConfig(chunk_tokens=48, neighbours=2))


def _leave_room(filler: Path, room: int) -> None:
    with open(filler, "r+b") as f:
        f.truncate(max(0, filler.stat().st_size - room))


def _no_entry_without_its_caches(index: FusionIndex) -> None:
    report = index.verify(repair=False)  # NOTE: takes the writer lock: on a full disk too
    assert report.missing == report.corrupt == report.mismatched == 0, report
    assert [p for p in (index.data_dir or Path()).rglob("*.tmp")] == []


@pytest.mark.parametrize("room", [0, 1_000_000, 1_400_000], ids=["no-room", "room-for-blobs", "room-for-some"])
def test_an_ingest_onto_a_full_disk_stops_with_a_clear_error_and_resumes_once_freed(
        engine: FusionEngine, disk: Path, room: int) -> None:
    # NOTE: with no room the writer lock's holder record cannot be written; with room for the blobs
    # Chroma's own database fills; with room for some, a blob write meets ENOSPC.
    index = _open_index(engine, disk)
    try:
        filler = fill(disk)
        _leave_room(filler, room)
        with pytest.raises(InsufficientSpaceError, match="full") as stopped:
            index.add_texts(CORPUS, space_check=False)  # NOTE: a disk can fill past the check (other writers)
        assert str(disk) in str(stopped.value) and "again" in str(stopped.value), stopped.value
        _no_entry_without_its_caches(index)
        index.close()
        filler.unlink()
        index = _open_index(engine, disk)
        report = index.add_texts(CORPUS)
        assert len(index) == len(report.doc_ids) == len(CORPUS)
        assert index.verify(repair=False).ok
    finally:
        index.close()


def test_an_index_opened_on_a_full_disk_is_refused_with_a_clear_error_and_opens_once_freed(
        engine: FusionEngine, disk: Path) -> None:
    filler = fill(disk)
    with pytest.raises(InsufficientSpaceError, match="full") as refused:
        _open_index(engine, disk)
    assert str(disk) in str(refused.value), refused.value
    assert [p for p in files_under(disk) if p.suffix == ".tmp"] == []
    filler.unlink()
    index = _open_index(engine, disk)
    try:
        index.add_texts(CORPUS[:4])
        assert len(index) == 4
    finally:
        index.close()
