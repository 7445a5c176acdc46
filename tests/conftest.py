"""Shared fixtures: the real default model is loaded once per test session (it takes ~25 s on CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from tests.ingest_worker import tokenizer_dir


@pytest.fixture(scope="session")
def default_engine() -> Iterator[FusionEngine]:
    """The packaged SmolLM2-135M-Instruct, fp32 on CPU. Tests must not leave a store attached."""
    torch.manual_seed(0)
    engine = FusionEngine.from_pretrained(device="cpu", dtype=torch.float32)
    yield engine


@pytest.fixture(scope="session")
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    """Only the default model's tokenizer (no weights), from a plain-file copy kept in pytest's cache."""
    return AutoTokenizer.from_pretrained(tokenizer_dir(request.config.cache.mkdir("fusionrag-tokenizer")))


@pytest.fixture(scope="session")
def smollm_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    return tokenizer


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module of tiny-model tests: a second OpenMP thread only adds
    synchronisation to tiny matrices on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
