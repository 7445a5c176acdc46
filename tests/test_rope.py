"""Re-rotated keys equal keys computed at the new position, for every RoPE variant we accept."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from fusionrag_core.errors import UnsupportedModelError
from fusionrag_core.runtime import compat
from fusionrag_core.runtime.rope import apply_rope, cos_sin, shift_keys

ROPE_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
}


def tiny_llama(rope_parameters: dict[str, Any], **overrides: Any) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters=rope_parameters, **overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_shifted_keys_equal_keys_rotated_at_new_position(variant: str) -> None:
    model = tiny_llama(ROPE_VARIANTS[variant])
    table = compat.rope_tables(model)[0]
    assert table.rope_type == variant
    raw = torch.randn(1, 2, 40, 16)  # [1, H, T, D] un-rotated keys
    p0 = torch.arange(3, 43)[None]
    p1 = torch.arange(517, 557)[None]
    rotary = model.model.rotary_emb
    cos0, sin0 = rotary(raw, p0)
    cos1, sin1 = rotary(raw, p1)
    k0 = apply_rotary_pos_emb(raw, raw, cos0, sin0)[1]  # transformers' own rotation at p0
    k1 = apply_rotary_pos_emb(raw, raw, cos1, sin1)[1]  # ... and at p1
    layers = k0.expand(2, -1, -1, -1)  # [L, H, T, D], both layers share the table
    shifted = shift_keys(layers, (p1 - p0)[0], compat.rope_tables(model))
    assert (shifted - k1.expand(2, -1, -1, -1)).abs().max().item() < 1e-4
    assert (k0 - k1).abs().max().item() > 1e-2  # the shift did real work
    # rotated straight into a buffer's (strided) slots: the same keys
    buf = torch.full((2, 2, 50, 16), float("nan"))
    into = shift_keys(layers, (p1 - p0)[0], compat.rope_tables(model), out=buf[:, :, 5:45])
    assert into.data_ptr() == buf[:, :, 5:45].data_ptr()
    assert torch.allclose(buf[:, :, 5:45], shifted, atol=1e-6) and buf[:, :, :5].isnan().all()


def test_yarn_attention_scaling_is_applied_once() -> None:
    table = compat.rope_tables(tiny_llama(ROPE_VARIANTS["yarn"]))[0]
    assert table.attention_scaling > 1.0  # otherwise this test proves nothing about the scaling


def test_partial_rotary_moves_only_rotated_dims() -> None:
    from fusionrag_core.runtime.compat import RopeTable

    table = RopeTable("default", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), 1.0)  # R = 8 of D = 16
    raw = torch.randn(1, 2, 10, 16)
    p0, p1 = torch.arange(10), torch.arange(100, 110)
    k0 = apply_rope(raw, *cos_sin(p0, table, torch.float32))
    k1 = apply_rope(raw, *cos_sin(p1, table, torch.float32))
    shifted = shift_keys(k0, p1 - p0, [table])
    assert (shifted - k1).abs().max().item() < 1e-4
    assert torch.equal(shifted[..., 8:], raw[..., 8:])


def test_shift_by_zero_is_identity_and_bf16_stays_close() -> None:
    model = tiny_llama(ROPE_VARIANTS["default"])
    tables = compat.rope_tables(model)
    keys = torch.randn(2, 2, 12, 16)
    assert shift_keys(keys, torch.tensor(0), tables) is keys
    delta = torch.full((12,), 1000)
    exact = shift_keys(keys, delta, tables)
    half = shift_keys(keys.to(torch.bfloat16), delta, tables)
    assert half.dtype == torch.bfloat16
    assert (half.float() - exact).abs().max().item() < 5e-2  # one bf16 rounding, not an accumulation


@pytest.mark.parametrize(
    ("rope_parameters", "reason"),
    [
        ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, "dynamic"),
        ({"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
          "original_max_position_embeddings": 256}, "longrope"),
    ],
)
def test_position_dependent_rope_is_refused(rope_parameters: dict[str, Any], reason: str) -> None:
    model = tiny_llama(rope_parameters)
    with pytest.raises(UnsupportedModelError, match=reason):
        compat.rope_tables(model)


def test_learned_absolute_positions_are_refused() -> None:
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    with pytest.raises(UnsupportedModelError, match=r"Llama-family|learned absolute"):
        compat.decoder_parts(model)


def test_a_projection_that_is_not_a_linear_is_refused() -> None:
    class Scaled(torch.nn.Module):  # e.g. an adapter wrapper: no `.weight` the decoder could pack
        def __init__(self, inner: torch.nn.Linear) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * self.inner(x)

    model = tiny_llama(ROPE_VARIANTS["default"])
    compat.decoder_parts(model)  # plain: accepted
    model.lm_head = Scaled(model.lm_head)
    with pytest.raises(UnsupportedModelError, match=r"lm_head is a Scaled, not an nn.Linear.*unquantized"):
        compat.decoder_parts(model)
    model = tiny_llama(ROPE_VARIANTS["default"])
    model.model.layers[0].mlp.down_proj = Scaled(model.model.layers[0].mlp.down_proj)
    with pytest.raises(UnsupportedModelError, match=r"mlp.down_proj is a Scaled"):
        compat.decoder_parts(model)
