"""Learned spans: context that arrives without retriever callbacks is reused from the second ask.

Today's tutorials fetch their documents themselves (`vector_store.similarity_search` inside a
`dynamic_prompt` middleware or a LangGraph node) or send a hand-built list of chat messages, e.g.
over an HTTP API: nothing tells the model where a document starts. The prompt's context is cut into
content-defined spans whose K/V are learned, and found again by content in the next prompt.

A tiny random Llama over the real SmolLM2 tokenizer and chat template (the splits are the real ones).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, dynamic_prompt
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.vectorstores import InMemoryVectorStore
from langgraph.checkpoint.memory import MemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.recognise.marks import mark_chunk
from fusionrag_core.reuse.learned import LearnedCaches, content_id
from fusionrag_core.reuse.spans import MAX_SPAN_CHARS, MIN_SPAN_CHARS, conversation_spans, cut_spans
from fusionrag_core.runtime.compat import tokenize_plain
from fusionrag_integrations.langchain import ChatFusionRAG
from fusionrag_integrations.session import PENDING_REASON
from tests.ingest_worker import tiny_engine
from tests.lighthouse import QUESTION, TEXTS

FOLLOW_UP = "And in which year was the lighthouse designed?"
INSTRUCTION = "You are a helpful assistant. Use the following context in your response:"
LONG_QUESTION = "Which town was the engineer who designed the Lumen lighthouse on Gull Point born in?"


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer)


@pytest.fixture
def vector_store() -> InMemoryVectorStore:
    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    store.add_documents([Document(page_content=t) for t in TEXTS])
    return store


def _tokens(engine: FusionEngine, texts: Sequence[str]) -> int:
    return sum(len(tokenize_plain(engine.tokenizer, t)) for t in texts)


def _llm(engine: FusionEngine, tmp_path: Path, **kwargs: Any) -> ChatFusionRAG:
    return ChatFusionRAG(engine=engine, max_tokens=3, learned_dir=str(tmp_path / "learned"), **kwargs)


def _learned(llm: ChatFusionRAG) -> LearnedCaches:
    learned = llm.reuse_session().learned()
    assert learned is not None, "nothing was learned"
    return learned


def _meta(message: Any) -> Mapping[str, Any]:
    assert isinstance(message, AIMessage)
    return message.response_metadata


# ---- item 3: today's tutorials reuse from the second ask ------------------------------------------

def test_langchain_v1_two_step_chain_reuses_its_context_from_the_second_ask(
        engine: FusionEngine, vector_store: InMemoryVectorStore, tmp_path: Path) -> None:
    """Defect: `create_agent` + `dynamic_prompt` calling `similarity_search` reused 0 tokens on every ask."""
    llm = _llm(engine, tmp_path)

    @dynamic_prompt
    def prompt_with_context(request: ModelRequest) -> str:  # as in LangChain's RAG tutorial (v1)
        last_query = request.state["messages"][-1].text
        retrieved_docs = vector_store.similarity_search(last_query)
        docs_content = "\n\n".join(doc.page_content for doc in retrieved_docs)
        return f"{INSTRUCTION}\n\n{docs_content}"

    agent = create_agent(llm, tools=[], middleware=[prompt_with_context])
    asks = [agent.invoke({"messages": [{"role": "user", "content": QUESTION}]}) for _ in range(2)]
    first, second = (_meta(ask["messages"][-1]) for ask in asks)
    repeated = _tokens(engine, [d.page_content for d in vector_store.similarity_search(QUESTION)])
    assert first["reused_tokens"] == 0
    assert second["reused_tokens"] >= 0.7 * repeated, (second["reused_tokens"], repeated)
    assert second["cache_misses"] == 0


def test_langgraph_chat_with_memory_reuses_the_retrieved_text_of_its_system_message(
        engine: FusionEngine, vector_store: InMemoryVectorStore, tmp_path: Path) -> None:
    """Defect: a LangGraph chat whose system message holds retrieved text reused 0 tokens on every turn."""
    llm = _llm(engine, tmp_path)

    def call_model(state: MessagesState) -> dict[str, Any]:
        docs = vector_store.similarity_search(state["messages"][-1].text)
        system = SystemMessage(f"{INSTRUCTION}\n\n" + "\n\n".join(d.page_content for d in docs))
        return {"messages": [llm.invoke([system, *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_edge(START, "model")
    app = graph.compile(checkpointer=MemorySaver())
    thread: RunnableConfig = {"configurable": {"thread_id": "1"}}
    first = _meta(app.invoke(MessagesState(messages=[HumanMessage(QUESTION)]), thread)["messages"][-1])
    second = _meta(app.invoke(MessagesState(messages=[HumanMessage(FOLLOW_UP)]), thread)["messages"][-1])
    repeated = set(d.page_content for d in vector_store.similarity_search(QUESTION)) & set(
        d.page_content for d in vector_store.similarity_search(FOLLOW_UP))
    assert len(repeated) >= 2
    assert first["reused_tokens"] == 0
    assert second["reused_tokens"] >= 0.7 * _tokens(engine, sorted(repeated)), second


def test_a_hand_built_chat_message_list_reuses_its_context_from_the_second_ask(
        engine: FusionEngine, tmp_path: Path) -> None:
    """Defect: a raw list of chat messages (as an HTTP API receives them) reused 0 tokens on every ask."""
    llm = _llm(engine, tmp_path)

    def ask(question: str, texts: Sequence[str]) -> Mapping[str, Any]:
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "Use these notes:\n\n" + "\n\n".join(texts)
                     + f"\n\nQuestion: {question}"}]
        return _meta(llm.invoke(messages))

    first = ask(QUESTION, TEXTS)
    second = ask(FOLLOW_UP, TEXTS[::-1])  # the same notes, in another order, for another question
    assert first["reused_tokens"] == 0
    assert second["reused_tokens"] >= 0.7 * _tokens(engine, TEXTS), second
    assert second["cache_misses"] == 0
    assert set(second["chunk_found_by"]) == {content_id(t, engine.fingerprint) for t in TEXTS}


def test_a_later_turn_continues_the_exact_kv_of_the_turn_that_learned_its_spans(engine: FusionEngine,
                                                                                 tmp_path: Path) -> None:
    """Its spans were learned after the first turn, which read them as plain text: the second turn
    continues that turn's kept K/V whole (exact), instead of reading the learned spans (approximate)
    that its tokens, cut at the spans, would part from the kept ones at."""
    llm = _llm(engine, tmp_path)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Use these notes:\n\n" + "\n\n".join(TEXTS) + f"\n\nQuestion: {QUESTION}"}]
    reply = llm.invoke(messages)
    first = _meta(reply)
    assert first["reused_tokens"] == 0 and len(_learned(llm).index) > 0
    later = [*messages, {"role": "assistant", "content": str(reply.content)}, {"role": "user", "content": FOLLOW_UP}]
    second = _meta(llm.invoke(later))
    assert second["kept_prefix_tokens"] >= first["prompt_tokens"], second
    assert second["reused_tokens"] == 0 and second["exact_tokens"] == second["prompt_tokens"]
    # NOTE: what the second turn adds that is new is learned after its answer, as any first-seen text
    assert second["chunk_found_by"] == {} and set(second["cache_miss_reasons"].values()) <= {PENDING_REASON}


def _ask(llm: ChatFusionRAG, messages: Sequence[Mapping[str, str]]) -> Mapping[str, Any]:
    return _meta(llm.invoke([dict(m) for m in messages]))


def _notes(question: str, texts: Sequence[str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"{INSTRUCTION}\n\n" + "\n\n".join(texts)},
            {"role": "user", "content": question}]


def _prose(seed: int, words: int) -> str:
    """A paragraph of made-up words, the same for the same seed."""
    rng = random.Random(seed)
    return " ".join("".join(rng.choice("aeioulmnrstk") for _ in range(rng.randint(2, 9))) for _ in range(words))


# ---- item 1: spans are cut by content, and learned from any prompt ----------------------------------

def test_the_same_text_gets_the_same_spans_whatever_precedes_it() -> None:
    """The cut depends on the text alone: a paragraph keeps its spans after any preamble, and inside
    a long paragraph the cuts agree again after its first cut."""
    paragraph = _prose(1, 2500)
    assert len(paragraph) > 5 * MAX_SPAN_CHARS
    spans = cut_spans(paragraph)
    assert len(spans) > 5
    for preamble in ("Context:", "A different and much longer preamble, which is a span of its own, surely."):
        assert [s for s in cut_spans(f"{preamble}\n\n{paragraph}") if s != preamble] == spans
    shifted = cut_spans(f"Some other opening sentence, in the same paragraph. {paragraph}")
    assert shifted[1:] == spans[1:] and shifted[0] != spans[0]


def test_spans_stay_within_their_bounds_and_cut_at_word_boundaries() -> None:
    text = "\n\n".join([_prose(2, 3000), "too short", _prose(3, 40), "x" * (3 * MAX_SPAN_CHARS)])
    spans = cut_spans(text)
    assert "too short" not in spans and _prose(3, 40) in spans
    assert all(MIN_SPAN_CHARS <= len(s) <= MAX_SPAN_CHARS for s in spans)
    words = set(text.split())
    assert all(w in words for s in spans[:-3] for w in s.split())  # no word of the prose is cut in two


def test_a_sentence_repeated_a_thousand_times_is_a_few_spans_not_a_thousand() -> None:
    sentence = "The lamp is lit at dusk."
    for text in (f"{sentence} " * 1000, f"{sentence}\n" * 1000, f"{sentence} {sentence} {sentence}\n\n" * 1000):
        spans = cut_spans(text)
        assert len(spans) >= 1 and len(set(spans)) <= 3, [s[:40] for s in set(spans)]


def test_the_system_prompt_the_question_and_marked_text_are_not_spans() -> None:
    doc, other = _prose(4, 30), _prose(5, 30)
    contents = [f"{INSTRUCTION}\n\n{doc}", f"Notes: {mark_chunk('abc', other)}\n\n{other}\n\n{LONG_QUESTION}"]
    assert conversation_spans(contents) == [doc, other]
    assert conversation_spans([f"{LONG_QUESTION}"]) == []


def test_the_instruction_the_question_and_the_template_are_not_learned(engine: FusionEngine, tmp_path: Path) -> None:
    """Only the context is learned: the system prompt's opening paragraph stays in the prefix (its
    cache is memoised), the question is new in every request, the template's text is in no message."""
    llm = _llm(engine, tmp_path)
    _ask(llm, _notes(LONG_QUESTION, TEXTS))
    ids = {content_id(t, engine.fingerprint) for t in TEXTS}
    assert _learned(llm).index.chunk_ids() == ids
    second = _ask(llm, _notes(LONG_QUESTION, TEXTS))
    assert set(second["chunk_found_by"]) == ids and set(second["chunk_found_by"].values()) == {"content"}
    # no system message: the chat template's own default system prompt is not learned either
    other = _llm(engine, tmp_path / "no-system")
    _ask(other, [{"role": "user", "content": "Notes:\n\n" + "\n\n".join(TEXTS) + f"\n\n{LONG_QUESTION}"}])
    assert _learned(other).index.chunk_ids() == ids


