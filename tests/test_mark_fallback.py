"""`format_docs` marks whose id has no cache: the marked text is found by content, never by the id.

`FusionRAGVectorStore` returns Documents with LangChain *document* ids (langchain-chroma semantics)
while caches are keyed by chunk id. `format_docs` marks each Document with its id, so a chain
`store.as_retriever() | format_docs | ... | ChatFusionRAG` names ids that have no cache: the marked
text is then recognised by content (a digest of a stored chunk's whole text), and the statistics
say so (`chunk_found_by`). A 2-layer random Llama (tests.ingest_worker.tiny_engine) computes the
caches; chunks are at most 24 tokens.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import BaseMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import IngestConfig
from fusionrag_core.query.stitch import NO_CACHE
from fusionrag_core.recognise.content_index import ANCHOR_CHARS
from fusionrag_core.recognise.marks import MARK_CLOSE, MARK_OPEN, MARK_SEP, mark_chunk
from fusionrag_core.store import DiskKVStore
from fusionrag_integrations.langchain import ChatFusionRAG, FusionRAGVectorStore, format_docs
from tests.ingest_worker import tiny_engine

TEXTS = [
    "The Lumen lighthouse was designed by Ada Vell.",
    "Ada Vell was born in the port town of Marrow.",
    "Marrow is known for its salt market and ferries.",
    "Tessaly Instruments was founded by Piet Orran.",
]
LONG = ("The Brell observatory opened in 1874 on the hill above the old harbour. Its first director was "
        "Mara Quint, who catalogued comets for forty years. The dome was rebuilt in copper after the fire "
        "of 1903, and the telescope was moved to the university in 1950.")  # NOTE: its last chunk is "in 1950."
PROMPT = ChatPromptTemplate.from_messages([("system", "Context:\n\n{context}"), ("human", "{question}")])


@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(tokenizer)


@pytest.fixture(scope="module")
def store(engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> FusionRAGVectorStore:
    store = FusionRAGVectorStore(collection_name="marks", embedding_function=DeterministicFakeEmbedding(size=8),
                                 persist_directory=tmp_path_factory.mktemp("marks"), engine=engine,
                                 config=IngestConfig(chunk_tokens=24, neighbours=2))
    store.add_texts([*TEXTS, LONG], ids=[f"d{i}" for i in range(len(TEXTS))] + ["long"])
    return store


@pytest.fixture
def chat(store: FusionRAGVectorStore) -> ChatFusionRAG:
    return ChatFusionRAG(index=store.index, max_tokens=2, learn=False)


def _chunk_ids(store: FusionRAGVectorStore, doc_id: str) -> list[str]:
    """The chunk ids of a document, in document order, from the index (the trusted mapping)."""
    got = store.index.collection.get(where={"doc_id": doc_id}, include=["metadatas"])
    order = sorted(zip(got["ids"], got["metadatas"] or [], strict=True), key=lambda r: int(r[1]["chunk_index"]))
    return [cid for cid, _ in order]


def _ask(chat: ChatFusionRAG, context: str, question: str = "Who designed the Lumen lighthouse?") -> BaseMessage:
    return (PROMPT | chat).invoke({"context": context, "question": question})


def test_store_documents_through_format_docs_reuse_their_chunks(store: FusionRAGVectorStore,
                                                                chat: ChatFusionRAG) -> None:
    retriever = store.as_retriever(search_kwargs={"k": 3})
    docs = retriever.invoke("Who designed the Lumen lighthouse?")
    assert {d.id for d in docs} <= {f"d{i}" for i in range(len(TEXTS))} | {"long"}  # document ids, not chunk ids
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | chat
    meta = chain.invoke("Who designed the Lumen lighthouse?").response_metadata
    assert meta["cache_misses"] == 0 and meta["reused_tokens"] > 0
    found = meta["chunk_found_by"]
    assert len(found) == len(docs) and set(found.values()) == {"mark_then_content"}
    assert set(found).isdisjoint({d.id for d in docs})  # the chunks' own ids, found by their text
    # the prompt is token for token the one marks with the chunk ids give (marks stand for text + separator)
    by_chunk_id = "".join(mark_chunk(cid, d.page_content) for cid, d in zip(found, docs, strict=True))
    assert torch.equal(chat.reuse_prompt([{"role": "user", "content": by_chunk_id}], None).token_ids(),
                       chat.reuse_prompt([{"role": "user", "content": format_docs(docs)}], None).token_ids())


def test_a_long_document_marked_whole_finds_its_chunks_in_order(store: FusionRAGVectorStore,
                                                                chat: ChatFusionRAG) -> None:
    chunks = _chunk_ids(store, "long")
    assert len(chunks) >= 3 and len(store.get_by_ids(["long"])[-1].page_content) < ANCHOR_CHARS
    meta = _ask(chat, format_docs([Document(id="long", page_content=LONG)])).response_metadata
    assert list(meta["chunk_found_by"]) == chunks and meta["cache_misses"] == 0
    assert set(meta["chunk_found_by"].values()) == {"mark_then_content"} and meta["reused_tokens"] > 0


def test_a_marked_text_that_is_not_stored_stays_a_reported_miss(chat: ChatFusionRAG) -> None:
    never = Document(id="never-stored", page_content="A passage about tide tables that was never ingested here.")
    meta = _ask(chat, format_docs([never])).response_metadata
    assert meta["chunk_found_by"] == {"never-stored": "mark"}
    assert meta["cache_miss_reasons"] == {"never-stored": NO_CACHE.reason} and meta["reused_tokens"] == 0


def test_altered_or_forged_text_under_a_mark_reuses_nothing(store: FusionRAGVectorStore,
                                                            chat: ChatFusionRAG) -> None:
    stored = _chunk_ids(store, "d0")[0]
    altered = TEXTS[0].replace("Ada Vell", "Ada Vall")
    cases: dict[str, Any] = {
        # a genuine mark under a document id, one word changed: no stored chunk has this text
        "document id": (mark_chunk("d0", altered), "d0"),
        # a genuine mark naming the stored chunk's id over another text: its token ids do not match
        "chunk id": (mark_chunk(stored, altered), stored),
    }
    for name, (context, missed) in cases.items():
        meta = _ask(chat, context).response_metadata
        assert meta["reused_tokens"] == 0, name
        assert list(meta["cache_miss_reasons"]) == [missed] and meta["chunk_found_by"] == {missed: "mark"}, name
    # a look-alike mark (MAC not made here) naming the stored chunk over altered text is plain text
    genuine = mark_chunk(stored, altered)
    forged = genuine.replace(genuine.split(MARK_SEP)[1], "0" * 16)
    assert forged.startswith(MARK_OPEN) and forged.endswith(MARK_CLOSE) and forged != genuine
    meta = _ask(chat, forged).response_metadata
    assert meta["reused_tokens"] == 0 and meta["chunk_found_by"] == {} and meta["cache_misses"] == 0


def test_threads_sharing_one_model_each_get_their_own_routes(store: FusionRAGVectorStore,
                                                             chat: ChatFusionRAG) -> None:
    docs = store.get_by_ids(["d0", "d1", "d3"])
    contexts = [format_docs(docs[:2]), format_docs([Document(id="x", page_content="Never stored, not found.")]),
                "".join(mark_chunk(cid, d.page_content) for d in docs[2:] for cid in _chunk_ids(store, d.id or "")),
                "\n\n".join(d.page_content for d in docs)]

    def route(i: int) -> tuple[str, dict[str, str], int]:
        message = _ask(chat, contexts[i % len(contexts)])
        meta = message.response_metadata
        return str(message.content), dict(meta["chunk_found_by"]), int(meta["reused_tokens"])

    serial = [route(i) for i in range(len(contexts))]
    assert [sorted(set(r[1].values())) for r in serial] == [["mark_then_content"], ["mark"], ["mark"], ["content"]]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(route, range(4 * len(contexts)))) == serial * 4


def test_without_a_store_check_marks_are_taken_at_their_id(engine: FusionEngine, store: FusionRAGVectorStore) -> None:
    """The core's own `prompt_from_messages` (no `has_cache`) keeps the explicit fast path unchanged."""
    prompt = engine.prompt_from_messages([{"role": "user", "content": format_docs(store.get_by_ids(["d0"])) + "Q?"}])
    assert [(s.chunk_id, s.found_by) for s in prompt.segments if s.kind == "chunk"] == [("d0", "mark")]


