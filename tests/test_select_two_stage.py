"""Two-stage selection: a re-probe over a partially corrected cache. Tiny random Llama and Gemma 3
models (a sliding-window architecture), SmolLM2 tokenizer."""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import EngineConfig, FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.recompute import recompute
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.query.select import SelectConfig, attention_drop, get_selector, question_attention
from fusionrag_core.query.stitch import Stitched, stitch
from tests.test_engine import ARCHS, CHUNKS, independent_caches, prompt_for

pytestmark = pytest.mark.usefixtures("one_thread")

MORE_CHUNKS = [*CHUNKS, "The salt market of Marrow opens at dawn on every second day of the week.",
               "Gull Point is a rocky headland north of Marrow, where the river Tell meets the sea."]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request: pytest.FixtureRequest, smollm_tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    torch.manual_seed(0)
    return FusionEngine(ARCHS[request.param]().eval(), smollm_tokenizer, name=request.param)


@pytest.fixture(scope="module")
def caches(engine: FusionEngine) -> dict[str, object]:
    return dict(independent_caches(engine, MORE_CHUNKS))


def _stitched(engine: FusionEngine, caches: dict[str, object], *, exact_prefix: bool = True) -> Stitched:
    prompt = prompt_for(engine, MORE_CHUNKS)
    return stitch(engine.decoder, prompt, engine.prefix_cache(prompt.prefix), lambda cid, _first: caches.get(cid),
                  extra_capacity=1, exact_prefix=exact_prefix)


def test_a_reprobe_reads_the_cache_as_if_its_fresh_tokens_were_recomputed_first(
        engine: FusionEngine, caches: dict[str, object]) -> None:
    # One pass of (fresh tokens + question), scoring the question only, equals recomputing the fresh
    # tokens at every layer first (they come before the question: they never see it), then a plain probe.
    st = _stitched(engine, caches)
    fresh = st.reusable_slots[3::4]
    layers = tuple(range(engine.decoder.num_layers))
    at = torch.cat([fresh, st.question_slots])
    joint = st.decoder.probe(st.buf, st.slot_tokens[at], at, layers=layers, readers=int(st.question_slots.numel()))
    st = _stitched(engine, caches)
    st.decoder.fill(st.buf, st.slot_tokens[fresh], fresh)
    after = st.decoder.probe(st.buf, st.question_ids, st.question_slots, layers=layers)
    for layer in layers:
        torch.testing.assert_close(joint[layer], after[layer], atol=1e-5, rtol=1e-4)
    # and it differs from the probe over the stale cache (the re-probe is not a no-op)
    st = _stitched(engine, caches)
    stale = st.decoder.probe(st.buf, st.question_ids, st.question_slots, layers=layers)
    assert not torch.allclose(joint[layers[-1]], stale[layers[-1]], atol=1e-5)
    with pytest.raises(ValueError, match="readers"):
        st.decoder.probe(st.buf, st.question_ids, st.question_slots, layers=layers, readers=0)


@pytest.mark.parametrize("budget", [1, 7, 20])
def test_two_stage_is_stage_one_then_the_reprobes_best(engine: FusionEngine, caches: dict[str, object],
                                                       budget: int) -> None:
    config = SelectConfig()
    st = _stitched(engine, caches)
    picked = get_selector("two_stage")(st, budget, config)
    assert picked.numel() == budget
    assert bool((picked[1:] > picked[:-1]).all()) and bool(torch.isin(picked, st.reusable_slots).all())
    assert not bool(torch.isin(picked, st.exact_slots).any())  # exact tokens never take budget
    # stage 1 is fusion_aware_early's top share of the budget
    first_n = round(config.two_stage_share * budget)
    st = _stitched(engine, caches)
    first = get_selector("fusion_aware_early")(st, first_n, config)
    assert bool(torch.isin(first, picked).all())
    # stage 2: the best other inexact tokens by the question's attention once stage 1 is recomputed
    st = _stitched(engine, caches)
    scores = question_attention(st, (0.75,), fresh=first)
    keep = ~torch.isin(st.reusable_slots, torch.cat([st.exact_slots, first]))
    order = torch.sort(-scores[keep], stable=True).indices[:budget - first_n]
    assert torch.equal(torch.sort(torch.cat([first, st.reusable_slots[keep][order]])).values, picked)


def test_two_stage_is_deterministic_and_bounded(engine: FusionEngine, caches: dict[str, object]) -> None:
    st = _stitched(engine, caches)
    inexact = st.num_reused_tokens - int(st.exact_slots.numel())
    for budget in (0, inexact + 5):  # nothing, and more than there is to spend: every inexact token
        picks = [get_selector("two_stage")(_stitched(engine, caches), budget, SelectConfig()) for _ in range(2)]
        assert torch.equal(picks[0], picks[1])
        assert picks[0].numel() == min(budget, inexact)
    # all of the budget in stage 1 is fusion_aware_early
    st = _stitched(engine, caches)
    one = get_selector("two_stage")(st, 9, SelectConfig(two_stage_share=1.0))
    assert torch.equal(one, get_selector("fusion_aware_early")(_stitched(engine, caches), 9, SelectConfig()))
    with pytest.raises(InvalidRequestError, match="two_stage_share"):
        SelectConfig(two_stage_share=0.0)


@pytest.mark.parametrize("name", ["two_stage", "two_stage_adaptive"])
def test_two_stage_shares_nothing_between_threads(engine: FusionEngine, caches: dict[str, object], name: str) -> None:
    # one engine, several requests at once: each selection is what it is alone
    budgets = [2, 5, 9, 13]
    config = SelectConfig(adaptive_floor=0.05, adaptive_drop=1e-3)
    alone = [get_selector(name)(_stitched(engine, caches), b, config) for b in budgets]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda b: get_selector(name)(_stitched(engine, caches), b, config), budgets * 2))
    for got, want in zip(together, alone * 2, strict=True):
        assert torch.equal(got, want)



