"""Healing an answer in flight (`HealConfig.answers`, a request's `heal_answer`; `batching.answer_heal`).

What is proven, on a tiny random Llama reusing fused chunk caches: with answer healing, the request's
K/V are healed between its decode steps, and once the heal has caught up every later token is full
attention's continuation of the tokens generated so far: the logits of the first token decoded over
the healed K/V equal full attention's for the same prompt and answer prefix (float tolerance), and
the greedy tokens after it equal full attention's. Without it (the control) they do not. The kept
entry of a healed answer needs no healing afterwards; the engine counts the pieces; a request that
asks for it on an engine that does not heal is refused with a clear error, as is `fusionrag serve
--heal-answers` without `--heal`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import PreTrainedTokenizerBase

import fusionrag_core.batching.phases as phases_module
from fusionrag_core.batching.heal import HealConfig
from fusionrag_core.batching.request import Request
from fusionrag_core.cli import build_parser
from fusionrag_core.engine import EngineConfig, FusionEngine, Generation
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_integrations.openai_server import command as serve_command
from tests.test_heal import _fused, _kept, _llama, _turns

PIECE = 16
SAMPLING = SamplingConfig(max_new_tokens=24)


@pytest.fixture
def step_logits(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The `[V]` logits each decode step hands a request (token j+1 is picked from entry j)."""
    seen: list[torch.Tensor] = []
    advance = phases_module.advance

    def recording(request: Request, logits: torch.Tensor) -> None:
        seen.append(logits.detach().clone())
        advance(request, logits)

    monkeypatch.setattr(phases_module, "advance", recording)
    return seen


def _engines(tokenizer: PreTrainedTokenizerBase, answers: bool,
             piece: int = PIECE) -> tuple[FusionEngine, FusionEngine]:
    """(an engine healing answers in flight or not, in pieces of `piece` tokens; full attention's reference)."""
    config = EngineConfig(heal=HealConfig(piece_tokens=piece, answers=answers))
    engine = FusionEngine(_llama(tokenizer), tokenizer, name="tiny", config=config)
    return engine, engine.with_config(dataclasses.replace(config, prefix_cache=None, heal=None))


def _continuation(fresh: FusionEngine, prompt: FusionPrompt, answer: list[int], n: int) -> Generation:
    """Full attention over `prompt` followed by `answer` (as forced tokens), `n` tokens on."""
    ids = torch.cat([prompt.token_ids(), torch.tensor(answer, dtype=torch.int64)])
    return fresh.full_attention(FusionPrompt(ids[:0], (), ids), sampling=SamplingConfig(max_new_tokens=n)).collect()


def test_after_the_heal_catches_up_the_answer_is_full_attentions_continuation(
        smollm_tokenizer: PreTrainedTokenizerBase, step_logits: list[torch.Tensor]) -> None:
    engine, fresh = _engines(smollm_tokenizer, answers=True)
    fused = _fused(engine)
    prompt, _ = _turns(engine, None)
    served = engine.generate(prompt, sampling=SAMPLING, caches=fused)
    k = served.answer_healed_at
    assert served.approximate_tokens > 0 and k is not None  # reused caches, healed within the answer
    assert 0 < k < len(served.token_ids) - 4, f"healed at token {k} of {len(served.token_ids)}: too late to check"
    reference = _continuation(fresh, prompt, served.token_ids[:k], len(served.token_ids) - k)
    torch.testing.assert_close(step_logits[k - 1], reference.first_token_logits, atol=1e-4, rtol=0)
    assert served.token_ids[k:] == reference.token_ids
    kept = _kept(engine)
    assert kept.exact_tokens == kept.num_tokens and not bool(kept.inexact.any())
    assert kept.healed is not None and int(kept.healed.sum()) >= served.approximate_tokens
    stats = engine.stats()
    assert stats["answer_heals"] == 1 and stats["answer_heal_pieces"] >= -(-served.approximate_tokens // PIECE)
    assert stats["answer_healed_tokens"] >= served.approximate_tokens


def test_a_piece_that_covers_the_prompt_heals_before_the_second_token_is_picked(
        smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    """The piece runs before the step's decode, so only the first token (picked with the prefill) is
    approximate: the second already reads the healed prompt (before, it was picked first, and only
    the third token on was full attention's continuation)."""
    engine, fresh = _engines(smollm_tokenizer, answers=True, piece=4096)
    prompt, _ = _turns(engine, None)
    served = engine.generate(prompt, sampling=SAMPLING, caches=_fused(engine))
    assert served.approximate_tokens > 0 and served.answer_healed_at == 1
    reference = _continuation(fresh, prompt, served.token_ids[:1], len(served.token_ids) - 1)
    assert served.token_ids[1:] == reference.token_ids


def test_without_answer_healing_the_answer_is_not_full_attentions_continuation(
        smollm_tokenizer: PreTrainedTokenizerBase, step_logits: list[torch.Tensor]) -> None:
    """The control: the server's answer healing off, the request's on and off."""
    engine, fresh = _engines(smollm_tokenizer, answers=False)
    fused = _fused(engine)
    prompt, _ = _turns(engine, None)
    plain = engine.generate(prompt, sampling=SAMPLING, caches=fused)
    assert plain.answer_healed_at is None and engine.stats()["answer_heal_pieces"] == 0
    reference = _continuation(fresh, prompt, plain.token_ids[:8], 1)
    assert not torch.allclose(step_logits[7], reference.first_token_logits, atol=1e-4, rtol=0)
    engine.prefix_cache.clear()  # type: ignore[union-attr]  # NOTE: the same prompt again, not a continuation
    asked = engine.generate(prompt, sampling=SAMPLING, caches=fused, heal_answer=True)
    assert asked.answer_healed_at is not None and engine.stats()["answer_heals"] == 1


def test_answer_healing_needs_an_engine_that_heals(smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    engine, fresh = _engines(smollm_tokenizer, answers=False)
    prompt, _ = _turns(engine, None)
    with pytest.raises(InvalidRequestError, match=r"EngineConfig\.heal"):
        fresh.stream(prompt, sampling=SAMPLING, heal_answer=True)


def test_serve_heal_answers_sets_the_servers_default_and_needs_heal(smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    engine, _ = _engines(smollm_tokenizer, answers=False)
    args = build_parser().parse_args(["serve", "--heal", "32", "--heal-answers"])
    served = serve_command.healing(args, engine)
    assert served.config.heal == HealConfig(piece_tokens=32, answers=True) and served.decoder is engine.decoder

    def never_loaded() -> FusionEngine:
        raise AssertionError("the model loaded before the options were checked")

    alone = build_parser().parse_args(["serve", "--heal-answers"])
    with pytest.raises(InvalidRequestError, match="--heal PIECE_TOKENS"):
        serve_command.run(alone, never_loaded, ["serve", "--heal-answers"])
