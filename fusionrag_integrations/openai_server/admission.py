"""A bounded queue in front of the engine: `max_running` generate, `max_waiting` wait, the rest get 429.

One per server, used from its event loop only (asyncio primitives, no thread ever touches it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class QueueFullError(Exception):
    """The queue is full: the request was not admitted.

    Attributes:
        retry_after_s: a guess at when a slot frees (whole seconds, at least 1).
        limit: the setting to raise, for the message.
    """

    def __init__(self, retry_after_s: int, limit: str) -> None:
        super().__init__(f"the server is at capacity ({limit}); retry after {retry_after_s} s or raise {limit}")
        self.retry_after_s = retry_after_s
        self.limit = limit


class Admission:
    """Admits a request to generate, waits it in a bounded queue, or refuses it at once."""

    def __init__(self, max_running: int, max_waiting: int) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.waiting = 0
        self._mean_s = 1.0  # NOTE: a running mean of request durations, for Retry-After

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one generation slot for the block; waits in the queue, or raises QueueFullError."""
        if self.running >= self.max_running and self.waiting >= self.max_waiting:
            ahead = self.waiting + self.running
            raise QueueFullError(max(1, math.ceil(ahead * self._mean_s / self.max_running)), "max_waiting")
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        started = time.perf_counter()
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
            self._mean_s = 0.8 * self._mean_s + 0.2 * (time.perf_counter() - started)


__all__ = ["Admission", "QueueFullError"]
