"""Attention over a slot-addressed KV buffer whose cost follows the keys each query can see.

A recompute, probe or chunk-prefill pass runs a few queries at scattered positions over a long
stitched buffer. A masked SDPA call over the whole buffer costs `N x S` however little the mask
lets through (and its masked kernel is ~2x slower per score than the unmasked one on CPU). Here a
pass is planned once — not per layer — from its `MaskSpec`:

* queries are cut into blocks of consecutive rows; because slots are ordered by position (every
  stitched buffer, decode step and chunk prefill), the keys a row may see form one contiguous slot
  range, and the keys *every* row of a block sees form one range too: the block's **body**;
* the body runs through SDPA with no mask at all (split at invalid slots, if any);
* what some but not all rows of a block see is the block's **tail** (a triangle at the block's
  own positions, plus the window's edge on sliding layers): small, masked, and computed for every
  block in ONE batched call;
* body and tail are merged by their log-sum-exp, which is exact.

So a pass costs its visible scores plus a tail of about `block_rows` keys per row. A mask spec
also carries sequence ids, so several sequences packed into one buffer (batched chunk prefills)
attend only within their own sequence with the same plan.

Shapes: `Hq` query heads, `H` kv heads, `G = Hq // H`, `N` queries, `S` keys, `D` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fusionrag_core import compat

# NOTE: rows per query block. The tail each row pays for is about this many keys; fewer rows mean
# more body calls. CPU SDPA calls are cheap to launch; CUDA launches are not (and a GPU computes a
# wider tail for free), so CUDA blocks are wider.
BLOCK_ROWS = {"cpu": 64, "cuda": 256}
# NOTE: a block's tail is at most this many times its row cap wide (see `_cut`).
TAIL_WIDTH = 4


@dataclass(frozen=True)
class MaskSpec:
    """Who may attend to whom, by position, validity, window and sequence; never materialised whole.

    Query `i` may see key `j` iff `k_valid[j]`, `k_seq[j] == q_seq[i]` (when given),
    `k_pos[j] <= q_pos[i]`, and `q_pos[i] - k_pos[j] < window` (when given).

    Attributes:
        q_pos: `[N]` int64 query positions.
        k_pos: `[S]` int64 key positions (slot order).
        k_valid: `[S]` bool, keys that hold K/V (the pass's own slots included).
        window: sliding-window length, or None for full attention.
        q_seq: `[N]` int64 sequence id of each query, or None (one sequence).
        k_seq: `[S]` int64 sequence id of each key; given iff `q_seq` is.
    """

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    k_valid: torch.Tensor
    window: int | None = None
    q_seq: torch.Tensor | None = None
    k_seq: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.q_seq is None) != (self.k_seq is None):
            raise ValueError("give sequence ids for both queries and keys, or for neither")
        if self.k_pos.shape != self.k_valid.shape or self.q_pos.dim() != 1:
            raise ValueError(f"q_pos [N], k_pos [S] and k_valid [S] expected; got {tuple(self.q_pos.shape)}, "
                             f"{tuple(self.k_pos.shape)}, {tuple(self.k_valid.shape)}")

    def allowed(self, rows: torch.Tensor | None = None, keys: torch.Tensor | None = None) -> torch.Tensor:
        """Bool mask `[..., n, s]` of query `rows` `[..., n]` x key slots `keys` `[..., s]` (None = all)."""
        q_pos = self.q_pos if rows is None else self.q_pos[rows]
        k_pos = self.k_pos if keys is None else self.k_pos[keys]
        k_valid = self.k_valid if keys is None else self.k_valid[keys]
        q_pos, k_pos = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
        mask = (k_pos <= q_pos) & k_valid.unsqueeze(-2)
        if self.window is not None:
            mask &= (q_pos - k_pos) < self.window
        if self.q_seq is not None and self.k_seq is not None:
            q_seq = self.q_seq if rows is None else self.q_seq[rows]
            k_seq = self.k_seq if keys is None else self.k_seq[keys]
            mask &= q_seq.unsqueeze(-1) == k_seq.unsqueeze(-2)
        return mask

    def is_plain_causal(self) -> bool:
        """Queries are every key, at positions `0..S-1` in slot order: SDPA's causal fast path applies."""
        S = int(self.k_pos.shape[0])
        return (self.window is None and self.q_seq is None and int(self.q_pos.shape[0]) == S
                and bool(self.k_valid.all())
                and bool((self.q_pos == torch.arange(S, device=self.q_pos.device)).all())
                and bool((self.k_pos == self.q_pos).all()))


@dataclass(frozen=True)
class Block:
    """One block of query rows: its unmasked body runs and where its tail rows sit.

    Attributes:
        r0, r1: the block's query rows.
        body: `(lo, hi)` key-slot runs every row of the block sees (all valid): attended unmasked.
    """

    r0: int
    r1: int
    body: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Tail:
    """Every block's tail, padded to one batched SDPA call.

    Attributes:
        keys: `[B_n, W]` int64 key slots of each block's tail (padding points at slot 0, masked).
        rows: `[B_n, R]` int64 query rows of each block (padding repeats its last row, masked).
        real: `[B_n * R]` bool, the rows that are not padding (in order, they are rows `0..N-1`).
        bias: `[B_n, 1, G * R, W]` additive mask (0 / -inf) in the queries' dtype, rows folded
            group-major like the queries (`R` = rows per block).
        has_key: `[B_n, G * R]` bool, rows that see at least one tail key.
    """

    keys: torch.Tensor
    rows: torch.Tensor
    real: torch.Tensor
    bias: torch.Tensor
    has_key: torch.Tensor


@dataclass(frozen=True)
class Plan:
    """How one pass attends at the layers that share a window; built once, used by every such layer.

    Attributes:
        kind: "causal" (SDPA's causal fast path), "blocks" (bodies + merged tails) or "dense"
            (one masked call: keys are not in position order, which no buffer here produces).
        rows: rows of the largest block (`R`; every block's tail is padded to it).
        blocks: the query blocks.
        tail: the batched tail, or None when no block has one.
        dense_mask: `[N, S]` bool for "dense".
    """

    kind: str
    rows: int = 0
    blocks: tuple[Block, ...] = ()
    tail: Tail | None = None
    dense_mask: torch.Tensor | None = None

    def scores(self, num_queries: int, num_keys: int) -> int:
        """Query-key scores the plan computes per head (padding included): its attention cost."""
        if self.kind != "blocks":
            causal = self.kind == "causal"
            return num_queries * (num_keys + 1) // 2 if causal else num_queries * num_keys
        body = sum((b.r1 - b.r0) * sum(hi - lo for lo, hi in b.body) for b in self.blocks)
        tail = 0 if self.tail is None else len(self.blocks) * self.rows * int(self.tail.keys.shape[1])
        return body + tail


def plan(spec: MaskSpec, *, group: int, dtype: torch.dtype, block_rows: int | None = None) -> Plan:
    """Plan a pass's attention from its mask spec (one host sync here, none per layer).

    Args:
        spec: the pass's visibility.
        group: query heads per kv head (`G`).
        dtype: the queries' dtype (the tail's additive mask uses it).
        block_rows: rows per query block (default by device, `BLOCK_ROWS`).
    """
    if spec.is_plain_causal():
        return Plan("causal")
    order = _order_keys(spec)
    if order is None:
        return Plan("dense", dense_mask=spec.allowed())
    device = spec.q_pos.device
    R = block_rows or BLOCK_ROWS.get(device.type, BLOCK_ROWS["cuda"])
    lo, hi = _row_ranges(spec, order)  # [N], [N]: row i may see key slots lo[i] <= j < hi[i] (and no others)
    invalid = _invalid_runs(spec.k_valid)
    blocks: list[Block] = []
    tails: list[torch.Tensor] = []
    lo_l, hi_l = lo.tolist(), hi.tolist()
    # NOTE: on a sliding layer every row sees only `window` keys: a tail as wide as the row cap
    # would cost more than the body, so the tail there is capped at a quarter of the window.
    width = TAIL_WIDTH * R if spec.window is None else max(1, min(TAIL_WIDTH * R, spec.window // 4))
    for r0, r1 in _cut(lo_l, hi_l, R, width):
        u_lo, u_hi = min(lo_l[r0:r1]), max(hi_l[r0:r1])
        f_lo, f_hi = max(lo_l[r0:r1]), min(hi_l[r0:r1])
        if f_lo >= f_hi:  # no key every row sees: the whole union is tail
            body: tuple[tuple[int, int], ...] = ()
            tail = [(u_lo, u_hi)]
        else:
            body = _subtract(f_lo, f_hi, invalid)
            tail = [(u_lo, f_lo), (f_hi, u_hi)]
        blocks.append(Block(r0, r1, body))
        tails.append(torch.cat([torch.arange(a, b) for a, b in tail]))
    rows = max(b.r1 - b.r0 for b in blocks)  # NOTE: tails are padded to the largest block, not the cap
    return Plan("blocks", rows, tuple(blocks), _tail(spec, blocks, tails, rows, group, dtype))


def _cut(lo: list[int], hi: list[int], rows: int, width: int) -> list[tuple[int, int]]:
    """Cut query rows into blocks of at most `rows` rows whose tail is at most `width` keys wide.

    NOTE: the tail of rows `r0:r1` is the keys some but not all of them see:
    `(max hi - min hi) + (max lo - min lo)`. All tails are padded to the widest, so one sparse
    stretch of queries must not widen every block's tail: it gets blocks of fewer rows instead.
    """
    cuts, r0, N = [], 0, len(lo)
    while r0 < N:
        min_lo = max_lo = lo[r0]
        min_hi = max_hi = hi[r0]
        r1 = r0 + 1
        while r1 < N and r1 - r0 < rows:
            a, b = lo[r1], hi[r1]
            if (max(max_hi, b) - min(min_hi, b)) + (max(max_lo, a) - min(min_lo, a)) > width:
                break
            min_lo, max_lo, min_hi, max_hi = min(min_lo, a), max(max_lo, a), min(min_hi, b), max(max_hi, b)
            r1 += 1
        cuts.append((r0, r1))
        r0 = r1
    return cuts


def _order_keys(spec: MaskSpec) -> torch.Tensor | None:
    """`[S]` sort key `seq * stride + pos` of each key slot, or None if slots are not in that order."""
    k = spec.k_pos
    if spec.k_seq is not None:
        stride = int(k.max()) + 1 if k.numel() else 1
        k = spec.k_seq * stride + k
    if k.numel() > 1 and bool((k[1:] < k[:-1]).any()):
        return None
    return k


def _row_ranges(spec: MaskSpec, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the key-slot range `[lo, hi)` outside which it sees nothing (validity aside)."""
    q = spec.q_pos
    low = torch.zeros_like(q) if spec.window is None else (q - spec.window + 1).clamp(min=0)
    if spec.q_seq is not None:
        stride = int(spec.k_pos.max()) + 1 if spec.k_pos.numel() else 1
        q, low = spec.q_seq * stride + q, spec.q_seq * stride + low
    lo = torch.searchsorted(order, low, right=False)
    hi = torch.searchsorted(order, q, right=True)
    return lo, hi


def _invalid_runs(valid: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal `[a, b)` slot runs of invalid keys (typically none, or one per uncached chunk)."""
    bad = ~valid
    if not bool(bad.any()):
        return []
    edges = torch.diff(bad.to(torch.int8), prepend=bad.new_zeros(1, dtype=torch.int8),
                       append=bad.new_zeros(1, dtype=torch.int8))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, ends, strict=True))


def _subtract(lo: int, hi: int, holes: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """`[lo, hi)` minus the (sorted, disjoint) `holes`, as runs."""
    runs, at = [], lo
    for a, b in holes:
        if b <= at or a >= hi:
            continue
        if a > at:
            runs.append((at, a))
        at = max(at, b)
    if at < hi:
        runs.append((at, hi))
    return tuple(runs)


def _tail(spec: MaskSpec, blocks: list[Block], tails: list[torch.Tensor], rows_per_block: int, group: int,
          dtype: torch.dtype) -> Tail | None:
    """Pad every block's tail keys to one width and precompute the batched call's additive mask."""
    R = rows_per_block
    width = max(int(t.shape[0]) for t in tails)
    if width == 0:
        return None
    device = spec.q_pos.device
    n_blocks = len(tails)
    keys = torch.zeros(n_blocks, width, dtype=torch.int64)
    real = torch.zeros(n_blocks, width, dtype=torch.bool)
    for b, t in enumerate(tails):
        keys[b, : t.shape[0]] = t
        real[b, : t.shape[0]] = True
    keys, real = keys.to(device), real.to(device)
    starts = torch.tensor([b.r0 for b in blocks], device=device)
    ends = torch.tensor([b.r1 for b in blocks], device=device)
    rows = starts[:, None] + torch.arange(R, device=device)  # [B_n, R]: block b's rows, padded past its end
    row_real = rows < ends[:, None]
    rows = torch.where(row_real, rows, ends[:, None] - 1)
    allowed = spec.allowed(rows, keys)  # [B_n, R, W]
    allowed &= real[:, None, :] & row_real[:, :, None]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))
    # NOTE: queries are folded [H, G, rows] -> [H, G * rows]: every group member sees what its row sees.
    bias = bias[:, None].expand(n_blocks, group, R, width).reshape(n_blocks, 1, group * R, width)
    has_key = allowed.any(-1)[:, None].expand(n_blocks, group, R).reshape(n_blocks, group * R)
    return Tail(keys, rows, row_real.flatten(), compat.aligned_bias(bias), has_key)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, p: Plan, *, scale: float) -> torch.Tensor:
    """Attention of `q` `[Hq, N, D]` over `keys`/`values` `[H, S, D]` as planned; returns `[Hq, N, D]`."""
    Hq, N, D = q.shape
    H = keys.shape[0]
    G = Hq // H
    if p.kind == "causal":
        return F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True, scale=scale,
                                              enable_gqa=G > 1)[0]
    if p.kind == "dense":
        assert p.dense_mask is not None
        return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=p.dense_mask,
                                              scale=scale, enable_gqa=G > 1)[0]
    qg = q.view(H, G, N, D)  # query head h uses kv head h // G
    if p.tail is None and all(len(b.body) == 1 for b in p.blocks):
        return _bodies_only(qg, keys, values, p, scale).view(Hq, N, D)
    out, lse = _bodies(qg, keys, values, p, scale)  # [H, G, N, D], [H, G, N]
    if p.tail is None:
        return out.to(q.dtype).view(Hq, N, D)
    t_out, t_lse = _tails(qg, keys, values, p, scale)
    return _merge(out, lse, t_out, t_lse).to(q.dtype).view(Hq, N, D)


