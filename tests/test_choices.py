"""n choices of one prompt (`FusionEngine.astream_choices`, OpenAI's `n`): the prompt is prepared
once (one stitch, one probe, one recompute) and decoded n times; choice i with seed s equals a
separate request with seed s + i; the choices' running slots and buffers are admitted together."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.batching import phases
from fusionrag_core.batching.scheduler import SchedulerConfig
from fusionrag_core.engine import EngineConfig, FusionEngine, Generation
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.runtime.kv import ChunkKV

PASSAGES = ("Ada Vell was born in the port town of Marrow.", "The Lumen lighthouse was designed by Ada Vell.")


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    torch.manual_seed(9)
    config = LlamaConfig(vocab_size=len(smollm_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    # NOTE: no prefix cache: every request below is computed from the chunk caches, never from another's kept K/V
    return FusionEngine(LlamaForCausalLM(config).eval(), smollm_tokenizer, name="tiny",
                        config=EngineConfig(prefix_cache=None, scheduler=SchedulerConfig(max_running=4)))


@pytest.fixture(scope="module")
def caches(engine: FusionEngine) -> dict[str, ChunkKV]:
    return {cid: engine.chunk_cache(text) for cid, text in zip("ab", PASSAGES, strict=True)}


def _prompt(engine: FusionEngine) -> FusionPrompt:
    return engine.prompt("Where was the designer born?", chunks=list(zip("ab", PASSAGES, strict=True)))


def _choices(engine: FusionEngine, n: int, sampling: SamplingConfig, caches: dict[str, ChunkKV]) -> list[Generation]:
    async def run() -> list[Generation]:
        streams = engine.astream_choices(_prompt(engine), n, sampling=sampling, caches=caches)
        return list(await asyncio.gather(*(s.collect() for s in streams)))
    return asyncio.run(run())


def test_choices_equal_separate_requests_of_consecutive_seeds(engine: FusionEngine,
                                                              caches: dict[str, ChunkKV]) -> None:
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.2, seed=40, logprobs=True)
    choices = _choices(engine, 3, sampling, caches)
    for i, choice in enumerate(choices):
        alone = engine.generate(_prompt(engine), sampling=SamplingConfig(max_new_tokens=8, temperature=1.2, seed=40 + i,
                                                                         logprobs=True), caches=caches)
        assert choice.token_ids == alone.token_ids, i
        assert choice.logprobs is not None and alone.logprobs is not None
        assert [e.logprob for e in choice.logprobs] == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-4)
        assert choice.token_partition() == alone.token_partition()
    assert len({tuple(c.token_ids) for c in choices}) > 1  # NOTE: the seeds differ, so (here) do the answers


def test_the_prompt_is_prepared_once(engine: FusionEngine, caches: dict[str, ChunkKV],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {"stitch": 0, "recompute": 0, "fork": 0}

    def counting(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(phases, "stitch_request", counting("stitch", phases.stitch_request))
    monkeypatch.setattr(phases, "recompute", counting("recompute", phases.recompute))
    monkeypatch.setattr(phases, "fork", counting("fork", phases.fork))
    choices = _choices(engine, 4, SamplingConfig(max_new_tokens=4), caches)
    assert counts == {"stitch": 1, "recompute": 1, "fork": 3}
    assert len({tuple(c.token_ids) for c in choices}) == 1  # NOTE: greedy: every choice the same answer
    assert all(torch.equal(c.first_token_logits, choices[0].first_token_logits) for c in choices)


def test_more_choices_than_running_slots_are_refused(engine: FusionEngine, caches: dict[str, ChunkKV]) -> None:
    with pytest.raises(InvalidRequestError, match="max_running"):
        _choices(engine, 5, SamplingConfig(max_new_tokens=2), caches)
    assert engine.scheduler is not None and engine.scheduler.load["running"] == 0


def test_choices_need_the_scheduler(engine: FusionEngine) -> None:
    alone = engine.with_config(EngineConfig(prefix_cache=None, scheduler=None))

    async def run() -> None:
        alone.astream_choices(_prompt(alone), 2)
    with pytest.raises(InvalidRequestError, match="scheduler"):
        asyncio.run(run())


def test_a_failed_prompt_fails_every_choice(engine: FusionEngine, caches: dict[str, ChunkKV],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("stitch broke")
    monkeypatch.setattr(phases, "stitch_request", broken)

    async def run() -> list[BaseException | Generation]:
        streams = engine.astream_choices(_prompt(engine), 3, sampling=SamplingConfig(max_new_tokens=2), caches=caches)
        return list(await asyncio.wait_for(asyncio.gather(*(s.collect() for s in streams), return_exceptions=True),
                                           60))
    results = asyncio.run(run())
    assert all(isinstance(r, RuntimeError) and "stitch broke" in str(r) for r in results), results
    scheduler = engine.scheduler
    assert scheduler is not None
    deadline = time.monotonic() + 30  # NOTE: the step hands out the error before the scheduler frees its slots
    while scheduler.load["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.load["running"] == 0
