"""Sparse-query attention equals masked SDPA over every key, and costs what it computes."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from fusionrag_core.runtime import attention, compat
from fusionrag_core.runtime import decoder as decoder_module
from fusionrag_core.runtime.attention import MaskSpec
from fusionrag_core.runtime.decoder import Decoder

pytestmark = pytest.mark.usefixtures("one_thread")


def _spec(s: int, queries: torch.Tensor, *, window: int | None = None, holes: tuple[tuple[int, int], ...] = (),
          seq: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> MaskSpec:
    k_pos = torch.arange(s) if positions is None else positions
    valid = torch.ones(s, dtype=torch.bool)
    for a, b in holes:
        valid[a:b] = False
    valid[queries] = True  # a pass's own slots are written before its attention
    return MaskSpec(k_pos[queries], k_pos, valid, window,
                    None if seq is None else seq[queries], seq)


def _qkv(n: int, s: int, heads: int, kv_heads: int, d: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(n * 1000 + s)
    return (torch.randn(heads, n, d, generator=g), torch.randn(kv_heads, s, d, generator=g),
            torch.randn(kv_heads, s, d, generator=g))


def _scattered(s: int, n: int, tail: int, seed: int) -> torch.Tensor:
    """`n` scattered slots of the first `s - tail` plus the last `tail` slots (a recompute pass)."""
    g = torch.Generator().manual_seed(seed)
    picked = torch.randperm(s - tail, generator=g)[:n]
    return torch.cat([torch.sort(picked).values, torch.arange(s - tail, s)])


@pytest.mark.parametrize("window", [None, 16, 50])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("holes", [(), ((40, 70), (200, 201))])
def test_planned_attention_equals_masked_sdpa(window: int | None, heads: int, kv_heads: int,
                                             holes: tuple[tuple[int, int], ...]) -> None:
    S = 300
    for seed, queries in enumerate([_scattered(S, 45, 12, 0), _scattered(S, 0, 30, 1), torch.tensor([S - 1]),
                                    _scattered(S, 150, 0, 2), torch.arange(S)]):
        spec = _spec(S, queries, window=window, holes=holes)
        q, k, v = _qkv(int(queries.shape[0]), S, heads, kv_heads)
        p = attention.plan(spec, group=heads // kv_heads, dtype=q.dtype, block_rows=8)
        got = attention.attend(q, k, v, p, scale=0.25)
        want = attention.reference(q, k, v, spec, scale=0.25)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (seed, p.kind, (got - want).abs().max())


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize(("keys", "queries"), [(300, 280), (300, 2), (129, 128), (300, 100)])
def test_a_causal_suffix_equals_masked_sdpa(heads: int, kv_heads: int, keys: int, queries: int) -> None:
    """The suffix plan is exact both ways: as the keys before the queries unmasked, merged with the
    causal part, and (few keys before) as one causal call with empty query rows in front."""
    spec = _spec(keys, torch.arange(keys - queries, keys))
    q, k, v = _qkv(queries, keys, heads, kv_heads)
    p = attention.plan(spec, group=heads // kv_heads, dtype=q.dtype)
    assert p.kind == "suffix"
    got, want = attention.attend(q, k, v, p, scale=0.25), attention.reference(q, k, v, spec, scale=0.25)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    before = keys - queries
    padding = before * (before + 1) // 2 if attention.padded_suffix(before, queries) else 0
    assert p.scores(queries, keys) == int(spec.allowed().sum()) + padding


def test_plan_kinds() -> None:
    S = 64
    causal = attention.plan(_spec(S, torch.arange(S)), group=1, dtype=torch.float32)
    assert causal.kind == "causal"
    suffix = attention.plan(_spec(S, torch.arange(20, S)), group=1, dtype=torch.float32)
    assert suffix.kind == "suffix"  # a prompt computed afresh after a cached prefix
    holed = attention.plan(_spec(S, torch.arange(20, S), holes=((5, 9),)), group=1, dtype=torch.float32)
    assert holed.kind == "blocks"
    windowed = attention.plan(_spec(S, torch.arange(S), window=8), group=1, dtype=torch.float32)
    assert windowed.kind == "blocks"
    decode = attention.plan(_spec(S, torch.tensor([S - 1])), group=1, dtype=torch.float32)
    assert decode.kind == "blocks" and not decode.tails and decode.blocks[0].body == ((0, S),)
    shuffled = torch.randperm(S, generator=torch.Generator().manual_seed(0))
    spec = _spec(S, torch.tensor([3, 9]), positions=shuffled)
    dense = attention.plan(spec, group=1, dtype=torch.float32)
    assert dense.kind == "dense"  # keys out of position order: one masked call, still exact
    q, k, v = _qkv(2, S, 2, 2)
    assert torch.allclose(attention.attend(q, k, v, dense, scale=0.25), attention.reference(q, k, v, spec, scale=0.25))


@pytest.mark.parametrize("window", [None, 256])
def test_cost_follows_visible_keys(window: int | None) -> None:
    """A recompute-shaped pass (15% scattered + a question) scores about what it may see."""
    S = 4096
    queries = _scattered(S, 600, 24, 3)
    spec = _spec(S, queries, window=window)
    p = attention.plan(spec, group=3, dtype=torch.float32)
    visible = int(spec.allowed().sum())
    masked_sdpa = int(queries.shape[0]) * S
    cost = p.scores(int(queries.shape[0]), S)
    # NOTE: sliding layers pay a relatively wider tail (both window edges move with the queries)
    assert cost <= (1.1 if window is None else 1.8) * visible, (cost, visible)
    assert visible < masked_sdpa / (1.8 if window is None else 10)


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("holes", [(), ((40, 70), (200, 201))])
def test_body_calls_cover_each_blocks_body_exactly_once(window: int | None, holes: tuple[tuple[int, int], ...]) -> None:
    """The tree of unmasked calls telescopes: a block's rows get exactly its body's keys, written once, then merged."""
    S = 300
    spec = _spec(S, _scattered(S, 80, 20, 5), window=window, holes=holes)
    p = attention.plan(spec, group=2, dtype=torch.float32, block_rows=8)
    assert p.kind == "blocks" and len(p.calls) <= 2 * len(p.blocks)
    assert any(c.r1 - c.r0 > 8 for c in p.calls)  # keys shared by several blocks go through one wider call
    for b in p.blocks:
        mine = [c for c in p.calls if c.r0 <= b.r0 and b.r1 <= c.r1]
        assert all(c.r1 <= b.r0 or c.r0 >= b.r1 or c in mine for c in p.calls)  # calls hold whole blocks
        slots = [j for c in mine for lo, hi in c.runs for j in range(lo, hi)]
        assert sorted(slots) == [j for lo, hi in b.body for j in range(lo, hi)]  # each body key once
        assert [c.first for c in mine] == [True] + [False] * (len(mine) - 1)
    for t in p.tails:  # a tail run is that block's own width, not padded to the widest
        seen = spec.allowed(torch.arange(t.r0, t.r1), torch.arange(t.lo, t.hi)).any(0)
        assert seen.any() and (holes or bool(seen[0] and seen[-1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_planned_attention_in_half_precision_equals_masked_sdpa(dtype: torch.dtype) -> None:
    S = 300
    spec = _spec(S, _scattered(S, 45, 12, 6), window=50, holes=((40, 70),))
    q, k, v = (x.to(dtype) for x in _qkv(57, S, 6, 2))
    p = attention.plan(spec, group=3, dtype=dtype, block_rows=8)
    got = attention.attend(q, k, v, p, scale=0.25)
    want = attention.reference(q.float(), k.float(), v.float(), spec, scale=0.25)
    assert got.dtype == dtype and torch.allclose(got.float(), want, atol=2e-2), (got.float() - want).abs().max()


def test_sequence_ids_keep_packed_sequences_apart() -> None:
    lengths = [37, 80, 21]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    S = int(seq.shape[0])
    for window in (None, 10):
        spec = _spec(S, torch.arange(S), seq=seq, positions=positions, window=window)
        allowed = spec.allowed()
        assert not allowed[40, 10] and allowed[40, 37] and not allowed[120, 100]  # other sequences: invisible
        q, k, v = _qkv(S, S, 4, 2)
        p = attention.plan(spec, group=2, dtype=q.dtype, block_rows=16)
        assert p.kind == "blocks"
        got = attention.attend(q, k, v, p, scale=0.25)
        assert torch.allclose(got, attention.reference(q, k, v, spec, scale=0.25), atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_kernel_lse_matches_explicit_scores(masked: bool) -> None:
    q, k, v = torch.randn(2, 3, 10, 16), torch.randn(2, 3, 25, 16), torch.randn(2, 3, 25, 16)
    bias = None
    if masked:
        allowed = torch.rand(2, 1, 10, 25, generator=torch.Generator().manual_seed(0)) > 0.5
        allowed[..., 0] = True
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    out, lse = compat.sdpa_with_lse(q, k, v, bias, 0.3)
    ref_out, ref_lse = compat.sdpa_math_with_lse(q, k, v, bias, 0.3)
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)


def test_attention_mass_is_a_distribution_per_query_and_head() -> None:
    S = 50
    queries = torch.arange(40, 50)
    spec = _spec(S, queries, holes=((5, 9),))
    q, k, _ = _qkv(10, S, 4, 2)
    mass = attention.attention_mass(q, k, spec, scale=0.25)
    assert mass.shape == (S,) and torch.isclose(mass.sum(), torch.tensor(40.0))
    assert (mass[5:9] == 0).all()


# ---- the decoder's passes over the planned attention ------------------------------------------------

SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}


def _model(arch: str) -> PreTrainedModel:
    torch.manual_seed(0)
    if arch == "gemma3":
        config = Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=16,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        return Gemma3ForCausalLM(config).eval()
    return LlamaForCausalLM(LlamaConfig(**SMALL)).eval()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sparse_recompute_of_a_filled_buffer_equals_a_plain_prefill(arch: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(attention.BLOCK_ROWS, "cpu", 8)  # many blocks, tails and window edges
    model = _model(arch)
    decoder = Decoder(model)
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(1))
    ref = compat.hf_logits(model, ids)[-1].float()

    buf = decoder.new_buffer(200)
    slots = buf.reserve(torch.arange(200), valid=False)
    assert torch.allclose(decoder.prefill(buf, ids, slots), ref, atol=1e-4)

    # fill a context, then recompute a scattered subset of it together with the last 40 tokens
    buf = decoder.new_buffer(200)
    context = buf.reserve(torch.arange(160), valid=False)
    decoder.fill(buf, ids[:160], context)
    buf.valid[context] = True
    question = buf.reserve(torch.arange(160, 200), valid=False)
    picked = _scattered(160, 30, 0, 4)
    slots = torch.cat([picked, question])
    assert torch.allclose(decoder.prefill(buf, ids[slots], slots), ref, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_packed_last_passes_of_several_requests_equal_their_passes_one_at_a_time(arch: str) -> None:
    """`prefill_batch` (the scheduler's packed last passes): each request's logits and written K/V
    equal its own `prefill`, over buffers of other lengths, holes and scattered recomputed slots;
    one request is `prefill` bit for bit."""
    decoder = Decoder(_model(arch))
    g = torch.Generator().manual_seed(3)
    # (context, recomputed, question) per request: scattered rows past a sliding window, a plain
    # suffix, a single question row
    shapes = [(160, 30, 40), (40, 0, 12), (90, 9, 1)]
    bufs, ids, slots = [], [], []
    for s, (context, picked, question) in enumerate(shapes):
        tokens = torch.randint(0, 256, (context + question,), generator=g)
        buf = decoder.new_buffer(context + question)
        filled = buf.reserve(torch.arange(context), valid=False)
        decoder.fill(buf, tokens[:context], filled)
        buf.valid[filled] = True
        asked = buf.reserve(torch.arange(context, context + question), valid=False)
        pass_slots = torch.cat([_scattered(context, picked, 0, s) if picked else asked[:0], asked])
        bufs.append(buf)
        ids.append(tokens[pass_slots])
        slots.append(pass_slots)
    alone = [copy.deepcopy(b) for b in bufs]
    want = torch.stack([decoder.prefill(b, t, s) for b, t, s in zip(alone, ids, slots, strict=True)])  # [B, V]
    got = decoder.prefill_batch(bufs, ids, slots)  # [B, V]
    assert torch.allclose(got, want, atol=1e-5) and not torch.equal(got[0], got[1])
    for b, a in zip(bufs, alone, strict=True):
        assert torch.allclose(b.keys[:, :, :b.length], a.keys[:, :, :a.length], atol=1e-5)
        assert torch.allclose(b.values[:, :, :b.length], a.values[:, :, :a.length], atol=1e-5)
    one = copy.deepcopy(alone[0])
    assert torch.equal(decoder.prefill_batch([one], ids[:1], slots[:1])[0], decoder.prefill(alone[0], ids[0], slots[0]))
    with pytest.raises(ValueError, match="one \\[N_b\\] token and slot tensor per buffer"):
        decoder.prefill_batch(bufs, ids[:2], slots)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_packed_probes_of_several_requests_equal_their_probes_one_at_a_time(arch: str) -> None:
    decoder = Decoder(_model(arch))
    g = torch.Generator().manual_seed(5)
    bufs, ids, slots = [], [], []
    for context, question in [(150, 12), (30, 5), (70, 1)]:
        tokens = torch.randint(0, 256, (context + question,), generator=g)
        buf = decoder.new_buffer(context + question)
        filled = buf.reserve(torch.arange(context), valid=False)
        decoder.fill(buf, tokens[:context], filled)
        buf.valid[filled] = True
        bufs.append(buf)
        ids.append(tokens[context:])
        slots.append(buf.reserve(torch.arange(context, context + question), valid=False))
    weights = [torch.linspace(0.1, 1.0, 12), None, torch.ones(1)]
    alone = [copy.deepcopy(b) for b in bufs]
    want = [decoder.probe(b, t, s, layers=(1, 2), weights=w) for b, t, s, w in zip(alone, ids, slots, weights,
                                                                                    strict=True)]
    got = decoder.probe_batch(bufs, ids, slots, layers=(1, 2), weights=weights)
    for g_b, w_b in zip(got, want, strict=True):
        assert sorted(g_b) == [1, 2]
        for layer in (1, 2):
            assert torch.allclose(g_b[layer], w_b[layer], atol=1e-5)
    assert not torch.allclose(got[0][2][:30], got[1][2][:30])  # each request read its own buffer
    one = decoder.probe_batch(bufs[:1], ids[:1], slots[:1], layers=(2,), weights=weights[:1])[0][2]
    assert torch.equal(one, decoder.probe(alone[0], ids[0], slots[0], layers=(2,), weights=weights[0])[2])


def test_packed_fill_equals_separate_fills() -> None:
    model = _model("gemma3")
    decoder = Decoder(model)
    a, b = torch.randint(0, 256, (30,)), torch.randint(0, 256, (45,))
    separate = []
    for ids in (a, b):
        buf = decoder.new_buffer(len(ids))
        decoder.fill(buf, ids, buf.reserve(torch.arange(len(ids)), valid=False))
        separate.append(buf.keys.clone())
    buf = decoder.new_buffer(75)
    slots = torch.cat([buf.reserve(torch.arange(30), valid=False), buf.reserve(torch.arange(45), valid=False)])
    decoder.fill(buf, torch.cat([a, b]), slots, seq_ids=torch.cat([torch.zeros(30), torch.ones(45)]).long())
    assert torch.allclose(buf.keys[:, :, :30], separate[0], atol=1e-5)
    assert torch.allclose(buf.keys[:, :, 30:], separate[1], atol=1e-5)


def test_probe_reports_the_mass_at_every_layer_asked_for() -> None:
    model = _model("llama")
    decoder = Decoder(model)
    ids = torch.randint(0, 256, (60,))
    buf = decoder.new_buffer(60)
    context = buf.reserve(torch.arange(50), valid=False)
    decoder.fill(buf, ids[:50], context)
    buf.valid[context] = True
    question = buf.reserve(torch.arange(50, 60), valid=False)
    masses = decoder.probe(buf, ids[50:], question, layers=(0, 2))
    assert sorted(masses) == [0, 2]
    for mass in masses.values():
        assert mass.shape == (60,) and torch.isclose(mass.sum(), torch.tensor(4.0 * 10), atol=1e-3)
    assert not torch.allclose(masses[0], masses[2])
    with pytest.raises(ValueError, match="attention layers"):
        decoder.probe(buf, ids[50:], question, layers=(3,))


@pytest.mark.parametrize("dense", [True, False])
def test_unwritten_buffer_memory_never_reaches_attention(dense: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers are not zero-filled: NaN garbage in unclaimed memory must not leak into any pass
    (invalid reserved slots are zeroed, slots past `length` are never read)."""
    monkeypatch.setitem(attention.BLOCK_ROWS, "cpu", 8)  # tails that span the hole
    if not dense:  # NOTE: 32 queries over 80 keys attend in one masked call unless told otherwise
        monkeypatch.setattr(decoder_module, "DENSE_MAX_QUERIES", 0)
    model = _model("llama")
    decoder = Decoder(model)
    ids = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(2))
    logits = []
    for garbage in (0.0, float("nan")):
        buf = decoder.new_buffer(100)
        buf.keys.fill_(garbage)
        buf.values.fill_(garbage)
        context = buf.reserve(torch.arange(50), valid=False)
        decoder.fill(buf, ids[:50], context)
        buf.valid[context] = True
        buf.reserve(torch.arange(50, 60), valid=False)  # a hole no pass computes: masked, yet in tails
        question = buf.reserve(torch.arange(60, 80), valid=False)
        slots = torch.cat([_scattered(50, 12, 0, 3), question])
        logits.append(decoder.prefill(buf, ids[slots], slots))
        assert buf.keys[:, :, 80:].isnan().all() == (garbage != 0.0)  # past the prompt: untouched
    assert torch.isfinite(logits[1]).all() and torch.allclose(logits[0], logits[1])


@pytest.mark.slow
def test_compiled_decode_step_equals_eager() -> None:
    """`compile_decode` (opt-in) changes how one-token passes run, not what they compute."""
    model = _model("llama")
    eager, compiled = Decoder(model), Decoder(model, compile_decode=True)
    assert eager.one_token_mlps is None and compiled.one_token_mlps is not None
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5))
    logits = []
    for decoder in (eager, compiled):
        buf = decoder.new_buffer(42)
        decoder.fill(buf, ids, buf.reserve(torch.arange(40), valid=True))
        steps = [decoder.decode_step(buf, t, buf.reserve(torch.tensor([40 + j]), valid=True))
                 for j, t in enumerate((7, 9))]
        logits.append(torch.stack(steps))
    assert torch.allclose(logits[0], logits[1], atol=1e-4)