def test_retrieved_documents_keep_their_own_boundaries(engine: FusionEngine, vector_store: InMemoryVectorStore,
                                                       tmp_path: Path) -> None:
    """With retriever callbacks, the documents say where documents are: a document is learned whole,
    even where it holds several paragraphs, and the text around it is not cut into spans."""
    two = f"{TEXTS[0]}\n\n{TEXTS[1]}"
    llm = _llm(engine, tmp_path)
    session = llm.reuse_session()
    sources = session.sources(llm.request_options({}))
    messages = _notes(LONG_QUESTION, [two, TEXTS[2]])
    # NOTE: a piece seen for the first time stays text in the prompt and waits to be learned (`pending`)
    session.prompt(messages, sources, retrieved=[two])
    assert [cid for cid, _ in sources.pending] == [content_id(two, engine.fingerprint)]
    session.prompt(messages, sources)
    assert [cid for cid, _ in sources.pending] == [content_id(t, engine.fingerprint) for t in TEXTS[:3]]


# ---- item 6: bounds and bad input -----------------------------------------------------------------

def test_a_stream_of_never_repeating_prompts_stays_within_the_learned_byte_bound(
        engine: FusionEngine, tmp_path: Path) -> None:
    bound = 40_000  # NOTE: a few spans of this tiny model (~256 bytes per token in float16, two variants each)
    llm = _llm(engine, tmp_path, learned_max_bytes=bound)
    blobs = tmp_path / "learned" / "kv"
    for i in range(12):
        texts = [_prose(100 * i + j, 16) for j in range(3)]
        _ask(llm, _notes(LONG_QUESTION, texts))
        learned = _learned(llm)
        assert 0 < learned.nbytes <= bound
        # what a lookup reads stays bounded too: evicted spans leave the content index and the disk
        assert len(learned.index) == len(learned) == len({f.name.split(".")[0] for f in blobs.rglob("*")
                                                          if f.is_file() and not f.name.startswith(".")})
    assert len(learned) < 12 * 3  # spans were evicted: the stream learned 36
    last = _ask(llm, _notes(FOLLOW_UP, texts))
    assert last["reused_tokens"] > 0  # the newest spans are the ones kept


