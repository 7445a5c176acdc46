"""Learning changes no answer: a request that reuses nothing equals a plain prefill, learning on or off.

Issue 44, item 3: with learning on, the context of a first-time request was cut into learnable
spans, each tokenized on its own, so the model read other tokens than a plain prefill of the same
messages (first-token KL 0.012-0.019 on SmolLM2, other greedy text), although nothing was reused.
A 2-layer random Llama over the real SmolLM2 tokenizer and chat template (the splits are the real ones).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_integrations.request import RequestOptions
from fusionrag_integrations.session import ReuseConfig, ReuseSession
from tests.ingest_worker import tiny_engine

WORDS = (
    "harbour", "lantern", "copper", "ledger", "meadow", "quarry", "saddle", "timber", "vessel", "walnut",
    "orchard", "beacon", "granite", "pepper", "spindle", "thimble", "tallow", "cobalt", "ferry", "hollow",
)


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer)


def conversation(seed: int) -> list[dict[str, Any]]:
    """A system prompt, two paragraphs of made-up context and a question: spans are cut from it."""
    rng = random.Random(seed)

    def paragraph() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 220))).capitalize() + "."
    return [{"role": "system", "content": f"Answer from the context.\n\n{paragraph()}\n\n{paragraph()}"},
            {"role": "user", "content": f"Which {rng.choice(WORDS)} is named first?"}]


PROMPTS = [conversation(seed) for seed in range(20)]


def answer(session: ReuseSession, messages: list[dict[str, Any]], **options: Any) -> Generation:
    pieces = list(session.answer(messages, RequestOptions(SamplingConfig(max_new_tokens=4), **options)))
    generation = pieces[-1]
    assert isinstance(generation, Generation)
    return generation


def plain_prefill(engine: FusionEngine, messages: list[dict[str, Any]]) -> Generation:
    """Full attention over the chat template's tokens: no chunk found, no cache."""
    prompt = engine.prompt_from_messages(messages)
    return engine.full_attention(prompt, sampling=SamplingConfig(max_new_tokens=4)).collect()


def test_a_request_that_reuses_nothing_equals_a_plain_prefill_with_learning_on_or_off(
        engine: FusionEngine, tmp_path: Path) -> None:
    """Defect: with learning on, a first-time request's spans were tokenized apart from their context."""
    for learn in (True, False):
        session = ReuseSession(engine, None, ReuseConfig(learn=learn, learned_dir=tmp_path / f"learned-{learn}"))
        for messages in PROMPTS:
            served = answer(session, messages)
            plain = plain_prefill(engine, messages)
            assert served.reused_tokens == served.recomputed_tokens == 0
            assert served.prompt_tokens == plain.prompt_tokens, f"learn={learn}: the prompt was tokenized differently"
            torch.testing.assert_close(served.first_token_logits, plain.first_token_logits, rtol=1e-4, atol=1e-4)
            assert served.token_ids == plain.token_ids


TOP = 5  # NOTE: the first token's top log-probabilities the server's answer is compared by


def test_the_server_answers_a_first_time_request_as_a_plain_prefill(engine: FusionEngine, tmp_path: Path) -> None:
    """The same through the OpenAI server, learning on: greedy text (4 tokens) and the first token's top
    log-probabilities, the logits as far as the API shows them."""
    from fusionrag_integrations.openai_server import ServerConfig, create_app
    from tests.http_server import running_app

    session = ReuseSession(engine, None, ReuseConfig(learned_dir=tmp_path / "server"))
    with running_app(create_app(session, ServerConfig())) as url:
        for messages in PROMPTS:
            plain = plain_prefill(engine, messages)
            body = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                              json={"messages": messages, "max_tokens": 4, "temperature": 0,
                                    "logprobs": True, "top_logprobs": TOP}).json()
            assert body["choices"][0]["message"]["content"] == engine.tokenizer.decode(plain.token_ids)
            assert body["fusionrag"]["reused_tokens"] == 0
            served = [t["logprob"] for t in body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]]
            expected = torch.log_softmax(plain.first_token_logits.float(), dim=-1).topk(TOP).values
            torch.testing.assert_close(torch.tensor(served), expected, rtol=1e-4, atol=1e-4)


def test_both_integrations_answer_a_first_time_request_as_a_plain_prefill(
        engine: FusionEngine, tmp_path: Path) -> None:
    """The same through ChatFusionRAG and the LlamaIndex LLM, learning on (greedy text: 4 tokens)."""
    from llama_index.core.base.llms.types import ChatMessage

    from fusionrag_integrations.langchain import ChatFusionRAG
    from fusionrag_integrations.llama_index import FusionRAGLLM

    expected = [engine.tokenizer.decode(plain_prefill(engine, m).token_ids) for m in PROMPTS]
    chat = ChatFusionRAG(engine=engine, max_tokens=4, learned_dir=str(tmp_path / "langchain"))
    llm = FusionRAGLLM(engine=engine, max_new_tokens=4, learned_dir=str(tmp_path / "llama_index"))
    for messages, text in zip(PROMPTS, expected, strict=True):
        assert chat.invoke([(m["role"], m["content"]) for m in messages]).content == text
        answer = llm.chat([ChatMessage(role=m["role"], content=m["content"]) for m in messages])
        assert answer.message.content == text
