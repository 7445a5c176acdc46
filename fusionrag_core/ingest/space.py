"""Disk-space check: what an ingest will write, checked against the room the KV store has left.

A chunk's cache is `2 (K and V) x layers x kv_heads x head_dim x tokens` values in the storage
dtype, per variant: ~5.6 MB per 256-token chunk per variant for SmolLM2-135M in float16, so a
5 MB text file projects to ~39 GB. An ingest that would not fit is refused before its first
prefill, with the numbers and the option to go on anyway.

Chunking a large file takes minutes, so the check runs twice: before chunking, on an estimate (the
tokens of the documents new to the collection, in as few chunks as they fit), and after, on the
new chunks themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
        free = "unknown free space" if self.free_bytes is None else f"{_gb(self.free_bytes)} free"
        how = ", estimated before chunking" if self.estimated else ""
        return (f"~{_gb(self.bytes)} of KV caches ({self.chunks} chunk(s), {self.tokens} tokens, "
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


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


__all__ = ["Projection", "check_room", "fewest_chunks", "fits", "project"]
