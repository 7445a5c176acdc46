"""FusionRAGQueryEngine.from_index on RetrieverQueryEngine: every response mode answers through the
standard synthesizer with the retrieved chunks' caches reused; postprocessors, templates and
streaming are the user's. A tiny random model over the real tokenizer (answers are nonsense; reuse
and plumbing are what is checked)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from llama_index.core.base.response.schema import Response, StreamingResponse
from llama_index.core.bridge.pydantic import Field
from llama_index.core.postprocessor import SimilarityPostprocessor
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import PromptTemplate
from llama_index.core.response_synthesizers import ResponseMode, get_response_synthesizer
from llama_index.core.schema import NodeWithScore, QueryBundle
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.index import FusionIndex, IngestConfig
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.recognise.marks import MARK_OPEN
from fusionrag_integrations.llama_index import FusionRAGLLM, FusionRAGQueryEngine

TEXTS = [
    "The Lumen lighthouse on Gull Point was designed by the engineer Ada Vell.",
    "Ada Vell was born in the port town of Marrow.",
    "Marrow lies at the mouth of the Gorse River.",
]
QUESTION = "Where was the designer of the Lumen lighthouse born?"
LLM_MODES = ["refine", "compact", "simple_summarize", "tree_summarize", "accumulate", "compact_accumulate"]


@pytest.fixture(scope="module")
def index(smollm_tokenizer: PreTrainedTokenizerBase, tmp_path_factory: pytest.TempPathFactory,
          one_thread: None) -> Iterator[FusionIndex]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smollm_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    engine = FusionEngine(LlamaForCausalLM(config).eval(), smollm_tokenizer, name="tiny-llama")
    index = FusionIndex.open(engine, tmp_path_factory.mktemp("qe"), collection_name="qe-modes",
                             config=IngestConfig(chunk_tokens=64, neighbours=1), storage_dtype="float32")
    index.add_texts(TEXTS)
    yield index


def _llm(index: FusionIndex) -> FusionRAGLLM:
    return FusionRAGLLM(engine=index.engine, max_new_tokens=3)


@pytest.mark.parametrize("mode", LLM_MODES)
def test_every_llm_response_mode_reuses_the_retrieved_chunks(index: FusionIndex, mode: str) -> None:
    engine = FusionRAGQueryEngine.from_index(index, llm=_llm(index), similarity_top_k=2, response_mode=mode)
    response = engine.query(QUESTION)
    assert isinstance(response, Response) and len(response.source_nodes) == 2
    meta = response.metadata
    assert meta["llm_calls"] >= 1 and meta["reused_tokens"] > 0 and meta["cache_misses"] == 0
    assert meta["chunks_without_drift"] == 0  # every fused cache carries its drift
    assert MARK_OPEN not in (response.response or "")
    for node in response.source_nodes:
        assert node.node.node_id in response.metadata  # RetrieverQueryEngine's node metadata is kept


@pytest.mark.parametrize("mode", ["generation", "no_text", "context_only"])
def test_modes_that_do_not_read_chunks_through_the_llm(index: FusionIndex, mode: str) -> None:
    response = FusionRAGQueryEngine.from_index(index, llm=_llm(index), similarity_top_k=2,
                                               response_mode=mode).query(QUESTION)
    meta = response.metadata or {}
    if mode == "generation":
        assert meta["llm_calls"] == 1 and meta["reused_tokens"] == 0  # the question alone
    else:
        assert "llm_calls" not in meta  # no LLM call at all
    if mode == "context_only":
        assert TEXTS[0] in str(response.response) and MARK_OPEN in str(response.response)


def test_compact_answers_exactly_like_the_engine(index: FusionIndex) -> None:
    response = FusionRAGQueryEngine.from_index(index, llm=_llm(index), similarity_top_k=2).query(QUESTION)
    generation, _ = index.answer(QUESTION, k=2, sampling=SamplingConfig(max_new_tokens=3))
    assert response.response == generation.text
    assert response.metadata["reused_tokens"] == generation.reused_tokens


def test_streaming_fills_the_statistics_once_consumed(index: FusionIndex) -> None:
    streaming = FusionRAGQueryEngine.from_index(index, llm=_llm(index), similarity_top_k=2,
                                                streaming=True).query(QUESTION)
    assert isinstance(streaming, StreamingResponse) and "llm_calls" not in (streaming.metadata or {})
    text = "".join(streaming.response_gen)
    assert streaming.metadata["llm_calls"] == 1 and streaming.metadata["reused_tokens"] > 0
    assert text == FusionRAGQueryEngine.from_index(index, llm=_llm(index), similarity_top_k=2).query(QUESTION).response


class _KeepFirst(BaseNodePostprocessor):
    seen: list[str] = Field(default_factory=list)

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
                           ) -> list[NodeWithScore]:
        self.seen.extend(n.node.get_content() for n in nodes)
        return nodes[:1]


def test_user_postprocessors_run_before_marking_and_templates_are_used(index: FusionIndex) -> None:
    keep = _KeepFirst()
    template = PromptTemplate("Facts:\n{context_str}\nQ: {query_str}\nA:")
    response = FusionRAGQueryEngine.from_index(
        index, llm=_llm(index), similarity_top_k=2, node_postprocessors=[SimilarityPostprocessor(), keep],
        text_qa_template=template,
    ).query(QUESTION)
    assert keep.seen and not any(MARK_OPEN in text for text in keep.seen)  # they saw plain text
    assert len(response.source_nodes) == 1
    call = response.metadata
    assert call["reused_tokens"] > 0 and call["cache_misses"] == 0  # marked chunks reused under any template


def test_async_query_records_its_generations(index: FusionIndex) -> None:
    engine = FusionRAGQueryEngine.from_index(index, llm=_llm(index), similarity_top_k=2)
    response = asyncio.run(engine.aquery(QUESTION))
    assert response.metadata["reused_tokens"] > 0


def test_a_ready_synthesizer_or_its_arguments_not_both(index: FusionIndex) -> None:
    llm = _llm(index)
    synthesizer = get_response_synthesizer(llm=llm, response_mode=ResponseMode.REFINE)
    engine = FusionRAGQueryEngine.from_index(index, llm=llm, response_synthesizer=synthesizer)
    assert engine.query(QUESTION).metadata["llm_calls"] >= 1
    with pytest.raises(InvalidRequestError, match="not both"):
        FusionRAGQueryEngine.from_index(index, llm=llm, response_synthesizer=synthesizer, streaming=True)


def test_an_llm_without_a_store_reads_the_index_store(index: FusionIndex, tmp_path: Path) -> None:
    llm = _llm(index)
    assert llm.kv_store is None
    response = FusionRAGQueryEngine.from_index(index, llm=llm).query(QUESTION)
    assert response.metadata["reused_tokens"] > 0
    assert llm.kv_store is None  # the caller's LLM is left as it was
    from_store: dict[str, Any] = {}
    with pytest.raises(InvalidRequestError, match="no KV store"):
        FusionRAGQueryEngine.from_vector_store(object(), llm, **from_store)  # type: ignore[arg-type]
