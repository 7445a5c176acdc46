"""LangChain's standard test suites (langchain-tests) for ChatFusionRAG and FusionRAGRetriever.

The unit suite never loads weights (construction is lazy). The integration suites run the real
default model, the session's one shared engine (`default_engine`), with short generations.
Features the model does not have are declared through the suites' own properties, each with
its reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.tools import tool
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex, IngestConfig
from fusionrag_core.store import DiskKVStore, KVStore
from fusionrag_integrations.langchain import ChatFusionRAG, FusionRAGRetriever, format_docs

LOOPING_JSON = ("test_json_mode", "test_structured_output_optional_param")
"""The suite's tests the 135M model fails unforced (strict xfails below)."""
CACHED_ID = "lumen-lighthouse"
CACHED_TEXT = "The Lumen lighthouse on Gull Point was designed by the engineer Ada Vell in 1891."
CORPUS = [
    CACHED_TEXT,
    "Ada Vell was born in the port town of Marrow, where her father repaired ship clocks.",
    "Marrow lies at the mouth of the river Tell and is known for its salt market.",
    "Tessaly Instruments built the lighthouse clock; its founder was Oren Tessaly.",
]


class FusionRAGChatFeatures:
    """What a local FusionRAG chat model over SmolLM2-135M-Instruct can and cannot do."""

    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatFusionRAG

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        """The suite's standard parameters this model honours. Dropped: `timeout`, `max_retries`
        and `api_key` belong to remote APIs (generation is local: there is no request to time
        out, retry or authenticate), and the model refuses arguments it cannot honour."""
        return {"temperature": 0, "max_tokens": 100, "stop": []}

    @property
    def has_tool_calling(self) -> bool:
        """True: bind_tools shows the tools (the template's way, else the fallback format) and
        decodes calls under their schemas' grammar."""
        return True

    @property
    def has_tool_choice(self) -> bool:
        """True: "any"/"required", a tool's name or a dict force calls through the grammar."""
        return True

    @property
    def has_structured_output(self) -> bool:
        """True: with_structured_output decodes under the schema's grammar (llguidance)."""
        return True

    @property
    def supports_json_mode(self) -> bool:
        """True: method="json_mode" constrains decoding to a JSON object."""
        return True

    @property
    def supports_image_inputs(self) -> bool:
        """False: the supported models are text-only (image content is refused with an error)."""
        return False

    @property
    def supports_image_urls(self) -> bool:
        """False: text-only models."""
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        """False: text-only models; load PDFs with a document loader and ingest their text instead."""
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        """False: text-only models."""
        return False

    @property
    def supports_model_override(self) -> bool:
        """False: a model instance is bound to one loaded engine (weights, KV caches keyed by its
        fingerprint); another model means another instance."""
        return False

    @property
    def enable_vcr_tests(self) -> bool:
        """False: generation is local; there is no HTTP traffic to record."""
        return False


class TestChatFusionRAGUnit(FusionRAGChatFeatures, ChatModelUnitTests):
    """Construction, parameters and tracing metadata; no weights are loaded."""

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "smollm2-135m"}


@pytest.fixture(scope="module")
def cached_store(default_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVStore]:
    """A store holding one chunk cache of the real model (models pass it with each request)."""
    store = DiskKVStore(tmp_path_factory.mktemp("standard-kv"))
    store.put(CACHED_ID, default_engine.chunk_cache(CACHED_TEXT))
    yield store


