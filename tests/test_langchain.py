"""LangChain integration: chunk recognition, streaming, options, retriever, vector store and chains.

Fast tests run a tiny random Llama with the real SmolLM2 tokenizer (token ids, and so chunk
recognition, are the real ones); tests marked `slow` use the shared real default model.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from pydantic import ValidationError
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine, Generation, GenerationStream
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.index import FusionIndex, IngestConfig
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.recognise.marks import MARK_CLOSE, MARK_OPEN, MARK_SEP, strip_marks
from fusionrag_core.runtime.kv import ChunkKV
from fusionrag_core.store import DiskKVStore, KVStore
from fusionrag_integrations.langchain import (
    ChatFusionRAG,
    FusionRAGChain,
    FusionRAGLLM,
    FusionRAGRetriever,
    FusionRAGVectorStore,
    format_docs,
)
from fusionrag_integrations.langchain.messages import to_chat_dicts

MARKS = (MARK_OPEN, MARK_SEP, MARK_CLOSE)
# NOTE: texts chosen for tokenization edges: leading space, no final period, non-ASCII, an inner
# newline, digits glued to letters, an emoji.
TEXTS = [
    "The Lumen lighthouse on Gull Point was designed by the engineer Ada Vell in 1891.",
    " Ada Vell was born in the port town of Marrow, where her father repaired ship clocks",
    "Marrow lies at the mouth of the river Tell — known for its salt market (est. 1702).",
    "Tessaly Instruments built the lighthouse clock;\nits founder was Oren Tessaly.",
    "Room 12b holds the lamp 🚀 and 3 spare wicks.",
]
QUESTION = "In which town was the designer of the Lumen lighthouse born?"
PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context."), ("human", "Context:{context}Question: {question}")]
)


def _has_marks(text: str) -> bool:
    return any(c in text for c in MARKS)


class TokenRecorder(BaseCallbackHandler):
    """Records streamed tokens and the final LLM results."""

    def __init__(self) -> None:
        self.tokens: list[str | list[Any]] = []
        self.results: list[LLMResult] = []

    def on_llm_new_token(self, token: str | list[Any], **kwargs: Any) -> None:
        self.tokens.append(token)

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        self.results.append(response)


# ---- fixtures: a tiny random model over the real tokenizer ------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine(smollm_tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smollm_tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048)
    return FusionEngine(LlamaForCausalLM(config).eval(), smollm_tokenizer, name="tiny-llama")


@pytest.fixture(scope="module")
def docs() -> list[Document]:
    return [Document(id=f"chunk-{i}", page_content=t, metadata={"i": i}) for i, t in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def caches(tiny_engine: FusionEngine, docs: list[Document]) -> dict[str, ChunkKV]:
    return {d.id: tiny_engine.chunk_cache(d.page_content) for d in docs if d.id}


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory: pytest.TempPathFactory, caches: dict[str, ChunkKV]) -> KVStore:
    store = DiskKVStore(tmp_path_factory.mktemp("kv"), storage_dtype="float32")
    for chunk_id, kv in caches.items():
        store.put(chunk_id, kv)
    return store


@pytest.fixture
def chat(tiny_engine: FusionEngine, tiny_store: KVStore) -> Iterator[ChatFusionRAG]:
    yield ChatFusionRAG(engine=tiny_engine, store=tiny_store, max_tokens=6)


def _ask(chat: ChatFusionRAG, docs: list[Document], **kwargs: Any) -> AIMessage:
    message = (PROMPT | chat.bind(**kwargs)).invoke({"context": format_docs(docs), "question": QUESTION})
    assert isinstance(message, AIMessage)
    return message


# ---- construction ------------------------------------------------------------------------------------
def test_construction_is_lazy_and_defaults_to_the_data_dir_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_engine: FusionEngine
) -> None:
    loads: list[dict[str, Any]] = []

    def fake_from_pretrained(model: Any = None, **kwargs: Any) -> FusionEngine:
        loads.append({"model": model, **kwargs})
        return tiny_engine

    monkeypatch.setattr(FusionEngine, "from_pretrained", staticmethod(fake_from_pretrained))
    monkeypatch.chdir(tmp_path)
    chat = ChatFusionRAG(max_tokens=2)
    assert loads == [] and not (tmp_path / "fusionrag-data").exists()
    assert chat.model_name == "smollm2-135m"

    chat.invoke("Hello")
    chat.invoke("Hello again")
    assert len(loads) == 1 and loads[0]["model"] is None
    assert "store" not in loads[0]  # the store travels with each request, never with the engine
    store = chat.kv_store()
    assert isinstance(store, DiskKVStore)
    assert store.root.resolve() == (tmp_path / "fusionrag-data" / "kv" / "fusionrag").resolve()


def test_conflicting_or_invalid_arguments_are_refused(tiny_engine: FusionEngine, tiny_store: KVStore) -> None:
    with pytest.raises(ValidationError, match="only one of"):
        ChatFusionRAG(model="smollm2-135m", engine=tiny_engine)
    with pytest.raises(ValidationError, match="recompute ratio"):
        ChatFusionRAG(engine=tiny_engine, ratio=1.5)
    with pytest.raises(ValidationError, match="unknown selector"):
        FusionRAGLLM(engine=tiny_engine, selector="best")
    with pytest.raises(ValidationError, match="max_new_tokens"):
        ChatFusionRAG(max_tokens=0)
    chat = ChatFusionRAG(engine=tiny_engine, store=tiny_store)
    with pytest.raises(InvalidRequestError, match="unsupported call option"):
        chat.invoke("Hello", caches={"x": "y"})
    with pytest.raises(InvalidRequestError, match="temperature"):
        chat.invoke("Hello", temperature=-1.0)


# ---- messages and prompt text ------------------------------------------------------------------------
def test_messages_become_role_dicts_and_non_text_is_refused() -> None:
    messages: list[BaseMessage] = [
        SystemMessage("sys"),
        HumanMessage([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], name="bob"),
        AIMessage("answer"),
    ]
    assert to_chat_dicts(messages) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "answer"},
    ]
    image = HumanMessage([{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:,x"}}])
    with pytest.raises(InvalidRequestError, match="image_url"):
        to_chat_dicts([image])
    # a cut (or forged) mark is plain text: it names no cache and breaks nothing
    cut = f"cut {MARK_OPEN}chunk-1{MARK_SEP}text without end"
    assert to_chat_dicts([HumanMessage(cut)]) == [{"role": "user", "content": cut}]


def test_format_docs_marks_chunks_and_strips_back_to_the_texts(docs: list[Document]) -> None:
    anonymous = Document(page_content="No id here.")
    foreign = Document(id="notes.md#3", page_content="An id no KV store can hold.")
    text = format_docs([*docs, anonymous, foreign])
    assert text.count(MARK_OPEN) == len(docs)
    assert strip_marks(text) == "".join(d.page_content for d in [*docs, anonymous, foreign])
    assert not _has_marks(strip_marks(text))
    # a document whose text holds marks (here: formatted context) is marked whole and read back whole
    nested = format_docs([Document(id="x", page_content=text)])
    assert strip_marks(nested) == text


# ---- recognition: order, token boundaries, unknown text -----------------------------------------------
def test_marked_chunks_are_reused_in_any_order_with_their_exact_cached_tokens(
    chat: ChatFusionRAG, docs: list[Document], caches: dict[str, ChunkKV]
) -> None:
    cached_tokens = sum(kv.num_tokens for kv in caches.values())
    orders = [docs, docs[::-1], random.Random(7).sample(docs, len(docs))]
    for order in orders:
        meta = _ask(chat, order, selector="none").response_metadata
        # NOTE: full reuse (selector "none") keeps every cached token only if each chunk's prompt
        # token ids equal its cached ids exactly, whatever the text around the marks.
        assert meta["reused_tokens"] == cached_tokens
        assert meta["cache_misses"] == 0 and meta["cache_miss_ids"] == []
        assert meta["independent_chunks"] == len(docs)  # the store holds independent caches only
    meta = _ask(chat, orders[2]).response_metadata
    assert meta["selector"] == "drift_aware"
    # the query-guided pass recomputes its share of the chunk tokens and reuses the rest
    assert meta["recomputed_tokens"] == round(0.15 * cached_tokens) > 0
    assert meta["reused_tokens"] + meta["recomputed_tokens"] == cached_tokens


def test_unknown_chunks_and_plain_text_are_prefilled(chat: ChatFusionRAG, docs: list[Document]) -> None:
    unknown = Document(id="never-ingested", page_content="The harbour master is Jon Pell.")
    meta = _ask(chat, [docs[0], unknown, docs[1]], selector="none").response_metadata
    assert meta["cache_miss_ids"] == ["never-ingested"] and meta["cache_misses"] == 1
    assert meta["reused_tokens"] == sum(
        chat.fusion_engine().layout.chunk_ids(d.page_content).numel() for d in docs[:2]
    )
    assert meta["completion_tokens"] > 0


def test_nothing_reused_answers_like_full_attention(tiny_engine: FusionEngine, docs: list[Document]) -> None:
    unknown = [Document(id=f"unknown-{d.id}", page_content=d.page_content) for d in docs[:3]]
    fusion = ChatFusionRAG(engine=tiny_engine, max_tokens=8, temperature=0.0)
    full = ChatFusionRAG(engine=tiny_engine, max_tokens=8, full_attention=True)
    a, b = _ask(fusion, unknown), _ask(full, unknown)
    assert a.response_metadata["reused_tokens"] == 0 and len(a.response_metadata["cache_miss_ids"]) == 3
    assert b.response_metadata["selector"] == "full_attention"
    assert a.content == b.content and a.usage_metadata is not None and b.usage_metadata is not None
    details = a.usage_metadata.pop("input_token_details")
    # NOTE: the system prefix may come from the engine's prefix cache: a cache read the baseline never makes
    assert details == {"cache_read": a.response_metadata["prefix_cached_tokens"]}
    assert a.usage_metadata == {k: v for k, v in b.usage_metadata.items() if k != "input_token_details"}


def test_output_never_holds_mark_characters(
    monkeypatch: pytest.MonkeyPatch, chat: ChatFusionRAG, docs: list[Document]
) -> None:
    """Even a model that emits the mark code points (it never sees them) streams clean text."""
    engine = chat.fusion_engine()
    real = _ask(chat, docs[:2])
    finished = engine.generate(chat.fusion_prompt([HumanMessage("Hello")]), sampling=SamplingConfig(max_new_tokens=2))
    echo = [f"{MARK_OPEN}chunk-0{MARK_SEP}", "The Lumen", f" lighthouse{MARK_CLOSE}", MARK_SEP]

    def echoing_stream(prompt: Any, **kwargs: Any) -> GenerationStream:
        return GenerationStream(iter([*echo, finished]))

    monkeypatch.setattr(engine, "stream", echoing_stream)
    recorder = TokenRecorder()
    chunks = list((PROMPT | chat).stream({"context": format_docs(docs), "question": QUESTION},
                                         config={"callbacks": [recorder]}))
    streamed = "".join(str(c.content) for c in chunks)
    assert streamed == "chunk-0The Lumen lighthouse"
    assert not any(_has_marks(str(t)) for t in recorder.tokens)
    for message in (real, *chunks):
        assert not _has_marks(str(message.content)) and not _has_marks(repr(message.response_metadata))


# ---- streaming, callbacks, options, async -------------------------------------------------------------
def test_stream_and_invoke_agree_and_report_tokens_to_callbacks(chat: ChatFusionRAG, docs: list[Document]) -> None:
    inputs = {"context": format_docs(docs[:3]), "question": QUESTION}
    streamed_recorder, invoked_recorder = TokenRecorder(), TokenRecorder()
    chunks = list(chat.stream(PROMPT.invoke(inputs), config={"callbacks": [streamed_recorder]}))
    invoked = chat.invoke(PROMPT.invoke(inputs), config={"callbacks": [invoked_recorder]})

    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk
    assert isinstance(full, AIMessageChunk)
    assert full.content == invoked.content == "".join(map(str, invoked_recorder.tokens))
    assert [t for t in streamed_recorder.tokens if t] == [c.content for c in chunks if c.content]
    # usage and statistics ride on the last chunk only, so summing chunks counts them once
    assert chunks[-1].chunk_position == "last"
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1
    assert full.usage_metadata == invoked.usage_metadata
    usage = invoked.usage_metadata
    assert usage is not None
    meta = invoked.response_metadata
    assert usage["input_tokens"] == meta["prompt_tokens"] and usage["output_tokens"] == meta["completion_tokens"]
    assert usage.get("input_token_details", {}).get("cache_read") == (
        meta["reused_tokens"] + meta["prefix_cached_tokens"]) and meta["reused_tokens"] > 0
    assert meta["model_name"] == "tiny-llama" and meta["ttft_s"] > 0
    llm_output = invoked_recorder.results[0].generations[0][0]
    assert llm_output.text == invoked.content


def test_stop_max_tokens_and_per_call_options(chat: ChatFusionRAG, docs: list[Document]) -> None:
    free = _ask(chat, docs[:2], max_tokens=10)
    text = str(free.content)
    assert free.response_metadata["completion_tokens"] == 10 and len(text) > 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text[: text.find(stop)]
    stopped = (PROMPT | chat.bind(stop=[stop], max_tokens=10)).invoke(
        {"context": format_docs(docs[:2]), "question": QUESTION}
    )
    assert stopped.content == cut and stopped.response_metadata["finish_reason"] == "stop"
    by_field = ChatFusionRAG(engine=chat.fusion_engine(), max_tokens=10, stop=[stop])
    assert _ask(by_field, docs[:2]).content == cut

    short = _ask(chat, docs[:2], max_tokens=3)
    assert short.response_metadata["completion_tokens"] == 3 and text.startswith(str(short.content))
    sampled = [_ask(chat, docs[:2], temperature=1.0, top_p=0.9, seed=seed).content for seed in (3, 3, 4)]
    assert sampled[0] == sampled[1] != sampled[2]
    independent = _ask(chat, docs[:2], variant="independent", ratio=0.5, selector="first_k")
    assert independent.response_metadata["selector"] == "first_k" and independent.response_metadata["ratio"] == 0.5


def test_async_matches_sync(chat: ChatFusionRAG, docs: list[Document]) -> None:
    inputs = {"context": format_docs(docs[:2]), "question": QUESTION}
    chain = PROMPT | chat

    async def run() -> tuple[BaseMessage, list[BaseMessage]]:
        return await chain.ainvoke(inputs), [c async for c in chain.astream(inputs)]

    invoked, streamed = asyncio.run(run())
    assert invoked.content == chain.invoke(inputs).content
    assert "".join(str(c.content) for c in streamed) == invoked.content
    assert streamed[-1].response_metadata["reused_tokens"] == invoked.response_metadata["reused_tokens"] > 0


def test_completion_llm_reports_statistics(
    tiny_engine: FusionEngine, tiny_store: KVStore, docs: list[Document]
) -> None:
    llm = FusionRAGLLM(engine=tiny_engine, store=tiny_store, max_tokens=5, selector="none")
    prompt = f"Context:{format_docs(docs[:2])}Question: {QUESTION}"
    result = llm.generate([prompt])
    generation = result.generations[0][0]
    info = generation.generation_info or {}
    assert info["reused_tokens"] == sum(tiny_engine.layout.chunk_ids(d.page_content).numel() for d in docs[:2])
    assert info["completion_tokens"] == 5 and info["model_name"] == "tiny-llama"
    assert "".join(llm.stream(prompt)) == generation.text == llm.invoke(prompt)
    async_result = asyncio.run(llm.agenerate([prompt]))
    assert async_result.generations[0][0].text == generation.text
    assert llm._get_ls_params()["ls_provider"] == "fusionrag"


# ---- the explicit path: documents by id -------------------------------------------------------------
def test_chain_builds_the_canonical_prompt_from_document_ids(chat: ChatFusionRAG, docs: list[Document]) -> None:
    engine = chat.fusion_engine()
    chain = FusionRAGChain(llm=chat)
    answer = chain.invoke({"question": QUESTION, "documents": docs[:3]}, max_tokens=6, selector="none")
    expected = engine.prompt(QUESTION, chunks=[(d.id, d.page_content) for d in docs[:3]])
    assert torch.equal(chat.fusion_prompt([HumanMessage(QUESTION)], docs[:3]).token_ids(), expected.token_ids())
    assert answer.response_metadata["prompt_tokens"] == expected.num_tokens
    assert answer.response_metadata["reused_tokens"] == sum(s.num_tokens for s in expected.segments)
    direct = engine.generate(expected, sampling=SamplingConfig(max_new_tokens=6), selector="none")
    assert answer.content == direct.text
    streamed = "".join(str(c.content) for c in chain.stream({"question": QUESTION, "documents": docs[:3]},
                                                              max_tokens=6, selector="none"))
    assert streamed == answer.content
    with pytest.raises(InvalidRequestError, match="FusionRAGChain takes"):
        chain.invoke({"question": QUESTION, "documents": "not documents"})
    with pytest.raises(InvalidRequestError, match="one human message"):
        chat.invoke([HumanMessage("hi"), AIMessage("hello"), HumanMessage(QUESTION)], documents=docs[:1])


# ---- retriever and vector store over a FusionIndex -----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_index(tiny_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FusionIndex]:
    index = FusionIndex.open(tiny_engine, tmp_path_factory.mktemp("index"), config=IngestConfig(chunk_tokens=48,
                                                                                               neighbours=2))
    index.add_texts(TEXTS, [{"topic": f"t{i}"} for i in range(len(TEXTS))], doc_ids=[f"doc{i}" for i in range(5)])
    yield index


def test_retriever_returns_chunk_ids_and_cache_status(tiny_index: FusionIndex) -> None:
    retriever = FusionRAGRetriever(index=tiny_index, k=3)
    found = retriever.invoke("Who designed the Lumen lighthouse?")
    assert len(found) == 3 and len(retriever.invoke("lighthouse", k=1)) == 1
    assert len(asyncio.run(retriever.ainvoke("lighthouse", k=2))) == 2
    top = found[0]
    assert top.page_content == TEXTS[0].strip() and top.metadata["doc_id"] == "doc0"
    for doc in found:
        assert doc.id is not None and doc.id == doc.metadata["chunk_id"] and doc.metadata["fusionrag_cache"] == "fused"
        assert tiny_index.store.has(doc.id, "fused") and doc.metadata["topic"].startswith("t")
        assert all(isinstance(v, str | int | float | bool) for v in doc.metadata.values())
        assert not _has_marks(doc.page_content) and not any(k.startswith("fusion_") for k in doc.metadata)
    scores = [d.metadata["fusionrag_score"] for d in found]
    assert scores == sorted(scores, reverse=True)

    second = found[1].metadata["chunk_id"]
    tiny_index.store.delete(second)
    again = {d.id: d.metadata["fusionrag_cache"] for d in retriever.invoke("Who designed the Lumen lighthouse?")}
    assert again[second] == "missing"
    tiny_index.verify(repair=True)
    assert tiny_index.store.has(second, "fused")


def test_lcel_chain_over_the_index_reuses_retrieved_chunks(tiny_index: FusionIndex) -> None:
    retriever = FusionRAGRetriever(index=tiny_index, k=3)
    chat = ChatFusionRAG(index=tiny_index, max_tokens=6)
    recorder = TokenRecorder()
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | chat | StrOutputParser()
    answer = chain.invoke(QUESTION, config={"callbacks": [recorder]})
    generation = recorder.results[0].generations[0][0]
    assert isinstance(generation, ChatGeneration)
    message = generation.message
    assert message.response_metadata["reused_tokens"] > 0 and message.response_metadata["cache_misses"] == 0
    assert message.response_metadata["fused_chunks"] == 3 and message.response_metadata["independent_chunks"] == 0
    messages = PROMPT.invoke({"context": format_docs(retriever.invoke(QUESTION)), "question": QUESTION})
    engine = tiny_index.engine
    plain = [{"role": "system", "content": "Answer from the context."},
             {"role": "user", "content": str(messages.to_messages()[1].content)}]
    direct = engine.generate(engine.prompt_from_messages(plain), store=tiny_index.store,
                             sampling=SamplingConfig(max_new_tokens=6))
    assert isinstance(direct, Generation) and answer == direct.text


def test_vector_store_ingests_documents_and_deletes_by_document_id(
    tiny_engine: FusionEngine, tmp_path: Path
) -> None:
    splits = [Document(page_content=t, metadata={"source": f"s{i}.md"}, id=f"doc-{i}") for i, t in enumerate(TEXTS)]
    store = FusionRAGVectorStore.from_documents(splits, engine=tiny_engine, data_dir=tmp_path,
                                                config=IngestConfig(chunk_tokens=48, neighbours=2))
    hits = store.similarity_search("Who founded Tessaly Instruments?", k=2)
    assert hits[0].id == "doc-3" and hits[0].metadata == {"source": "s3.md"}
    chunk = FusionRAGRetriever(index=store.index, k=1).invoke("Who founded Tessaly Instruments?")[0]
    assert chunk.metadata["doc_id"] == "doc-3" and store.index.store.has(str(chunk.id), "fused")
    scored = store.similarity_search_with_score("Who founded Tessaly Instruments?", k=2)
    assert [d.id for d, _ in scored] == [d.id for d in hits] and 0 <= scored[0][1] < scored[1][1]
    relevance = store.similarity_search_with_relevance_scores("Who founded Tessaly Instruments?", k=1)
    assert relevance[0][1] == pytest.approx(chunk.metadata["fusionrag_score"], abs=1e-6)
    assert [d.id for d in store.as_retriever(search_kwargs={"k": 1}).invoke("salt market")] == [
        d.id for d in store.similarity_search("salt market", k=1)
    ]
    assert [d.id for d in store.similarity_search("salt market", k=5, filter={"source": "s1.md"})] == ["doc-1"]

    added = store.add_documents([Document(page_content="A new pier opened in 1910.", id="doc-new")])
    assert added == ["doc-new"] and len(store.index) == len(TEXTS) + 1
    assert store.delete(["doc-new"]) is True and len(store.index) == len(TEXTS)
    with pytest.raises(InvalidRequestError, match="drop embedding_function"):
        FusionRAGVectorStore.from_texts(["a"], embedding=DeterministicFakeEmbedding(size=4), index=store.index)
    with pytest.raises(InvalidRequestError, match="unknown argument"):
        store.similarity_search("x", k=1, where={"doc_id": "doc-1"})


# ---- the real default model --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_chat(default_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChatFusionRAG]:
    store = DiskKVStore(tmp_path_factory.mktemp("real-kv"))
    for i, text in enumerate(TEXTS[:3]):
        store.put(f"real-{i}", default_engine.chunk_cache(text))
    yield ChatFusionRAG(engine=default_engine, store=store, max_tokens=24)


@pytest.mark.slow
def test_real_model_echoing_its_context_returns_clean_text(real_chat: ChatFusionRAG) -> None:
    docs = [Document(id=f"real-{i}", page_content=t) for i, t in enumerate(TEXTS[:3])]
    prompt = ChatPromptTemplate.from_messages([("human", "Repeat this text word for word:\n{context}\nNow repeat it.")])
    chunks = list((prompt | real_chat).stream({"context": format_docs(docs)}))
    text = "".join(str(c.content) for c in chunks)
    assert chunks[-1].response_metadata["reused_tokens"] > 0
    assert text.strip() and not _has_marks(text) and strip_marks(text) == text
    # NOTE: the model does echo the passages, so the check above is not vacuous.
    assert "Lumen" in text or "Ada" in text or "Marrow" in text


@pytest.mark.slow
def test_real_model_without_caches_answers_like_full_attention(real_chat: ChatFusionRAG) -> None:
    unknown = [Document(id=f"absent-{i}", page_content=t) for i, t in enumerate(TEXTS[:3])]
    full = real_chat.model_copy(update={"full_attention": True})
    a, b = _ask(real_chat, unknown), _ask(full, unknown)
    assert a.response_metadata["reused_tokens"] == 0 and a.response_metadata["cache_misses"] == 3
    assert a.content == b.content and str(a.content).strip()
