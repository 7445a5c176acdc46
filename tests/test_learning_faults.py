"""Learning from traffic never costs an answer, and no model reads caches it can never reuse.

Defects pinned here:

* a full disk (ENOSPC, EDQUOT...) under the learned caches made every request raise after decoding,
  so the answer was lost; learning is best-effort: the answer comes, the cache is skipped, one
  warning per cause says why and where, and no blob is left without its index rows;
* `LearnConfig(storage_dtype="int8")` raised `KeyError: 'int8'` after decoding (the byte
  accounting knew only the float formats);
* a model pointed at another model's store or learned caches warned on every request, relearned
  every request and reused nothing; it is refused with `CacheMismatchError` when its session is
  made (at construction for `engine=`, at the first request for a lazily loaded `model=`);
* `ChatFusionRAG(engine=..., data_dir=...)` (and the LlamaIndex `FusionRAGLLM`) read no store.

A 2-layer random Llama over the real SmolLM2 tokenizer; another seed is "another model".
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
from collections.abc import Iterator
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

from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.errors import CacheMismatchError
from fusionrag_core.index import FusionIndex, IngestConfig
from fusionrag_core.paths import kv_dir
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.recognise.content_index import ContentIndex
from fusionrag_core.reuse.learned import LearnConfig, LearnedCaches
from fusionrag_core.reuse.learning import learn_pieces
from fusionrag_core.reuse.sources import ReuseSources
from fusionrag_core.store import DiskKVStore
from fusionrag_core.store.redis import RedisKVStore
from fusionrag_integrations.langchain import ChatFusionRAG
from fusionrag_integrations.llama_index import FusionRAGLLM
from tests.ingest_worker import tiny_engine
from tests.lighthouse import QUESTION, TEXTS
from tests.servers import running_redis_server

SAMPLING = SamplingConfig(max_new_tokens=3)
COLLECTION = "docs"
PROMPT = ChatPromptTemplate.from_messages([("system", "Answer from the context.\n\n{context}"),
                                           ("human", "{question}")])
CONTEXT = "\n\n".join(TEXTS)
MESSAGES = [{"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": f"Context:\n{CONTEXT}\n\nQuestion: {QUESTION}"}]


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer)


@pytest.fixture(scope="module")
def other(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer, seed=1)


def _ingested(engine: FusionEngine, data_dir: Path) -> Path:
    index = FusionIndex.open(engine, data_dir, collection_name=COLLECTION,
                             config=IngestConfig(chunk_tokens=48, neighbours=2))
    index.add_texts(TEXTS)
    return data_dir


@pytest.fixture(scope="module")
def ours(engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory whose collection `docs` this test's model ingested."""
    return _ingested(engine, tmp_path_factory.mktemp("ours"))