def _bodies_only(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, p: Plan,
                 scale: float) -> torch.Tensor:
    """No tails anywhere (e.g. a decode step): each block's single body run is its whole attention."""
    H, G, _, D = qg.shape
    parts = []
    for b in p.blocks:
        (lo, hi), = b.body  # NOTE: without a tail, every row of the block sees exactly this run
        qb = qg[:, :, b.r0:b.r1].reshape(1, H, G * (b.r1 - b.r0), D)
        parts.append(F.scaled_dot_product_attention(qb, keys[None, :, lo:hi], values[None, :, lo:hi],
                                                    scale=scale).view(H, G, b.r1 - b.r0, D))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _bodies(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, p: Plan,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's unmasked body: outputs `[H, G, N, D]` and log-sum-exps `[H, G, N]` (-inf: no body)."""
    H, G, N, D = qg.shape
    out = qg.new_zeros(H, G, N, D, dtype=torch.float32)
    lse = qg.new_full((H, G, N), float("-inf"), dtype=torch.float32)
    for b in p.blocks:
        if not b.body:
            continue
        n = b.r1 - b.r0
        qb = qg[:, :, b.r0:b.r1].reshape(1, H, G * n, D)
        runs = [compat.sdpa_with_lse(qb, keys[None, :, lo:hi], values[None, :, lo:hi], None, scale)
                for lo, hi in b.body]  # NOTE: one run unless the block's keys hold a hole (an uncached chunk)
        o, o_lse = runs[0][0].view(H, G, n, D), runs[0][1].view(H, G, n)
        for run, run_lse in runs[1:]:
            o, o_lse = _merge(o, o_lse, run.view(H, G, n, D), run_lse.view(H, G, n), with_lse=True)
        out[:, :, b.r0:b.r1], lse[:, :, b.r0:b.r1] = o, o_lse
    return out, lse


def _tails(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, p: Plan,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block's masked tail in one batched call: `[H, G, N, D]`, `[H, G, N]` (-inf: no tail key)."""
    assert p.tail is not None
    H, G, _, D = qg.shape
    n_blocks, R = len(p.blocks), p.rows
    qt = qg[:, :, p.tail.rows].permute(2, 0, 1, 3, 4).reshape(n_blocks, H, G * R, D)  # [B_n, H, G*R, D]
    kt = keys[:, p.tail.keys].transpose(0, 1)  # [B_n, H, W, D]
    vt = values[:, p.tail.keys].transpose(0, 1)
    o, lse = compat.sdpa_with_lse(qt, kt, vt, p.tail.bias, scale)  # [B_n, H, G*R, D], [B_n, H, G*R]
    has = p.tail.has_key[:, None]  # [B_n, 1, G*R]
    o = torch.where(has[..., None], o.float(), 0.0)
    lse = torch.where(has, lse.float(), float("-inf"))
    o = o.view(n_blocks, H, G, R, D).permute(1, 2, 0, 3, 4).reshape(H, G, n_blocks * R, D)[:, :, p.tail.real]
    lse = lse.view(n_blocks, H, G, R).permute(1, 2, 0, 3).reshape(H, G, n_blocks * R)[:, :, p.tail.real]
    return o, lse


def _merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor, *,
           with_lse: bool = False) -> torch.Tensor:
    """Softmax over the union of two disjoint key sets from each set's output and log-sum-exp.

    NOTE: exact: `softmax(s)v = (e^{l1} o1 + e^{l2} o2) / (e^{l1} + e^{l2})`; a side with no keys
    has `l = -inf` and weight 0 (every row has keys on at least one side).
    """
    m = torch.maximum(l1, l2.float())
    w1, w2 = torch.exp(l1 - m), torch.exp(l2.float() - m)
    total = w1 + w2
    out = (o1.float() * (w1 / total)[..., None] + o2.float() * (w2 / total)[..., None])
    if with_lse:
        return out, m + torch.log(total)  # type: ignore[return-value]
    return out


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, spec: MaskSpec, *,
              scale: float) -> torch.Tensor:
    """Masked SDPA over every key (what `attend` must equal): `[Hq, N, D]`."""
    G = q.shape[0] // keys.shape[0]
    return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=spec.allowed(), scale=scale,
                                          enable_gqa=G > 1)[0]


def attention_mass(q: torch.Tensor, keys: torch.Tensor, spec: MaskSpec, *, scale: float) -> torch.Tensor:
    """Attention probability each key slot receives, summed over heads and queries.

    Args:
        q: `[Hq, Nq, D]` post-RoPE queries; keys: `[H, S, D]`; spec: their visibility (`[Nq]` queries).

    Returns:
        `[S]` fp32. NOTE: only `Nq x S` scores per head exist at once (Nq = question length).
    """
    H = keys.shape[0]
    Hq, Nq, D = q.shape
    group = Hq // H
    qg = q.float().reshape(H, group * Nq, D)  # query head h uses kv head h // group
    scores = torch.bmm(qg, keys.float().transpose(1, 2)) * scale  # [H, G*Nq, S]
    scores = scores.view(Hq, Nq, -1).masked_fill(~spec.allowed()[None], float("-inf"))
    return torch.softmax(scores, dim=-1).sum(dim=(0, 1))  # [S]
