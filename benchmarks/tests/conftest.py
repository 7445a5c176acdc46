"""Fixtures of the benchmark scripts' tests: a script loaded as a module (its `main` runs in-process),
and the product tests' shared fixtures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import (  # noqa: F401  (the product tests' shared fixtures)
    default_engine,
    one_thread,
    smollm_tokenizer,
    tokenizer,
    tokenizer_path,
)

SCRIPTS = Path(__file__).resolve().parents[1]


def load_script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """`benchmarks/<name>.py` as module `name` (registered for the test only: dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
