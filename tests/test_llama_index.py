"""LlamaIndex integration: LLM, embedding adapter, ingestion transform, retriever, query engine, marker.

Fast tests run a tiny random Llama with the real SmolLM2 tokenizer; the acceptance tests (`slow`)
share the session's default engine and ingest two sample documents once per module.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import chromadb
import pytest
import torch
from chromadb.config import Settings as ChromaSettings
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole
from llama_index.core.base.response.schema import Response, StreamingResponse
from llama_index.core.bridge.pydantic import Field
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode, NodeRelationship, NodeWithScore, RelatedNodeInfo, TextNode
from llama_index.vector_stores.chroma import ChromaVectorStore
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.data import load_sample_questions, sample_corpus_dir
from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import FusionRAGError, InvalidRequestError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.chroma import VectorDBConfig, open_collection
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.query.prompt import PromptLayout
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.recognise.marks import mark_chunk, strip_marks
from fusionrag_core.runtime.kv import ChunkKV
from fusionrag_core.store import DiskKVStore, KVStore, validate_chunk_id
from fusionrag_integrations.llama_index import (
    FusionChunkMarker,
    FusionKVTransform,
    FusionRAGEmbedding,
    FusionRAGLLM,
    FusionRAGQueryEngine,
    FusionRAGRetriever,
    fusion_text_qa_template,
)
from fusionrag_integrations.llama_index.transform import CHUNK_ID_KEY

TINY: dict[str, Any] = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}
CHUNKS = [
    "The Lumen lighthouse on Gull Point was designed by the engineer Ada Vell.",
    "Ada Vell was born in the port town of Marrow.",
    "Marrow lies at the mouth of the Gorse River.",
]
QUESTION = "In which town was the designer of the Lumen lighthouse born?"
GREEDY = SamplingConfig(max_new_tokens=6)


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine(smollm_tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    torch.manual_seed(0)
    return FusionEngine(LlamaForCausalLM(LlamaConfig(**TINY)).eval(), smollm_tokenizer, name="tiny-llama")


@pytest.fixture
def tiny(tiny_engine: FusionEngine) -> FusionEngine:
    return tiny_engine


@pytest.fixture
def kv(tmp_path: Path) -> KVStore:
    """A fresh disk store (passed explicitly: an engine holds no store)."""
    return DiskKVStore(tmp_path / "kv")


def _nodes(texts: list[str], embeddings: list[list[float]]) -> list[TextNode]:
    """Nodes as a splitter leaves them: random ids, PREVIOUS/NEXT links, user metadata."""
    nodes = [TextNode(text=t, embedding=e, metadata={"file_name": "doc.md"}) for t, e in zip(texts, embeddings,
                                                                                             strict=True)]
    for a, b in itertools.pairwise(nodes):
        a.relationships[NodeRelationship.NEXT] = RelatedNodeInfo(node_id=b.node_id)
        b.relationships[NodeRelationship.PREVIOUS] = RelatedNodeInfo(node_id=a.node_id)
    return nodes


def _chroma_store(path: Path, name: str) -> ChromaVectorStore:
    client = chromadb.PersistentClient(path=str(path), settings=ChromaSettings(anonymized_telemetry=False))
    return ChromaVectorStore(chroma_collection=client.get_or_create_collection(name, embedding_function=None))


class _LLMStats(BaseEventHandler):
    """Collects the statistics FusionRAGLLM puts on its chat responses."""

    stats: list[dict[str, Any]] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "llm_stats"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.stats.append(dict(event.response.additional_kwargs))


# ---- FusionRAGLLM --------------------------------------------------------------------------------
def test_llm_construction_is_lazy_and_refuses_mixed_sources(tiny_engine: FusionEngine) -> None:
    llm = FusionRAGLLM(model="/nonexistent/model.gguf")  # NOTE: would fail if it loaded here.
    assert llm.model == "/nonexistent/model.gguf"
    with pytest.raises(FusionRAGError, match="does not exist"):
        _ = llm.engine
    with pytest.raises(InvalidRequestError, match="engine= and model="):
        FusionRAGLLM(engine=tiny_engine, model="smollm2-135m")
    meta = FusionRAGLLM(engine=tiny_engine, max_new_tokens=7).metadata
    assert (meta.context_window, meta.num_output, meta.model_name) == (2048, 7, "tiny-llama")
    assert meta.is_chat_model  # the SmolLM2 tokenizer has a chat template


def test_complete_reuses_marked_chunks_and_reports_stats(tiny: FusionEngine, tmp_path: Path) -> None:
    # NOTE: the LLM's own store, passed per request.
    own = DiskKVStore(tmp_path / "own")
    own.put("c0", tiny.chunk_cache(CHUNKS[0]))
    llm = FusionRAGLLM(engine=tiny, store=str(tmp_path / "own"), max_new_tokens=GREEDY.max_new_tokens)
    prompt = f"Context:\n{mark_chunk('c0', CHUNKS[0])}\n{mark_chunk('c1', CHUNKS[1])}\nQuestion: {QUESTION}"

    response = llm.complete(prompt)

    expected = tiny.generate(tiny.prompt_from_messages([{"role": "user", "content": prompt}]), sampling=GREEDY,
                             store=own)
    assert response.text == expected.text
    stats = response.additional_kwargs
    assert stats["reused_tokens"] > 0 and stats["reused_tokens"] == expected.reused_tokens
    assert set(stats["cache_miss_reasons"]) == {"c1"}
    assert response.raw == stats and isinstance(stats["ttft_s"], float)
    plain = llm.complete(strip_marks(prompt))
    assert plain.additional_kwargs["reused_tokens"] == 0
    assert FusionRAGLLM(engine=tiny, max_new_tokens=2).complete(prompt).additional_kwargs["reused_tokens"] == 0


def test_stream_complete_is_cumulative_and_matches_complete(tiny: FusionEngine) -> None:
    llm = FusionRAGLLM(engine=tiny, max_new_tokens=8)
    prompt = f"{mark_chunk('c0', CHUNKS[0])}\nQuestion: {QUESTION}"

    chunks = list(llm.stream_complete(prompt))

    assert len(chunks) >= 2
    text = ""
    for chunk in chunks:
        text += chunk.delta or ""
        assert chunk.text == text
    assert chunks[-1].delta == "" and chunks[-1].additional_kwargs["completion_tokens"] == 8
    assert all(not c.additional_kwargs for c in chunks[:-1])
    assert chunks[-1].text == llm.complete(prompt).text


def test_chat_renders_messages_with_the_chat_template(tiny: FusionEngine) -> None:
    llm = FusionRAGLLM(engine=tiny, max_new_tokens=6)
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="Answer briefly."),
                ChatMessage(role=MessageRole.USER, content=f"{mark_chunk('c1', CHUNKS[1])}\n{QUESTION}")]

    response = llm.chat(messages)
    streamed = list(llm.stream_chat(messages))

    dicts = [{"role": "system", "content": "Answer briefly."},
             {"role": "user", "content": f"{mark_chunk('c1', CHUNKS[1])}\n{QUESTION}"}]
    assert response.message.content == tiny.generate(tiny.prompt_from_messages(dicts), sampling=GREEDY).text
    assert response.message.role == MessageRole.ASSISTANT
    assert streamed[-1].message.content == response.message.content
    assert streamed[-1].additional_kwargs["prompt_tokens"] == response.additional_kwargs["prompt_tokens"]


def test_bad_requests_are_refused_with_a_fix(tiny: FusionEngine) -> None:
    llm = FusionRAGLLM(engine=tiny, max_new_tokens=2)
    with pytest.raises(InvalidRequestError, match="per-call options"):
        llm.complete("Hello?", max_tokens=3)
    with pytest.raises(InvalidRequestError, match="text-only"):
        llm.chat([ChatMessage(role=MessageRole.USER, blocks=[ImageBlock(url="http://example.invalid/x.png")])])
    cut = mark_chunk("c0", CHUNKS[0])[:-5]  # a mark LlamaIndex's re-splitting could leave behind: plain text
    assert llm.complete(f"{cut}\nQuestion: {QUESTION}").additional_kwargs["reused_tokens"] == 0


# ---- FusionKVTransform ---------------------------------------------------------------------------
def test_transform_names_nodes_by_content_and_stores_fused_caches(tiny: FusionEngine, kv: KVStore) -> None:
    store = kv
    # node 0 is nearest to node 1; node 3 repeats node 0's text
    nodes = _nodes([*CHUNKS, CHUNKS[0]], [[1.0, 0.0], [0.9, 0.2], [0.0, 1.0], [1.0, 0.0]])
    old_ids = [n.node_id for n in nodes]

    kept = FusionKVTransform(tiny, store=kv, neighbours=1)(nodes)

    assert [n.get_content() for n in kept] == CHUNKS
    ids = [n.node_id for n in kept]
    assert len(set(ids)) == 3 and not set(ids) & set(old_ids)
    assert all(validate_chunk_id(i) for i in ids)
    assert kept[0].relationships[NodeRelationship.NEXT].node_id == ids[1]  # type: ignore[union-attr]
    assert kept[2].relationships[NodeRelationship.PREVIOUS].node_id == ids[1]  # type: ignore[union-attr]
    for node in kept:
        assert node.metadata[CHUNK_ID_KEY] == node.node_id
        for mode in (MetadataMode.LLM, MetadataMode.EMBED):
            content = node.get_content(metadata_mode=mode)
            assert node.node_id not in content and "file_name: doc.md" in content
        assert store.has(node.node_id, "independent") and store.has(node.node_id, "fused")

    def load(chunk_id: str, variant: Any) -> ChunkKV:
        return store.get(chunk_id, variant, fingerprint=tiny.fingerprint, shape=tiny.kv_shape)

    fused = load(ids[0], "fused")
    assert torch.equal(fused.token_ids, tiny.layout.chunk_ids(CHUNKS[0]))
    # fused after its nearest node (node 1), as ingest fuses: from the neighbour's stored cache
    expected = tiny.chunk_cache(CHUNKS[0], [load(ids[1], "independent")])
    assert torch.equal(fused.positions, expected.positions)
    torch.testing.assert_close(fused.keys, expected.keys.to(fused.keys.dtype), atol=2e-3, rtol=2e-3)
    assert not torch.equal(fused.positions, load(ids[0], "independent").positions)


def test_transform_rerun_computes_nothing_and_same_ids(tiny: FusionEngine, kv: KVStore,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    embeddings = [[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]]
    first = [n.node_id for n in FusionKVTransform(tiny, store=kv, neighbours=2)(_nodes(CHUNKS, embeddings))]
    calls: list[int] = []
    original = tiny.chunk_cache

    def counting(*args: Any, **kwargs: Any) -> ChunkKV:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(tiny, "chunk_cache", counting)

    again = [n.node_id for n in FusionKVTransform(tiny, store=kv, neighbours=2)(_nodes(CHUNKS, embeddings))]

    assert again == first and calls == []


def test_transform_refuses_documents_bad_settings_and_worker_processes(tiny: FusionEngine, kv: KVStore) -> None:
    transform = FusionKVTransform(tiny, store=kv)
    with pytest.raises(InvalidRequestError, match="node parser"):
        transform([Document(text=CHUNKS[0])])
    with pytest.raises(InvalidRequestError, match="neighbours must be"):
        FusionKVTransform(tiny, neighbours=-1)
    with pytest.raises(FusionRAGError, match="num_workers"):
        transform.__getstate__()
    storeless = FusionKVTransform(tiny)
    with pytest.raises(InvalidRequestError, match="store="):
        storeless(_nodes(CHUNKS[:1], [[1.0]]))


# ---- retriever over a vector store, marker, template ---------------------------------------------
def test_vector_store_retriever_returns_chunk_ids_and_refuses_foreign_nodes(tiny: FusionEngine, kv: KVStore,
                                                                            tmp_path: Path) -> None:
    embed = MockEmbedding(embed_dim=4)
    ours = FusionKVTransform(tiny, store=kv, neighbours=1, embed_model=embed)(_nodes(CHUNKS, [[1.0, 0.0]] * 3))
    store = _chroma_store(tmp_path / "chroma", "ours")
    store.add(list(embed(ours)))
    hits = FusionRAGRetriever.from_vector_store(store, embed_model=embed, similarity_top_k=2).retrieve(QUESTION)
    assert len(hits) == 2 and {h.node.node_id for h in hits} <= {n.node_id for n in ours}

    foreign = _chroma_store(tmp_path / "chroma", "foreign")
    foreign.add(list(embed([TextNode(text=t) for t in CHUNKS])))
    with pytest.raises(InvalidRequestError, match="FusionKVTransform"):
        FusionRAGRetriever.from_vector_store(foreign, embed_model=embed).retrieve(QUESTION)
    with pytest.raises(InvalidRequestError, match="similarity_top_k"):
        FusionRAGRetriever.from_vector_store(store, embed_model=embed, similarity_top_k=0)


def test_marker_marks_copies_and_template_matches_the_canonical_layout(
    smollm_tokenizer: PreTrainedTokenizerBase,
) -> None:
    hits = [NodeWithScore(node=TextNode(id_=f"c{i}", text=t), score=1.0) for i, t in enumerate(CHUNKS[:2])]

    marked = FusionChunkMarker().postprocess_nodes(hits)

    assert [h.node.get_content() for h in hits] == CHUNKS[:2]  # the retriever's nodes are untouched
    assert [strip_marks(m.node.get_content()) for m in marked] == CHUNKS[:2]
    assert [m.node.node_id for m in marked] == ["c0", "c1"]
    context = "\n\n".join(m.node.get_content(metadata_mode=MetadataMode.LLM) for m in marked)
    messages = fusion_text_qa_template().format_messages(context_str=context, query_str=QUESTION)
    layout = PromptLayout(smollm_tokenizer)
    flat = layout.from_messages([{"role": m.role.value, "content": m.content or ""} for m in messages])
    canonical = layout.build([(f"c{i}", layout.chunk_ids(t)) for i, t in enumerate(CHUNKS[:2])], QUESTION)
    assert torch.equal(flat.prefix, canonical.prefix) and torch.equal(flat.question, canonical.question)
    chunks = [s for s in flat.segments if s.kind == "chunk"]
    assert [s.chunk_id for s in chunks] == ["c0", "c1"]
    assert all(torch.equal(a.token_ids, b.token_ids) for a, b in zip(chunks, canonical.segments, strict=True))


# ---- acceptance: the default model, a pipeline into Chroma, the query paths ----------------------
@pytest.fixture(scope="module")
def pipeline_corpus(default_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory,
                    ) -> Iterator[tuple[FusionRAGLLM, ChromaVectorStore, FusionRAGEmbedding, KVStore]]:
    """Two sample documents through SentenceSplitter → embeddings → FusionKVTransform → ChromaVectorStore."""
    root = tmp_path_factory.mktemp("llama_index")
    llm = FusionRAGLLM(engine=default_engine, store=str(root / "kv"), max_new_tokens=8)
    embed = FusionRAGEmbedding()
    files = ["lumen_lighthouse.md", "ada_vell.md"]  # the two hops of the first sample question
    documents = [Document(text=(sample_corpus_dir() / f).read_text(encoding="utf-8"), metadata={"file_name": f})
                 for f in files]
    # NOTE: our collection opener: cosine space and the offline embedding function, never a download.
    collection = open_collection(VectorDBConfig(path=str(root / "chroma"), collection="llamaindex"))
    vector_store = ChromaVectorStore(chroma_collection=collection)
    pipeline = IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=160, chunk_overlap=0), embed,
                         FusionKVTransform(llm, neighbours=2)],
        vector_store=vector_store,
    )
    pipeline.run(documents=documents)
    store = llm.kv_store
    assert store is not None  # the caches went to the LLM's own store
    yield llm, vector_store, embed, store


@pytest.mark.slow
def test_query_engine_reuses_caches_and_answers_like_the_engine(
    pipeline_corpus: tuple[FusionRAGLLM, ChromaVectorStore, FusionRAGEmbedding, KVStore],
) -> None:
    llm, vector_store, embed, store = pipeline_corpus
    question = load_sample_questions()[0].question
    query_engine = FusionRAGQueryEngine.from_vector_store(vector_store, llm, embed_model=embed, similarity_top_k=2)

    response = query_engine.query(question)

    assert isinstance(response, Response) and len(response.source_nodes) == 2
    assert all(store.has(n.node.node_id, "fused") for n in response.source_nodes)
    assert response.metadata is not None
    assert response.metadata["reused_tokens"] > 0 and response.metadata["cache_misses"] == 0
    # NOTE: source nodes are the marked copies the synthesizer saw
    chunks = [(n.node.node_id, strip_marks(n.node.get_content(metadata_mode=MetadataMode.NONE)))
              for n in response.source_nodes]
    engine = llm.engine
    expected = engine.generate(engine.prompt(question, chunks=chunks), sampling=SamplingConfig(max_new_tokens=8),
                               store=store)
    # NOTE: the same chunks are reused as in the canonical prompt; the answers may differ, since the
    # synthesizer also shows each node's LLM metadata (file_name) as plain text between the chunks.
    assert response.response.strip() and expected.text.strip()
    assert response.metadata["reused_tokens"] == expected.reused_tokens

    streaming = FusionRAGQueryEngine.from_vector_store(vector_store, llm, embed_model=embed, similarity_top_k=2,
                                                       streaming=True).query(question)
    assert isinstance(streaming, StreamingResponse)
    assert "reused_tokens" not in (streaming.metadata or {})  # filled once exhausted
    pieces = list(streaming.response_gen)
    assert len(pieces) > 1 and "".join(pieces) == response.response

    def untimed(meta: dict[str, Any]) -> dict[str, Any]:
        # NOTE: prefilled_tokens may drop: the first query's uncached context was learned as caches, and
        # its system prefix computed, which the second serves from the system-prefix memo
        # (system_prefix_tokens, prefix_cached_tokens and the exact_cached_tokens they make, reuse_ratio)
        return {k: v for k, v in meta.items()
                if k not in ("ttft_s", "total_s", "prefilled_tokens", "prefix_cached_tokens",
                             "system_prefix_tokens", "exact_cached_tokens", "reuse_ratio")}

    assert untimed(streaming.metadata) == untimed(response.metadata)


@pytest.mark.slow
def test_standard_synthesizer_reuses_marked_chunks(
    pipeline_corpus: tuple[FusionRAGLLM, ChromaVectorStore, FusionRAGEmbedding, KVStore],
) -> None:
    llm, vector_store, embed, _ = pipeline_corpus
    question = load_sample_questions()[0].question
    handler = _LLMStats()
    get_dispatcher().add_event_handler(handler)
    index = VectorStoreIndex.from_vector_store(vector_store, embed_model=embed)
    try:
        marked = index.as_query_engine(llm=llm, similarity_top_k=2, node_postprocessors=[FusionChunkMarker()],
                                       text_qa_template=fusion_text_qa_template()).query(question)
    finally:
        get_dispatcher().event_handlers.remove(handler)

    # NOTE: one LLM call (compact mode, both chunks fit); without the marker nothing is reused, as
    # test_complete_reuses_marked_chunks_and_reports_stats shows on the flattened prompt.
    assert len(handler.stats) == 1
    assert handler.stats[0]["reused_tokens"] > 0 and handler.stats[0]["cache_misses"] == 0
    assert isinstance(marked, Response) and marked.response
    assert all(n.node.node_id == n.node.metadata[CHUNK_ID_KEY] for n in marked.source_nodes)


@pytest.mark.slow
def test_query_engine_over_a_fusion_index(default_engine: FusionEngine, tmp_path: Path) -> None:
    index = FusionIndex.open(default_engine, tmp_path, collection_name="li-index",
                             config=IngestConfig(chunk_tokens=64, neighbours=2))
    index.add_texts(CHUNKS)  # one chunk each
    question = QUESTION
    hits = FusionRAGRetriever.from_index(index, similarity_top_k=2).retrieve(question)
    assert [h.node.node_id for h in hits] == [c.chunk_id for c in index.search(question, k=2)]
    assert all(index.store.has(h.node.node_id, "fused") for h in hits)

    response = FusionRAGQueryEngine.from_index(
        index, llm=FusionRAGLLM(engine=default_engine, max_new_tokens=8), similarity_top_k=2
    ).query(question)
    assert isinstance(response, Response)

    generation, _ = index.answer(question, k=2, sampling=SamplingConfig(max_new_tokens=8))
    assert response.response == generation.text
    assert response.metadata is not None and response.metadata["reused_tokens"] > 0
