"""Per-query collection of the generation statistics of every LLM call a query makes.

A query engine's synthesizer may call the LLM several times (refine, tree_summarize); the LLM
records each call's statistics into the list of the query that is running, found through a
context variable, so one shared LLM serves concurrent queries without per-request state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

_CALLS: ContextVar[list[dict[str, Any]] | None] = ContextVar("fusionrag_llm_calls", default=None)


@contextmanager
def recording(calls: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Within this block, each FusionRAGLLM generation appends its statistics to `calls`."""
    token = _CALLS.set(calls)
    try:
        yield calls
    finally:
        _CALLS.reset(token)


def record(stats: dict[str, Any]) -> None:
    """Append a finished generation's statistics to the running query's list, if any."""
    calls = _CALLS.get()
    if calls is not None:
        calls.append(stats)


__all__ = ["record", "recording"]