@pytest.fixture(scope="module")
def theirs(other: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory whose collection `docs` another model ingested."""
    return _ingested(other, tmp_path_factory.mktemp("theirs"))


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _fail_fsync_under(monkeypatch: pytest.MonkeyPatch, root: Path, code: int) -> None:
    """Every fsync of a file under `root` fails with `code`, as a full disk does once the written
    bytes must reach it; other files (the test's own, the corpus) are untouched."""
    real = os.fsync
    root = root.resolve()

    def fsync(fd: int) -> None:
        if Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(root):
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)



def answer_and_learn(engine: FusionEngine, prompt: FusionPrompt, sources: ReuseSources) -> Generation:
    """Answer `prompt` reading `sources`, then learn what it held without a cache, as `ReuseSession.run` does."""
    generation = engine.generate(prompt, store=sources, sampling=SAMPLING)
    assert sources.learned is not None
    learn_pieces(engine, sources.learned, sources.pending)
    return generation

def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ---- a full disk under the learned caches -------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_a_full_disk_skips_learning_with_one_warning_and_every_answer_comes(
        engine: FusionEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        code: int) -> None:
    learned = LearnedCaches(tmp_path / "learned", engine.fingerprint)
    sources = ReuseSources(None, learned)
    expected = engine.generate(sources.prompt(engine, MESSAGES), store=sources, sampling=SAMPLING)
    _fail_fsync_under(monkeypatch, learned.root, code)
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        for _ in range(3):
            prompt = sources.prompt(engine, MESSAGES, documents=TEXTS)
            generation = answer_and_learn(engine, prompt, sources)
            assert generation.token_ids == expected.token_ids and len(sources.pending) == len(TEXTS)
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert os.strerror(code) in warnings[0] and str(learned.root) in warnings[0]
    assert len(learned) == 0 and _files(learned.root / "kv") == []  # no blob, no temp file
    assert learned.index.find(CONTEXT) == []
    monkeypatch.undo()  # room again: learning resumes
    prompt = sources.prompt(engine, MESSAGES, documents=TEXTS)
    answer_and_learn(engine, prompt, sources)
    assert len(learned) == len(TEXTS)


def test_a_full_index_database_leaves_no_blob_without_its_rows(
        engine: FusionEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    learned = LearnedCaches(tmp_path / "learned", engine.fingerprint)
    sources = ReuseSources(None, learned)

    def full(self: ContentIndex, entries: Any, **kwargs: Any) -> int:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(ContentIndex, "add", full)
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        for _ in range(2):
            prompt = sources.prompt(engine, MESSAGES, documents=TEXTS)
            answer_and_learn(engine, prompt, sources)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "database or disk is full" in warnings[0], warnings
    assert len(learned) == 0 and learned.store.list_ids() == set()


def test_a_content_index_at_its_page_limit_leaves_no_learned_blob_without_its_rows(
        engine: FusionEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # NOTE: SQLite's own SQLITE_FULL, the error a full disk gives: the index's open connection is
    # capped at its pages (until it reconnects) and filled with rows of no chunk. The index skipped
    # the learned row with a warning of its own and the blob stayed: a cache no prompt could find.
    learned = LearnedCaches(tmp_path / "learned", engine.fingerprint)
    sources = ReuseSources(None, learned)
    junk: set[str] = set()
    with learned.index._lock:
        db = learned.index._connection()
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
        for size in (1000, 100, 10, 1):
            with contextlib.suppress(sqlite3.OperationalError):
                while True:
                    with db:
                        db.execute("INSERT INTO anchors VALUES (?, ?, 0, 0, 0, 0)",
                                   (len(junk), "j" * size + str(len(junk))))
                    junk.add("j" * size + str(len(junk)))
    with caplog.at_level(logging.WARNING):
        prompt = sources.prompt(engine, MESSAGES, documents=TEXTS)
        answer_and_learn(engine, prompt, sources)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "database or disk is full" in warnings[0], warnings
    with learned._lock:
        rows = {c for (c,) in learned._db.execute("SELECT chunk_id FROM learned")}
    assert learned.store.list_ids() == rows == learned.index.chunk_ids() - junk


def _retriever_chain(chat: ChatFusionRAG) -> Any:
    vector_store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    vector_store.add_documents([Document(page_content=t) for t in TEXTS])
    retriever = vector_store.as_retriever(search_kwargs={"k": 3})
    return ({"context": retriever | (lambda docs: "\n\n".join(d.page_content for d in docs)),
             "question": RunnablePassthrough()} | PROMPT | chat)


def test_a_full_disk_costs_a_langchain_chain_no_answer_and_warns_once(
        engine: FusionEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    chat = ChatFusionRAG(engine=engine, store=DiskKVStore(tmp_path / "kv"), max_tokens=2,
                         learned_dir=str(tmp_path / "learned"))
    chain = _retriever_chain(chat)
    _fail_fsync_under(monkeypatch, tmp_path / "learned", errno.ENOSPC)
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        answers = [chain.invoke(QUESTION) for _ in range(3)]
    # NOTE: nothing could be learned, so nothing is reused; every answer still comes
    assert all(isinstance(a, AIMessage) and a.response_metadata["reused_tokens"] == 0 for a in answers)
    warnings = [w for w in _warnings(caplog) if os.strerror(errno.ENOSPC) in w]
    assert len(warnings) == 1 and str((tmp_path / "learned").resolve()) in warnings[0], _warnings(caplog)
    assert [p for p in _files(tmp_path / "learned") if p.suffix in (".safetensors", ".tmp")] == []


def test_a_learned_dir_that_cannot_be_made_costs_no_answer_and_warns_once(
        engine: FusionEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("not a directory")
    chat = ChatFusionRAG(engine=engine, store=DiskKVStore(tmp_path / "kv"), max_tokens=2,
                         learned_dir=str(tmp_path / "file" / "learned"))
    chain = _retriever_chain(chat)
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        answers = [chain.invoke(QUESTION) for _ in range(2)]
    assert all(isinstance(a, AIMessage) for a in answers)
    warnings = [w for w in _warnings(caplog) if "learned" in w and str(tmp_path / "file") in w]
    assert len(warnings) == 1, _warnings(caplog)


# ---- 8-bit learned caches -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_8bit_learned_caches_are_kept_and_reused(engine: FusionEngine, tmp_path: Path, dtype: Any) -> None:
    learned = LearnedCaches(tmp_path, engine.fingerprint, LearnConfig(storage_dtype=dtype))
    sources = ReuseSources(None, learned)
    answer_and_learn(engine, sources.prompt(engine, MESSAGES, documents=TEXTS), sources)
    assert len(learned) == len(TEXTS) and len(sources.pending) == len(TEXTS)
    second = engine.generate(ReuseSources(None, learned).prompt(engine, MESSAGES), store=sources, sampling=SAMPLING)
    assert second.reused_tokens > 0 and second.cache_misses == {}
    assert learned.nbytes == sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*.safetensors"))


# ---- another model's caches -------------------------------------------------------------------------------
def test_another_models_store_is_refused_at_construction_in_both_frameworks(engine: FusionEngine,
                                                                            theirs: Path) -> None:
    kv = kv_dir(theirs, COLLECTION)
    makes = [
        lambda: ChatFusionRAG(engine=engine, data_dir=str(theirs), collection_name=COLLECTION),
        lambda: ChatFusionRAG(engine=engine, store=DiskKVStore(kv)),
        lambda: FusionRAGLLM(engine=engine, data_dir=str(theirs), collection_name=COLLECTION),
        lambda: FusionRAGLLM(engine=engine, store=str(kv)),
        lambda: FusionRAGLLM(engine=engine, kv_store=DiskKVStore(kv)),
    ]
    for make in makes:
        with pytest.raises(CacheMismatchError, match="another model") as refused:
            make()
        assert engine.fingerprint[:12] in str(refused.value) and "data_dir" in str(refused.value)
    assert not (theirs / "learned").exists()


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with running_redis_server() as url:
        yield url


def _redis_namespace(engine: FusionEngine, data_dir: Path, redis_url: str) -> str:
    """The namespace of a corpus `engine` ingested into Redis."""
    index = FusionIndex.open(engine, data_dir, redis_url=redis_url, collection_name=COLLECTION,
                             config=IngestConfig(chunk_tokens=48, neighbours=2))
    try:
        index.add_texts(TEXTS)
        store = index.store.backend
        assert isinstance(store, RedisKVStore)
        return store.namespace
    finally:
        index.close()


def test_another_models_redis_store_is_refused_at_construction_as_a_disk_store_is(
        engine: FusionEngine, other: FusionEngine, redis_url: str, tmp_path: Path) -> None:
    theirs = RedisKVStore(redis_url, namespace=_redis_namespace(other, tmp_path / "theirs", redis_url))
    makes = [
        lambda: ChatFusionRAG(engine=engine, store=theirs),
        lambda: FusionRAGLLM(engine=engine, kv_store=theirs),
    ]
    for make in makes:
        with pytest.raises(CacheMismatchError, match="another model") as refused:
            make()
        assert engine.fingerprint[:12] in str(refused.value) and "data_dir" in str(refused.value)
    assert theirs.stored_fingerprints() == {other.fingerprint}
    ours = RedisKVStore(redis_url, namespace=_redis_namespace(engine, tmp_path / "ours", redis_url))
    assert ours.stored_fingerprints() == {engine.fingerprint}
    ChatFusionRAG(engine=engine, store=ours)  # NOTE: this model's caches are accepted
    assert RedisKVStore(redis_url, namespace="empty").stored_fingerprints() == set()


def test_a_lazily_loaded_model_refuses_another_models_store_at_its_first_request(
        engine: FusionEngine, theirs: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(FusionEngine, "from_pretrained", staticmethod(lambda *args, **kwargs: engine))
    chat = ChatFusionRAG(model="tiny", data_dir=str(theirs), collection_name=COLLECTION, max_tokens=2)
    chain = PROMPT | chat
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        for _ in range(2):
            with pytest.raises(CacheMismatchError, match="another model"):
                chain.invoke({"context": CONTEXT, "question": QUESTION})
    assert _warnings(caplog) == [] and not (theirs / "learned").exists()


def test_another_models_learned_caches_are_refused_when_opened(engine: FusionEngine, other: FusionEngine,
                                                               tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    theirs = LearnedCaches(shared, other.fingerprint)
    sources = ReuseSources(None, theirs)
    answer_and_learn(other, sources.prompt(other, MESSAGES, documents=TEXTS), sources)
    assert len(theirs) == len(TEXTS)
    with pytest.raises(CacheMismatchError, match="learned_dir"):
        LearnedCaches(shared, engine.fingerprint)
    for make in (lambda: ChatFusionRAG(engine=engine, learned_dir=str(shared)),
                 lambda: FusionRAGLLM(engine=engine, learned_dir=str(shared))):
        with pytest.raises(CacheMismatchError, match="learned_dir"):
            make()


# ---- an engine with a data directory ----------------------------------------------------------------------
def test_an_engine_with_a_data_dir_reads_its_store_in_both_frameworks(engine: FusionEngine, ours: Path,
                                                                      tmp_path: Path) -> None:
    where = {"data_dir": str(ours), "collection_name": COLLECTION, "learned_dir": str(tmp_path / "learned")}
    chat = ChatFusionRAG(engine=engine, max_tokens=2, **where)
    store = chat.kv_store()
    assert isinstance(store, DiskKVStore) and store.root == kv_dir(ours, COLLECTION).resolve()
    meta = (PROMPT | chat).invoke({"context": CONTEXT, "question": QUESTION}).response_metadata
    assert meta["reused_tokens"] > 0 and meta["cache_misses"] == 0, meta
    llm = FusionRAGLLM(engine=engine, max_new_tokens=2, **where)
    stats = llm.complete(f"Context:\n{CONTEXT}\n\nQuestion: {QUESTION}").additional_kwargs
    assert stats["reused_tokens"] > 0 and stats["cache_misses"] == 0, stats


@pytest.fixture
def no_default_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    assert not (tmp_path / "fusionrag-data").exists()


def test_an_engine_without_a_data_dir_or_store_reads_no_store(engine: FusionEngine,
                                                              no_default_data_dir: Path) -> None:
    assert ChatFusionRAG(engine=engine).kv_store() is None
    assert FusionRAGLLM(engine=engine).kv_store is None
