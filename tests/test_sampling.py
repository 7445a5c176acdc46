"""Sampling through transformers' logits processors: greedy and penalised greedy equal `generate`,
warpers keep what transformers keeps, stop strings fire where transformers' StopStringCriteria does."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase
from transformers.generation.stopping_criteria import StopStringCriteria

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.sampling import Sampler, SamplingConfig, TextAssembler


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=len(smollm_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return FusionEngine(LlamaForCausalLM(config).eval(), smollm_tokenizer, name="tiny")


def _hf_greedy(engine: FusionEngine, ids: torch.Tensor, max_new_tokens: int, **kwargs: float) -> list[int]:
    out = engine.model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), do_sample=False,
                                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, eos_token_id=None,
                                pad_token_id=0, top_k=None, top_p=None, temperature=None, **kwargs)
    return [int(t) for t in out[0, ids.numel():]]


@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_greedy_equals_transformers_generate(engine: FusionEngine, penalty: float) -> None:
    prompt = engine.prompt("Which town?", chunks=["Ada Vell was born in Marrow.", "Marrow sells salt."])
    # NOTE: EOS is disabled on both sides so both run the full budget.
    eos, engine.eos_ids = engine.eos_ids, set()
    try:
        ours = engine.full_attention(prompt, sampling=SamplingConfig(max_new_tokens=6, repetition_penalty=penalty))
        tokens = ours.collect().token_ids
    finally:
        engine.eos_ids = eos
    assert tokens == _hf_greedy(engine, prompt.token_ids(), 6, repetition_penalty=penalty)


def test_unprocessed_greedy_is_plain_argmax() -> None:
    logits = torch.randn(4096, dtype=torch.bfloat16)
    sampler = Sampler(SamplingConfig())
    assert len(sampler.processors) == 0
    assert sampler(logits) == int(torch.argmax(logits))


def test_repetition_penalty_counts_the_prompt_and_the_answer() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert Sampler(SamplingConfig(repetition_penalty=2.0), torch.tensor([1]))(logits) == 2
    sampler = Sampler(SamplingConfig(repetition_penalty=2.0))
    assert sampler(logits) == 1
    assert sampler(logits) == 2  # token 1 is now in the answer


def test_warpers_keep_what_transformers_keeps() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    top_k = Sampler(SamplingConfig(temperature=1.0, top_k=2, seed=0))
    assert {top_k(logits) for _ in range(100)} == {0, 1}
    # min_p=0.3: kept tokens have at least 0.3 x the top token's probability (e^-1 > 0.3 > e^-2)
    min_p = Sampler(SamplingConfig(temperature=1.0, min_p=0.3, seed=0))
    assert {min_p(logits) for _ in range(100)} == {0, 1}
    names = [type(p).__name__ for p in SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1,
                                                      repetition_penalty=1.1).logits_processors()]
    assert names == ["RepetitionPenaltyLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper",
                     "TopPLogitsWarper", "MinPLogitsWarper"]


@pytest.mark.parametrize("kwargs", [{"top_k": -1}, {"min_p": 1.5}, {"repetition_penalty": 0.0}])
def test_invalid_new_knobs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "stop"), [
    ("Paris is nice.\nQuestion: next one", "\nQuestion"),
    ("The answer is stopped here", "stop"),
    ("a lighthouse, a lamp", "house,"),
    ("no match at all", "xyz"),
])
def test_stop_strings_fire_at_the_token_transformers_stops_at(
    smollm_tokenizer: PreTrainedTokenizerBase, text: str, stop: str
) -> None:
    ids = smollm_tokenizer(text, add_special_tokens=False)["input_ids"]
    criteria = StopStringCriteria(smollm_tokenizer, [stop])
    theirs = next((i for i in range(len(ids)) if bool(criteria(torch.tensor([ids[: i + 1]]), None)[0])), None)
    assembler = TextAssembler(smollm_tokenizer, [stop])
    ours = next((i for i, t in enumerate(ids) if (assembler.add(t), assembler.stopped)[1]), None)
    assert ours == theirs
    if ours is not None:
        assert assembler.text == text[: text.index(stop)]  # NOTE: LangChain's convention: the stop is cut
