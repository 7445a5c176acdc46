"""Blocking engine work, run off the event loop: one worker thread per call, results back on the loop.

The engine is synchronous (torch kernels release the GIL, so a worker thread computes while the
loop keeps serving other coroutines). A streaming call pushes every piece to the loop as soon as
the worker has it, rather than collecting the answer first.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_ITEM, _ERROR, _DONE = "item", "error", "done"


async def call_in_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a worker thread, with the caller's context (instrumentation spans) copied."""
    return await asyncio.to_thread(fn, *args)


async def iterate_in_thread(make: Callable[[], Iterator[T]]) -> AsyncGenerator[T, None]:
    """Iterate `make()` in a worker thread, yielding each item on the loop as soon as it exists.

    Closing the async generator early (a consumer that stops reading, a cancelled task) makes the
    worker stop after its current item and close the iterator, so no generation runs on unseen.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    stop = threading.Event()

    def post(kind: str, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # NOTE: the loop closed under us: nobody is left to read
            stop.set()

    def work() -> None:
        try:
            iterator = make()
            try:
                for item in iterator:
                    if stop.is_set():
                        break
                    post(_ITEM, item)
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
        except BaseException as exc:  # NOTE: re-raised on the loop, in the consumer
            post(_ERROR, exc)
        else:
            post(_DONE, None)

    context = contextvars.copy_context()
    worker = threading.Thread(target=context.run, args=(work,), name="fusionrag-astream", daemon=True)
    worker.start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == _ITEM:
                yield value
            elif kind == _ERROR:
                raise value
            else:
                return
    finally:
        stop.set()


__all__ = ["call_in_thread", "iterate_in_thread"]
