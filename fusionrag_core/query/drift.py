"""Fusion drift: how far fusion moved each token's K/V away from its independent cache.

Ingest computes every chunk's K/V twice: alone (after the system prefix) and fused (after its
nearest neighbours). A token whose K/V hardly changed between the two barely depends on what
precedes the chunk, so its cached K/V is likely close to right in any prompt; one that moved a lot
is context-sensitive, and in a prompt whose context differs again its cache is likely stale. The
drift is stored with the fused cache (`ChunkKV.drift`, one fp32 per token) and weighs the
question's attention in `select.select_drift_aware`: recompute where the question looks *and* the
cache can be wrong.

    drift[t] = mean over layers l of  |k_f - k_i|^2 / |k_f|^2  +  |v_f - v_i|^2 / |v_f|^2

(sums over heads and head dims; keys compared at the fused cache's positions, so RoPE cancels).
Relative per layer and per token, so it needs no statistics of the rest of the corpus and a chunk
scores the same in every prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusionrag_core.errors import CacheMismatchError
from fusionrag_core.runtime.compat import RopeTable
from fusionrag_core.runtime.kv import ChunkKV
from fusionrag_core.runtime.rope import shift_keys


def fusion_drift(fused: ChunkKV, independent: ChunkKV, rope: Sequence[RopeTable]) -> torch.Tensor:
    """`[T]` fp32 drift of each token of `fused` from `independent` (see the module docstring).

    Args:
        fused: the chunk's fused cache.
        independent: the same chunk's independent cache (same token ids).
        rope: the model's RoPE table per layer (`Decoder.rope`), to compare keys at one position.

    Raises:
        CacheMismatchError: the two caches are not of the same tokens and shape.
    """
    same_tokens = torch.equal(fused.token_ids.cpu(), independent.token_ids.cpu())
    if not same_tokens or fused.keys.shape != independent.keys.shape:
        raise CacheMismatchError(
            f"drift compares two caches of one chunk; got {fused.num_tokens} and {independent.num_tokens} tokens "
            f"(shapes {tuple(fused.keys.shape)} / {tuple(independent.keys.shape)})"
        )
    device = fused.keys.device
    delta = fused.positions.to(device) - independent.positions.to(device)  # [T]
    keys_i = shift_keys(independent.keys.to(device, torch.float32), delta, rope)  # [L, H, T, D]
    keys_f = fused.keys.float()  # [L, H, T, D]
    values_f, values_i = fused.values.float(), independent.values.to(device, torch.float32)
    dk = _relative(keys_f, keys_i)  # [L, T]
    dv = _relative(values_f, values_i)  # [L, T]
    return (dk + dv).mean(dim=0).cpu()  # [T]


def _relative(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`[L, T]` |ref - other|^2 / |ref|^2 per layer and token (sums over heads and dims)."""
    diff = (ref - other).pow(2).sum(dim=(1, 3))
    return diff / ref.pow(2).sum(dim=(1, 3)).clamp_min(1e-30)


def prompt_drift(per_chunk: Sequence[torch.Tensor | None], sizes: Sequence[int],
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """`[R]` fp32 drift of every reused token in prompt order, on `device`.

    A chunk without drift (an independent cache, a learned one, a blob from before drift was
    stored) gets the mean drift of the chunks that have it: neither favoured nor passed over. With
    no drift at all every token gets 1, which leaves a drift-weighted score equal to the attention.

    Args:
        per_chunk: each reused chunk's `[T_c]` drift (already cut to the tokens reused) or None.
        sizes: each reused chunk's reused token count `T_c`.
    """
    known = [d.to(device, torch.float32) for d in per_chunk if d is not None and d.numel()]
    # NOTE: a 0-d tensor, not a float: on CUDA the mean stays on the device (no sync per request).
    fill = torch.cat(known).mean() if known else torch.ones((), device=device)
    parts = [d.to(device, torch.float32) if d is not None else fill.expand(n)
             for d, n in zip(per_chunk, sizes, strict=True)]
    return torch.cat(parts) if parts else torch.empty(0, device=device)


__all__ = ["fusion_drift", "prompt_drift"]