def test_at_ratio_one_they_equal_a_full_prefill(engine: FusionEngine, caches: dict[str, object]) -> None:
    prompt = prompt_for(engine, MORE_CHUNKS)
    sampling = SamplingConfig(max_new_tokens=3)
    full = engine.full_attention(prompt, sampling=sampling).collect()
    # a floor of 1: the adaptive mode's first stage is its whole budget
    eager = FusionEngine(engine.model, engine.tokenizer, config=EngineConfig(select=SelectConfig(adaptive_floor=1.0)))
    inexact = sum(c.num_tokens for c in caches.values()) - caches["c0"].num_tokens  # type: ignore[attr-defined]
    for name in ("two_stage", "two_stage_adaptive"):
        gen = eager.generate(prompt, caches=caches, selector=name, ratio=1.0, sampling=sampling)  # type: ignore[arg-type]
        assert gen.recomputed_tokens == inexact  # the first chunk's exact cache is left alone
        assert (gen.first_token_logits - full.first_token_logits).abs().max().item() < 1e-3
        assert gen.token_ids == full.token_ids


def _adaptive_count(st: Stitched, budget: int, config: SelectConfig) -> tuple[int, float]:
    """What two_stage_adaptive should recompute, from its documented rule, and the drop it saw."""
    inexact = ~torch.isin(st.reusable_slots, st.exact_slots)
    slots = st.reusable_slots[inexact]
    before = question_attention(st, (0.75,))[inexact]
    first = torch.sort(slots[torch.sort(-before, stable=True).indices[:math.ceil(config.adaptive_floor
                                                                                 * st.num_reused_tokens)]]).values
    after = question_attention(st, (0.75,), fresh=first)[inexact]
    drop = attention_drop(before, after, slots, first)
    more = min(budget, int(slots.numel())) - int(first.numel())
    return int(first.numel()) + round(more * min(1.0, max(0.0, drop) / config.adaptive_drop)), drop


def _misdirecting(engine: FusionEngine, caches: dict[str, object]) -> dict[str, object]:
    """The caches with chunk c2's keys blown up: stale K/V that pull the question's attention."""
    kv = caches["c2"]
    return {**caches, "c2": dataclasses.replace(kv, keys=kv.keys * 30.0)}  # type: ignore[type-var, attr-defined]


def test_the_adaptive_ratio_follows_the_attention_drop(engine: FusionEngine, caches: dict[str, object]) -> None:
    st = _stitched(engine, caches)
    budget, floor = st.num_reused_tokens // 2, math.ceil(0.1 * st.num_reused_tokens)
    config = SelectConfig(adaptive_floor=0.1)
    # caches as computed: the recomputed tokens keep their attention, so the floor is (about) all it spends
    want, calm = _adaptive_count(_stitched(engine, caches), budget, config)
    assert abs(calm) < 0.01 and want <= floor + 0.1 * (budget - floor)
    # caches that misdirect the question: its best tokens lose some of their attention once fresh
    bad = _misdirecting(engine, caches)
    _, drop = _adaptive_count(_stitched(engine, bad), budget, config)
    assert drop > 0.02 > calm
    counts = []
    for threshold in (drop / 2, drop * 2, drop * 8):  # the whole budget at or below the drop; a share above
        config = SelectConfig(adaptive_floor=0.1, adaptive_drop=threshold)
        want, _ = _adaptive_count(_stitched(engine, bad), budget, config)
        picked = get_selector("two_stage_adaptive")(_stitched(engine, bad), budget, config)
        assert picked.numel() == want and bool((picked[1:] > picked[:-1]).all())
        assert not bool(torch.isin(picked, st.exact_slots).any())
        counts.append(want)
    assert counts[0] == budget > counts[1] > counts[2] > floor
    # the floor is stage 1: fusion_aware_early's best tokens
    first = get_selector("fusion_aware_early")(_stitched(engine, bad), floor, SelectConfig())
    assert bool(torch.isin(first, picked).all())


def test_the_reported_ratio_is_what_was_recomputed(engine: FusionEngine, caches: dict[str, object]) -> None:
    # the engine's statistics are the adaptive selection's own size, and that many chunk tokens' K/V
    # were computed afresh (each differs from its cached K/V at the last layer)
    prompt = prompt_for(engine, MORE_CHUNKS)
    config = SelectConfig(ratio=0.6, adaptive_floor=0.1, adaptive_drop=0.5)
    served = FusionEngine(engine.model, engine.tokenizer, config=EngineConfig(select=config))
    gen = served.generate(prompt, caches=caches, selector="two_stage_adaptive",  # type: ignore[arg-type]
                          sampling=SamplingConfig(max_new_tokens=1))
    st = _stitched(engine, caches)
    want, _ = _adaptive_count(_stitched(engine, caches), config.budget(st.num_reused_tokens), config)
    assert gen.recomputed_tokens == want
    stats = gen.stats()
    assert stats["recomputed_tokens"] == want and stats["reused_tokens"] == st.num_reused_tokens - want
    cached = st.buf.keys[-1, :, st.reusable_slots].clone()
    picked = get_selector("two_stage_adaptive")(st, config.budget(st.num_reused_tokens), config)
    recompute(st, picked)
    changed = (st.buf.keys[-1, :, st.reusable_slots] - cached).abs().amax(dim=(0, 2)) > 1e-6
    assert int(changed.sum()) == want == picked.numel()
