"""Chunk caches: a chunk prefilled after the system prefix, alone (independent) or after its
neighbours (fused), keeping only the chunk's own slice."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusionrag_core.forward import Decoder
from fusionrag_core.kv import ChunkKV
from fusionrag_core.stitch import append_shifted


def prefill_prefix(decoder: Decoder, prefix_ids: torch.Tensor, fingerprint: str) -> ChunkKV:
    """The exact cache of the system prefix `[P]` at positions `0..P-1`."""
    buf = decoder.new_buffer(int(prefix_ids.shape[0]))
    slots = buf.reserve(torch.arange(prefix_ids.shape[0], device=decoder.device), valid=False)
    decoder.forward(buf, prefix_ids, slots, logits=False)
    keys, values = buf.slice(slots)
    return ChunkKV(prefix_ids.cpu(), keys, values, buf.positions[slots].cpu(), fingerprint, "independent")


def prefill_chunk(
    decoder: Decoder,
    prefix: ChunkKV | None,
    token_ids: torch.Tensor,
    fingerprint: str,
    neighbours: Sequence[ChunkKV] = (),
) -> ChunkKV:
    """Prefill one chunk `[T]` after the prefix and (for a fused cache) its neighbours' caches.

    Neighbours are stitched in the given order at consecutive positions after the prefix (their
    keys re-rotated), the chunk follows them, and only the chunk's slice is kept. With no
    neighbours the result is the chunk's independent cache.

    Returns:
        ChunkKV with keys/values `[L, H, T, D]` on the decoder's device and dtype, positions at
        which the chunk was prefilled, variant "fused" iff neighbours were given.
    """
    if token_ids.dim() != 1 or token_ids.numel() == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}")
    for n in neighbours:
        n.validate(fingerprint=fingerprint, shape=decoder.kv_shape)
    context = (prefix.num_tokens if prefix is not None else 0) + sum(n.num_tokens for n in neighbours)
    buf = decoder.new_buffer(context + int(token_ids.shape[0]))
    if prefix is not None:
        buf.put(prefix, prefix.keys, 0)
    for n in neighbours:
        append_shifted(decoder, buf, n)
    slots = buf.reserve(torch.arange(context, context + token_ids.shape[0], device=decoder.device), valid=False)
    decoder.forward(buf, token_ids, slots, logits=False)
    keys, values = buf.slice(slots)  # [L, H, T, D]
    return ChunkKV(token_ids.cpu().to(torch.int64), keys, values, buf.positions[slots].cpu(), fingerprint,
                   "fused" if neighbours else "independent")
