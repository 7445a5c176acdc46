"""`benchmarks/pass_packing.py` on a tiny random Llama: both arms compute the same products, and the
report holds every rows x packs cell."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.tests.conftest import load_script
from fusionrag_core.runtime.decoder import Decoder

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_script("pass_packing", monkeypatch)


@pytest.fixture(scope="module")
def decoder() -> Decoder:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return Decoder(LlamaForCausalLM(config).eval())


def test_packed_products_equal_the_products_one_request_at_a_time(script: ModuleType, decoder: Decoder) -> None:
    x = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(1))  # [1, 3 requests x 4 rows, C]
    packed = script.products(decoder, x)
    serial = torch.cat([script.products(decoder, x[:, j:j + 4]) for j in range(0, 12, 4)], dim=1)
    assert torch.allclose(packed, serial, atol=1e-5)
    assert not torch.allclose(packed, x)  # the layers did run


def test_measure_reports_both_arms(script: ModuleType, decoder: Decoder) -> None:
    row = script.measure(decoder, 4, 3, repeats=2)
    assert (row["rows"], row["packs"]) == (4, 3)
    assert row["serial_ms"] > 0 and row["packed_ms"] > 0
    assert row["packed_over_serial"] == pytest.approx(row["packed_ms"] / row["serial_ms"])
