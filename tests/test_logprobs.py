"""Log-probabilities of generated tokens, and vLLM's extra sampling fields, on a tiny random model:
each logprob is the log-softmax of the model's own logits at its position (vLLM's raw logprobs,
whatever the sampling did), top-k 1 is greedy, and the repetition penalty acts as CTRL's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.logprobs import TextPiece, piece_logprobs
from fusionrag_core.query.sampling import Sampler, SamplingConfig
from fusionrag_integrations.logprobs import chat_logprobs, completion_logprobs


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=len(smollm_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return FusionEngine(LlamaForCausalLM(config).eval(), smollm_tokenizer, name="tiny")


def _model_logprobs(engine: FusionEngine, prompt_ids: torch.Tensor, answer: list[int]) -> torch.Tensor:
    """`[A, V]` log-softmax of the model's logits at each answer position (a plain forward pass)."""
    ids = torch.cat([prompt_ids, torch.tensor(answer, dtype=prompt_ids.dtype)])[None]
    with torch.no_grad():
        logits = engine.model(ids).logits[0, prompt_ids.numel() - 1:-1]  # [A, V]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=6, logprobs=True, top_logprobs=3),
    SamplingConfig(max_new_tokens=6, logprobs=True, top_logprobs=3, temperature=1.3, top_k=40, seed=4,
                   repetition_penalty=1.4),
])
def test_logprobs_are_the_log_softmax_of_the_model_logits(engine: FusionEngine, sampling: SamplingConfig) -> None:
    prompt = engine.prompt("Which town?", chunks=["Ada Vell was born in Marrow."])
    eos, engine.eos_ids = engine.eos_ids, set()  # NOTE: the whole budget, so every position is checked
    try:
        generation = engine.full_attention(prompt, sampling=sampling).collect()
    finally:
        engine.eos_ids = eos
    assert generation.logprobs is not None and len(generation.logprobs) == len(generation.token_ids) == 6
    reference = _model_logprobs(engine, prompt.token_ids(), generation.token_ids)
    for row, entry, token in zip(reference, generation.logprobs, generation.token_ids, strict=True):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        top = torch.topk(row, 3)
        assert [i for i, _ in entry.top] == top.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_greedy_picks_the_top_logprob_and_streams_carry_every_entry(engine: FusionEngine) -> None:
    prompt = engine.prompt("Where?", chunks=["Marrow is a port town."])
    stream = engine.stream(prompt, sampling=SamplingConfig(max_new_tokens=8, logprobs=True, top_logprobs=1))
    carried = [e for piece in stream for e in piece_logprobs(piece)]
    generation = stream.result
    assert generation is not None and generation.logprobs is not None
    assert all(e.top[0][0] == e.token_id for e in generation.logprobs)
    assert carried == generation.logprobs[:len(carried)]  # NOTE: held-back text reports at the end
    assert engine.generate(prompt, sampling=SamplingConfig(max_new_tokens=8)).logprobs is None


def test_top_k_1_is_greedy(engine: FusionEngine) -> None:
    prompt = engine.prompt("Who?", chunks=["Ada Vell designed the lighthouse."])
    greedy = engine.generate(prompt, sampling=SamplingConfig(max_new_tokens=8)).token_ids
    for seed in (1, 2):
        top1 = SamplingConfig(max_new_tokens=8, temperature=1.5, top_k=1, seed=seed)
        assert engine.generate(prompt, sampling=top1).token_ids == greedy


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    """CTRL's penalty, as vLLM and transformers apply it: a seen token's logit l becomes l / p when
    l > 0 and l * p otherwise; unseen tokens keep theirs."""
    logits = torch.tensor([2.0, 1.9, -0.5, -0.6])
    assert Sampler(SamplingConfig(), torch.tensor([0]))(logits.clone()) == 0
    assert Sampler(SamplingConfig(repetition_penalty=1.1), torch.tensor([0]))(logits.clone()) == 1  # 2/1.1 < 1.9
    # NOTE: -0.5 * 1.3 = -0.65 < -0.6: the seen negative token falls below the unseen one
    masked = torch.tensor([-9.0, -9.0, -0.5, -0.6])
    assert Sampler(SamplingConfig(repetition_penalty=1.3), torch.tensor([2]))(masked) == 3
    # NOTE: below 1 it rewards repetition
    assert Sampler(SamplingConfig(repetition_penalty=0.5), torch.tensor([1]))(logits.clone()) == 1


def test_logprob_settings_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="top_logprobs needs logprobs"):
        SamplingConfig(top_logprobs=2)
    with pytest.raises(InvalidRequestError, match="0 to 20"):
        SamplingConfig(logprobs=True, top_logprobs=21)


def test_openai_shapes(engine: FusionEngine) -> None:
    generation = engine.generate(engine.prompt("Hi"), sampling=SamplingConfig(max_new_tokens=4, logprobs=True,
                                                                             top_logprobs=2))
    assert generation.logprobs is not None
    chat = chat_logprobs(generation.logprobs, engine.tokenizer)
    assert chat["refusal"] is None and len(chat["content"]) == len(generation.token_ids)
    first = chat["content"][0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert bytes(first["bytes"]).decode() == first["token"] == engine.tokenizer.decode(generation.token_ids[:1])
    assert len(first["top_logprobs"]) == 2 and set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    text = completion_logprobs(generation.logprobs, engine.tokenizer, text_offset=5)
    assert text["text_offset"][0] == 5 and len(text["tokens"]) == len(text["token_logprobs"]) == 4
    assert all(len(top) <= 2 for top in text["top_logprobs"])


def test_a_text_piece_is_a_str() -> None:
    piece = TextPiece("abc", ())
    assert piece == "abc" and isinstance(piece, str) and piece_logprobs("abc") == ()


def test_langchain_chat_model_reports_logprobs_as_chat_openai_does(engine: FusionEngine, tmp_path: Path) -> None:
    from fusionrag_integrations.langchain import ChatFusionRAG

    llm = ChatFusionRAG(engine=engine, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, learn=False,
                        data_dir=tmp_path)
    message = llm.invoke("Hi")
    content = message.response_metadata["logprobs"]["content"]
    assert len(content) == message.usage_metadata["output_tokens"] and len(content[0]["top_logprobs"]) == 2
    plain = ChatFusionRAG(engine=engine, max_tokens=4, temperature=0, learn=False, data_dir=tmp_path).invoke("Hi")
    assert "logprobs" not in plain.response_metadata


def test_llama_index_llm_reports_logprobs_as_its_openai_llm_does(engine: FusionEngine, tmp_path: Path) -> None:
    from llama_index.core.llms import ChatMessage

    from fusionrag_integrations.llama_index import FusionRAGLLM

    llm = FusionRAGLLM(engine=engine, max_new_tokens=4, temperature=0, logprobs=True, top_logprobs=2, learn=False,
                       data_dir=tmp_path)
    response = llm.chat([ChatMessage(role="user", content="Hi")])
    assert response.logprobs is not None and all(len(top) == 2 for top in response.logprobs)
    assert llm.complete("Hi").logprobs is not None
    plain = FusionRAGLLM(engine=engine, max_new_tokens=4, temperature=0, learn=False, data_dir=tmp_path)
    assert plain.chat([ChatMessage(role="user", content="Hi")]).logprobs is None