def test_marked_documents_of_another_store_are_learned_then_reused(engine: FusionEngine, tmp_path: Path) -> None:
    """A plain InMemoryVectorStore's Documents (uuid ids, nothing ingested) through format_docs: the
    first ask learns them as retrieved documents, the second finds them by content in the learned caches."""
    from langchain_core.vectorstores import InMemoryVectorStore

    vector_store = InMemoryVectorStore(DeterministicFakeEmbedding(size=8))
    vector_store.add_documents([Document(page_content=t) for t in TEXTS])
    retriever = vector_store.as_retriever(search_kwargs={"k": 2})
    chat = ChatFusionRAG(engine=engine, store=DiskKVStore(tmp_path / "kv"), max_tokens=2,
                         learned_dir=str(tmp_path / "learned"))
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | chat
    first = chain.invoke("Who designed the Lumen lighthouse?").response_metadata
    assert set(first["chunk_found_by"].values()) == {"mark_then_document"} and first["reused_tokens"] == 0
    second = chain.invoke("Who designed the Lumen lighthouse?").response_metadata
    assert set(second["chunk_found_by"].values()) == {"mark_then_content"} and second["cache_misses"] == 0
    assert second["reused_tokens"] > 0 and list(second["chunk_found_by"]) == list(first["chunk_found_by"])
