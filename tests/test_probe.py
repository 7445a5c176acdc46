"""The query-guided probe against a straightforward reference: the question run layer by layer
through the model's own modules, with explicit masked softmax attention over every key.

The probe plans its attention per window, packs its projections for oneDNN and reads the mass
without a `T x T` matrix; none of that may change what it computes, nor which slots a
query-guided selector then picks. Tiny random Llama, Qwen3 (q/k norms) and Gemma 3 (sliding
window far shorter than the prompt) models, SmolLM2 tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import EngineConfig, FusionEngine
from fusionrag_core.query.probe import question_weights, run_probes
from fusionrag_core.query.select import SelectConfig, get_selector, probe_for
from fusionrag_core.runtime import attention
from fusionrag_core.runtime import decoder as decoder_module
from fusionrag_core.runtime.decoder import Decoder
from fusionrag_core.runtime.kv import KVBuffer
from fusionrag_core.runtime.rope import apply_rope, cos_sin
from tests.test_engine import ARCHS, CHUNKS, _stitched

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=[(arch, packed) for arch in ("llama", "qwen3", "gemma3")
                                        for packed in (True, False)], ids=lambda p: f"{p[0]}-packed{p[1]}")
def engine(request: pytest.FixtureRequest, smollm_tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    arch, packed = request.param
    torch.manual_seed(0)
    return FusionEngine(ARCHS[arch]().eval(), smollm_tokenizer, name=arch,
                        config=EngineConfig(packed_linears=packed))


@torch.inference_mode()
def reference_probe(d: Decoder, buf: KVBuffer, token_ids: torch.Tensor, slots: torch.Tensor,
                    layers: Sequence[int], weights: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """What `Decoder.probe` must return, computed the plain way (the buffer is not written)."""
    S, N = buf.length, int(token_ids.shape[0])
    Hq, H, D = d.num_heads, d.num_kv_heads, d.head_dim
    keys, values = buf.keys[:, :, :S].clone(), buf.values[:, :, :S].clone()  # [L, H, S, D]
    valid = buf.valid[:S].clone()
    valid[slots] = True
    q_pos, k_pos = buf.positions[slots], buf.positions[:S]
    x = d.parts.embed_tokens(token_ids[None])  # [1, N, C]
    masses = {}
    for i in range(max(layers) + 1):
        layer = d.parts.layers[i]
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(1, N, Hq, D).transpose(1, 2)
        k = attn.k_proj(h).view(1, N, H, D).transpose(1, 2)
        v = attn.v_proj(h).view(1, N, H, D).transpose(1, 2)
        if d.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = cos_sin(q_pos, d.rope[i], q.dtype)
        q, k = apply_rope(q, cos, sin)[0], apply_rope(k, cos, sin)[0]  # [Hq, N, D], [H, N, D]
        keys[i][:, slots], values[i][:, slots] = k, v[0]
        allowed = (k_pos[None] <= q_pos[:, None]) & valid[None]  # [N, S]
        if d.windows[i] is not None:
            allowed &= (q_pos[:, None] - k_pos[None]) < d.windows[i]
        kk, vv = keys[i].repeat_interleave(Hq // H, 0), values[i].repeat_interleave(Hq // H, 0)  # [Hq, S, D]
        scores = (q.float() @ kk.float().transpose(1, 2)) * d.scaling
        probs = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)  # [Hq, N, S]
        if i in layers:
            w = torch.ones(N) if weights is None else weights.float()  # [N]
            masses[i] = (probs * w[None, :, None]).sum(dim=(0, 1))
        o = attn.o_proj((probs.to(vv.dtype) @ vv).transpose(0, 1).reshape(1, N, Hq * D))
        if d.sandwich_norms:
            x = x + layer.post_attention_layernorm(o)
            x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
        else:
            x = x + o
            x = x + layer.mlp(layer.post_attention_layernorm(x))
    return masses


@pytest.mark.parametrize("dense", [True, False])
def test_probe_masses_equal_the_reference(engine: FusionEngine, dense: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not dense:  # the question's few queries attend in one masked call unless told otherwise
        monkeypatch.setattr(decoder_module, "DENSE_MAX_QUERIES", 0)
        monkeypatch.setitem(attention.BLOCK_ROWS, "cpu", 4)  # several blocks, tails and window edges
    layers = tuple(range(engine.decoder.num_layers))
    st = _stitched(engine, CHUNKS)
    want = reference_probe(engine.decoder, st.buf, st.question_ids, st.question_slots, layers)
    got = engine.decoder.probe(st.buf, st.question_ids, st.question_slots, layers=layers)
    assert sorted(got) == list(layers)
    for layer in layers:
        assert got[layer].shape == (st.buf.length,)
        torch.testing.assert_close(got[layer], want[layer], atol=1e-5, rtol=1e-5)
    if engine.name == "gemma3":  # the window hides the first chunk from the question at sliding layers
        first = st.chunk_slots[0]
        assert (got[0][first] == 0).all() and (got[1][first] > 0).all()


def test_weighted_probe_masses_equal_the_reference(engine: FusionEngine) -> None:
    layers = (0, engine.decoder.num_layers - 1)
    st = _stitched(engine, CHUNKS)
    weights = question_weights(int(st.question_ids.numel()), 0.5, engine.device)
    assert weights is not None
    want = reference_probe(engine.decoder, st.buf, st.question_ids, st.question_slots, layers, weights)
    got = engine.decoder.probe(st.buf, st.question_ids, st.question_slots, layers=layers, weights=weights)
    plain = engine.decoder.probe(st.buf, st.question_ids, st.question_slots, layers=layers)
    for layer in layers:
        torch.testing.assert_close(got[layer], want[layer], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got[layer], plain[layer] / st.question_ids.numel(), atol=1e-4)
    with pytest.raises(ValueError, match="one per scored token"):
        engine.decoder.probe(st.buf, st.question_ids, st.question_slots, layers=layers, weights=weights[1:])


@pytest.mark.parametrize("name", ["query_guided", "drift_aware"])
@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_selectors_pick_what_the_reference_masses_pick(engine: FusionEngine, name: str, ratio: float,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    config = SelectConfig(ratio=ratio)
    st = _stitched(engine, CHUNKS)
    picked = get_selector(name)(st, config.budget(st.num_reused_tokens), config)
    with monkeypatch.context() as m:
        m.setattr(Decoder, "probe", lambda self, buf, ids, slots, *, layers, weights=None: reference_probe(
            self, buf, ids, slots, layers, weights))
        st = _stitched(engine, CHUNKS)
        want = get_selector(name)(st, config.budget(st.num_reused_tokens), config)
    assert picked.numel() > 0 and torch.equal(picked, want)


@pytest.mark.parametrize("name", ["query_guided", "drift_aware"])
def test_probes_run_packed_beforehand_are_the_ones_selectors_read(engine: FusionEngine, name: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`probe_for` names the probe a selector will run; `run_probes` runs several requests' probes as
    one pass and the selectors then read those masses instead of probing, picking what they pick
    alone (the masses differ only by float rounding)."""
    config = SelectConfig(ratio=0.2)
    alone = [_stitched(engine, chunks) for chunks in (CHUNKS, CHUNKS[::-1])]
    want = [get_selector(name)(st, config.budget(st.num_reused_tokens), config) for st in alone]
    sts = [_stitched(engine, chunks) for chunks in (CHUNKS, CHUNKS[::-1])]
    probes = [probe_for(name, st, config.budget(st.num_reused_tokens), config) for st in sts]
    assert all(p is not None for p in probes)
    run_probes([p for p in probes if p is not None])
    assert all(len(st.probed) == 1 for st in sts)
    with monkeypatch.context() as m:
        m.setattr(Decoder, "probe", lambda *a, **k: pytest.fail("a selector probed again"))
        got = [get_selector(name)(st, config.budget(st.num_reused_tokens), config) for st in sts]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(not st.probed for st in sts)  # NOTE: taken, not kept: no stale masses for a later selection
    assert probe_for("kv_deviation", sts[0], 10, config) is None and probe_for(name, sts[0], 0, config) is None
