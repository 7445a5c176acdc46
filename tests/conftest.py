"""Shared fixtures: the real default model is loaded once per test session (it takes ~25 s on CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.model import resolve_source


@pytest.fixture(scope="session")
def default_engine() -> Iterator[FusionEngine]:
    """The packaged SmolLM2-135M-Instruct, fp32 on CPU. Tests must not leave a store attached."""
    torch.manual_seed(0)
    engine = FusionEngine.from_pretrained(device="cpu", dtype=torch.float32)
    yield engine


@pytest.fixture(scope="session")
def smollm_tokenizer() -> PreTrainedTokenizerBase:
    """Only the default model's tokenizer (fast: no weights)."""
    source = resolve_source(None)
    return AutoTokenizer.from_pretrained(source.path_or_id, gguf_file=source.gguf_file)
