"""Disk-space check: what an ingest will write, checked against the room the KV store has left.

A chunk's cache is `2 (K and V) x layers x kv_heads x head_dim x tokens` values in the storage
dtype, per variant: ~5.6 MB per 256-token chunk per variant for SmolLM2-135M in float16, so a
5 MB text file projects to ~39 GB. An ingest that would not fit is refused before its first
prefill, with the numbers and the option to go on anyway.

Chunking a large file takes minutes, so the check runs twice: before chunking, on an estimate (the
tokens of the documents new to the collection, in as few chunks as they fit), and after, on the
new chunks themselves.

The projection counts the caches, not what Chroma and the bookkeeping files add, nor what other
writers take meanwhile: a write that meets a full disk anyway stops the ingest with the same
error (`stopped_when_full`); the ingest's write order leaves nothing indexed without its caches,
and running it again once there is room resumes it.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fusionrag_core.errors import InsufficientSpaceError
from fusionrag_core.store.base import KVStore
from fusionrag_core.store.codec import storage_torch_dtype

# NOTE: per blob: the safetensors header (< 2 KiB) plus token ids and positions (int64 each).
_HEADER_BYTES = 2048
_PER_TOKEN_BYTES = 16
# NOTE: fill a disk to at most 95%: a full disk fails every writer on it, not only this ingest.
_HEADROOM = 0.05


@dataclass(frozen=True)
class Projection:
    """What an ingest will store.

    Attributes:
        chunks: chunks whose caches will be written.
        tokens: their tokens (separators included).
        variants: cache variants per chunk (2 when fusing).
        bytes: projected bytes in the store.
        free_bytes: room the store reports (None: it cannot tell).
        estimated: projected from whole documents, before chunking (else from the chunks).
    """

    chunks: int
    tokens: int
    variants: int
    bytes: int
    free_bytes: int | None
    estimated: bool = False

    def describe(self, where: str) -> str:
        free = "unknown free space" if self.free_bytes is None else f"{gb(self.free_bytes)} free"
        how = ", estimated before chunking" if self.estimated else ""
        return (f"~{gb(self.bytes)} of KV caches ({self.chunks} chunk(s), {self.tokens} tokens, "
                f"{self.variants} variant(s){how}) into {where} ({free})")


def project(store: KVStore, kv_shape: tuple[int, int, int], token_counts: list[int], variants: int,
            *, estimated: bool = False) -> Projection:
    """The bytes `token_counts` chunks of caches take in `store`, and the room it has.

    Args:
        store: where the caches go (its storage dtype and free space).
        kv_shape: the model's `(layers, kv_heads, head_dim)`.
        token_counts: tokens of each chunk to be cached.
        variants: 1 (independent only) or 2 (independent and fused).
        estimated: the counts are `fewest_chunks` of whole documents (said in the description).
    """
    layers, heads, head_dim = kv_shape
    item = storage_torch_dtype(store.storage_dtype).itemsize
    tokens = sum(token_counts)
    per_token = 2 * layers * heads * head_dim * item + _PER_TOKEN_BYTES
    need = variants * (tokens * per_token + len(token_counts) * _HEADER_BYTES)
    return Projection(len(token_counts), tokens, variants, need, store.free_bytes(), estimated)


def fewest_chunks(document_tokens: Sequence[int], chunk_tokens: int) -> list[int]:
    """The token counts of the fewest chunks documents of `document_tokens` tokens can be cut into:
    every chunk full but each document's last. Chunking yields about as many tokens (more with
    overlap), in as many chunks or more."""
    counts: list[int] = []
    for tokens in document_tokens:
        full, rest = divmod(tokens, chunk_tokens)
        counts += [chunk_tokens] * full + ([rest] if rest else [])
    return counts


def fits(projection: Projection) -> bool:
    """Whether a projection fits the store's free space, less headroom (or the store cannot tell)."""
    free = projection.free_bytes
    return free is None or projection.bytes <= free * (1 - _HEADROOM)


def check_room(projection: Projection, where: str) -> None:
    """Refuse a projection that does not fit (see `fits`).

    Raises:
        InsufficientSpaceError: with both numbers and how to go on.
    """
    if fits(projection):
        return
    raise InsufficientSpaceError(
        f"this ingest would write {projection.describe(where)}, more than fits; free space there, ingest fewer "
        "documents at a time, use --no-fuse (half the caches) or a model with a smaller KV cache, or go on "
        "anyway with --no-space-check (space_check=False)"
    )


# NOTE: what a write to a full disk raises: an errno, SQLite's SQLITE_FULL as text (Chroma passes
# it on in its own errors' messages).
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("database or disk is full", "No space left on device", "Disk quota exceeded")
# NOTE: a storage error (Chroma's "Failed to apply logs to the metadata segment", a bare SQLite I/O
# error) raised while the disk has less room than this is taken for a full disk: the cause is lost
# inside Chroma's Rust core, the room is not.
NEARLY_FULL_BYTES = 1 << 18


@contextlib.contextmanager
def stopped_when_full(where: str | Path, what: str, then: str) -> Iterator[None]:
    """Raise `InsufficientSpaceError` in place of an error a full disk under `where` made in the block.

    Args:
        where: the directory written (named in the message; its disk's room is checked).
        what: what stopped, for the message ("this ingest").
        then: what to do once space is freed, for the message ("run it again: it resumes").
    """
    try:
        yield
    except InsufficientSpaceError:
        raise
    except Exception as e:
        if not _full_disk(e, Path(where)):
            raise
        raise InsufficientSpaceError(
            f"{what} stopped: the disk under {where} is full ({type(e).__name__}: {e}); free space there "
            f"(or move the data directory), then {then}"
        ) from e


def _full_disk(error: BaseException, where: Path) -> bool:
    """Whether `error`, or an error it was raised from, is a full disk's, or a storage error raised
    while the disk under `where` is (nearly) full."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL_ERRNOS:
            return True
        if any(text in str(seen) for text in _FULL_TEXTS):
            return True
        seen = seen.__cause__ or seen.__context__
    if not isinstance(error, (OSError, sqlite3.Error)) and not type(error).__module__.startswith("chromadb"):
        return False
    return room(where) < NEARLY_FULL_BYTES


def room(where: Path) -> int:
    """Bytes free on the disk of `where` (of its nearest existing ancestor); unknown counts as plenty."""
    for path in (where, *where.parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(path).free
    return 1 << 62


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


__all__ = ["NEARLY_FULL_BYTES", "Projection", "check_room", "fewest_chunks", "fits", "gb", "project", "room",
           "stopped_when_full"]
