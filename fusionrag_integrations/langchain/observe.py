"""Which documents a retriever returned in the run a FusionRAG model answers: LangChain callbacks.

A FusionRAG model learns the KV cache of a retrieved document from the prompt that holds it
(`fusionrag_core.reuse.learned`), so it must know which texts in its prompt are retrieved documents. In an
LCEL chain the retriever and the model are sibling runs of one trace; a model sees only its own
run. `RetrievalObserver` is one process-wide callback handler, added to every LangChain run through
LangChain's configure hook (the mechanism its tracers use): it records each run's parent and, per
trace (root run), the texts its retrievers returned. The model looks its own trace up by run id;
where LangChain does not hand the model its run (`stream`, `astream`, `invoke` with streaming on
call `_stream` without a run manager), by the run of the step that called it, read from the
runnable config LangChain keeps for the running step: a run of the same trace.

Only ids and texts are kept, never tensors; at most `MAX_RUNS` runs are remembered (oldest
forgotten first) and a trace is forgotten when its root run ends. `observing(False)` turns it off.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler, BaseCallbackManager
from langchain_core.documents import Document
from langchain_core.runnables import ensure_config
from langchain_core.tracers.context import register_configure_hook

MAX_RUNS = 10_000
"""Runs (and traces) remembered at once; a trace older than that has ended long ago."""


class RetrievalObserver(BaseCallbackHandler):
    """Remembers, per trace, the page contents its retrievers returned (see module docstring)."""

    # NOTE: inline, so a retriever's end is recorded before the next step of its chain starts,
    # also under async callback managers (which would otherwise run it in an executor).
    run_inline = True
    raise_error = False

    def __init__(self) -> None:
        self._parents: OrderedDict[UUID, UUID | None] = OrderedDict()
        self._documents: OrderedDict[UUID, list[str]] = OrderedDict()
        self._lock = threading.Lock()

    def _started(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        with self._lock:
            self._parents[run_id] = parent_run_id
            while len(self._parents) > MAX_RUNS:
                self._parents.popitem(last=False)

    def _root(self, run_id: UUID) -> UUID:
        seen = 0
        while (parent := self._parents.get(run_id)) is not None and seen < MAX_RUNS:
            run_id, seen = parent, seen + 1
        return run_id

    def on_chain_start(self, serialized: dict[str, Any] | None, inputs: Any, *, run_id: UUID,
                       parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._started(run_id, parent_run_id)

    def on_retriever_start(self, serialized: dict[str, Any] | None, query: str, *, run_id: UUID,
                           parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._started(run_id, parent_run_id)

    def on_chat_model_start(self, serialized: dict[str, Any] | None, messages: Any, *, run_id: UUID,
                            parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._started(run_id, parent_run_id)

    def on_llm_start(self, serialized: dict[str, Any] | None, prompts: Any, *, run_id: UUID,
                     parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._started(run_id, parent_run_id)

    def on_retriever_end(self, documents: Sequence[Document], *, run_id: UUID, parent_run_id: UUID | None = None,
                         **kwargs: Any) -> None:
        texts = [d.page_content for d in documents if isinstance(d, Document) and d.page_content.strip()]
        with self._lock:
            root = self._root(run_id)
            self._documents.setdefault(root, []).extend(texts)
            self._documents.move_to_end(root)
            while len(self._documents) > MAX_RUNS:
                self._documents.popitem(last=False)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                     **kwargs: Any) -> None:
        if parent_run_id is None:  # the trace is over: nothing in it can ask any more
            with self._lock:
                self._documents.pop(run_id, None)
                self._parents.pop(run_id, None)

    def documents_for(self, run_id: UUID | None) -> list[str]:
        """Texts retrieved so far in the trace of `run_id` (empty when unknown or off)."""
        if run_id is None:
            return []
        with self._lock:
            return list(self._documents.get(self._root(run_id), ()))


OBSERVER = RetrievalObserver()
_observer_var: ContextVar[RetrievalObserver | None] = ContextVar("fusionrag_retrieval_observer", default=OBSERVER)
register_configure_hook(_observer_var, inheritable=True)


def observing(enabled: bool) -> None:
    """Turn the observer on or off for the current context (and the tasks and threads it starts)."""
    _observer_var.set(OBSERVER if enabled else None)


def retrieved_texts(run_id: UUID | None) -> list[str]:
    """The texts retrievers returned in the trace of `run_id` (a model's run), in retrieval order.

    `run_id` None (LangChain called the model without its run manager): the trace of the step
    running now, found through its caller's run (`calling_run_id`).
    """
    return OBSERVER.documents_for(run_id if run_id is not None else calling_run_id())


def calling_run_id() -> UUID | None:
    """The run of the runnable step that is calling the current code (None outside any chain).

    NOTE: a step's child config (`ensure_config()`, LangChain's context variable for the running
    step) carries the callback manager its children are started under, whose parent is that step.
    """
    callbacks = ensure_config().get("callbacks")
    return callbacks.parent_run_id if isinstance(callbacks, BaseCallbackManager) else None


__all__ = ["MAX_RUNS", "OBSERVER", "RetrievalObserver", "calling_run_id", "observing", "retrieved_texts"]
