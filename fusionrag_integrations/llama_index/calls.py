"""Per-query collection of the generation statistics of every LLM call a query makes.

A query engine's synthesizer may call the LLM several times (refine, tree_summarize); the LLM
records each call's statistics into the list of the query that is running, found through a
context variable, so one shared LLM serves concurrent queries without per-request state.
Recordings nest: a call made inside several (a structured predict inside a query) is recorded
into each.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

_CALLS: ContextVar[tuple[list[dict[str, Any]], ...]] = ContextVar("fusionrag_llm_calls", default=())


@contextmanager
def recording(calls: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Within this block, each FusionRAGLLM generation appends its statistics to `calls`."""
    token = _CALLS.set((*_CALLS.get(), calls))
    try:
        yield calls
    finally:
        _CALLS.reset(token)


def record(stats: dict[str, Any]) -> None:
    """Append a finished generation's statistics to the list of every recording running."""
    for calls in _CALLS.get():
        calls.append(stats)


__all__ = ["record", "recording"]