# NOTE: `anyio` runs the suites' async tests (pytest-asyncio, in strict mode, would need a mark
# on each of them, which the suite does not carry); it leaves the sync tests alone.
@pytest.mark.slow
@pytest.mark.anyio
class TestChatFusionRAGIntegration(FusionRAGChatFeatures, ChatModelIntegrationTests):
    """Invoke, stream, async, batch, conversations, usage and stop sequences on the real model."""

    @pytest.fixture(autouse=True)
    def _shared_engine(self, default_engine: FusionEngine, cached_store: KVStore, request: pytest.FixtureRequest
                       ) -> None:
        # NOTE: the suite builds its models from `chat_model_params`, a property; the session's one
        # loaded engine reaches it through the test instance.
        self.engine = default_engine
        self.store = cached_store
        # NOTE: a budget that fits each test's answer, kept small since the machine is shared: a tool
        # call takes ~30 tokens; the structured-output joke and JSON-mode answers, free strings, more.
        # The two tests the 135M model cannot pass (below) fail the same way at 64 tokens as at 256.
        roomy = any(k in request.node.name for k in ("structured", "json_mode")) and not any(
            k in request.node.name for k in LOOPING_JSON)
        self.max_tokens = 256 if roomy else 64

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": self.engine, "store": self.store, "max_tokens": self.max_tokens}

    @pytest.mark.xfail(strict=True, raises=OutputParserException, reason=(
        "SmolLM2-135M does not close unconstrained JSON: asked for a cat joke in JSON mode it nests "
        '{"setup": {"setup": ...}} until max_tokens (256 tried). JSON mode itself works: '
        "tests/test_langchain_structured.py, and the suite's test_structured_output* with a schema."))
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(strict=True, raises=OutputParserException, reason=(
        "SmolLM2-135M repeats a phrase inside the punchline string (\"I'm a cat, I'm a cat, ...\") until "
        "max_tokens (256 tried) on the test's first prompts; the optional field itself is decoded: "
        "test_packaged_model_decodes_an_optional_field in tests/test_langchain_structured.py"))
    def test_structured_output_optional_param(self, model: BaseChatModel) -> None:
        super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(strict=True, reason=(
        "SmolLM2-135M answers 'What is the weather in San Francisco, CA?' in text instead of calling the unforced "
        "get_weather tool; the same loop with the call forced passes: test_agent_loop_with_the_call_forced below"))
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    @property
    def supported_usage_metadata_details(self) -> dict[Any, Any]:
        """Reused chunk tokens are reported as `cache_read` input tokens."""
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        model = ChatFusionRAG(**self.chat_model_params)
        context = format_docs([Document(id=CACHED_ID, page_content=CACHED_TEXT)])
        prompt = f"Context:\n{context}\nQuestion: Who designed the Lumen lighthouse?"
        if not stream:
            message = model.invoke(prompt)
            assert isinstance(message, AIMessage)
        else:
            full: AIMessageChunk | None = None
            for chunk in model.stream(prompt):
                full = chunk if full is None else full + chunk
            assert full is not None
            message = full
        # NOTE: stronger than the suite's check (an int >= 0): the cached chunk really was read.
        assert message.usage_metadata is not None
        assert message.usage_metadata.get("input_token_details", {}).get("cache_read", 0) > 0
        return message


@pytest.mark.slow
def test_agent_loop_with_the_call_forced(default_engine: FusionEngine) -> None:
    """The suite's `test_agent_loop` with `tool_choice="any"` on the first call: the call's content
    blocks, its id carried into the ToolMessage, and the answer to the tool's result."""

    @tool
    def get_weather(location: str) -> str:
        """Get the weather at a location."""
        return "It's sunny."

    model = ChatFusionRAG(engine=default_engine, max_tokens=64, temperature=0)
    question = HumanMessage("What is the weather in San Francisco, CA?")
    call = model.bind_tools([get_weather], tool_choice="any").invoke([question])
    assert any(block["type"] == "tool_call" for block in call.content_blocks)
    assert len(call.tool_calls) == 1 and isinstance(call.tool_calls[0]["args"]["location"], str)
    result = get_weather.invoke(call.tool_calls[0])
    assert isinstance(result, ToolMessage) and result.tool_call_id == call.tool_calls[0]["id"]
    answer = model.bind_tools([get_weather]).invoke([question, call, result])
    assert isinstance(answer, AIMessage) and (answer.content or answer.tool_calls)


@pytest.fixture(scope="module")
def corpus_index(default_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FusionIndex]:
    index = FusionIndex.open(default_engine, tmp_path_factory.mktemp("standard-index"),
                             config=IngestConfig(chunk_tokens=64, neighbours=2))
    index.add_texts(CORPUS)
    yield index


@pytest.mark.slow
@pytest.mark.anyio
class TestFusionRAGRetrieverIntegration(RetrieversIntegrationTests):
    """`k` in the constructor and in `invoke`, sync and async, over a FusionIndex of the real model."""

    @pytest.fixture(autouse=True)
    def _shared_index(self, corpus_index: FusionIndex) -> None:
        self.index = corpus_index

    @property
    def retriever_constructor(self) -> type[BaseRetriever]:
        return FusionRAGRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"index": self.index, "k": 2}

    @property
    def retriever_query_example(self) -> str:
        return "Who designed the Lumen lighthouse?"
