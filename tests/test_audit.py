"""Live quality audits (EngineConfig.audit_rate): which requests, what they record, when they run,
and that many threads sharing one engine each get their own request's audit."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.engine import EngineConfig, FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.audit import Auditor
from fusionrag_core.query.divergence import first_token_kl
from fusionrag_core.query.sampling import SamplingConfig
from tests.test_engine import CHUNKS, SMALL

QUESTIONS = [f"Question {i}: where was the designer of the lighthouse born?" for i in range(8)]
SHORT = SamplingConfig(max_new_tokens=3)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL)).eval()


def _engine(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, rate: float) -> FusionEngine:
    return FusionEngine(model, tokenizer, name="tiny", config=EngineConfig(audit_rate=rate))


def _caches(engine: FusionEngine) -> dict[str, object]:
    return {f"c{i}": engine.chunk_cache(text) for i, text in enumerate(CHUNKS)}


def _prompt(engine: FusionEngine, question: str):  # type: ignore[no-untyped-def]
    return engine.prompt(question, chunks=[(f"c{i}", t) for i, t in enumerate(CHUNKS)])


def test_the_auditor_picks_an_exact_evenly_spread_share() -> None:
    quarter = Auditor(0.25)
    assert [quarter.should_audit() for _ in range(8)] == [False, False, False, True] * 2
    assert not any(Auditor(0.0).should_audit() for _ in range(100))
    assert all(Auditor(1.0).should_audit() for _ in range(10))
    percent = Auditor(0.01)
    assert sum(percent.should_audit() for _ in range(1000)) == 10
    for bad in (-0.1, 1.5):
        with pytest.raises(InvalidRequestError, match="audit_rate"):
            Auditor(bad)
        with pytest.raises(InvalidRequestError, match="audit_rate"):
            EngineConfig(audit_rate=bad)


def test_an_audit_records_kl_and_agreement(model: LlamaForCausalLM, smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    engine = _engine(model, smollm_tokenizer, 1.0)
    caches = _caches(engine)
    prompt = _prompt(engine, QUESTIONS[0])
    exact = engine.generate(prompt, caches=caches, selector="all", sampling=SHORT)
    assert exact.audit is not None and exact.audit.kl_first_token < 1e-6 and exact.audit.first_token_agree
    reused = engine.generate(prompt, caches=caches, selector="none", sampling=SHORT)
    full = engine.full_attention(prompt, sampling=SHORT).collect()  # a baseline is never audited itself
    assert full.audit is None
    assert reused.audit is not None
    assert reused.audit.kl_first_token == pytest.approx(first_token_kl(full.first_token_logits,
                                                                       reused.first_token_logits))
    assert reused.audit.kl_first_token > 0 and reused.audit.selector == "none" and reused.audit.seconds > 0
    stats = reused.stats()
    assert stats["audit_kl_first_token"] == reused.audit.kl_first_token
    assert stats["audit_first_token_agree"] == reused.audit.first_token_agree
    summary = engine.audit_summary()
    assert summary["requests"] == 2 and summary["audited"] == 2
    assert summary["kl_first_token_mean"] == pytest.approx(reused.audit.kl_first_token / 2)
    assert summary["kl_first_token_max"] == reused.audit.kl_first_token


def test_no_audit_by_default(model: LlamaForCausalLM, smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    engine = FusionEngine(model, smollm_tokenizer)
    gen = engine.generate(_prompt(engine, QUESTIONS[0]), caches=_caches(engine), sampling=SHORT)
    assert gen.audit is None and gen.stats()["audit_kl_first_token"] is None
    assert engine.audit_summary()["audited"] == 0 and engine.audit_summary()["kl_first_token_mean"] is None


def test_the_audit_runs_after_the_answer_has_streamed(model: LlamaForCausalLM,
                                                      smollm_tokenizer: PreTrainedTokenizerBase,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(model, smollm_tokenizer, 1.0)
    caches = _caches(engine)
    calls: list[int] = []
    full_attention = engine.full_attention

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return full_attention(*args, **kwargs)

    monkeypatch.setattr(engine, "full_attention", counting)
    stream = engine.stream(_prompt(engine, QUESTIONS[0]), caches=caches,
                           sampling=SamplingConfig(max_new_tokens=6))
    pieces = 0
    for _piece in stream:
        pieces += 1
        assert not calls  # every text piece reaches the caller before the audit starts
    assert pieces > 0 and len(calls) == 1
    assert stream.result is not None and stream.result.audit is not None
    assert stream.result.ttft_s < stream.result.total_s


def test_threads_sharing_an_engine_each_get_their_own_audit(model: LlamaForCausalLM,
                                                            smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    engine = _engine(model, smollm_tokenizer, 0.5)
    caches = _caches(engine)
    prompts = [_prompt(engine, q) for q in QUESTIONS]
    with ThreadPoolExecutor(4) as pool:
        gens = list(pool.map(lambda p: engine.generate(p, caches=caches, selector="none", sampling=SHORT), prompts))
    audited = [(p, g) for p, g in zip(prompts, gens, strict=True) if g.audit is not None]
    assert len(audited) == 4  # exactly half of 8 requests, whatever the threads' interleaving
    summary = engine.audit_summary()
    assert summary["requests"] == 8 and summary["audited"] == 4
    kls = []
    for prompt, gen in audited:
        assert gen.audit is not None
        reference = engine.full_attention(prompt, sampling=SHORT).collect()
        kls.append(first_token_kl(reference.first_token_logits, gen.first_token_logits))
        # the audit compared this request with its own prompt's full attention, not another thread's
        assert gen.audit.kl_first_token == pytest.approx(kls[-1], rel=1e-5, abs=1e-9)
    assert summary["kl_first_token_mean"] == pytest.approx(sum(kls) / 4, rel=1e-5)