def test_a_prompt_of_one_sentence_repeated_a_thousand_times_learns_a_few_spans(
        smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None, tmp_path: Path) -> None:
    config = LlamaConfig(vocab_size=len(smollm_tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=4096)
    torch.manual_seed(0)
    engine = FusionEngine(LlamaForCausalLM(config).eval(), smollm_tokenizer, name="tiny-llama-4k")
    llm = _llm(engine, tmp_path)
    messages = _notes(LONG_QUESTION, ["Go on. " * 1000])
    first = _ask(llm, messages)
    assert first["prompt_tokens"] > 3000
    assert 1 <= len(_learned(llm)) <= 3
    second = _ask(llm, messages)
    assert second["reused_tokens"] >= 0.7 * 3000, second


def test_text_that_only_looks_like_a_learned_span_reuses_nothing(engine: FusionEngine, tmp_path: Path) -> None:
    llm = _llm(engine, tmp_path)
    _ask(llm, _notes(LONG_QUESTION, TEXTS))
    assert _ask(llm, _notes(LONG_QUESTION, TEXTS))["reused_tokens"] > 0
    # homoglyphs (Cyrillic e): the same look, other characters: no span is found
    lookalike = [t.replace("e", "\u0435") for t in TEXTS]
    assert _ask(llm, _notes(LONG_QUESTION, lookalike))["reused_tokens"] == 0
    # a learned cache under a text's id whose token ids are another text's: found, never reused
    learned = _learned(llm)
    source, target = content_id(TEXTS[0], engine.fingerprint), content_id(TEXTS[1], engine.fingerprint)
    kv = learned.store.get(source, "fused", fingerprint=engine.fingerprint)
    learned.store.put(target, kv)
    meta = _ask(llm, _notes(LONG_QUESTION, [TEXTS[1]]))
    assert meta["reused_tokens"] == 0 and "token ids" in meta["cache_miss_reasons"][target]
