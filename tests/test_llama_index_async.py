"""LlamaIndex async: generation runs off the event loop, pieces reach the loop as they are decoded,
and each call fires one start and one end event (CustomLLM's fallbacks fired each twice)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import (
    LLMChatEndEvent,
    LLMChatStartEvent,
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_integrations.llama_index import FusionRAGLLM

STEP_S = 0.03  # NOTE: each decode step blocks its thread this long: a stand-in for a big model's compute
TOKENS = 6


class _Events(BaseEventHandler):
    names: list[str] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "events"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, (LLMCompletionStartEvent, LLMCompletionEndEvent, LLMChatStartEvent, LLMChatEndEvent)):
            self.names.append(type(event).__name__)


@pytest.fixture(scope="module")
def slow_engine(smollm_tokenizer: PreTrainedTokenizerBase) -> Iterator[FusionEngine]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smollm_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    engine = FusionEngine(LlamaForCausalLM(config).eval(), smollm_tokenizer, name="tiny-slow")
    engine.eos_ids = set()  # every call decodes its whole budget
    batch = engine.decoder.decode_batch

    def slow_batch(*args: Any, **kwargs: Any) -> Any:
        time.sleep(STEP_S)  # blocks the calling thread, as a long kernel would
        return batch(*args, **kwargs)

    # NOTE: the engine's scheduler runs every decode step as a batch (of one request, here)
    engine.decoder.decode_batch = slow_batch  # type: ignore[method-assign]
    yield engine


@pytest.fixture
def events() -> Iterator[_Events]:
    handler = _Events()
    get_dispatcher().add_event_handler(handler)
    yield handler
    get_dispatcher().event_handlers.remove(handler)


async def _with_ticker(work: Any) -> tuple[Any, list[float]]:
    """Run `work` while a coroutine ticks every 5 ms; returns work's result and the tick times."""
    ticks: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.005)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    ticks.clear()
    try:
        result = await work
    finally:
        done.set()
        await task
    return result, ticks


def test_acomplete_leaves_the_loop_running(slow_engine: FusionEngine, events: _Events) -> None:
    llm = FusionRAGLLM(engine=slow_engine, max_new_tokens=TOKENS)
    start = time.perf_counter()
    response, ticks = asyncio.run(_with_ticker(llm.acomplete("Who designed the lighthouse?")))
    elapsed = time.perf_counter() - start
    assert response.additional_kwargs["completion_tokens"] == TOKENS
    assert elapsed > (TOKENS - 1) * STEP_S
    assert len(ticks) >= 5  # NOTE: 0 when the generation blocks the loop
    assert response.text == llm.complete("Who designed the lighthouse?").text
    assert events.names == ["LLMCompletionStartEvent", "LLMCompletionEndEvent"] * 2  # one pair per call


def test_astream_complete_streams_pieces_as_they_are_decoded(slow_engine: FusionEngine, events: _Events) -> None:
    llm = FusionRAGLLM(engine=slow_engine, max_new_tokens=TOKENS)

    async def consume() -> list[tuple[float, Any]]:
        return [(time.perf_counter(), r) async for r in await llm.astream_complete("Tell me about lamps.")]

    arrivals, ticks = asyncio.run(_with_ticker(consume()))
    responses = [r for _, r in arrivals]
    assert responses[-1].additional_kwargs["completion_tokens"] == TOKENS
    assert "".join(r.delta for r in responses) == responses[-1].text == llm.complete("Tell me about lamps.").text
    # NOTE: pieces come while decoding goes on (spread over the steps), and the loop ticks in between
    pieces = [t for t, r in arrivals if r.delta]
    assert len(pieces) >= 2 and pieces[-1] - pieces[0] > 2 * STEP_S
    assert any(pieces[0] < tick < pieces[-1] for tick in ticks)
    assert events.names[:2] == ["LLMCompletionStartEvent", "LLMCompletionEndEvent"]
    assert events.names.count("LLMCompletionStartEvent") == 2  # the astream call and the complete call


def test_achat_and_astream_chat_fire_one_event_pair_each(slow_engine: FusionEngine, events: _Events) -> None:
    llm = FusionRAGLLM(engine=slow_engine, max_new_tokens=3)
    messages = [ChatMessage(role=MessageRole.USER, content="Hello there")]

    async def both() -> tuple[Any, list[Any]]:
        reply = await llm.achat(messages)
        streamed = [r async for r in await llm.astream_chat(messages)]
        return reply, streamed

    (reply, streamed), ticks = asyncio.run(_with_ticker(both()))
    assert reply.message.content == streamed[-1].message.content
    assert reply.additional_kwargs["completion_tokens"] == 3 == streamed[-1].additional_kwargs["completion_tokens"]
    assert len(ticks) >= 3
    assert events.names == ["LLMChatStartEvent", "LLMChatEndEvent"] * 2


def test_async_errors_reach_the_caller(slow_engine: FusionEngine) -> None:
    llm = FusionRAGLLM(engine=slow_engine, max_new_tokens=2)
    with pytest.raises(InvalidRequestError, match="does not accept"):
        asyncio.run(llm.acomplete("Hi", bogus=1))

    async def stream() -> None:
        async for _ in await llm.astream_complete("Hi", bogus=1):
            pass

    with pytest.raises(InvalidRequestError, match="does not accept"):
        asyncio.run(stream())


def test_closing_a_stream_early_stops_the_worker(slow_engine: FusionEngine) -> None:
    llm = FusionRAGLLM(engine=slow_engine, max_new_tokens=40)

    async def first_piece() -> None:
        gen = await llm.astream_complete("Count to forty.")
        async for _ in gen:
            break
        await gen.aclose()

    asyncio.run(first_piece())
    time.sleep(3 * STEP_S)  # NOTE: the worker finishes its current step, then stops (40 steps would take 1.2 s)
    assert not [t for t in threading.enumerate() if t.name == "fusionrag-astream"]
