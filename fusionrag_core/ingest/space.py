"""Disk-space check: what an ingest will write, checked against the room the KV store has left.

A chunk's cache is `2 (K and V) x layers x kv_heads x head_dim x tokens` values in the storage
dtype, per variant: ~5.6 MB per 256-token chunk per variant for SmolLM2-135M in float16, so a
5 MB text file projects to ~39 GB. An ingest that would not fit is refused before its first
prefill, with the numbers and the option to go on anyway.
"""

from __future__ import annotations

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
    """

    chunks: int
    tokens: int
    variants: int
    bytes: int
    free_bytes: int | None

    def describe(self, where: str) -> str:
        free = "unknown free space" if self.free_bytes is None else f"{_gb(self.free_bytes)} free"
        return (f"~{_gb(self.bytes)} of KV caches ({self.chunks} chunk(s), {self.tokens} tokens, "
                f"{self.variants} variant(s)) into {where} ({free})")


def project(store: KVStore, kv_shape: tuple[int, int, int], token_counts: list[int], variants: int) -> Projection:
    """The bytes `token_counts` chunks of caches take in `store`, and the room it has.

    Args:
        store: where the caches go (its storage dtype and free space).
        kv_shape: the model's `(layers, kv_heads, head_dim)`.
        token_counts: tokens of each chunk to be cached.
        variants: 1 (independent only) or 2 (independent and fused).
    """
    layers, heads, head_dim = kv_shape
    item = storage_torch_dtype(store.storage_dtype).itemsize
    tokens = sum(token_counts)
    per_token = 2 * layers * heads * head_dim * item + _PER_TOKEN_BYTES
    need = variants * (tokens * per_token + len(token_counts) * _HEADER_BYTES)
    return Projection(len(token_counts), tokens, variants, need, store.free_bytes())


def check_room(projection: Projection, where: str) -> None:
    """Refuse a projection that does not fit the store's free space (less headroom).

    Raises:
        InsufficientSpaceError: with both numbers and how to go on.
    """
    free = projection.free_bytes
    if free is None or projection.bytes <= free * (1 - _HEADROOM):
        return
    raise InsufficientSpaceError(
        f"this ingest would write {projection.describe(where)}, more than fits; free space there, ingest fewer "
        "documents at a time, use --no-fuse (half the caches) or a model with a smaller KV cache, or go on "
        "anyway with --no-space-check (space_check=False)"
    )


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


__all__ = ["Projection", "check_room", "project"]
