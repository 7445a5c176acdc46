"""Statistics that add up, and a no-reuse warning only where documents were expected to be reused.

Defects pinned here:

* tokens of the system prefix served from the engine's in-memory prefix cache were counted neither
  as reused nor as prefilled, so `reused + recomputed + prefilled` fell short of `prompt_tokens`
  (e.g. 69 of 84) and `reuse_ratio` understated reuse;
* the reuse monitor warned ("reused no KV cache ... ingest these documents") on prompts with no
  document at all: a plain chat turn, an agent's ReAct header, LlamaIndex's condense prompt.

A tiny random Llama over the real SmolLM2 tokenizer (the splits are the real ones).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from llama_index.core import VectorStoreIndex
from llama_index.core.agent.react.prompts import REACT_CHAT_SYSTEM_HEADER
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.chat_engine.condense_question import DEFAULT_TEMPLATE as CONDENSE_TEMPLATE
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import TextNode
from transformers import PreTrainedTokenizerBase

from fusionrag_core import demo
from fusionrag_core.cli import main
from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.index import FusionIndex, IngestConfig
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.reuse.sources import ReuseMonitor, ReuseSources
from fusionrag_core.store import DiskKVStore
from fusionrag_integrations.langchain import ChatFusionRAG, FusionRAGRetriever
from fusionrag_integrations.llama_index import FusionRAGLLM
from tests.ingest_worker import tiny_engine
from tests.lighthouse import QUESTION, TEXTS
from tests.test_reuse_langchain import SYSTEM_PROMPT, Results, format_docs

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingConfig(max_new_tokens=2)
PARTS = ("reused_tokens", "recomputed_tokens", "prefilled_tokens", "prefix_cached_tokens")


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer)


@pytest.fixture(scope="module")
def index(engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FusionIndex]:
    index = FusionIndex.open(engine, tmp_path_factory.mktemp("index"), config=IngestConfig(chunk_tokens=48,
                                                                                          neighbours=1))
    index.add_texts(TEXTS)
    yield index
    index.close()


def _adds_up(stats: Mapping[str, Any]) -> None:
    """Every prompt token is in exactly one of the four counts, and reuse_ratio is what was not computed."""
    assert sum(stats[k] for k in PARTS) == stats["prompt_tokens"], {k: stats[k] for k in (*PARTS, "prompt_tokens")}
    assert stats["reuse_ratio"] == pytest.approx(
        (stats["reused_tokens"] + stats["prefix_cached_tokens"]) / stats["prompt_tokens"])


# ---- statistics that add up ------------------------------------------------------------------------
def test_engine_statistics_add_up_with_the_prefix_cache_cold_and_warm(engine: FusionEngine,
                                                                      index: FusionIndex) -> None:
    hits = index.search(QUESTION, 3)
    chunks = [(h.chunk_id, h.text) for h in hits]
    prompt = engine.prompt(QUESTION, chunks, instruction="Answer in one word, from the passages above only.")
    prefix = int(prompt.prefix.shape[0])
    cold = engine.stream(prompt, store=index.store, sampling=GREEDY).collect()
    warm = engine.generate(prompt, store=index.store, sampling=GREEDY)
    for g in (cold, warm):
        _adds_up(g.stats())
        assert g.reused_tokens > 0
    assert cold.prefix_cached_tokens == 0, "a prefix never seen is computed: prefilled"
    assert warm.prefix_cached_tokens == prefix and warm.prefilled_tokens == cold.prefilled_tokens - prefix
    assert warm.reuse_ratio > cold.reuse_ratio
    full = engine.full_attention(prompt, sampling=GREEDY).collect()
    _adds_up(full.stats())
    assert (full.prefilled_tokens, full.prefix_cached_tokens, full.reuse_ratio) == (full.prompt_tokens, 0, 0.0)


def test_index_answer_and_a_chat_prompt_repeated_add_up(engine: FusionEngine, index: FusionIndex) -> None:
    generation, _ = index.answer(QUESTION, k=3, sampling=GREEDY)
    _adds_up(generation.stats())
    sources = ReuseSources(index.store, None)
    messages = [{"role": "system", "content": "Use the context.\n\n" + "\n\n".join(TEXTS[:3])},
                {"role": "user", "content": QUESTION}]
    first, second = (engine.generate(sources.prompt(engine, messages), store=sources, sampling=GREEDY)
                     for _ in range(2))
    for g in (first, second):
        _adds_up(g.stats())
    assert second.prefix_cached_tokens > 0, "the chat header before the first chunk is served from the prefix cache"


def test_cli_ask_prints_counts_that_add_up(engine: FusionEngine, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, text in enumerate(TEXTS):
        (docs / f"d{i}.md").write_text(text)
    db = ["--db", str(tmp_path / "db")]
    assert main([*db, "ingest", str(docs), "--quiet", "--chunk-tokens", "64"], engine_factory=lambda _: engine) == 0
    line = re.compile(r"prompt (\d+) tokens = reused (\d+) \+ recomputed (\d+) \([\d.]+%\) \+ prefilled (\d+) "
                      r"\+ prefix cache (\d+) \|")
    for extra in ([], [], ["--full-attention"]):
        capsys.readouterr()
        assert main([*db, "ask", QUESTION, "--max-tokens", "2", "-k", "3", *extra],
                    engine_factory=lambda _: engine) == 0
        found = line.search(capsys.readouterr().out)
        assert found, "the statistics line shows every part of the prompt"
        prompt, *parts = map(int, found.groups())
        assert sum(parts) == prompt, found[0]


def test_langchain_metadata_and_usage_add_up_on_invoke_and_stream(engine: FusionEngine, index: FusionIndex,
                                                                 tmp_path: Path) -> None:
    llm = ChatFusionRAG(index=index, max_tokens=2, learned_dir=str(tmp_path / "learned"))
    chain = {"context": FusionRAGRetriever(index=index, k=3) | format_docs,
             "question": RunnablePassthrough()} | SYSTEM_PROMPT | llm
    invoked = [chain.invoke(QUESTION) for _ in range(2)]
    streamed = list(chain.stream(QUESTION))[-1]
    for message in (*invoked, streamed):
        meta, usage = message.response_metadata, message.usage_metadata
        _adds_up(meta)
        assert usage is not None and usage["input_tokens"] == meta["prompt_tokens"]
        assert usage.get("input_token_details", {}).get("cache_read") == (
            meta["reused_tokens"] + meta["prefix_cached_tokens"])
    assert invoked[1].response_metadata["prefix_cached_tokens"] > 0


def test_llama_index_responses_add_up_on_complete_chat_and_query(engine: FusionEngine, index: FusionIndex,
                                                                 tmp_path: Path) -> None:
    llm = FusionRAGLLM(engine=engine, kv_store=index.store, max_new_tokens=2, learned_dir=str(tmp_path / "learned"))
    context = "\n\n".join(TEXTS[:3])
    for _ in range(2):
        _adds_up(llm.complete(f"Context:\n{context}\n\nQuestion: {QUESTION}").additional_kwargs)
        _adds_up(llm.chat([ChatMessage(role="system", content=f"Context:\n{context}"),
                           ChatMessage(role="user", content=QUESTION)]).additional_kwargs)
    *_, last = llm.stream_complete(f"Context:\n{context}\n\nQuestion: {QUESTION}")
    _adds_up(last.additional_kwargs)
    nodes = [TextNode(text=t, embedding=[float(i == j) for j in range(4)]) for i, t in enumerate(TEXTS)]
    query_engine = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=4)).as_query_engine(
        llm=llm, similarity_top_k=3, response_mode="refine")
    response = query_engine.query(QUESTION)
    assert response.metadata is not None
    _adds_up(response.metadata)


def test_demo_counts_row_shows_the_prefix_cache_and_adds_up(engine: FusionEngine, index: FusionIndex) -> None:
    prompt = index.prompt_for(QUESTION, index.search(QUESTION, 3))
    generation = index.stream(prompt, sampling=GREEDY).collect()
    row = demo._counts_row("FusionRAG", generation)
    counts = [int(v) for v in row.split(" s", 1)[1].split()]
    assert counts == [generation.reused_tokens, generation.recomputed_tokens, generation.prefilled_tokens,
                      generation.prefix_cached_tokens, generation.prompt_tokens]
    assert sum(counts[:4]) == counts[4]


def test_an_unbalanced_generation_is_refused() -> None:
    """The partition is checked where a Generation's counts are finalised: a count that loses a
    token raises instead of reporting a ratio that does not add up."""
    stats = Generation(text="", token_ids=[], finish_reason="stop", ttft_s=0.0, total_s=0.0, prompt_tokens=10,
                       reused_tokens=4, recomputed_tokens=1, selector="none", ratio=None, kv_bytes_loaded=0,
                       first_token_logits=torch.zeros(1),
                       prefilled_tokens=3, prefix_cached_tokens=2)
    assert stats.token_partition() == {"reused_tokens": 4, "recomputed_tokens": 1, "prefilled_tokens": 3,
                                       "prefix_cached_tokens": 2}
    stats.prefilled_tokens = 2
    with pytest.raises(AssertionError, match="9 of 10"):
        stats.token_partition()


# ---- the warning only where it helps ----------------------------------------------------------------
def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "fusionrag"]


def _chatty_system() -> str:
    # NOTE: long enough that the old rule (64 tokens besides the canonical prefix) fired.
    return ("You are a friendly assistant for the harbour museum. Be polite and brief. If you do not know, say "
            "so. Never make up opening hours. Answer in the language of the visitor, and keep it to a few lines. "
            "Greet returning visitors warmly, mention the lighthouse exhibition when asked what is new, and "
            "suggest the café on the quay when someone asks where to eat.")


def test_a_plain_chat_turn_never_warns(engine: FusionEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    llm = ChatFusionRAG(engine=engine, store=DiskKVStore(tmp_path / "kv"), max_tokens=2,
                        learned_dir=str(tmp_path / "learned"))
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        message = llm.invoke([SystemMessage(_chatty_system()), HumanMessage("Hi! Is the museum open on Sunday?")])
    assert message.response_metadata["prompt_tokens"] > 90 and message.response_metadata["context_tokens"] == 0
    assert _warnings(caplog) == []


def test_an_agent_react_header_never_warns(engine: FusionEngine, tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    tools = "".join(f"> Tool Name: {name}\nTool Description: {what}\nTool Args: {{\"properties\": {{\"input\": "
                    f"{{\"title\": \"Input\", \"type\": \"string\"}}}}, \"required\": [\"input\"], \"type\": "
                    "\"object\"}\n\n" for name, what in (("search", "Search the museum's catalogue."),
                                                         ("hours", "Opening hours of a given day.")))
    header = REACT_CHAT_SYSTEM_HEADER.replace("{tool_desc}", tools).replace("{tool_names}", "search, hours")
    llm = FusionRAGLLM(engine=engine, kv_store=DiskKVStore(tmp_path / "kv"), max_new_tokens=2,
                       learned_dir=str(tmp_path / "learned"))
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        response = llm.chat([ChatMessage(role="system", content=header),
                             ChatMessage(role="user", content="Is the museum open on Sunday?")])
    assert response.additional_kwargs["reused_tokens"] == 0
    assert _warnings(caplog) == []


def test_a_llama_index_condense_prompt_never_warns(engine: FusionEngine, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    history = ("user: Who designed the Lumen lighthouse?\n"
               "assistant: The engineer Ada Vell designed it, in 1891, after the old light failed.\n"
               "user: Where was she born?\nassistant: In the port town of Marrow.")
    llm = FusionRAGLLM(engine=engine, kv_store=DiskKVStore(tmp_path / "kv"), max_new_tokens=2,
                       learned_dir=str(tmp_path / "learned"))
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        response = llm.complete(CONDENSE_TEMPLATE.format(chat_history=history, question="And her father?"))
    assert response.additional_kwargs["reused_tokens"] == 0
    assert _warnings(caplog) == []


def test_retrieved_documents_that_are_not_stored_warn_once_naming_the_cause(
        engine: FusionEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    vector_store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    vector_store.add_documents([Document(page_content=t) for t in TEXTS])
    retriever = vector_store.as_retriever(search_kwargs={"k": 3})
    llm = ChatFusionRAG(engine=engine, store=DiskKVStore(tmp_path / "kv"), max_tokens=2, learn=False)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | SYSTEM_PROMPT | llm
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        for _ in range(2):
            chain.invoke(QUESTION, config={"callbacks": [Results()]})
    (warning,) = _warnings(caplog)
    assert "reused no KV cache" in warning and "3 documents retrieved for this request" in warning
    assert "holds no indexed chunk text" in warning and "learning is off" in warning
    assert "changed or were split differently" not in warning, "nothing was ingested: nothing changed"


def test_a_pasted_document_without_a_retriever_warns_that_no_retriever_ran(
        engine: FusionEngine, index: FusionIndex, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Learning on, a store with chunks, a long paragraph of prose found nowhere and no retriever:
    the cause is that nothing could learn it, not that the documents changed after ingest."""
    sources = ReuseSources(index.store, None, learning=True)
    monitor = ReuseMonitor("tiny-llama")
    paragraph = " ".join(t.replace(" the ", " a ") for t in TEXTS * 2)  # NOTE: matches no stored chunk
    prompt = sources.prompt(engine, [{"role": "user", "content": f"{paragraph}\n\nQuestion: {QUESTION}"}])
    generation = engine.generate(prompt, store=sources, sampling=GREEDY)
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        cause = monitor.check(engine, prompt, generation, sources)
    (warning,) = _warnings(caplog)
    assert cause is not None and cause in warning and "no retriever" in cause
    assert "document-like" in warning
