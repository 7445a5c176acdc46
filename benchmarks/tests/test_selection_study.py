"""`benchmarks/selection_study.py`'s teacher-forced answer KL: zero for a full recompute, not for reuse."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from benchmarks.tests.conftest import load_script
from fusionrag_core.engine import FusionEngine
from fusionrag_core.query.divergence import first_token_kl
from fusionrag_core.query.recompute import recompute
from fusionrag_core.query.sampling import SamplingConfig
from tests.test_engine import ARCHS, CHUNKS, prompt_for

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request: pytest.FixtureRequest, smollm_tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    torch.manual_seed(0)
    return FusionEngine(ARCHS[request.param]().eval(), smollm_tokenizer, name=request.param)


@pytest.fixture()
def study(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_script("selection_study", monkeypatch)


def _answer_kls(engine: FusionEngine, study: ModuleType, reuse_all: bool) -> list[float]:
    caches = {f"c{i}": (engine.chunk_cache(c), engine.chunk_cache(c)) for i, c in enumerate(CHUNKS)}
    prompt = prompt_for(engine, CHUNKS)
    tokens, reference = study.full_attention_answer(engine, prompt, caches, 6)
    want = engine.full_attention(prompt, sampling=SamplingConfig(max_new_tokens=6)).collect()
    assert tokens == want.token_ids[: len(tokens)] and len(reference) == len(tokens)
    st = study.stitched(engine, prompt, caches, extra_capacity=6)
    logits, _ = recompute(st, st.reusable_slots[:0] if reuse_all else st.reusable_slots)
    return [first_token_kl(r, m) for r, m in zip(reference, study.forced_logits(engine, st, prompt, logits, tokens),
                                                 strict=True)]


def test_a_full_recompute_follows_full_attention_through_the_answer(engine: FusionEngine, study: ModuleType) -> None:
    kls = _answer_kls(engine, study, reuse_all=False)
    assert len(kls) > 1 and max(kls) < 1e-9


def test_full_reuse_departs_from_full_attention_in_the_answer(engine: FusionEngine, study: ModuleType) -> None:
    # independent caches of chunks 1.. never saw the chunks before them: the answer must differ
    # (a tiny random model's distributions are near-uniform, so the KLs are small: ~1e-4)
    assert min(_answer_kls(engine, study, reuse_all=True)[1:]) > 1e-5
