"""Faults at the integrations' edges: bad blobs read through LangChain / LlamaIndex, streamed chains
that must learn what they retrieved, and documents holding the private-use characters of marks and
escapes.

A tiny random Llama over the real SmolLM2 tokenizer (the splits are the real ones). Every test here
failed before the fix it pins; each says which defect.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from llama_index.core import VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import TextNode
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.query.prompt import PromptLayout
from fusionrag_core.recognise.marks import MARK_CLOSE, MARK_OPEN, MARK_SEP
from fusionrag_core.reuse.learned import content_id
from fusionrag_core.runtime.compat import tokenize_plain
from fusionrag_core.runtime.kv import VARIANTS, ChunkKV, Variant
from fusionrag_core.store import DiskKVStore, KVStore
from fusionrag_core.store import disk as disk_store
from fusionrag_core.store.content_index import ContentIndex
from fusionrag_core.store.disk import QUARANTINE_DIR
from fusionrag_core.store.tiered import TieredKVStore
from fusionrag_integrations.langchain import ChatFusionRAG, FusionRAGRetriever
from fusionrag_integrations.llama_index import FusionKVTransform, FusionRAGLLM
from tests.ingest_worker import tiny_engine
from tests.lighthouse import QUESTION, TEXTS
from tests.test_reuse_langchain import Results, format_docs

PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Use the following pieces of retrieved context to answer the question.\n\n{context}"),
    ("human", "{question}"),
])
CONFIG = IngestConfig(chunk_tokens=64, neighbours=1)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(tokenizer)


def _warnings(caplog: pytest.LogCaptureFixture, containing: str = "") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and containing in r.getMessage()]


def _tokens(engine: FusionEngine, texts: Sequence[str]) -> int:
    return sum(len(tokenize_plain(engine.tokenizer, t)) for t in texts)


# ---- a corrupt blob read through an integration -----------------------------------------------------
def _truncate(store: DiskKVStore, chunk_id: str) -> None:
    for variant in VARIANTS:
        path = store.path_for(chunk_id, variant)
        path.write_bytes(path.read_bytes()[:100])


def _quarantined(store: DiskKVStore) -> list[Path]:
    where = store.root / QUARANTINE_DIR
    return sorted(where.iterdir()) if where.is_dir() else []


@pytest.fixture
def damaged(engine: FusionEngine, tmp_path: Path) -> tuple[FusionIndex, str]:
    """An index of TEXTS whose second retrieved chunk has both of its blobs truncated."""
    index = FusionIndex.open(engine, tmp_path / "data", config=CONFIG)
    index.add_texts(TEXTS)
    victim = FusionRAGRetriever(index=index, k=3).invoke(QUESTION)[1].id
    assert victim is not None and isinstance(index.store, DiskKVStore)
    _truncate(index.store, victim)
    return index, victim


def _ask_twice(chain: Runnable[Any, Any]) -> list[dict[str, Any]]:
    out = []
    for _ in range(2):
        results = Results()
        chain.invoke(QUESTION, config={"callbacks": [results]})
        out.append(results.metadata())
    return out


@pytest.mark.parametrize("wrapping", ["index", "tiered"])
def test_a_corrupt_blob_read_through_langchain_is_set_aside_once(
        engine: FusionEngine, damaged: tuple[FusionIndex, str], wrapping: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Defect: through ChatFusionRAG the reason said "set aside", but the blob stayed (the request's
    view of the stores could not set it aside) and the warning came back on every request."""
    index, victim = damaged
    assert isinstance(index.store, DiskKVStore)
    if wrapping == "index":
        llm = ChatFusionRAG(index=index, max_tokens=2, learn=False)
    else:
        tiered = TieredKVStore(index.store, device="cpu", dtype=torch.float32, device_bytes=1 << 24, host_bytes=0)
        llm = ChatFusionRAG(engine=engine, store=tiered, max_tokens=2, learn=False)
    chain = {"context": FusionRAGRetriever(index=index, k=3) | format_docs, "question": RunnablePassthrough()}
    with caplog.at_level(logging.WARNING):
        first, second = _ask_twice(chain | PROMPT | llm)
    assert "set aside" in first["cache_miss_reasons"][victim], first["cache_miss_reasons"]
    assert not any(index.store.has(victim, v) for v in VARIANTS), "the bad blobs left the store"
    assert len(_quarantined(index.store)) == 2
    assert len(_warnings(caplog, victim)) == 2, "one warning per blob, on the request that set it aside"
    assert second["cache_miss_reasons"].get(victim, "no cache stored for this chunk id") == (
        "no cache stored for this chunk id")


