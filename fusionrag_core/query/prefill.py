"""Chunk caches: a chunk prefilled after the system prefix, alone (independent) or after its
neighbours (fused), keeping only the chunk's own slice."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusionrag_core.query.stitch import append_shifted
from fusionrag_core.runtime.decoder import Decoder
from fusionrag_core.runtime.kv import ChunkKV


def prefill_prefix(decoder: Decoder, prefix_ids: torch.Tensor, fingerprint: str) -> ChunkKV:
    """The exact cache of the system prefix `[P]` at positions `0..P-1`."""
    buf = decoder.new_buffer(int(prefix_ids.shape[0]))
    slots = buf.reserve(torch.arange(prefix_ids.shape[0], device=decoder.device), valid=False)
    decoder.fill(buf, prefix_ids, slots)
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
    decoder.fill(buf, token_ids, slots)
    keys, values = buf.slice(slots)  # [L, H, T, D]
    return ChunkKV(token_ids.cpu().to(torch.int64), keys, values, buf.positions[slots].cpu(), fingerprint,
                   "fused" if neighbours else "independent")


def prefill_chunks(
    decoder: Decoder,
    prefix: ChunkKV | None,
    token_ids: Sequence[torch.Tensor],
    fingerprint: str,
    neighbours: Sequence[Sequence[ChunkKV]],
) -> list[ChunkKV]:
    """`prefill_chunk` for several chunks in one packed pass (equal within fp tolerance).

    Each chunk gets its own run of slots in one buffer, laid out as `prefill_chunk` lays out a
    single one (prefix copy, its shifted neighbours, the chunk), with positions starting at 0 for
    each; the pass runs the linear layers over all chunks' tokens at once, and attention per chunk
    over its own slots only (`Decoder.fill(seq_ids=...)`), so no chunk sees another's context.

    Args:
        token_ids: per chunk, `[T_i]` int64 ids.
        neighbours: per chunk, the caches stitched in front of it (may be empty).

    Returns:
        One ChunkKV per chunk, in order, as `prefill_chunk` returns it.
    """
    if len(token_ids) != len(neighbours):
        raise ValueError(f"got {len(token_ids)} chunks and {len(neighbours)} neighbour lists; pass one list per chunk")
    for ids in token_ids:
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"token_ids must be non-empty 1-D tensors, got shape {tuple(ids.shape)}")
    for group in neighbours:
        for n in group:
            n.validate(fingerprint=fingerprint, shape=decoder.kv_shape)
    prefix_len = prefix.num_tokens if prefix is not None else 0
    sizes = [prefix_len + sum(n.num_tokens for n in group) + int(ids.shape[0])
             for ids, group in zip(token_ids, neighbours, strict=True)]
    buf = decoder.new_buffer(sum(sizes))
    chunk_slots: list[torch.Tensor] = []
    seq_ids: list[torch.Tensor] = []  # per chunk, its sequence id on each of its slots
    for ids, group in zip(token_ids, neighbours, strict=True):
        first = buf.length
        if prefix is not None:
            buf.put(prefix, prefix.keys, 0)
        for n in group:
            append_shifted(decoder, buf, n, start_position=buf.length - first)
        context = buf.length - first
        slots = buf.reserve(torch.arange(context, context + ids.shape[0], device=decoder.device), valid=False)
        chunk_slots.append(slots)
        seq_ids.append(torch.full((buf.length - first,), len(seq_ids), dtype=torch.int64))
    decoder.fill(buf, torch.cat(list(token_ids)), torch.cat(chunk_slots), seq_ids=torch.cat(seq_ids))
    out = []
    for ids, group, slots in zip(token_ids, neighbours, chunk_slots, strict=True):
        keys, values = buf.slice(slots)  # [L, H, T, D]
        out.append(ChunkKV(ids.cpu().to(torch.int64), keys, values, buf.positions[slots].cpu(), fingerprint,
                           "fused" if group else "independent"))
    return out
