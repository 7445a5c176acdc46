"""Reuse through LlamaIndex's standard query engine: default synthesizers and templates, no marker.

A tiny random Llama over the real SmolLM2 tokenizer (the splits are the real ones).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.response.schema import Response
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import MetadataMode, TextNode
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.runtime.compat import tokenize_plain
from fusionrag_core.store import DiskKVStore
from fusionrag_integrations.llama_index import FusionKVTransform, FusionRAGLLM
from tests.ingest_worker import tiny_engine
from tests.lighthouse import QUESTION, TEXTS

MODES = ["compact", "refine", "tree_summarize", "simple_summarize"]


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer)


def _nodes() -> list[TextNode]:
    # NOTE: metadata the synthesizer shows the LLM sits between the chunks ("file_path: ...\n\n").
    return [TextNode(text=t, metadata={"file_path": f"doc{i}.md"}, embedding=[float(i == j) for j in range(4)])
            for i, t in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def ingested(engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> tuple[VectorStoreIndex, Path]:
    """Nodes through FusionKVTransform (fused caches, content indexed), in a plain VectorStoreIndex."""
    kv = tmp_path_factory.mktemp("kv")
    nodes = FusionKVTransform(engine, store=DiskKVStore(kv), neighbours=1)(_nodes())
    return VectorStoreIndex(list(nodes), embed_model=MockEmbedding(embed_dim=4)), kv


def _chunk_tokens(engine: FusionEngine, response: Response) -> int:
    return sum(len(tokenize_plain(engine.tokenizer, n.node.get_content(metadata_mode=MetadataMode.NONE)))
               for n in response.source_nodes)


@pytest.mark.parametrize("mode", MODES)
def test_standard_query_engine_reuses_ingested_chunks_in_every_response_mode(
        engine: FusionEngine, ingested: tuple[VectorStoreIndex, Path], mode: str, tmp_path: Path) -> None:
    index, kv = ingested
    llm = FusionRAGLLM(engine=engine, store=str(kv), max_new_tokens=2, learned_dir=str(tmp_path / "learned"))
    response = index.as_query_engine(llm=llm, response_mode=mode, similarity_top_k=3).query(QUESTION)
    assert isinstance(response, Response) and response.metadata is not None
    meta = response.metadata
    assert meta["reused_tokens"] >= 0.7 * _chunk_tokens(engine, response), (mode, meta)
    assert meta["cache_misses"] == 0 and meta["llm_calls"] >= 1 and 0 < meta["reuse_ratio"] <= 1
    assert all(n.node.node_id in meta for n in response.source_nodes)  # LlamaIndex's own entries stay


def test_nodes_never_ingested_are_learned_from_the_first_query(engine: FusionEngine, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    index = VectorStoreIndex(_nodes(), embed_model=MockEmbedding(embed_dim=4))
    llm = FusionRAGLLM(engine=engine, max_new_tokens=2, learned_dir=str(tmp_path / "learned"))
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=3)
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        first = query_engine.query(QUESTION)
    assert first.metadata is not None and first.metadata["reused_tokens"] == 0
    assert first.metadata["cache_misses"] == 3
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]  # it learned: nothing was lost
    second = query_engine.query("Who designed the Lumen lighthouse?")
    assert second.metadata is not None
    assert second.metadata["reused_tokens"] >= 0.7 * _chunk_tokens(engine, second)
    assert (tmp_path / "learned" / "lru.sqlite").exists()
