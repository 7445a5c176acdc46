"""Exceptions raised by fusionrag_core.

Every error says what went wrong *and* how to fix it; callers (CLI, integrations) print the
message as is.
"""

from __future__ import annotations


class FusionRAGError(Exception):
    """Base class of every error this package raises on purpose."""


class UnsupportedModelError(FusionRAGError):
    """The model's positional encoding or architecture cannot be re-positioned exactly."""


class ContextLengthError(FusionRAGError):
    """The prompt (plus generation budget) does not fit the model's context window."""


class CacheMismatchError(FusionRAGError):
    """A KV cache belongs to another model, has the wrong shape/dtype, or wrong token ids."""


class CacheNotFoundError(FusionRAGError, KeyError):
    """No KV cache is stored for the requested chunk id and variant."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class CacheCorruptError(FusionRAGError):
    """A stored KV blob cannot be read (truncated, bad header, failed checksum)."""


class InvalidRequestError(FusionRAGError, ValueError):
    """A request is malformed (empty question, unknown selector, bad ratio...)."""


class CorpusLockedError(FusionRAGError):
    """Another process (or thread) is writing to the corpus: one writer per corpus at a time."""


class InsufficientSpaceError(FusionRAGError):
    """An ingest's projected caches do not fit the KV store's free space, or its disk filled while it wrote."""


class DatabaseInUseError(FusionRAGError):
    """An embedded Chroma database is open in another process: a write there needs to be its only
    user, and opening it waits for another process's write (several processes need a Chroma server)."""


class ReadOnlyError(FusionRAGError):
    """A store or database directory this process cannot write (a read-only mount, missing
    permissions) was asked to change."""


class OverloadedError(FusionRAGError):
    """The engine's scheduler cannot take the request: its waiting queue is full, or the request's KV
    alone exceeds the running requests' byte budget (the message names the limit to raise).

    Attributes:
        limit: the `SchedulerConfig` field that refused it ("max_waiting" or "kv_budget_bytes").
        retry_after_s: when a retry may be served (whole seconds, >= 1); None when retrying the
            same request cannot help (it exceeds a limit alone).
    """

    def __init__(self, message: str, *, limit: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s


class AccountingError(FusionRAGError, AssertionError):
    """The engine's token accounting of a request does not add up: a defect in the engine, never the
    caller's. An AssertionError too, raised explicitly: it is checked under `python -O` as well."""
