"""The decoder's projections through packed oneDNN weights compute what the model's `nn.Linear`s do."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fusionrag_core.runtime import compat
from fusionrag_core.runtime.decoder import Decoder
from fusionrag_core.runtime.linear import LayerLinears, Linears

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(compat.packed_linear_weight(torch.zeros(2, 2)) is None,
                                 reason="this torch has no oneDNN linear")]


def _modules(widths: tuple[int, ...], *, bias: bool, k: int = 96) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(k, n, bias=bias) for n in widths]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 23, 145])
def test_packed_products_equal_the_modules(bias: bool, rows: int) -> None:
    modules = _modules((96, 32, 32), bias=bias)
    x = torch.randn(1, rows, 96)
    with torch.inference_mode():
        got = Linears(modules, packed=True)(x)
        want = [m(x) for m in modules]
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [2, 23, 145, 860])
def test_one_packed_product_of_several_weights_equals_each_packed_alone(rows: int) -> None:
    """The fused q/k/v (and gate/up) product changes no bit against packing each weight alone."""
    modules = _modules((576, 192, 192), bias=False, k=576)
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        fused = Linears(modules, packed=True)(x)
        alone = [Linears([m], packed=True)(x)[0] for m in modules]
    for f, a in zip(fused, alone, strict=True):
        assert torch.equal(f, a)


def test_unpacked_or_mixed_bias_falls_back_to_each_module() -> None:
    a, b = _modules((8,), bias=True)[0], _modules((8,), bias=False)[0]
    assert Linears([a, b], packed=True).packed is None  # NOTE: a concatenated bias would need zeros
    assert Linears([a], packed=False).packed is None
    x = torch.randn(5, 96)
    assert torch.equal(Linears([a, b], packed=True)(x)[0], a(x))


def test_layer_mlp_equals_the_models() -> None:
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    layer = LlamaForCausalLM(config).eval().model.layers[0]
    x = torch.randn(1, 23, 64)
    with torch.inference_mode():
        want = layer.mlp(x)
        assert torch.equal(LayerLinears(layer, packed=False).mlp(x), want)
        torch.testing.assert_close(LayerLinears(layer, packed=True).mlp(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_decoder_head_equals_the_models_logits(packed: bool, rows: int) -> None:
    """The decoder's head (packed apart from the embedding it is tied to) computes the model's logits."""
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    decoder = Decoder(model, packed_linears=packed)
    assert isinstance(decoder.head, Linears) and (decoder.head.packed is not None) == packed
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        want = model.lm_head(model.model.norm(x))
        got = decoder._head(x)
    assert got.shape == (rows, 300) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # NOTE: the tie survives packing