def test_a_corrupt_blob_read_through_llama_index_is_set_aside_once(
        engine: FusionEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Defect: as through LangChain, for FusionRAGLLM over a FusionKVTransform store."""
    kv = DiskKVStore(tmp_path / "kv")
    nodes = [TextNode(text=t, embedding=[float(i == j) for j in range(4)]) for i, t in enumerate(TEXTS)]
    nodes = list(FusionKVTransform(engine, store=kv, neighbours=1)(nodes))
    victim = nodes[1].node_id
    _truncate(kv, victim)
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=4))
    llm = FusionRAGLLM(engine=engine, store=str(kv.root), max_new_tokens=2, learn=False)
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=4)
    with caplog.at_level(logging.WARNING):
        first, second = (query_engine.query(QUESTION).metadata or {} for _ in range(2))
    assert "set aside" in first["cache_miss_reasons"][victim], first["cache_miss_reasons"]
    assert not any(kv.has(victim, v) for v in VARIANTS) and len(_quarantined(kv)) == 2
    assert len(_warnings(caplog, victim)) == 2
    assert second["cache_miss_reasons"].get(victim) == "no cache stored for this chunk id"


class NoQuarantine(KVStore):
    """A custom store that keeps its blobs in a DiskKVStore but cannot set one aside."""

    def __init__(self, inner: DiskKVStore) -> None:
        super().__init__(inner.storage_dtype)
        self.inner = inner

    @property
    def backend(self) -> KVStore:
        return self.inner

    def put(self, chunk_id: str, kv: ChunkKV) -> None:
        self.inner.put(chunk_id, kv)

    def get(self, chunk_id: str, variant: Variant, **kwargs: Any) -> ChunkKV:  # type: ignore[override]
        return self.inner.get(chunk_id, variant, **kwargs)

    def has(self, chunk_id: str, variant: Variant) -> bool:
        return self.inner.has(chunk_id, variant)

    def content_index(self) -> ContentIndex | None:
        return self.inner.content_index()

    def delete(self, chunk_id: str, variant: Variant | None = None) -> None:
        self.inner.delete(chunk_id, variant)

    def list_ids(self, variant: Variant | None = None) -> set[str]:
        return self.inner.list_ids(variant)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("why", ["read-only", "cannot"])
def test_a_corrupt_blob_that_cannot_be_moved_is_reported_left_in_place_once(
        engine: FusionEngine, damaged: tuple[FusionIndex, str], why: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Defect: a store that cannot set a blob aside (read-only, or a backend without `quarantine`)
    failed the request or claimed "set aside"; now the reason says the blob stayed, logged once."""
    index, victim = damaged
    assert isinstance(index.store, DiskKVStore)
    store: KVStore = index.store
    if why == "read-only":
        def read_only(src: Any, dst: Any) -> None:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(src))

        monkeypatch.setattr(disk_store.os, "rename", read_only)
    else:
        store = NoQuarantine(index.store)
    llm = ChatFusionRAG(engine=engine, store=store, max_tokens=2, learn=False)
    chain = {"context": FusionRAGRetriever(index=index, k=3) | format_docs, "question": RunnablePassthrough()}
    with caplog.at_level(logging.WARNING):
        first, second = _ask_twice(chain | PROMPT | llm)
    for meta in (first, second):
        reason = meta["cache_miss_reasons"][victim]
        assert "set aside" not in reason and "left in place" in reason, reason
    assert all(index.store.has(victim, v) for v in VARIANTS) and not _quarantined(index.store)
    assert len(_warnings(caplog, victim)) == 2, "one warning per blob, not one per request"


