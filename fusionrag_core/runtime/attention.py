"""Attention over a slot-addressed KV buffer whose cost follows the keys each query can see.

A recompute, probe or chunk-prefill pass runs a few queries at scattered positions over a long
stitched buffer. A masked SDPA call over the whole buffer costs `N x S` however little the mask
lets through (and its masked kernel is slower per score than the unmasked one on CPU). Here a
pass is planned once — not per layer — from its `MaskSpec`:

* queries are cut into blocks of consecutive rows; because slots are ordered by position (every
  stitched buffer, decode step and chunk prefill), the keys a row may see form one contiguous slot
  range, and the keys *every* row of a block sees form one range too: the block's **body**;
* bodies run through SDPA with no mask at all (split at invalid slots, if any), over a tree of
  blocks: keys that many blocks see (the long prefix in front of late picks) are attended by all
  of those blocks' rows in one call, which the CPU kernel runs at fewer ns per score than a call
  of one block's rows (`_body_calls`);
* what some but not all rows of a block see is the block's **tail** (a triangle at the block's
  own positions, plus the window's edge on sliding layers): small and masked, one call per run
  over a slice of the buffer (no gathered copy, no padding to the widest tail);
* the pieces are merged by their log-sum-exp in place, which is exact.

So a pass costs its visible scores plus a tail of about `block_rows / 2` keys per row. A mask spec
also carries sequence ids, so several sequences packed into one buffer (batched chunk prefills)
attend only within their own sequence with the same plan.

Shapes: `Hq` query heads, `H` kv heads, `G = Hq // H`, `N` queries, `S` keys, `D` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fusionrag_core.runtime import compat

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


    def is_causal_suffix(self) -> bool:
        """Two or more queries that are the last keys, at positions `S-N..S-1` in slot order, after
        keys that all hold K/V (a prompt computed afresh after a cached prefix): every earlier key
        unmasked, then causal among themselves."""
        S, N = int(self.k_pos.shape[0]), int(self.q_pos.shape[0])
        return (self.window is None and self.q_seq is None and 1 < N < S and bool(self.k_valid.all())
                and bool((self.k_pos == torch.arange(S, device=self.k_pos.device)).all())
                and bool((self.q_pos == self.k_pos[S - N:]).all()))


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
class BodyCall:
    """One unmasked attention call of consecutive query rows over key runs they all see.

    Attributes:
        r0, r1: the call's query rows (whole blocks).
        runs: `(lo, hi)` key-slot runs (all valid).
        first: the rows' first call (its output is written, not merged).
    """

    r0: int
    r1: int
    runs: tuple[tuple[int, int], ...]
    first: bool


@dataclass(frozen=True)
class TailRun:
    """Keys of one contiguous slot run that some but not all rows of a block see: one masked call.

    Attributes:
        r0, r1: the block's query rows.
        lo, hi: the run's key slots.
        bias: `[1, 1, G * n, hi - lo]` additive mask (0 / -inf) in the queries' dtype, rows folded
            group-major like the queries (`n = r1 - r0`).
        no_key: `[1, G, n]` bool, rows that see none of the run's keys, or None when every row sees one.
    """

    r0: int
    r1: int
    lo: int
    hi: int
    bias: torch.Tensor
    no_key: torch.Tensor | None


@dataclass(frozen=True)
class Plan:
    """How one pass attends at the layers that share a window; built once, used by every such layer.

    Attributes:
        kind: "causal" (SDPA's causal fast path), "suffix" (a causal suffix: the keys before it
            unmasked, merged with the causal call over its own keys), "blocks" (bodies + merged tails) or "dense"
            (one masked call: keys not in position order, which no buffer here produces, or a
            pass of a few queries over a short buffer: `forward._Pass.plan`).
        rows: rows of the largest block.
        blocks: the query blocks.
        calls: the unmasked calls that together cover every block's body exactly once (see
            `_body_calls`), in order (a call never precedes one it merges into).
        tails: every block's masked tail runs, each as wide as that block's own tail (no padding).
        dense_mask: `[N, S]` bool for "dense".
    """

    kind: str
    rows: int = 0
    blocks: tuple[Block, ...] = ()
    tails: tuple[TailRun, ...] = ()
    calls: tuple[BodyCall, ...] = ()
    dense_mask: torch.Tensor | None = None

    def scores(self, num_queries: int, num_keys: int) -> int:
        """Query-key scores the plan computes per head (padding included): its attention cost."""
        if self.kind == "suffix":
            before = num_keys - num_queries
            if padded_suffix(before, num_queries):
                return num_keys * (num_keys + 1) // 2
            return num_queries * before + num_queries * (num_queries + 1) // 2
        if self.kind != "blocks":
            causal = self.kind == "causal"
            return num_queries * (num_keys + 1) // 2 if causal else num_queries * num_keys
        body = sum((c.r1 - c.r0) * sum(hi - lo for lo, hi in c.runs) for c in self.calls)
        return body + sum((t.r1 - t.r0) * (t.hi - t.lo) for t in self.tails)


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
    # NOTE: two kernels and one merge per layer instead of a body, tails and merges per query block:
    # on CPU, each small kernel is a parallel region whose wake-up costs more than its work.
    if spec.q_pos.device.type == "cpu" and spec.is_causal_suffix():
        return Plan("suffix")
    order = _order_keys(spec)
    if order is None:
        return Plan("dense", dense_mask=spec.allowed())
    device = spec.q_pos.device
    R = block_rows or BLOCK_ROWS.get(device.type, BLOCK_ROWS["cuda"])
    lo, hi = _row_ranges(spec, order)  # [N], [N]: row i may see key slots lo[i] <= j < hi[i] (and no others)
    invalid = _invalid_runs(spec.k_valid)
    blocks: list[Block] = []
    common: list[tuple[int, int]] = []  # per block, the key range all its rows see (empty: lo >= hi)
    tails: list[TailRun] = []
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
        common.append((f_lo, f_hi))
        tails.extend(t for a, b in tail if a < b and (t := _tail_run(spec, r0, r1, a, b, group, dtype)) is not None)
    rows = max(b.r1 - b.r0 for b in blocks)
    return Plan("blocks", rows, tuple(blocks), tuple(tails), _body_calls(blocks, common, invalid))


def _body_calls(blocks: list[Block], common: list[tuple[int, int]],
                invalid: list[tuple[int, int]]) -> tuple[BodyCall, ...]:
    """Every block's body as unmasked calls over a tree of blocks, so that keys many blocks see
    are attended by all of their rows in one call.

    NOTE: the range a node's blocks all see, `[max lo, min hi)`, contains its parent's (a node's
    blocks are a subset of its parent's). A node attends only what it adds to its parent's range,
    so a leaf's ancestors' additions telescope to exactly the leaf's own body: the same scores as
    one call per block, but the keys seen by many blocks (the long prefix in front of late picks)
    go through one call of many rows, which the CPU kernel runs at up to ~25% fewer ns per score
    than a call of a 64-row block; each row pays one log-sum-exp merge per tree level it gains keys at.
    """
    calls: list[BodyCall] = []

    def visit(a: int, b: int, parent: tuple[int, int] | None, written: bool) -> None:
        lo = max(common[i][0] for i in range(a, b))
        hi = min(common[i][1] for i in range(a, b))
        here = (lo, hi) if lo < hi else None
        if here is not None:
            # NOTE: parent is inside here (nested ranges), so what is new is at most two runs
            new = [here] if parent is None else [(lo, parent[0]), (parent[1], hi)]
            runs = tuple(r for a_, b_ in new if a_ < b_ for r in _subtract(a_, b_, invalid))
            if runs:
                calls.append(BodyCall(blocks[a].r0, blocks[b - 1].r1, runs, not written))
                written = True
        if b - a > 1:
            mid = (a + b) // 2
            visit(a, mid, here or parent, written)
            visit(mid, b, here or parent, written)

    visit(0, len(blocks), None, False)
    return tuple(calls)


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


def _tail_run(spec: MaskSpec, r0: int, r1: int, lo: int, hi: int, group: int,
              dtype: torch.dtype) -> TailRun | None:
    """The masked call of rows `r0:r1` over key slots `lo:hi`, or None if none of them is visible."""
    device = spec.q_pos.device
    allowed = spec.allowed(torch.arange(r0, r1, device=device), torch.arange(lo, hi, device=device))  # [n, w]
    seen = allowed.any(-1)  # [n]
    if not bool(seen.any()):
        return None  # e.g. a run of invalid slots only
    n, w = allowed.shape
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))
    # NOTE: queries are folded [H, G, n] -> [H, G * n]: every group member sees what its row sees.
    bias = bias[None].expand(group, n, w).reshape(1, 1, group * n, w)
    no_key = None if bool(seen.all()) else (~seen)[None, None].expand(1, group, n).contiguous()
    return TailRun(r0, r1, lo, hi, compat.aligned_bias(bias), no_key)


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
    if p.kind == "suffix":
        before = int(keys.shape[1]) - N
        if padded_suffix(before, N):
            return _padded_causal(q, keys, values, scale)
        return _causal_suffix(qg, keys, values, scale).to(q.dtype).view(Hq, N, D)
    if not p.tails and all(len(b.body) == 1 for b in p.blocks):
        return _bodies_only(qg, keys, values, p, scale).view(Hq, N, D)
    out, lse = _bodies(qg, keys, values, p, scale)  # [H, G, N, D], [H, G, N]
    for t in p.tails:
        _tail_into(qg, keys, values, t, scale, out[:, :, t.r0:t.r1], lse[:, :, t.r0:t.r1])
    return out.to(q.dtype).view(Hq, N, D)


def padded_suffix(before: int, queries: int) -> bool:
    """Whether a causal suffix of `queries` rows after `before` keys runs as one causal call with
    `before` empty query rows in front: its cost, the corner of scores those rows add, is smaller
    than the second kernel and merge of `_causal_suffix` when the keys before are few (a prompt
    computed afresh after its system prefix)."""
    return before * 4 <= queries


def _padded_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the last N keys' queries `q` `[Hq, N, D]`, causal over all keys `[H, S, D]`: SDPA's
    causal mask is aligned top-left, so S - N zero query rows in front align it; their outputs are
    dropped. Returns `[Hq, N, D]`."""
    Hq, N, D = q.shape
    before = int(keys.shape[1]) - N
    padded = torch.cat([q.new_zeros(Hq, before, D), q], dim=1)  # [Hq, S, D]
    out = F.scaled_dot_product_attention(padded[None], keys[None], values[None], is_causal=True, scale=scale,
                                         enable_gqa=Hq != keys.shape[0])
    return out[0, :, before:]


def _causal_suffix(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the last N keys' queries `[H, G, N, D]`: over the keys before them (unmasked), merged
    with their causal attention over their own keys; returns fp32 `[H, G, N, D]` (exact: `_merge_into`)."""
    H, G, N, D = qg.shape
    P = int(keys.shape[1]) - N
    out, lse = compat.sdpa_with_lse(qg.reshape(1, H, G * N, D), keys[None, :, :P], values[None, :, :P], None, scale)
    out, lse = out.view(H, G, N, D).float(), lse.view(H, G, N).float()
    # NOTE: causal alignment needs a row per query, so the kv heads are repeated for the N x N part only.
    own, own_lse = compat.causal_sdpa_with_lse(qg.reshape(1, H * G, N, D),
                                               keys[None, :, P:].repeat_interleave(G, dim=1),
                                               values[None, :, P:].repeat_interleave(G, dim=1), scale)
    _merge_into(out, lse, own.view(H, G, N, D), own_lse.view(H, G, N))
    return out


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
    """Every block's unmasked body: outputs `[H, G, N, D]` and log-sum-exps `[H, G, N]` (-inf: no body)."""
    H, G, N, D = qg.shape
    out = qg.new_zeros(H, G, N, D, dtype=torch.float32)
    lse = qg.new_full((H, G, N), float("-inf"), dtype=torch.float32)
    for c in p.calls:
        n = c.r1 - c.r0
        qb = qg[:, :, c.r0:c.r1].reshape(1, H, G * n, D)
        first = c.first
        for lo, hi in c.runs:  # NOTE: one run unless the keys hold a hole (an uncached chunk)
            o, o_lse = compat.sdpa_with_lse(qb, keys[None, :, lo:hi], values[None, :, lo:hi], None, scale)
            o, o_lse = o.view(H, G, n, D), o_lse.view(H, G, n)
            if first:
                out[:, :, c.r0:c.r1], lse[:, :, c.r0:c.r1] = o, o_lse
                first = False
            else:
                _merge_into(out[:, :, c.r0:c.r1], lse[:, :, c.r0:c.r1], o, o_lse)
    return out, lse


def _tail_into(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, t: TailRun, scale: float,
               out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge one masked tail run into its block's accumulators `out` `[H, G, n, D]`, `lse` `[H, G, n]`.

    NOTE: the keys are a slice of the buffer, never a gathered copy.
    """
    H, G, _, D = qg.shape
    n = t.r1 - t.r0
    qb = qg[:, :, t.r0:t.r1].reshape(1, H, G * n, D)
    o, o_lse = compat.sdpa_with_lse(qb, keys[None, :, t.lo:t.hi], values[None, :, t.lo:t.hi], t.bias, scale)
    o, o_lse = o.view(H, G, n, D), o_lse.view(H, G, n)
    if t.no_key is not None:  # the kernel leaves rows with no visible key undefined: weight 0
        o = o.masked_fill(t.no_key[..., None], 0.0)
        o_lse = o_lse.masked_fill(t.no_key, float("-inf"))
    _merge_into(out, lse, o, o_lse)


def _merge_into(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, o_lse: torch.Tensor) -> None:
    """Fold attention `o` `[..., n, D]` over more keys, with log-sum-exp `o_lse` `[..., n]`, into the
    fp32 accumulators `out`/`lse` (views, updated in place): softmax over the union of the key sets.

    NOTE: exact: `softmax(s)v = e^{l1 - l} o1 + e^{l2 - l} o2` with `l = logaddexp(l1, l2)`; a side
    with no keys has `l = -inf` and weight 0 (every row has keys on at least one side).
    """
    o_lse = o_lse.float()
    total = torch.logaddexp(lse, o_lse)
    out.mul_(torch.exp(lse - total).unsqueeze(-1)).add_(o.float() * torch.exp(o_lse - total).unsqueeze(-1))
    lse.copy_(total)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, spec: MaskSpec, *,
              scale: float) -> torch.Tensor:
    """Masked SDPA over every key (what `attend` must equal): `[Hq, N, D]`."""
    G = q.shape[0] // keys.shape[0]
    return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=spec.allowed(), scale=scale,
                                          enable_gqa=G > 1)[0]


def attention_mass(q: torch.Tensor, keys: torch.Tensor, spec: MaskSpec, *, scale: float,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probability each key slot receives, summed over heads and queries.

    Args:
        q: `[Hq, Nq, D]` post-RoPE queries; keys: `[H, S, D]`; spec: their visibility (`[Nq]` queries).
        weights: `[Nq]` each query's weight in the sum (None: 1 each).

    Returns:
        `[S]` fp32. NOTE: only `Nq x S` scores per head exist at once (Nq = question length).
    """
    H = keys.shape[0]
    Hq, Nq, D = q.shape
    group = Hq // H
    qg = q.float().reshape(H, group * Nq, D)  # query head h uses kv head h // group
    scores = torch.bmm(qg, keys.float().transpose(1, 2)) * scale  # [H, G*Nq, S]
    scores = scores.view(Hq, Nq, -1).masked_fill(~spec.allowed()[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [Hq, Nq, S]
    if weights is None:
        return probs.sum(dim=(0, 1))  # [S]
    return torch.einsum("hns,n->s", probs, weights.to(probs))  # [S]
