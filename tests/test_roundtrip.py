"""One corpus format, both routes: a corpus ingested by either route is read through the other.

* FusionIndex ingest (the CLI's and LangChain's route) -> LlamaIndex's own `ChromaVectorStore`
  over the same collection -> `FusionRAGQueryEngine` and the standard `as_query_engine`, caches
  reused, no bookkeeping in the prompt;
* LlamaIndex `IngestionPipeline` (`FusionKVTransform`) -> `FusionIndex.search/answer/verify` and
  the LangChain `FusionRAGRetriever` + `ChatFusionRAG`, caches reused.

A tiny random Llama over the real SmolLM2 tokenizer: reuse is counted, answers are not judged.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import chromadb
import pytest
from chromadb.config import Settings as ChromaSettings
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document as LCDocument
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.bridge.pydantic import Field
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMChatStartEvent
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode
from llama_index.vector_stores.chroma import ChromaVectorStore
from transformers import PreTrainedTokenizerBase

from fusionrag_core.cli import main as cli_main
from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex, IngestConfig
from fusionrag_core.ingest.records import CHUNK_ID_KEY, INTERNAL_KEYS, NODE_RECORD_KEYS, OWNERS_KEY, RESERVED_KEYS
from fusionrag_core.recognise.marks import strip_marks
from fusionrag_integrations.langchain import ChatFusionRAG, FusionRAGVectorStore
from fusionrag_integrations.langchain import FusionRAGRetriever as LCRetriever
from fusionrag_integrations.langchain.documents import format_docs
from fusionrag_integrations.llama_index import (
    FusionKVTransform,
    FusionRAGEmbedding,
    FusionRAGLLM,
    FusionRAGQueryEngine,
    FusionRAGRetriever,
)
from tests.ingest_worker import tiny_engine
from tests.lighthouse import QUESTION, TEXTS

CONFIG = IngestConfig(chunk_tokens=48, neighbours=2)
PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Use the following pieces of retrieved context to answer the question.\n\n{context}"),
    ("human", "{question}"),
])


class _Calls(BaseEventHandler):
    """The messages FusionRAGLLM was sent and the statistics it answered with."""

    prompts: list[str] = Field(default_factory=list)
    stats: list[dict[str, Any]] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "roundtrip_calls"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, LLMChatStartEvent):
            self.prompts.append("\n".join(m.content or "" for m in event.messages))
        elif isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.stats.append(dict(event.response.additional_kwargs))


class _Results(BaseCallbackHandler):
    def __init__(self) -> None:
        self.metadata: dict[str, Any] = {}

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        generation = response.generations[0][0]
        assert isinstance(generation, ChatGeneration)
        self.metadata = dict(generation.message.response_metadata)


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer)


@pytest.fixture(scope="module")
def embed() -> FusionRAGEmbedding:
    return FusionRAGEmbedding()


def _leaks(text: str, index: FusionIndex) -> list[str]:
    """Bookkeeping names or values (chunk ids, neighbour lists) found in `text`."""
    found = [key for key in RESERVED_KEYS if key in text]
    ids = [str(m.get("fusion_neighbours", "")) for m in index.collection.get(include=["metadatas"])["metadatas"] or []]
    return found + [cid for cid in index.collection.get(include=[])["ids"] if cid in text] + [
        n for n in ids if n and n in text]


def test_fusion_index_corpus_reads_through_llama_index_chroma_vector_store(
        engine: FusionEngine, embed: FusionRAGEmbedding, tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path, collection_name="fi-route", config=CONFIG)
    index.add_texts(TEXTS, metadatas=[{"source": f"doc{i}.md"} for i in range(len(TEXTS))])
    vector_store = ChromaVectorStore(chroma_collection=index.collection)
    llm = FusionRAGLLM(engine=engine, kv_store=index.store, max_new_tokens=3, learn=False)

    # LlamaIndex rebuilds each node from the record FusionIndex wrote: id = chunk id, user metadata
    # visible, bookkeeping nowhere in LLM or embedding text
    nodes = vector_store.get_nodes(node_ids=sorted(index.collection.get(include=[])["ids"]))
    assert len(nodes) == len(TEXTS) and all(node.get_content(MetadataMode.NONE) in TEXTS for node in nodes)
    for node in nodes:
        for mode in (MetadataMode.LLM, MetadataMode.EMBED):
            text = node.get_content(mode)
            assert "source: doc" in text and not _leaks(text, index), (mode, text)
        assert node.ref_doc_id == index.collection.get(ids=[node.node_id])["metadatas"][0]["doc_id"]  # type: ignore[index]

    response = FusionRAGQueryEngine.from_vector_store(vector_store, llm, embed_model=embed,
                                                      similarity_top_k=2).query(QUESTION)
    assert response.metadata is not None
    assert response.metadata["reused_tokens"] > 0 and response.metadata["cache_misses"] == 0
    assert all(index.store.has(n.node.node_id, "fused") for n in response.source_nodes)

    # a document added again with new metadata: LlamaIndex's node record follows it
    report = index.add_texts([TEXTS[0]], metadatas=[{"source": "renamed.md"}])
    (cid,) = report.chunk_ids[0]
    (node,) = vector_store.get_nodes(node_ids=[cid])
    assert node.metadata["source"] == "renamed.md" and "source: renamed.md" in node.get_content(MetadataMode.LLM)


def test_standard_llama_index_engine_reuses_and_shows_no_bookkeeping(
        engine: FusionEngine, embed: FusionRAGEmbedding, tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path, collection_name="fi-standard", config=CONFIG)
    index.add_texts(TEXTS, metadatas=[{"source": f"doc{i}.md"} for i in range(len(TEXTS))])
    llm = FusionRAGLLM(engine=engine, kv_store=index.store, max_new_tokens=3, learn=False)
    standard = VectorStoreIndex.from_vector_store(ChromaVectorStore(chroma_collection=index.collection),
                                                  embed_model=embed)
    calls = _Calls()
    get_dispatcher().add_event_handler(calls)
    try:
        standard.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
    finally:
        get_dispatcher().event_handlers.remove(calls)

    assert len(calls.prompts) == 1 and "source: doc" in calls.prompts[0]
    assert not _leaks(calls.prompts[0], index), calls.prompts[0]
    # found by content in the standard template: every retrieved chunk's cache reused
    assert calls.stats[0]["reused_tokens"] > 0 and calls.stats[0]["cache_misses"] == 0


def test_llama_index_pipeline_corpus_reads_through_fusion_index_langchain_and_the_cli(
        engine: FusionEngine, embed: FusionRAGEmbedding, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    index = FusionIndex.open(engine, tmp_path / "db", collection_name="li-route", config=CONFIG)
    pipeline = IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=64, chunk_overlap=0), embed, FusionKVTransform.from_index(index)],
        vector_store=ChromaVectorStore(chroma_collection=index.collection),
    )
    pipeline.run(documents=[Document(text=t, metadata={"file_name": f"doc{i}.md"}) for i, t in enumerate(TEXTS)])
    assert len(index) == len(TEXTS)

    # the index agrees with what the pipeline wrote: every blob, the recorded neighbours, nothing stale
    report = index.verify(repair=False)
    assert (report.chunks, report.missing, report.mismatched, report.wrong_neighbours, report.stale,
            report.orphans) == (len(TEXTS), 0, 0, 0, 0, 0), report

    generation, hits = index.answer(QUESTION, k=2)
    assert generation.reused_tokens > 0 and not generation.cache_misses
    assert all(h.metadata["file_name"].startswith("doc") for h in hits)

    docs = LCRetriever(index=index, k=2).invoke(QUESTION)
    assert [d.id for d in docs] == [h.chunk_id for h in hits]
    assert all(d.metadata["fusionrag_cache"] == "fused" for d in docs)
    assert all(not INTERNAL_KEYS.intersection(d.metadata) and "doc_id" in d.metadata for d in docs)
    # NOTE: format_docs marks each chunk with its id (the mark is how the model finds its cache)
    assert not _leaks(strip_marks(format_docs(docs)), index)

    def user_format_docs(docs: Sequence[LCDocument]) -> str:
        return "\n\n".join(doc.page_content for doc in docs)

    results = _Results()
    chain = {"context": LCRetriever(index=index, k=2) | user_format_docs, "question": RunnablePassthrough()} | PROMPT
    (chain | ChatFusionRAG(index=index, max_tokens=3, learn=False)).invoke(QUESTION, config={"callbacks": [results]})
    assert results.metadata["reused_tokens"] > 0 and results.metadata["cache_misses"] == 0

    # LangChain's vector store over the same corpus: a document per chunk, the caller's metadata only
    found = FusionRAGVectorStore(index=index).similarity_search(QUESTION, k=2)
    assert len(found) == 2 and all(d.metadata["file_name"].startswith("doc") for d in found)
    assert all(not RESERVED_KEYS.intersection(d.metadata) for d in found)
    assert {d.page_content for d in found} == {h.text for h in hits}

    # the CLI opens the same corpus (data dir + collection name) and reuses its caches
    argv = ["--db", str(tmp_path / "db"), "--collection", "li-route", "ask", QUESTION, "--max-tokens", "2", "-k", "2"]
    assert cli_main(argv, engine_factory=lambda spec: engine) == 0
    out = capsys.readouterr().out
    assert "cache misses 0" in out and "sources: [1] doc0.md" in out and "reused 0" not in out, out

    # and the FusionIndex keeps managing the corpus: a document added its own way, one deleted
    index.add_texts(["The river Tell floods Marrow's quay every spring."], doc_ids=["tell"])
    assert "tell" in index.document_ids() and index.delete(["tell"]) == 1
    assert index.verify(repair=False).missing == 0


def test_legacy_fusion_index_entries_are_read_with_bookkeeping_hidden(engine: FusionEngine, tmp_path: Path) -> None:
    # NOTE: an entry as FusionIndex wrote it before node records: flat keys only (LlamaIndex's legacy reader)
    settings = ChromaSettings(anonymized_telemetry=False)
    client = chromadb.PersistentClient(path=str(tmp_path / "chroma"), settings=settings)
    collection = client.get_or_create_collection("legacy", embedding_function=None)
    collection.add(ids=["a" * 32], documents=[TEXTS[0]], embeddings=[[1.0, 0.0, 0.0, 0.0]],
                   metadatas=[{"doc_id": "d", "chunk_index": 0, OWNERS_KEY: '["d"]', "fusion_owners": 1,
                               "fusion_neighbours": "b" * 32, "fusion_radius": 0.5, "source": "doc0.md"}])
    hits = FusionRAGRetriever.from_vector_store(ChromaVectorStore(chroma_collection=collection),
                                                embed_model=MockEmbedding(embed_dim=4)).retrieve(QUESTION)
    assert [h.node.node_id for h in hits] == ["a" * 32]
    for mode in (MetadataMode.LLM, MetadataMode.EMBED):
        text = hits[0].node.get_content(mode)
        assert "source: doc0.md" in text and not [k for k in RESERVED_KEYS if k in text] and "b" * 32 not in text


def test_verify_gives_entries_written_before_node_records_theirs(engine: FusionEngine, tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path, collection_name="fi-old", config=CONFIG)
    index.add_texts(TEXTS[:2], metadatas=[{"source": "doc0.md"}, {"source": "doc1.md"}])
    ids = index.collection.get(include=[])["ids"]
    # NOTE: as a corpus ingested before node records (Chroma's update deletes a key set to None)
    dropped = dict.fromkeys([*NODE_RECORD_KEYS, CHUNK_ID_KEY])
    index.collection.update(ids=ids, metadatas=[dropped] * len(ids))  # type: ignore[list-item]
    vector_store = ChromaVectorStore(chroma_collection=index.collection)
    assert all(_leaks(n.get_content(MetadataMode.LLM), index) for n in vector_store.get_nodes(node_ids=ids))

    assert index.verify().ok
    for node in vector_store.get_nodes(node_ids=ids):
        text = node.get_content(MetadataMode.LLM)
        assert "source: doc" in text and not _leaks(text, index), text
        assert node.node_id in ids and node.ref_doc_id in index.document_ids()
    assert index.verify(repair=False).ok