# ---- a streamed chain learns what it retrieved ------------------------------------------------------
def _run(chain: Runnable[Any, Any], how: str, results: Results) -> None:
    config: Any = {"callbacks": [results]}
    if how == "stream":
        assert list(chain.stream(QUESTION, config=config))
    elif how == "astream":
        async def consume() -> None:
            assert [c async for c in chain.astream(QUESTION, config=config)]

        asyncio.run(consume())
    else:
        chain.invoke(QUESTION, config=config)


@pytest.mark.parametrize("how", ["stream", "astream", "streaming-invoke"])
def test_a_streamed_chain_learns_its_retrieved_documents_like_invoke(
        engine: FusionEngine, tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    """Defect: LangChain's stream/astream (and invoke with streaming=True) call the model without
    its run manager, so it never saw the retrieved documents: nothing was learned and the warning
    blamed the retriever that had run."""
    vector_store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    vector_store.add_documents([Document(page_content=t) for t in TEXTS])
    retriever = vector_store.as_retriever(search_kwargs={"k": 3})
    # NOTE: `streaming=False` given explicitly would turn LangChain's streaming off altogether.
    streaming = {"streaming": True} if how == "streaming-invoke" else {}
    llm = ChatFusionRAG(engine=engine, store=DiskKVStore(tmp_path / "kv"), max_tokens=2,
                        learned_dir=str(tmp_path / "learned"), **streaming)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | llm
    first, second = Results(), Results()
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        _run(chain, how, first)
        _run(chain, how, second)
    assert first.metadata()["cache_misses"] == 3, "the retrieved documents were learnable"
    meta = second.metadata()
    retrieved = [d.page_content for d in retriever.invoke(QUESTION)]
    assert meta["reused_tokens"] >= 0.7 * _tokens(engine, retrieved) and meta["cache_misses"] == 0, meta
    assert not _warnings(caplog), "the retriever ran: nothing to warn about"


def test_the_no_reuse_warning_of_a_streamed_chain_blames_the_prompt_not_the_retriever(
        engine: FusionEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Defect: when the retriever had run but the prompt held its documents changed, the warning
    still said they were not retrieved through a framework retriever."""
    vector_store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    vector_store.add_documents([Document(page_content=t) for t in TEXTS])
    retriever = vector_store.as_retriever(search_kwargs={"k": 3})
    llm = ChatFusionRAG(engine=engine, store=DiskKVStore(tmp_path / "kv"), max_tokens=2,
                        learned_dir=str(tmp_path / "learned"))

    def shouted(docs: Sequence[Document]) -> str:
        return "\n\n".join(d.page_content.upper() for d in docs)

    chain = {"context": retriever | shouted, "question": RunnablePassthrough()} | PROMPT | llm
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        assert list(chain.stream(QUESTION))
    (warning,) = _warnings(caplog)
    assert "3 documents retrieved for this request" in warning and "not retrieved through" not in warning


@pytest.mark.parametrize("how", ["query", "aquery"])
def test_a_streamed_llama_index_query_learns_its_retrieved_nodes(
        engine: FusionEngine, tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    """Defect: a streaming query engine's LLM call runs as the response is read, after the query's
    spans closed, so it never saw the retrieved nodes."""
    nodes = [TextNode(text=t, embedding=[float(i == j) for j in range(4)]) for i, t in enumerate(TEXTS)]
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=4))
    llm = FusionRAGLLM(engine=engine, max_new_tokens=2, learned_dir=str(tmp_path / "learned"))
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=3, streaming=True)

    async def aquery() -> dict[str, Any]:
        response = await query_engine.aquery(QUESTION)
        assert [t async for t in response.async_response_gen()]  # type: ignore[union-attr]
        return response.metadata or {}

    def query() -> dict[str, Any]:
        response = query_engine.query(QUESTION)
        assert "".join(response.response_gen)  # type: ignore[union-attr]
        return response.metadata or {}

    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        first, second = (query() if how == "query" else asyncio.run(aquery()) for _ in range(2))
    assert first.get("cache_misses") == 3, first  # the statistics fill in once the stream is read
    assert second["reused_tokens"] >= 0.7 * _tokens(engine, TEXTS[:3]) and second["cache_misses"] == 0, second
    assert second["llm_calls"] == 1
    assert not _warnings(caplog)


# ---- documents holding private-use characters ---------------------------------------------------------
# NOTE: the code points of marks, and of the escapes that keep special-token strings plain text
# ("\ue005" index "\ue006"), as a PDF extractor might leave them in a document.
ODD = (f"The Lumen lighthouse manual \ue0050\ue006 was scanned {MARK_OPEN}twice{MARK_SEP} by a PDF "
       f"extractor \ue005 in 1999 \ue006{MARK_CLOSE}, page nine \ue00599\ue006 of the survey.")


def _specials(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[int]:
    special = {int(t) for t in tokenizer.all_special_ids}
    special.update(int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return [int(i) for i in ids if int(i) in special]


def test_a_document_holding_private_use_characters_reaches_the_model_as_written(
        tokenizer: PreTrainedTokenizerBase) -> None:
    """Defect: an escape-like run in a document ("\\ue005" digits "\\ue006") was unescaped into a
    special-token string (`<jupyter_output>`...): the model read that instead of the document."""
    layout = PromptLayout(tokenizer)
    question = "\n\nQuestion: who scanned it?"
    plain = layout.from_messages([{"role": "user", "content": f"A page.{question}"}]).token_ids().tolist()
    for documents in ({}, {"d1": ODD}):
        prompt = layout.from_messages([{"role": "user", "content": f"{ODD}{question}"}], documents=documents)
        ids = prompt.token_ids().tolist()
        assert _specials(tokenizer, ids) == _specials(tokenizer, plain), "only the template's control tokens"
        assert ODD in tokenizer.decode(ids), "the model reads the document as written"
        assert all(s.text == ODD for s in prompt.segments if s.kind == "chunk")


@pytest.fixture
def odd_index(engine: FusionEngine, tmp_path: Path) -> Iterator[FusionIndex]:
    index = FusionIndex.open(engine, tmp_path / "data", config=CONFIG)
    index.add_texts([ODD, *TEXTS[:2]])
    yield index


def test_an_ingested_document_holding_private_use_characters_is_reused(
        engine: FusionEngine, odd_index: FusionIndex, tmp_path: Path) -> None:
    """Defect: the ingested chunk was found by content, then its text came back altered by the
    prompt's unescape: its token ids differed from its cache's, a reported miss on every ask."""
    llm = ChatFusionRAG(index=odd_index, max_tokens=2, learned_dir=str(tmp_path / "learned"))
    context = format_docs([Document(page_content=t) for t in (ODD, *TEXTS[:2])])
    results = Results()
    (PROMPT | llm).invoke({"context": context, "question": QUESTION}, config={"callbacks": [results]})
    meta = results.metadata()
    assert meta["cache_misses"] == 0 and len(meta["chunk_found_by"]) == 3, meta["cache_miss_reasons"]
    assert meta["reused_tokens"] >= 0.7 * _tokens(engine, [ODD, *TEXTS[:2]])


def test_a_learned_document_holding_private_use_characters_is_reused_as_written(
        engine: FusionEngine, tmp_path: Path) -> None:
    """Defect: the K/V learned for such a document were those of the altered text."""
    texts = [ODD, *TEXTS[:2]]
    vector_store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    vector_store.add_documents([Document(page_content=t) for t in texts])
    retriever = vector_store.as_retriever(search_kwargs={"k": 3})
    llm = ChatFusionRAG(engine=engine, store=DiskKVStore(tmp_path / "kv"), max_tokens=2,
                        learned_dir=str(tmp_path / "learned"))
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | llm
    first, second = _ask_twice(chain)
    assert first["cache_misses"] == 3
    assert second["cache_misses"] == 0 and len(second["chunk_found_by"]) == 3
    # the learned cache holds the document's own tokens, not those of a special-token string
    learned = llm.reuse_session().learned()
    assert learned is not None
    odd_id = content_id(ODD, engine.fingerprint)
    assert odd_id in second["chunk_found_by"]
    variant = next(v for v in VARIANTS if learned.store.has(odd_id, v))
    kv = learned.store.get(odd_id, variant, fingerprint=engine.fingerprint)
    own = tokenize_plain(engine.tokenizer, ODD)
    assert kv.token_ids.tolist()[: len(own)] == own
