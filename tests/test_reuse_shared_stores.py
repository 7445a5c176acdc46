"""Reuse through LangChain and LlamaIndex over a Chroma server and a Redis KV store, as deployed.

The same texts ingested twice with one tiny model: into an embedded corpus (disk caches, embedded
Chroma) and into a Chroma server + Redis (real servers on loopback). Each framework then asks the
same question of each, first ask, learning off, through a corpus opened afresh (a process that
ingested nothing: its own store objects, its own content index mirror). The cached tokens over the
shared stores must equal the embedded corpus's on the same prompt, the same chunks found by content.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.runnables import RunnablePassthrough
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex, IngestConfig
from fusionrag_integrations.langchain import ChatFusionRAG, FusionRAGRetriever
from fusionrag_integrations.llama_index import FusionRAGLLM, FusionRAGQueryEngine
from tests.ingest_worker import tiny_engine
from tests.lighthouse import QUESTION, TEXTS
from tests.test_reuse_langchain import SYSTEM_PROMPT, Results, format_docs

pytestmark = [pytest.mark.servers]

CONFIG = IngestConfig(chunk_tokens=48, neighbours=2)
STORES = ["embedded", "shared"]


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer)


@pytest.fixture(scope="module")
def corpora(engine: FusionEngine, chroma_and_redis: tuple[str, str],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, FusionIndex]]:
    """Each corpus ingested, then opened again by a process that ingested nothing."""
    chroma_url, redis_url = chroma_and_redis
    where = {"embedded": {}, "shared": {"chroma_url": chroma_url, "redis_url": redis_url}}
    dirs = {name: tmp_path_factory.mktemp(name) for name in STORES}
    for name in STORES:
        with FusionIndex.open(engine, dirs[name], config=CONFIG, **where[name]) as ingest:
            ingest.add_texts(TEXTS)
    opened = {name: FusionIndex.open(engine, dirs[name], config=CONFIG, **where[name]) for name in STORES}
    yield opened
    for index in opened.values():
        index.close()


def test_langchain_first_ask_over_chroma_server_and_redis_reuses_what_the_embedded_corpus_does(
        corpora: dict[str, FusionIndex], tmp_path: Path) -> None:
    meta: dict[str, dict[str, Any]] = {}
    contexts: dict[str, str] = {}
    for name, index in corpora.items():
        retriever = FusionRAGRetriever(index=index, k=3)
        contexts[name] = format_docs(retriever.invoke(QUESTION))
        llm = ChatFusionRAG(index=index, max_tokens=2, learn=False, learned_dir=str(tmp_path / name))
        results = Results()
        ({"context": retriever | format_docs, "question": RunnablePassthrough()} | SYSTEM_PROMPT | llm).invoke(
            QUESTION, config={"callbacks": [results]})
        meta[name] = results.metadata()
    assert contexts["shared"] == contexts["embedded"]  # NOTE: the same prompt: the comparison is fair
    assert meta["embedded"]["reused_tokens"] > 0 and meta["shared"]["cache_misses"] == 0
    # NOTE: not prefilled/prefix-cached tokens: the second ask finds the system prefix the first left in
    # the engine's prefix cache, whichever corpus it asks
    keys = ("prompt_tokens", "reused_tokens", "recomputed_tokens", "fused_chunks", "chunk_found_by")
    assert {k: meta["shared"][k] for k in keys} == {k: meta["embedded"][k] for k in keys}


def test_llama_index_first_ask_over_chroma_server_and_redis_reuses_what_the_embedded_corpus_does(
        engine: FusionEngine, corpora: dict[str, FusionIndex], tmp_path: Path) -> None:
    meta: dict[str, dict[str, Any]] = {}
    sources: dict[str, list[str]] = {}
    for name, index in corpora.items():
        llm = FusionRAGLLM(engine=engine, max_new_tokens=2, learn=False, learned_dir=str(tmp_path / name))
        response = FusionRAGQueryEngine.from_index(index, llm=llm, similarity_top_k=3).query(QUESTION)
        assert response.metadata is not None
        meta[name] = response.metadata
        sources[name] = [n.node.get_content() for n in response.source_nodes]
    assert sources["shared"] == sources["embedded"]
    assert meta["embedded"]["reused_tokens"] > 0 and meta["shared"]["cache_misses"] == 0
    keys = ("prompt_tokens", "reused_tokens", "recomputed_tokens", "fused_chunks", "llm_calls")
    assert {k: meta["shared"][k] for k in keys} == {k: meta["embedded"][k] for k in keys}
