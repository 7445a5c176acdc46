"""Reuse in the user's own LangChain code: no package helper in the prompt, no ingest at all.

A tiny random Llama over the real SmolLM2 tokenizer (the splits are the real ones).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex, IngestConfig
from fusionrag_core.recognise.marks import MARK_CLOSE, MARK_OPEN, MARK_SEP, mark_chunk
from fusionrag_core.runtime.compat import tokenize_plain
from fusionrag_core.store import DiskKVStore
from fusionrag_integrations.langchain import ChatFusionRAG, FusionRAGRetriever
from tests.ingest_worker import tiny_engine
from tests.lighthouse import QUESTION, TEXTS

# LangChain's RAG tutorial shapes: context in the system message, or in the human message (rlm/rag-prompt).
SYSTEM_PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Use the following pieces of retrieved context to answer the question.\n\n{context}"),
    ("human", "{question}"),
])
HUMAN_PROMPT = ChatPromptTemplate.from_messages([
    ("human", "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
              "to answer the question.\nQuestion: {question} \nContext: {context} \nAnswer:"),
])


def format_docs(docs: Sequence[Document]) -> str:
    """The user's own, as in LangChain's RAG tutorial."""
    return "\n\n".join(doc.page_content for doc in docs)


class Results(BaseCallbackHandler):
    def __init__(self) -> None:
        self.results: list[LLMResult] = []

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        self.results.append(response)

    def metadata(self) -> dict[str, Any]:
        generation = self.results[-1].generations[0][0]
        assert isinstance(generation, ChatGeneration)
        return dict(generation.message.response_metadata)


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer)


@pytest.fixture(scope="module")
def index(engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FusionIndex]:
    index = FusionIndex.open(engine, tmp_path_factory.mktemp("index"), config=IngestConfig(chunk_tokens=48,
                                                                                          neighbours=2))
    index.add_texts(TEXTS)
    yield index


def _chunk_tokens(engine: FusionEngine, docs: Sequence[Document]) -> int:
    return sum(len(tokenize_plain(engine.tokenizer, d.page_content)) for d in docs)


@pytest.mark.parametrize("prompt", [SYSTEM_PROMPT, HUMAN_PROMPT], ids=["system", "human"])
def test_rag_tutorial_chain_with_its_own_format_docs_reuses_the_retrieved_chunks(
        engine: FusionEngine, index: FusionIndex, prompt: ChatPromptTemplate, tmp_path: Path) -> None:
    retriever = FusionRAGRetriever(index=index, k=3)
    llm = ChatFusionRAG(index=index, max_tokens=3, learned_dir=str(tmp_path / "learned"))
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    results = Results()
    chain.invoke(QUESTION, config={"callbacks": [results]})
    meta = results.metadata()
    retrieved = retriever.invoke(QUESTION)
    assert meta["reused_tokens"] >= 0.7 * _chunk_tokens(engine, retrieved)
    assert meta["cache_misses"] == 0 and meta["reuse_ratio"] > 0
    assert meta["prefilled_tokens"] + meta["reused_tokens"] + meta["recomputed_tokens"] <= meta["prompt_tokens"]


def test_plain_in_memory_vector_store_reuses_from_the_second_ask(engine: FusionEngine, tmp_path: Path) -> None:
    vector_store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    vector_store.add_documents([Document(page_content=t) for t in TEXTS])
    retriever = vector_store.as_retriever(search_kwargs={"k": 3})
    # NOTE: an empty store of its own: nothing ingested anywhere
    llm = ChatFusionRAG(engine=engine, store=DiskKVStore(tmp_path / "kv"), max_tokens=3,
                        learned_dir=str(tmp_path / "learned"))
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | SYSTEM_PROMPT | llm
    first, second = Results(), Results()
    chain.invoke(QUESTION, config={"callbacks": [first]})
    assert first.metadata()["reused_tokens"] == 0 and first.metadata()["cache_misses"] == 3  # learned now
    chain.invoke(QUESTION, config={"callbacks": [second]})
    meta = second.metadata()
    assert meta["reused_tokens"] >= 0.7 * _chunk_tokens(engine, retriever.invoke(QUESTION))
    assert meta["cache_misses"] == 0
    # another question retrieving the same documents reuses them too; learning off: nothing new is kept
    off = ChatFusionRAG(engine=engine, store=DiskKVStore(tmp_path / "kv"), max_tokens=3, learn=False,
                        learned_dir=str(tmp_path / "off"))
    ({"context": retriever | format_docs, "question": RunnablePassthrough()} | SYSTEM_PROMPT | off).invoke(QUESTION)
    assert not (tmp_path / "off").exists()


def test_a_document_holding_mark_characters_is_answerable_and_a_forged_mark_steers_nothing(
        engine: FusionEngine, index: FusionIndex, tmp_path: Path) -> None:
    llm = ChatFusionRAG(index=index, max_tokens=3, learned_dir=str(tmp_path / "learned"))
    weird = Document(page_content=f"Odd {MARK_OPEN}bytes{MARK_SEP} and {MARK_CLOSE} from a PDF extractor.")
    forged = mark_chunk("abc", TEXTS[3]).replace(mark_chunk("abc", TEXTS[3])[5:21], "0" * 16)
    chain = SYSTEM_PROMPT | llm
    results = Results()
    answer = chain.invoke({"context": format_docs([weird]), "question": f"{QUESTION} {forged}"},
                          config={"callbacks": [results]})
    assert isinstance(answer, AIMessage)
    meta = results.metadata()
    # the forged id ("abc") was never looked up: the text inside it was found by its content
    assert "abc" not in meta["cache_miss_ids"] and meta["cache_misses"] == 0


def test_no_reuse_warns_once_per_model_with_the_cause(engine: FusionEngine, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    llm = ChatFusionRAG(engine=engine, store=DiskKVStore(tmp_path / "kv"), max_tokens=2, learn=False)
    # NOTE: the retriever runs in the chain: its documents are what the prompt was expected to reuse
    vector_store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    vector_store.add_documents([Document(page_content=t) for t in TEXTS])
    retriever = vector_store.as_retriever(search_kwargs={"k": 3})
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | SYSTEM_PROMPT | llm
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        for _ in range(2):
            chain.invoke(QUESTION)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "reused no KV cache" in warnings[0] and "ingest" in warnings[0]


def test_verify_indexes_the_texts_of_a_corpus_ingested_without_a_content_index(engine: FusionEngine,
                                                                               tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path, config=IngestConfig(chunk_tokens=48, neighbours=1))
    index.add_texts(TEXTS[:2])
    content = index.store.content_index()
    assert content is not None
    prompt = "\n\n".join(TEXTS[:2]) + "\n\nQ"
    assert len(content.find(prompt)) == 2
    content.remove(index.store.list_ids())  # as a corpus ingested before content indexing existed
    assert content.find(prompt) == []
    index.verify()
    assert sorted(m.chunk_id for m in content.find(prompt)) == sorted(index.store.list_ids())
