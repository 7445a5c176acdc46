"""ChunkKV: the KV cache of one chunk, the unit that is stored, loaded and stitched.

Shapes use `L` layers, `H` kv heads, `T` tokens, `D` head dim.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from fusionrag_core.errors import CacheMismatchError
from fusionrag_core.runtime.memory import KVMemory

Variant = Literal["independent", "fused"]
VARIANTS: tuple[Variant, ...] = ("independent", "fused")


def hash_token_ids(token_ids: torch.Tensor) -> str:
    """Stable hex digest of a 1-D integer tensor of token ids."""
    data = token_ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


@dataclass(frozen=True)
class ChunkKV:
    """The cached keys and values of one chunk, sliced out of a longer prefill.

    Attributes:
        token_ids: `[T]` int64, the chunk's own token ids (tokenized alone, no BOS).
        keys: `[L, H, T, D]`, post-RoPE keys, rotated for `positions`.
        values: `[L, H, T, D]`.
        positions: `[T]` int64, the absolute positions the keys were rotated for.
        fingerprint: model fingerprint the cache was computed with.
        variant: "independent" (prefilled after the system prefix only) or "fused"
            (prefilled after the prefix and the chunk's neighbours).
        fused_after: for a fused cache, a digest of the neighbour ids it was prefilled after
            (`neighbours_digest`), recorded so verify can tell a cache built on another neighbour
            list than the one the collection records; "" when unknown.
        drift: for a fused cache, `[T]` fp32 >= 0, how far fusion moved each token's K/V from its
            independent cache (`drift.fusion_drift`): what a selector reads as how much the token
            depends on its context; None when unknown (independent caches, older blobs).

    NOTE: keys and values share dtype and device; positions are strictly increasing.
    """

    token_ids: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    fingerprint: str
    variant: Variant
    fused_after: str = ""
    drift: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def validate(
        self,
        *,
        fingerprint: str | None = None,
        shape: tuple[int, int, int] | None = None,
    ) -> None:
        """Check internal consistency, and optionally model fingerprint and `(L, H, D)`.

        Raises:
            CacheMismatchError: with a message naming the mismatch and the fix.
        """
        t = self.token_ids
        if t.dim() != 1 or t.dtype != torch.int64:
            raise CacheMismatchError(f"token_ids must be a 1-D int64 tensor, got {tuple(t.shape)} {t.dtype}")
        if self.keys.dim() != 4 or self.keys.shape != self.values.shape:
            raise CacheMismatchError(
                f"keys/values must both be [L, H, T, D]; got {tuple(self.keys.shape)} and {tuple(self.values.shape)}"
            )
        if self.keys.dtype != self.values.dtype or not self.keys.dtype.is_floating_point:
            raise CacheMismatchError(f"keys/values must share a float dtype; got {self.keys.dtype}/{self.values.dtype}")
        if self.keys.shape[2] != t.shape[0] or self.positions.shape != t.shape:
            raise CacheMismatchError(
                f"cache holds {self.keys.shape[2]} key slots and {tuple(self.positions.shape)} positions "
                f"for {t.shape[0]} tokens; the blob is inconsistent, recompute it"
            )
        d = self.drift
        if d is not None and (d.dtype != torch.float32 or d.shape != t.shape):
            raise CacheMismatchError(f"drift must be a float32 [T] tensor for {t.shape[0]} tokens, got "
                                     f"{d.dtype} {tuple(d.shape)}; the blob is inconsistent, recompute it")
        if self.variant not in VARIANTS:
            raise CacheMismatchError(f"unknown cache variant {self.variant!r}; expected one of {VARIANTS}")
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise CacheMismatchError(
                f"cache was computed by model {self.fingerprint[:12]}, not by the loaded model {fingerprint[:12]}; "
                "re-ingest the corpus with this model (or load the model it was built with)"
            )
        if shape is not None:
            L, H, _, D = self.keys.shape
            if shape != (L, H, D):
                raise CacheMismatchError(
                    f"cache has (layers, kv_heads, head_dim)={(L, H, D)} but the model expects {shape}; "
                    "it was built for another model: re-ingest"
                )

    def head(self, n: int) -> ChunkKV:
        """The cache of the first `n` tokens (exact: under causal attention they never saw the rest)."""
        if n == self.num_tokens:
            return self
        return ChunkKV(self.token_ids[:n], self.keys[:, :, :n], self.values[:, :, :n], self.positions[:n],
                       self.fingerprint, self.variant, drift=None if self.drift is None else self.drift[:n])

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> ChunkKV:
        """A copy on `device` (and `dtype` for keys/values)."""
        return ChunkKV(
            token_ids=self.token_ids.to(device),
            keys=self.keys.to(device, dtype or self.keys.dtype),
            values=self.values.to(device, dtype or self.values.dtype),
            positions=self.positions.to(device),
            fingerprint=self.fingerprint,
            variant=self.variant,
            fused_after=self.fused_after,
            drift=None if self.drift is None else self.drift.to(device),
        )


def neighbours_digest(neighbour_ids: Sequence[str]) -> str:
    """A short digest of a fused cache's neighbour ids, nearest first (see `ChunkKV.fused_after`)."""
    return hashlib.sha256(" ".join(neighbour_ids).encode()).hexdigest()[:16]


def storage_bytes(*tensors: torch.Tensor) -> int:
    """The memory `tensors` hold: their storages' bytes, a storage they share counted once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# NOTE: a finished request's buffer is kept as it is (no copy) when its tokens fill this share of it.
KEEP_IN_PLACE_SHARE = 0.75


class KVBuffer:
    """A preallocated, slot-addressed KV cache for one request (batch size 1).

    Slots are filled in prompt order; `positions[s]` is the position slot `s` holds (-1 = empty)
    and `valid[s]` says whether its K/V may be attended to. Passes write K/V in place at the slots
    they compute, so a query never clones the cache.

    Attributes:
        keys, values: `[L, H, S, D]` buffers, `S` = capacity in tokens.
        positions: `[S]` int64.
        valid: `[S]` bool.
        length: number of slots in use (a prefix of the buffer).
    """

    def __init__(self, layers: int, kv_heads: int, capacity: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device, memory: KVMemory | None = None) -> None:
        """`memory`: where CPU buffers take their K/V memory from (None: allocated afresh)."""
        # NOTE: not zero-filled (two `L x H x S x D` passes of memory per request): a slot is written
        # by `put`, zeroed by `reserve(valid=False)`, or written by the pass that claims it before
        # anything reads it; slots `>= length` are never read.
        shape = (layers, kv_heads, capacity, head_dim)
        self._memory = memory if torch.device(device).type == "cpu" else None
        if self._memory is not None:
            self.keys, self.values = self._memory.take_pair(shape, dtype)  # [L, H, S, D] each, one piece
        else:
            self.keys = torch.empty(shape, dtype=dtype, device=device)  # [L, H, S, D]
            self.values = torch.empty_like(self.keys)  # [L, H, S, D]
        self.positions = torch.full((capacity,), -1, dtype=torch.int64, device=device)  # [S]
        self.valid = torch.zeros(capacity, dtype=torch.bool, device=device)  # [S]
        self.length = 0

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor) -> KVBuffer:
        """A full buffer over existing K/V `[L, H, T, D]` at positions `0..T-1`, every slot valid: a
        pass rewrites some of its slots in place (healing a kept prefix: `batching.heal`)."""
        buf = cls.__new__(cls)
        buf._memory = None
        buf.keys, buf.values = keys, values
        T = int(keys.shape[2])
        buf.positions = torch.arange(T, device=keys.device)  # [T]
        buf.valid = torch.ones(T, dtype=torch.bool, device=keys.device)  # [T]
        buf.length = T
        return buf

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[2])

    def reserve(self, positions: torch.Tensor, *, valid: bool) -> torch.Tensor:
        """Claim the next `len(positions)` slots for tokens at `positions`; returns the slot indices `[N]`.

        Invalid slots are zeroed: a masked score over them must be finite (masking adds -inf).
        """
        n = int(positions.shape[0])
        a, b = self.length, self.length + n
        if b > self.capacity:
            raise ValueError(f"KV buffer full: {a} + {n} > capacity {self.capacity}")
        self.positions[a:b] = positions.to(self.keys.device)
        self.valid[a:b] = valid
        if not valid:
            self.keys[:, :, a:b] = 0
            self.values[:, :, a:b] = 0
        self.length = b
        return torch.arange(a, b, device=self.keys.device)

    def copy_to(self, other: KVBuffer) -> None:
        """Fill `other`, an empty buffer of the same shape, with this buffer's slots in use: a request
        that decodes the same prompt again appends its own tokens there."""
        assert other.keys.shape == self.keys.shape and other.length == 0, "copy_to needs an empty buffer of one shape"
        n = self.length
        other.keys[:, :, :n] = self.keys[:, :, :n]  # [L, H, n, D]
        other.values[:, :, :n] = self.values[:, :, :n]
        other.positions[:n] = self.positions[:n]
        other.valid[:n] = self.valid[:n]
        other.length = n

    def put(self, kv: ChunkKV, keys: torch.Tensor | None, start_position: int) -> torch.Tensor:
        """Append a cache whose `keys` `[L, H, T, D]` are already rotated for consecutive positions from
        `start_position` (None: the caller writes them into `keys[:, :, slots]`); returns its slots `[T]`."""
        positions = torch.arange(start_position, start_position + kv.num_tokens, device=self.keys.device)
        a = self.length
        slots = self.reserve(positions, valid=True)
        b = self.length
        # NOTE: slots are consecutive: a strided copy (with any dtype/device cast), not an index_put
        if keys is not None:
            self.keys[:, :, a:b].copy_(keys)
        self.values[:, :, a:b].copy_(kv.values)
        return slots

    def keep_head(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V `[L, H, n, D]` of the first `n` slots, for the buffer's request once it is finished
        (nothing writes those slots again): views of the buffer itself when they fill at least
        `KEEP_IN_PLACE_SHARE` of the memory it holds, else compact copies, so what keeps them never
        holds much more memory than `n` slots (the rest of a generation budget it did not use, the
        rest of a larger piece of `KVMemory`)."""
        if not 0 < n <= self.length:
            raise ValueError(f"cannot keep {n} slots of a buffer holding {self.length}")
        keys, values = self.keys[:, :, :n], self.values[:, :, :n]  # [L, H, n, D] views
        if keys.nbytes + values.nbytes >= KEEP_IN_PLACE_SHARE * storage_bytes(self.keys, self.values):
            return keys, values
        if self._memory is None:
            return keys.clone(), values.clone()
        # NOTE: compact: a piece little more than it needs
        kept_keys, kept_values = self._memory.take_pair(tuple(keys.shape), keys.dtype, most=1.25)
        return kept_keys.copy_(keys), kept_values.copy_(values)

    def slice(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K/V `[L, H, T, D]` at `slots`, for storing a chunk's part of a prefill."""
        return self.keys[:, :, slots].clone(), self.values[:, :, slots].clone()
