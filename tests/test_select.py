"""Query-guided selection: the probe at several layers and depths, exact tokens, the registry.
Tiny random Llama and Gemma 3 models (a sliding-window architecture), SmolLM2 tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import EngineConfig, FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.probe import probe_layers
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.query.select import SELECTORS, SelectConfig, get_selector, question_attention
from fusionrag_core.query.selectors import DEFAULT_SELECTOR, SELECTOR_DESCRIPTIONS
from fusionrag_core.query.stitch import Stitched, stitch
from tests.test_engine import ARCHS, CHUNKS, _stitched, independent_caches, prompt_for

QUERY_GUIDED = ("query_guided", "drift_aware")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request: pytest.FixtureRequest, smollm_tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    torch.manual_seed(0)
    return FusionEngine(ARCHS[request.param]().eval(), smollm_tokenizer, name=request.param)


def _probe(st: Stitched, layers: tuple[int, ...]) -> torch.Tensor:
    masses = st.decoder.probe(st.buf, st.question_ids, st.question_slots, layers=layers)
    return torch.stack([masses[layer] for layer in layers])


def test_attention_at_several_layers_matches_transformers(engine: FusionEngine) -> None:
    # One independent chunk right after the prefix is exact: the stitched cache equals a full prefill,
    # so the question's attention at every layer must equal transformers' eager attention weights.
    if engine.name == "gemma3":
        pytest.skip("eager weights of sliding layers need the window mask; the llama case covers the arithmetic")
    prompt = prompt_for(engine, CHUNKS[:1])
    st = _stitched(engine, CHUNKS[:1])
    layers = tuple(range(engine.decoder.num_layers))
    mass = _probe(st, layers)  # [L, S]
    model = engine.model
    impl = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            attentions = model(prompt.token_ids()[None], output_attentions=True, use_cache=False).attentions
    finally:
        model.config._attn_implementation = impl
    q = int(prompt.question.shape[0])
    for layer in layers:
        expected = attentions[layer][0, :, -q:, :].sum(dim=(0, 1))  # [T]
        torch.testing.assert_close(mass[layer, : expected.shape[0]], expected, atol=1e-4, rtol=1e-4)


def test_a_shallow_probe_stops_at_its_deepest_layer(engine: FusionEngine) -> None:
    st = _stitched(engine, CHUNKS)
    deep = _probe(st, (engine.decoder.num_layers - 1,))
    st = _stitched(engine, CHUNKS)
    shallow = _probe(st, (0, 1))
    assert shallow.shape == (2, deep.shape[1])
    q = st.question_slots
    # the question's K/V were written at the probe layers and nowhere deeper: the deeper layers never ran
    assert bool(st.buf.keys[1, :, q].abs().sum() > 0)
    assert bool((st.buf.keys[2:, :, q] == 0).all()) and bool((st.buf.values[2:, :, q] == 0).all())
    # the same layer reads the same attention however deep the probe goes
    st = _stitched(engine, CHUNKS)
    both = _probe(st, (1, engine.decoder.num_layers - 1))
    torch.testing.assert_close(both[0], shallow[1])
    torch.testing.assert_close(both[1], deep[0])


def test_question_attention_averages_layer_shares(engine: FusionEngine) -> None:
    st = _stitched(engine, CHUNKS)
    last = engine.decoder.num_layers - 1
    per_layer = _probe(st, (0, last))[:, st.reusable_slots]
    expected = (per_layer / per_layer.sum(dim=1, keepdim=True)).mean(dim=0)
    st = _stitched(engine, CHUNKS)
    got = question_attention(st, (0.0, 1.0))
    torch.testing.assert_close(got, expected)
    assert got.sum().item() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("name", QUERY_GUIDED)
def test_query_guided_selectors_are_deterministic_and_respect_the_budget(engine: FusionEngine, name: str) -> None:
    config = SelectConfig(ratio=0.25)
    picks = []
    for _ in range(2):
        st = _stitched(engine, CHUNKS)
        budget = config.budget(st.num_reused_tokens)
        picks.append(get_selector(name)(st, budget, config))
    assert torch.equal(picks[0], picks[1])
    assert 0 < picks[0].numel() <= budget
    assert bool(torch.isin(picks[0], st.reusable_slots).all())
    assert bool((picks[0][1:] > picks[0][:-1]).all())  # sorted, no duplicates


@pytest.mark.parametrize("name", QUERY_GUIDED)
def test_query_guided_selectors_at_ratio_one_equal_a_full_prefill(engine: FusionEngine, name: str) -> None:
    prompt = prompt_for(engine, CHUNKS)
    caches = independent_caches(engine, CHUNKS)
    sampling = SamplingConfig(max_new_tokens=4)
    full = engine.full_attention(prompt, sampling=sampling).collect()
    gen = engine.generate(prompt, caches=caches, selector=name, ratio=1.0, sampling=sampling)
    # drift_aware leaves the first chunk alone: its independent cache is already exact
    skipped = caches["c0"].num_tokens if name == "drift_aware" else 0  # type: ignore[attr-defined]
    assert gen.recomputed_tokens == sum(c.num_tokens for c in caches.values()) - skipped  # type: ignore[attr-defined]
    assert (gen.first_token_logits - full.first_token_logits).abs().max().item() < 1e-3
    assert gen.token_ids == full.token_ids


def test_probe_depths_override_and_are_checked(engine: FusionEngine) -> None:
    st = _stitched(engine, CHUNKS)
    scores = question_attention(st, (0.75,))
    early = torch.sort(st.reusable_slots[torch.sort(-scores, stable=True).indices[:6]]).values
    st = _stitched(engine, CHUNKS)
    same = get_selector("query_guided")(st, 6, SelectConfig(probe_depths=(0.75,)))
    assert torch.equal(early, same)
    for bad in ((), (1.5,), (-0.1, 0.5)):
        with pytest.raises(InvalidRequestError, match="probe_depths"):
            SelectConfig(probe_depths=bad)


def test_probe_layers_out_of_range_are_refused(engine: FusionEngine) -> None:
    st = _stitched(engine, CHUNKS)
    with pytest.raises(ValueError, match="attention layers"):
        _probe(st, (engine.decoder.num_layers,))


def test_probe_depths_move_to_a_full_attention_layer() -> None:
    # Gemma 3 270M: 18 layers, every sixth one (5, 11, 17) full attention, the rest slide
    gemma = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    assert probe_layers(gemma, (1.0,)) == (17,)
    assert probe_layers(gemma, (0.75,)) == (11,)  # 0.75 * 17 -> layer 13 slides: the full layer below
    assert probe_layers(gemma, (1 / 3, 2 / 3, 1.0)) == (5, 11, 17)
    assert probe_layers(gemma, (0.1,)) == (2,)  # no full layer at or below: kept
    assert probe_layers([None] * 30, (0.75, 1.0)) == (22, 29)  # Llama: every layer is full
    assert probe_layers([4096] * 8, (0.5,)) == (4,)  # Mistral-style: every layer slides


def _exact_stitched(engine: FusionEngine, caches: dict[str, object], *, exact_prefix: bool) -> Stitched:
    prompt = prompt_for(engine, CHUNKS)
    return stitch(engine.decoder, prompt, engine.system_prefix(prompt.prefix), lambda cid, _first: caches.get(cid),
                  extra_capacity=1, exact_prefix=exact_prefix)


def test_only_the_first_chunks_independent_cache_is_exact(engine: FusionEngine) -> None:
    caches: dict[str, object] = dict(independent_caches(engine, CHUNKS))
    st = _exact_stitched(engine, caches, exact_prefix=True)
    assert torch.equal(st.exact_slots, st.chunk_slots[0])
    # the prefix is not the one caches were computed after, or the first chunk's cache is fused: nothing is exact
    assert _exact_stitched(engine, caches, exact_prefix=False).exact_slots.numel() == 0
    fused = engine.chunk_cache(CHUNKS[0], neighbours=[caches["c1"]])  # type: ignore[list-item]
    assert _exact_stitched(engine, {**caches, "c0": fused}, exact_prefix=True).exact_slots.numel() == 0
    # exact means exact: the first chunk's cached K/V equal what a full prefill computes there
    prompt = prompt_for(engine, CHUNKS)
    buf = engine.decoder.new_buffer(prompt.num_tokens)
    ids = prompt.token_ids()
    engine.decoder.fill(buf, ids, buf.reserve(torch.arange(ids.shape[0]), valid=False))
    e = st.exact_slots
    torch.testing.assert_close(st.buf.keys[:, :, e], buf.keys[:, :, e], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(st.buf.values[:, :, e], buf.values[:, :, e], atol=1e-4, rtol=1e-4)


def test_drift_aware_spends_the_budget_off_exact_tokens(engine: FusionEngine) -> None:
    caches: dict[str, object] = dict(independent_caches(engine, CHUNKS))
    config = SelectConfig(last_token_share=None)
    for budget in (3, 10):
        st = _exact_stitched(engine, caches, exact_prefix=True)
        picked = get_selector("drift_aware")(st, budget, config)
        assert picked.numel() == budget and not bool(torch.isin(picked, st.exact_slots).any())
        # caches without drift all count as the prompt's mean drift: the question's attention ranks them
        st = _exact_stitched(engine, caches, exact_prefix=True)
        scores = question_attention(st, (0.75,))
        inexact = ~torch.isin(st.reusable_slots, st.exact_slots)
        order = torch.sort(-scores[inexact], stable=True).indices[:budget]
        assert torch.equal(picked, torch.sort(st.reusable_slots[inexact][order]).values)


def test_selectors_follow_the_registry_and_open_their_docstrings_with_its_description() -> None:
    assert list(SELECTOR_DESCRIPTIONS) == list(SELECTORS) and next(iter(SELECTORS)) == DEFAULT_SELECTOR
    for name, selector in SELECTORS.items():
        assert SELECTOR_DESCRIPTIONS[name] == (selector.__doc__ or "").splitlines()[0], name
    assert EngineConfig().selector == DEFAULT_SELECTOR
