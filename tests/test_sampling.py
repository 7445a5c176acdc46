"""Sampling through transformers' logits processors: greedy and penalised greedy equal `generate`,
warpers keep what transformers keeps, stop strings fire where transformers' StopStringCriteria does."""

from __future__ import annotations

import random
import re
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

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


@pytest.mark.parametrize(("stop", "named"), [
    (("a", "b", "c", "d", "e"), "at most 4 stop strings"),
    (("x" * 1_025,), "1024 characters"),
    (("x" * 600, "y" * 425), "1024 characters"),
    (("ok", 7), "stop[1]"),
])
def test_stop_strings_over_the_limits_are_refused_naming_them(stop: tuple[str, ...], named: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(named)):
        SamplingConfig(stop=stop)


def test_stop_strings_at_the_limits_are_taken() -> None:
    assert SamplingConfig(stop=("a" * 1_021, "b", "c", "d")).stop[0] == "a" * 1_021


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


# ---- stop strings: the hold-back's work and its semantics ---------------------------------------------
class _Pieces:
    """A tokenizer over a few text pieces (id = index), decoding like real ones do at their edges:
    "~~" is one character ("é"), a lone "~" an incomplete one (U+FFFD), and " ." loses its space
    (`clean_up_tokenization_spaces`), so earlier text can change as tokens arrive."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = "".join(self.pieces[i] for i in ids)
        return text.replace("~~", "é").replace("~", "\ufffd").replace(" .", ".")


def _assembler(pieces: list[str], stop: list[str]) -> TextAssembler:
    return TextAssembler(_Pieces(pieces), stop)  # type: ignore[arg-type]


def _lines_run(run: Callable[[], object]) -> int:
    """Python lines executed by `run()`: the work done in Python, whatever the machine's speed."""
    count = 0

    def trace(frame: FrameType, event: str, arg: object) -> Any:  # NOTE: Any: typeshed's TraceFunction is private
        nonlocal count
        count += event == "line"
        return trace

    sys.settrace(trace)
    try:
        run()
    finally:
        sys.settrace(None)
    return count


@pytest.mark.parametrize("stop", ["a" * 10_000 + "b", "ab" * 5_000 + "c"])
def test_holding_back_a_stop_prefix_costs_the_same_whatever_the_stop_length(stop: str) -> None:
    def work(length: int) -> int:
        assembler = _assembler(["a", "b"], [stop[:length - 1] + stop[-1]])
        return _lines_run(lambda: [assembler.add(i % 2 if "b" in stop[:-1] else 0) for i in range(40)])

    short, long = work(100), work(len(stop))
    assert long <= 1.2 * short, f"40 tokens ran {long} lines with a {len(stop)}-character stop, {short} with 100"


def _old_assembler_output(tokenizer: _Pieces, stop: list[str], ids: list[int]) -> tuple[list[str], str, bool, str]:
    """What `TextAssembler` streamed before its hold-back became incremental (its quadratic
    hold-back, verbatim; the stop found is the earliest in the text, not the first listed)."""
    stops = [s for s in stop if s]
    seen: list[int] = []
    emitted, kept, stopped, pieces = 0, "", False, []

    def emit(upto: int) -> str:
        nonlocal emitted
        piece = kept[emitted:upto] if upto > emitted else ""
        emitted = max(emitted, upto)
        return piece

    for token in ids:
        seen.append(token)
        text = tokenizer.decode(seen)
        if text.endswith("\ufffd"):
            pieces.append("")
            continue
        kept = text
        found = [at for s in stops if (at := text.find(s, max(0, emitted - len(s)))) != -1]
        if found:
            kept, stopped = text[:min(found)], True
            pieces.append(emit(len(kept)))
            break
        hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        pieces.append(emit(len(text) - hold))
    return pieces, kept, stopped, emit(len(kept))


def test_the_incremental_hold_back_streams_what_the_quadratic_one_did() -> None:
    rng = random.Random(45)
    pieces = ["a", "b", "ab", "ba", "aab", " ", ".", " .", "a ", "~"]
    for case in range(4000):
        stop = ["".join(rng.choices("ab .é", k=rng.randint(0, 6))) for _ in range(rng.randint(0, 3))]
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randint(1, 20))]
        assembler = _assembler(pieces, stop)
        streamed = []
        for token in ids:
            streamed.append(assembler.add(token))
            if assembler.stopped:
                break
        ours = (streamed, assembler.text, assembler.stopped, assembler.flush())
        assert ours == _old_assembler_output(_Pieces(pieces), stop, ids), (case, stop, ids)


def test_a_stop_string_never_leaks_when_a_later_listed_one_comes_first() -> None:
    assembler = _assembler(["x", "ab"], ["b", "a"])
    assert assembler.add(0) == "x"
    assert assembler.add(1) == ""  # NOTE: "a" starts first: the text ends before it, not before "b"
    assert assembler.stopped
    assert assembler.text == "x"
