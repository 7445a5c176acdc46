"""8-bit K/V storage: int8 or fp8 (e4m3) codes with one fp32 scale per channel.

A channel is one `(layer, kv head, head dim)` coordinate; its scale covers the chunk's tokens.
Keys have a few large rotary channels and values are flatter; a scale per channel keeps the
quantisation error relative to each channel's own range, so the big channels do not swamp the
small ones. Decoding is one multiply, done on the device the cache is loaded to.

Shapes: `[L, H, T, D]` codes, `[L, H, 1, D]` scales.
"""

from __future__ import annotations

import torch

QUANTIZED: dict[str, torch.dtype] = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
# NOTE: the largest code each format represents; a channel's absolute maximum maps to it.
_CODE_MAX = {"int8": 127.0, "float8_e4m3fn": float(torch.finfo(torch.float8_e4m3fn).max)}


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes `[L, H, T, D]` in `fmt` and fp32 scales `[L, H, 1, D]` with `x ≈ codes * scales`."""
    xf = x.detach().float()
    amax = xf.abs().amax(dim=2, keepdim=True)  # [L, H, 1, D]
    # NOTE: an all-zero channel (or an empty chunk) gets scale 1, not 0: its codes are 0 either way.
    scale = torch.where(amax > 0, amax / _CODE_MAX[fmt], torch.ones_like(amax))
    scaled = xf / scale
    if fmt == "int8":
        return scaled.round_().clamp_(-127, 127).to(torch.int8), scale
    return scaled.clamp_(-_CODE_MAX[fmt], _CODE_MAX[fmt]).to(QUANTIZED[fmt]), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               device: torch.device | str) -> torch.Tensor:
    """`codes * scale` as `dtype` on `device` (the codes travel at one byte per value)."""
    codes, scale = codes.to(device, non_blocking=True), scale.to(device, non_blocking=True)
    return (codes.to(torch.float32) * scale).to(dtype)
