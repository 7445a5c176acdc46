"""Rotary position embeddings: apply them, and move already-rotated keys to new positions.

RoPE rotates each pair of dims `(x_i, x_{i+R/2})` by the angle `pos * inv_freq[i]`. Angles add,
so a key rotated for position `p0` becomes the key for `p1` by one more rotation by
`(p1 - p0) * inv_freq` — exactly, for every variant whose `inv_freq` does not depend on the
position or the sequence length (see `compat.EXACT_ROPE_TYPES`). The constant `attention_scaling`
(YaRN) multiplies cos and sin once at apply time; a pure rotation must not apply it again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusionrag_core.runtime.compat import RopeTable


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def cos_sin(
    positions: torch.Tensor, table: RopeTable, dtype: torch.dtype, *, scaled: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[N, R]` for integer `positions` `[N]`, computed in fp32 then cast to `dtype`.

    NOTE: transformers computes the angles in fp32 and casts cos/sin to the activation dtype;
    matching that order is what makes our passes bit-compatible with its forward.
    """
    inv = table.inv_freq.to(positions.device)
    freqs = positions.to(torch.float32)[:, None] * inv[None, :]  # [N, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, R]
    scale = table.attention_scaling if scaled else 1.0
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[..., N, D]` by cos/sin `[N, R]`; dims past `R` (partial rotary) pass through."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def shift_keys(keys: torch.Tensor, delta: torch.Tensor, tables: Sequence[RopeTable], *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Re-position post-RoPE keys by `delta` positions, exactly.

    Args:
        keys: `[L, H, T, D]` keys rotated for some positions `p`.
        delta: `[T]` int64 (or a 0-d tensor), the shift `p_new - p` per token.
        tables: one RopeTable per layer (layers may differ, e.g. Gemma 3 local/global).
        out: `[L, H, T, D]` (e.g. a request buffer's slots) to write the result into, or None.

    Returns:
        `[L, H, T, D]` keys rotated for `p + delta`, in the input dtype (`out` when given). The
        rotation is done in fp32 so that re-positioning bf16/fp16 caches adds no more than one rounding.
    """
    L, _, T, _ = keys.shape
    if len(tables) != L:
        raise ValueError(f"shift_keys got {len(tables)} RoPE tables for {L} layers")
    delta = delta.to(keys.device).expand(T) if delta.dim() == 0 else delta.to(keys.device)
    one_table = all(t is tables[0] for t in tables)
    if (out is not None and one_table and keys.dtype == out.dtype == torch.float32
            and keys.device == out.device and tables[0].inv_freq.shape[0] * 2 == keys.shape[-1]):
        cos, sin = cos_sin(delta, tables[0], torch.float32, scaled=False)  # [T, D]
        return _rotate_into(keys, cos, sin, out)
    if out is not None:
        return out.copy_(shift_keys(keys, delta, tables))
    if bool((delta == 0).all()):
        return keys
    if one_table:  # one table for every layer: no gather/scatter needed
        cos, sin = cos_sin(delta, tables[0], torch.float32, scaled=False)  # [T, R]
        return apply_rope(keys.to(torch.float32), cos, sin).to(keys.dtype)
    out = torch.empty_like(keys)
    # NOTE: layers sharing a table (e.g. Gemma 3's local vs global layers) are rotated in one batch.
    groups: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        groups.setdefault(id(table), []).append(i)
    for layer_ids in groups.values():
        cos, sin = cos_sin(delta, tables[layer_ids[0]], torch.float32, scaled=False)  # [T, R]
        idx = torch.tensor(layer_ids, device=keys.device)
        k = keys.index_select(0, idx).to(torch.float32)
        out.index_copy_(0, idx, apply_rope(k, cos, sin).to(keys.dtype))
    return out


def _rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`apply_rope(x, cos, sin)` (full rotary, fp32) written into `out` by halves: no temporaries.

    NOTE: a stitch moves every cached key once; this is two passes over it instead of five
    (rotate_half's copy, two products, the sum, the copy into the buffer).
    """
    h = x.shape[-1] // 2
    c, s = cos[:, :h], sin[:, :h]  # [T, D/2]: both halves of `emb` repeat the same angles
    x1, x2 = x[..., :h], x[..., h:]
    o1, o2 = out[..., :h], out[..., h:]
    torch.mul(x1, c, out=o1)
    o1.addcmul_(x2, s, value=-1.0)
    torch.mul(x2, c, out=o2)
    o2.addcmul_(x1, s)
    return out
