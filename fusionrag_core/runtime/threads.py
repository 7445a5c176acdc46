"""OpenMP worker pools on CPU: keep one, so parallel torch ops do not wait for sleeping workers.

libgomp, the OpenMP runtime of torch's Linux builds, keeps a pool of workers for every thread that
ever ran a parallel op (an elementwise op over more than 32K values, SDPA, a product), and keeps it
until that thread exits. Once the pools together hold more threads than there are cores, libgomp
stops letting workers spin between parallel regions: each region then wakes sleeping workers. A
pass or a decode step is hundreds of short regions; on a 2-core machine a stray pool in a
cache-loading thread made an elementwise op on a `[61, 576]` activation ~10x slower (see
docs/benchmarks.md, "Serving many users", for what releasing them did to throughput).

So a thread that ran torch ops and will not run the model next hands its pool back
(`release_pool`): the loader threads after each lookup, the blob writer after each put, the thread
that built the engine, a scheduler leader that another reader may follow, and every reader when it
stops reading. Limiting helper threads with `torch.set_num_threads(1)` instead would not do: the
setting is also the default of every thread started later.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

_OMP_PAUSE_SOFT = 1  # `omp_pause_soft`: free the calling thread's workers; the next region starts new ones


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (its wheels bundle their own copy: a name lookup could find another)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "/libgomp" in line})
    paths.sort(key=lambda path: not path.startswith(str(Path(torch.__file__).parent)))  # torch's first
    if not paths:
        logger.debug("no libgomp loaded (not Linux, or torch uses another OpenMP runtime): pools are not released")
        return None
    lib = ctypes.CDLL(paths[0])
    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
    lib.omp_pause_resource_all.restype = ctypes.c_int
    return lib


def release_pool() -> bool:
    """Free the calling thread's OpenMP workers, if it has any; its next parallel op starts a new pool
    (tens of microseconds). Returns False where there is nothing to release this way (no libgomp)."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0


def releasing(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, releasing the calling thread's pool after each call (for work handed to helper threads)."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        finally:
            release_pool()

    return call


__all__ = ["release_pool", "releasing"]
