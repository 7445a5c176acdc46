"""Host memory for request K/V buffers, kept for the next request once nothing views it.

A request's `KVBuffer` on CPU is tens of MB (`[L, H, S, D]` keys and values). Allocated afresh,
memory of that size is mapped on demand and unmapped when freed, so every request first-touches
every page of its buffer again. On a VM whose host takes freed guest pages back (balloon free-page
reporting) a first touch costs tens of microseconds per 4 KiB page: 0.1-0.2 s for a 40 MB
buffer on this project's CI machines, more than the whole stitch of a request. `KVMemory` keeps the
memory of finished buffers and carves later buffers from it, as vLLM's preallocated block pool and
torch's CUDA caching allocator do (on CUDA that allocator already does it; this is for CPU).

A piece of memory is free when no tensor but the pool's own reference views it (torch's storage
use count, `compat.storage_users`), so whatever still holds a request's K/V (a kept prefix entry,
a stream being read) keeps it out of reuse without telling the pool.
"""

from __future__ import annotations

import math
import threading

import torch

from fusionrag_core.runtime import compat

DEFAULT_IDLE_BYTES = 512 << 20


class KVMemory:
    """A thread-safe pool of flat host tensors that buffers are carved from.

    Args:
        idle_bytes: memory kept for reuse while nothing uses it; beyond it the pieces free the
            longest are handed back to the allocator. Checked whenever memory is taken: pieces
            freed since the last take are counted at the next one.
        granule: allocations are rounded up to a multiple of this many elements, so requests
            of slightly different lengths can reuse each other's memory.
    """

    def __init__(self, idle_bytes: int, granule: int) -> None:
        if idle_bytes < 0 or granule < 1:
            raise ValueError(f"KVMemory needs idle_bytes >= 0 and granule >= 1, got {idle_bytes} and {granule}")
        self.idle_bytes = idle_bytes
        self.granule = granule
        self._pieces: list[torch.Tensor] = []  # 1-D, least recently taken first
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    def __deepcopy__(self, memo: dict[int, object]) -> KVMemory:
        # NOTE: a pool is shared, like an allocator: a copied buffer takes from the same one
        return self

    def take(self, numel: int, dtype: torch.dtype, *, most: float = 2.0) -> torch.Tensor:
        """`[numel]` uninitialised CPU memory: the smallest free piece of at least `numel` and at most
        `most` times that, else a new one; it stays the caller's while any view of it lives."""
        with self._lock:
            free = self._free(dtype)
            if free is None:  # NOTE: this torch cannot tell what is free: allocate, keep no reference
                self.allocated += 1
                return torch.empty(numel, dtype=dtype)
            fits = [p for p in free if numel <= p.numel() <= most * numel]
            if fits:
                piece = min(fits, key=lambda p: p.numel())
                self.reused += 1
            else:
                piece = torch.empty(-(-numel // self.granule) * self.granule, dtype=dtype)
                self.allocated += 1
            # NOTE: most recently used last, so trimming drops what has waited longest
            self._pieces = [p for p in self._pieces if p is not piece] + [piece]
            self._trim([p for p in free if p is not piece])
            return piece[:numel]

    def take_pair(self, shape: tuple[int, ...], dtype: torch.dtype, *,
                  most: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Two uninitialised tensors of `shape` (keys, values) carved from one piece (`take`), so
        one storage use count decides when both are free."""
        n = math.prod(shape)
        flat = self.take(2 * n, dtype, most=most)  # [2n]: keys then values
        return flat[:n].view(shape), flat[n:].view(shape)

    def stats(self) -> dict[str, int]:
        """Pieces held, bytes held, and how many takes reused memory or allocated it."""
        with self._lock:
            return {"pieces": len(self._pieces), "bytes": sum(_nbytes(p) for p in self._pieces),
                    "reused": self.reused, "allocated": self.allocated}

    def _free(self, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """Pieces of `dtype` that nothing outside the pool views, least recently taken first; None
        where this torch has no storage use count (logged once by `compat.counts_storage_users`)."""
        if not compat.counts_storage_users():
            return None
        return [p for p in self._pieces if p.dtype == dtype and compat.storage_users(p) == 1]

    def _trim(self, free: list[torch.Tensor]) -> None:
        """Drop the oldest free pieces until the free ones hold at most `idle_bytes`."""
        idle = sum(_nbytes(p) for p in free)
        dropped = set()
        for p in free:
            if idle <= self.idle_bytes:
                break
            idle -= _nbytes(p)
            dropped.add(id(p))
        if dropped:
            self._pieces = [p for p in self._pieces if id(p) not in dropped]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


__all__ = ["KVMemory"]
