"""`CorpusIndex`: what a store's content index offers, whichever store keeps it.

A corpus's chunks are found by content in prompts through the index its store provides
(`KVStore.content_index()`): the disk store keeps an on-disk one next to its caches
(`content_index.ContentIndex`), the Redis store one in Redis beside its caches
(`redis_content_index.RedisContentIndex`). Ingest writes it, delete removes from it, `verify` checks
and rebuilds it, and requests find chunks with it; none of them needs to know which it is.

Every implementation keeps the rule of derived data: an index that cannot be used never fails a
request (lookups find nothing, `problem` says why, one warning names `fix`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from fusionrag_core.store.content_index import Match


class CorpusIndex(Protocol):
    """A corpus's chunk texts, findable by content in any prompt (see the module docstring).

    Attributes:
        problem: why the index could not be used at its last use (None: it could).
        fix: how to repair it, for warnings and `verify`'s report.
    """

    problem: str | None
    fix: str

    @property
    def where(self) -> str:
        """Where the index lives, for messages (a directory, a Redis key)."""
        ...

    def add(self, entries: Iterable[tuple[str, str]], *, strict: bool = False) -> int:
        """Index `(chunk_id, text)` pairs (replacing earlier rows of the ids); returns how many were blank.
        `strict`: raise what stopped the write instead of skipping it with the warning."""
        ...

    def remove(self, chunk_ids: Iterable[str]) -> None:
        """Forget chunks."""
        ...

    def find(self, text: str) -> list[Match]:
        """Every indexed chunk whose text occurs verbatim in `text`, non-overlapping, in text order."""
        ...

    def chunk_ids(self) -> set[str]:
        """The ids of every indexed chunk (empty when the index cannot be read)."""
        ...

    def check(self) -> str | None:
        """Why the index cannot be trusted as it stands, or None (for `verify`; logs nothing)."""
        ...

    def rebuild(self, entries: Iterable[tuple[str, str]]) -> int:
        """Replace every row by `entries`, atomically; returns how many were indexed."""
        ...

    def __len__(self) -> int:
        """Chunks indexed (0 when the index cannot be read)."""
        ...

    def close(self) -> None:
        """Release what the index holds open (its next use opens it again)."""
        ...


__all__ = ["CorpusIndex"]
