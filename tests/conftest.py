"""Shared fixtures: the real default model is loaded once per test session (~1 s from its converted
weights in ~/.cache/fusionrag/converted, ~16 s on a machine that has not converted it yet)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.runtime import compat, threads
from tests.ingest_worker import tokenizer_dir
from tests.servers import running_chroma_server, running_redis_server


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, the workers share the cores: each gets its share of torch threads
    (two workers with two threads each on two cores only add OpenMP contention).

    The processes a worker starts (notebook kernels, `subprocess` workers, `python -c` holders) get
    the same share through OMP_NUM_THREADS, which torch reads at import: otherwise each one spins a
    pool of its own over every core while the other worker computes too. A value already set wins;
    code that sets its thread count itself (Ray replicas, ingest workers) still does."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


@pytest.fixture(scope="session", autouse=True)
def empty_working_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every test runs in an empty directory: a model built without a data dir keeps its learned
    caches in `./fusionrag-data`, which must be neither the developer's corpus nor the repository.
    (Subprocesses that import `tests` run with `cwd=` the repository.)"""
    before = Path.cwd()
    here = tmp_path_factory.mktemp("cwd")
    os.chdir(here)
    yield here
    os.chdir(before)


@pytest.fixture(scope="session")
def default_engine() -> Iterator[FusionEngine]:
    """The packaged SmolLM2-135M-Instruct, fp32 on CPU. Tests must not leave a store attached."""
    torch.manual_seed(0)
    engine = FusionEngine.from_pretrained(device="cpu", dtype=torch.float32)
    yield engine


@pytest.fixture(scope="session")
def tokenizer_path(request: pytest.FixtureRequest) -> Path:
    """A saved copy of the default model's tokenizer (plain files, no weights) in pytest's cache."""
    return tokenizer_dir(request.config.cache.mkdir("fusionrag-tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path: Path) -> PreTrainedTokenizerBase:
    """Only the default model's tokenizer (no weights), from `tokenizer_path`."""
    return AutoTokenizer.from_pretrained(tokenizer_path)


@pytest.fixture(scope="session")
def smollm_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    return tokenizer


@pytest.fixture
def pool_releases(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the threads that call `threads.release_pool` during the test (which still releases)."""
    released: list[str] = []
    release = threads.release_pool

    def recording() -> bool:
        released.append(threading.current_thread().name)
        return release()

    monkeypatch.setattr(threads, "release_pool", recording)
    return released


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module of tiny-model tests: a second OpenMP thread only adds
    synchronisation to tiny matrices on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_layer_engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    """A 1-layer random Llama with the real tokenizer: for tests of the integrations' plumbing
    (arguments, sampling, structured output), where the weights do not matter."""
    torch.manual_seed(2)
    config = LlamaConfig(vocab_size=len(smollm_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    return FusionEngine(LlamaForCausalLM(config).eval(), smollm_tokenizer, name="tiny-llama")


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch, one_layer_engine: FusionEngine) -> list[dict[str, Any]]:
    """Records FusionEngine.from_pretrained calls (and answers with the 1-layer engine)."""
    calls: list[dict[str, Any]] = []

    def fake_from_pretrained(model: Any = None, **kwargs: Any) -> FusionEngine:
        calls.append({"model": model, **kwargs})
        return one_layer_engine

    monkeypatch.setattr(FusionEngine, "from_pretrained", staticmethod(fake_from_pretrained))
    return calls


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Threads switch every microsecond instead of every 5 ms: races show in a short test."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


@pytest.fixture
def weights_never_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to load model weights fails the test (for checks that must refuse before loading)."""

    def no_load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("weights were read")

    monkeypatch.setattr(compat, "load_model", no_load)


@pytest.fixture(scope="module")
def chroma_and_redis() -> Iterator[tuple[str, str]]:
    """(Chroma URL, Redis URL): a Chroma server and a Redis server on loopback, for the module."""
    with running_chroma_server() as chroma_url, running_redis_server() as redis_url:
        yield chroma_url, redis_url
