"""Sampling, stop strings and streaming."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.sampling import Sampler, SamplingConfig, TextAssembler


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return FusionEngine(LlamaForCausalLM(config).eval(), smollm_tokenizer, name="tiny")


def test_greedy_takes_argmax_and_top_p_keeps_the_nucleus() -> None:
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert Sampler(SamplingConfig())(logits) == 1
    nucleus = Sampler(SamplingConfig(temperature=1.0, top_p=0.5, seed=0))
    assert {nucleus(logits) for _ in range(50)} == {1}  # token 1 alone holds > 50% of the mass
    wide = Sampler(SamplingConfig(temperature=1.0, top_p=1.0, seed=0))
    assert {wide(logits) for _ in range(200)} >= {1, 2}


def test_seeded_sampling_is_reproducible() -> None:
    logits = torch.randn(100)
    a = Sampler(SamplingConfig(temperature=1.0, seed=7))
    b = Sampler(SamplingConfig(temperature=1.0, seed=7))
    assert [a(logits) for _ in range(20)] == [b(logits) for _ in range(20)]


def test_invalid_sampling_is_refused() -> None:
    for kwargs in ({"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}):
        with pytest.raises(InvalidRequestError):
            SamplingConfig(**kwargs)  # type: ignore[arg-type]


def test_stop_string_is_cut_and_never_streamed(smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    ids = smollm_tokenizer("Paris is nice.\nQuestion: next", add_special_tokens=False)["input_ids"]
    assembler = TextAssembler(smollm_tokenizer, stop=["\nQuestion"])
    streamed = ""
    for token in ids:
        streamed += assembler.add(token)
        if assembler.stopped:
            break
    streamed += assembler.flush()
    assert assembler.stopped
    assert streamed == assembler.text == "Paris is nice."


def test_stream_pieces_add_up_to_the_result(engine: FusionEngine) -> None:
    prompt = engine.prompt("What is it?", chunks=["A tiny passage about nothing in particular."])
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.8, seed=3)
    stream = engine.stream(prompt, sampling=sampling, selector="all")
    pieces = list(stream)
    assert stream.result is not None
    assert "".join(pieces) == stream.result.text
    again = engine.generate(prompt, sampling=sampling, selector="all")
    assert again.token_ids == stream.result.token_ids  # same seed, same tokens
    assert stream.result.finish_reason in ("stop", "length")
    assert len(stream.result.token_ids) <= 12
