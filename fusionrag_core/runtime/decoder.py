"""Decoder passes over a slot-addressed KV buffer: the only place that runs the model's layers.

Every pass is one per-layer step (`_project` then `_mix`) over different tokens; the entry points
say what a pass is for:

* `fill`: write the tokens' K/V at every layer (chunk and prefix prefills; no logits);
* `prefill`: `fill`, then the last token's logits (a plain prefill, the recompute pass);
* `decode_step`: `prefill` of one generated token;
* `decode_batch`: one generated token for each of several requests, each over its own buffer: the
  projections and MLPs run as one product over the batch, attention per request;
* `probe`: the attention mass the tokens give every slot at chosen layers (query-guided selectors);
* `probe_keys`: the tokens' fresh keys at one layer (CacheBlend's deviation).

It runs the transformers modules of a Llama-family decoder (projections, norms, MLP) but owns
attention, so that it can (a) write new K/V in place at arbitrary slots, (b) mask by *position* —
causal and sliding-window — rather than by slot order, at a cost that follows the keys each
query sees (`attention.py`), and (c) read attention mass without materialising any `T x T` matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from fusionrag_core.errors import UnsupportedModelError
from fusionrag_core.runtime import attention, compat
from fusionrag_core.runtime.kv import KVBuffer
from fusionrag_core.runtime.linear import LayerLinears, Linears
from fusionrag_core.runtime.memory import DEFAULT_IDLE_BYTES, KVMemory
from fusionrag_core.runtime.rope import RopeTable, apply_rope, cos_sin

# NOTE: passes this small attend in one masked call (see `_Pass.plan`).
DENSE_MAX_QUERIES = 512
DENSE_MAX_KEYS = 2048


@dataclass
class _Pass:
    """What every layer of one pass shares: where its tokens sit and how they may attend.

    Attributes:
        buf: the request's buffer; keys are its slots `< length`.
        slots: `[N]` slots the pass writes.
        spec: visibility of the pass's queries (window unset: `plan` sets it per layer kind).
        cos_sin: RoPE tables' cos/sin at the queries' positions, by table identity.
    """

    buf: KVBuffer
    slots: torch.Tensor
    spec: attention.MaskSpec
    group: int
    dtype: torch.dtype
    cos_sin: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _plans: dict[int | None, attention.Plan] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.spec.k_pos.shape[0])

    def rope(self, table: RopeTable) -> tuple[torch.Tensor, torch.Tensor]:
        if id(table) not in self.cos_sin:
            self.cos_sin[id(table)] = cos_sin(self.spec.q_pos, table, self.dtype)
        return self.cos_sin[id(table)]  # [N, R]

    def window_spec(self, window: int | None) -> attention.MaskSpec:
        s = self.spec
        return attention.MaskSpec(s.q_pos, s.k_pos, s.k_valid, window, s.q_seq, s.k_seq)

    def plan(self, window: int | None) -> attention.Plan:
        """The attention plan of layers with this window, built on first use (once per pass).

        On CPU, a pass of up to `DENSE_MAX_QUERIES` queries over a short buffer (a query-guided
        probe; a recompute pass: the selected chunk tokens and the question) attends in ONE masked
        call (`Plan("dense")`) instead of bodies, tails and their merges per block of query rows:
        dozens fewer kernels per layer, so fewer parallel regions for a second thread to join,
        which costs more than the masked scores the call computes in vain. Past `DENSE_MAX_KEYS`
        keys the unmasked bodies win, and one-query passes (decode) have no tail to save. Other
        devices always take the planned path (the thresholds are CPU ones).
        """
        if window not in self._plans:
            spec = self.window_spec(window)
            if (self.buf.keys.device.type == "cpu" and 1 < spec.q_pos.shape[0] <= DENSE_MAX_QUERIES
                    and self.length <= DENSE_MAX_KEYS):
                self._plans[window] = attention.Plan("dense", dense_mask=spec.allowed())  # [N, S]
            else:
                self._plans[window] = attention.plan(spec, group=self.group, dtype=self.dtype)
        return self._plans[window]

    def last_row(self) -> _Pass:
        """The same pass for its last query only (K/V are written: only the last output is read)."""
        s = self.spec
        q_seq = s.q_seq[-1:] if s.q_seq is not None else None
        spec = attention.MaskSpec(s.q_pos[-1:], s.k_pos, s.k_valid, None, q_seq, s.k_seq)
        return _Pass(self.buf, self.slots[-1:], spec, self.group, self.dtype)


class Decoder:
    """Runs a Llama-family transformers model layer by layer over a `KVBuffer`."""

    def __init__(self, model: PreTrainedModel, *, compile_decode: bool = False, packed_linears: bool = True,
                 idle_kv_bytes: int = DEFAULT_IDLE_BYTES) -> None:
        """Args:
            model: a Llama-family transformers model.
            compile_decode: compile each layer's MLP for one-token passes (see `EngineConfig`).
            packed_linears: CPU fp32 projections and head through oneDNN with packed weights (`linear.py`).
            idle_kv_bytes: on CPU, memory of finished buffers kept for later ones (`memory.KVMemory`);
                0: every buffer is allocated afresh.
        """
        self.model = model
        self.parts = compat.decoder_parts(model)
        self.rope = compat.rope_tables(model)
        self.windows = compat.sliding_windows(model)
        attn = self.parts.layers[0].self_attn
        if getattr(attn, "attn_logit_softcapping", None) is not None:
            raise UnsupportedModelError(
                "attention logit soft-capping (Gemma 2) has no fused attention kernel; "
                "use Gemma 3 or a Llama/Qwen model"
            )
        config = compat.text_config(model)
        self.num_layers = len(self.parts.layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.scaling = float(attn.scaling)
        self.sandwich_norms = hasattr(self.parts.layers[0], "pre_feedforward_layernorm")  # Gemma 2/3
        self.qk_norm = hasattr(attn, "q_norm")  # Qwen3, Gemma 3
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.linears = [LayerLinears(layer, packed=packed_linears) for layer in self.parts.layers]
        lm_head = self.parts.lm_head
        # NOTE: the head is packed apart from the embedding it may be tied to (a lookup reads rows of
        # the plain weight; the packed copy is blocked)
        self.head = Linears([lm_head], packed=packed_linears)
        # NOTE: buffers are carved in steps of 64 tokens of keys and values, so prompts of nearby
        # lengths reuse each other's memory
        self.memory = (KVMemory(idle_kv_bytes, granule=2 * 64 * self.num_layers * self.num_kv_heads * self.head_dim)
                       if self.device.type == "cpu" and idle_kv_bytes > 0 else None)
        self.one_token_mlps = ([_compiled(layer.mlp, self.device) for layer in self.parts.layers]
                               if compile_decode else None)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """`(L, H, D)` of every K/V tensor this model produces."""
        return (self.num_layers, self.num_kv_heads, self.head_dim)

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of a KV buffer holding `tokens` tokens (keys and values, every layer)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * tokens * self.dtype.itemsize

    def new_buffer(self, capacity: int) -> KVBuffer:
        return KVBuffer(self.num_layers, self.num_kv_heads, capacity, self.head_dim, dtype=self.dtype,
                        device=self.device, memory=self.memory)

    # ---- entry points ----------------------------------------------------------------------------
    @torch.inference_mode()
    def fill(self, buf: KVBuffer, token_ids: torch.Tensor, slots: torch.Tensor, *,
             seq_ids: torch.Tensor | None = None) -> None:
        """Write the K/V of `token_ids` `[N]` at every layer into `slots` `[N]` (a chunk prefill).

        All N tokens' K/V are written at each layer *before* that layer's attention, so the tokens
        of one pass see each other causally by position.

        Args:
            buf: the buffer; its slots `< buf.length` are the keys (those not `valid` are ignored).
            token_ids: `[N]` int64 tokens.
            slots: `[N]` slots reserved for them (their positions are `buf.positions[slots]`).
            seq_ids: `[buf.length]` int64 sequence id of every slot, for several sequences packed
                into one buffer: a token then sees only its own sequence's keys. None = one sequence.
        """
        p = self._pass(buf, slots, seq_ids)
        x = self._embed(token_ids)
        for i in range(self.num_layers):
            q = self._write(i, x, p)
            if i == self.num_layers - 1:
                break  # NOTE: the last layer's K/V are all a fill wants: its attention and MLP feed nothing
            x = self._mix(i, x, q, p)

    @torch.inference_mode()
    def prefill(self, buf: KVBuffer, token_ids: torch.Tensor, slots: torch.Tensor, *,
                seq_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`fill`, then the `[V]` fp32 logits of the last token (a plain prefill, the recompute pass).

        A recompute of every prompt token from position 0 equals a plain prefill: that is this
        pass with every slot in `slots`.
        """
        p = self._pass(buf, slots, seq_ids)
        x = self._embed(token_ids)
        for i in range(self.num_layers):
            q = self._write(i, x, p)
            if i == self.num_layers - 1:
                # NOTE: every token's K/V are written; only the last token's output is ever read
                x, q, p = x[:, -1:], q[:, :, -1:], p.last_row()
            x = self._mix(i, x, q, p)
        return self._logits(x)

    @torch.inference_mode()
    def prefill_batch(self, bufs: Sequence[KVBuffer], token_ids: Sequence[torch.Tensor],
                      slots: Sequence[torch.Tensor]) -> torch.Tensor:
        """`prefill` of `B` requests in one pass; returns each one's last-token logits `[B, V]` fp32.

        The rows of every request go through each projection and MLP as one product (a product
        of a few dozen rows on CPU is far from the cores' rate: `benchmarks/pass_packing.py`);
        each request writes its K/V into its own buffer and attends over it with the plan its
        pass has alone. A row equals its request's `prefill` up to float rounding (a product
        of more rows is blocked differently); one request runs `prefill` itself, bit for bit.

        Args:
            bufs: `B` request buffers (distinct).
            token_ids: `B` tensors `[N_b]` int64, each request's tokens.
            slots: `B` tensors `[N_b]`, the slots reserved for them in its buffer.
        """
        B = len(bufs)
        if len(token_ids) != B or len(slots) != B or any(
                t.shape != s.shape for t, s in zip(token_ids, slots, strict=True)):
            raise ValueError(f"prefill_batch needs one [N_b] token and slot tensor per buffer: {B} buffers, "
                             f"{[tuple(t.shape) for t in token_ids]} tokens, {[tuple(s.shape) for s in slots]} slots")
        if B == 1:
            return self.prefill(bufs[0], token_ids[0], slots[0])[None]
        passes = [self._pass(buf, s, None) for buf, s in zip(bufs, slots, strict=True)]
        bounds = _row_bounds(slots)
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        x = self._embed(torch.cat(list(token_ids)))  # [1, N, C], N = sum of N_b
        for i in range(self.num_layers):
            qs = self._write_batch(i, x, passes, bounds, tables)  # B x [Hq, N_b, D]
            if i == self.num_layers - 1:
                # NOTE: every token's K/V are written; only each request's last output is read
                x = x[:, [b - 1 for _, b in bounds]]  # [1, B, C]
                qs, passes = [q[:, -1:] for q in qs], [p.last_row() for p in passes]
            x = self._feed_forward(i, x, self._attend_batch(i, qs, passes))
        return self._head(x[0])  # [B, V]

    def _write_batch(self, i: int, x: torch.Tensor, passes: Sequence[_Pass], bounds: Sequence[tuple[int, int]],
                     tables: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Layer `i`'s projections of the packed rows `x` `[1, N, C]`; writes each request's K/V into its
        buffer and returns its post-RoPE queries `[Hq, N_b, D]`. `tables`: the pass's RoPE cos/sin
        at every row's position, by table identity (filled on first use)."""
        q, k, v = self._qkv(i, x)  # [1, Hq, N, D], [1, H, N, D] x 2
        table = self.rope[i]
        if id(table) not in tables:
            tables[id(table)] = cos_sin(torch.cat([p.spec.q_pos for p in passes]), table, self.dtype)  # [N, R]
        cos, sin = tables[id(table)]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # NOTE: elementwise: one call for every row
        qs = []
        for p, (a, b) in zip(passes, bounds, strict=True):
            self._store(i, k[:, :, a:b], v[:, :, a:b], p)
            qs.append(q[0, :, a:b])
        return qs

    def _attend_batch(self, i: int, qs: Sequence[torch.Tensor], passes: Sequence[_Pass]) -> torch.Tensor:
        """Layer `i`'s attention of each request's queries `[Hq, N_b, D]` over its own buffer, as planned
        for it alone; returns the outputs side by side, `[Hq, N, D]`."""
        return torch.cat([attention.attend(q, p.buf.keys[i, :, :p.length], p.buf.values[i, :, :p.length],
                                           p.plan(self.windows[i]), scale=self.scaling)
                          for q, p in zip(qs, passes, strict=True)], dim=1)

    def decode_step(self, buf: KVBuffer, token_id: int, slot: torch.Tensor) -> torch.Tensor:
        """Write one generated token's K/V at `slot` `[1]` and return its `[V]` fp32 logits."""
        return self.prefill(buf, torch.tensor([token_id], device=self.device), slot)

    @torch.inference_mode()
    def decode_batch(self, bufs: Sequence[KVBuffer], token_ids: torch.Tensor,
                     slots: Sequence[torch.Tensor]) -> torch.Tensor:
        """One decode step for `B` requests: write each token's K/V at its slot in its own buffer and
        return the `[B, V]` fp32 logits.

        A step is mostly reading the weights, so the rows share one read of every projection and MLP
        weight; attention runs per request over its own buffer, with the plan its decode step has
        alone. Each row equals `decode_step` of that request up to float rounding (a product of B
        rows is blocked differently from a product of one).

        Args:
            bufs: `B` request buffers (distinct).
            token_ids: `[B]` int64, the token each request feeds.
            slots: `B` tensors `[1]`, the slot each token takes in its buffer.
        """
        B = len(bufs)
        if token_ids.shape != (B,) or len(slots) != B:
            raise ValueError(f"decode_batch needs one token and one slot per buffer: {B} buffers, "
                             f"token_ids {tuple(token_ids.shape)}, {len(slots)} slots")
        passes = [self._pass(buf, slot, None) for buf, slot in zip(bufs, slots, strict=True)]
        bounds = [(b, b + 1) for b in range(B)]
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        x = self._embed(token_ids)  # [1, B, C]: the batch is the token axis of one pass
        for i in range(self.num_layers):
            qs = self._write_batch(i, x, passes, bounds, tables)  # B x [Hq, 1, D]
            x = self._feed_forward(i, x, self._attend_batch(i, qs, passes))
        return self._head(x[0])  # [B, V]

    @torch.inference_mode()
    def probe(self, buf: KVBuffer, token_ids: torch.Tensor, slots: torch.Tensor, *,
              layers: Sequence[int], weights: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        """Attention mass every slot receives from `token_ids`' queries, at each of `layers`.

        The tokens (a question) run at their slots up to the highest layer asked for; their K/V are
        written on the way (a later pass overwrites them), nothing above it runs.

        Args:
            weights: `[N]` each token's weight in the sum (None: 1 each).

        Returns:
            layer -> `[buf.length]` fp32: softmax per head over the visible keys, summed over heads
            and tokens (weighted by `weights`).
        """
        self._check_probe(layers, token_ids, weights)
        top = max(layers)
        p = self._pass(buf, slots, None)
        x = self._embed(token_ids)
        masses: dict[int, torch.Tensor] = {}
        for i in range(top + 1):
            q = self._write(i, x, p)
            if i in layers:
                masses[i] = attention.attention_mass(q[0], buf.keys[i, :, :p.length], p.window_spec(self.windows[i]),
                                                     scale=self.scaling, weights=weights)
            if i == top:
                break  # NOTE: the mass is read from this layer's queries and keys; its output feeds nothing
            x = self._mix(i, x, q, p)
        return masses

    @torch.inference_mode()
    def probe_batch(self, bufs: Sequence[KVBuffer], token_ids: Sequence[torch.Tensor], slots: Sequence[torch.Tensor],
                    *, layers: Sequence[int], weights: Sequence[torch.Tensor | None]) -> list[dict[int, torch.Tensor]]:
        """`probe` of `B` requests at the same `layers` in one pass; returns each one's masses.

        As in `prefill_batch`, the rows share every product and attend per request; a request's
        masses equal its own `probe` up to float rounding, and one request runs `probe` itself.

        Args:
            bufs: `B` request buffers (distinct).
            token_ids: `B` tensors `[N_b]`, each request's probing tokens (its question).
            slots: `B` tensors `[N_b]`, their slots in its buffer.
            layers: the layers whose masses every request reads.
            weights: per request, `[N_b]` weights of its tokens in the sum, or None (1 each).
        """
        B = len(bufs)
        if len(token_ids) != B or len(slots) != B or len(weights) != B:
            raise ValueError(f"probe_batch needs tokens, slots and weights per buffer: {B} buffers, "
                             f"{len(token_ids)} tokens, {len(slots)} slots, {len(weights)} weights")
        if B == 1:
            return [self.probe(bufs[0], token_ids[0], slots[0], layers=layers, weights=weights[0])]
        for t, w in zip(token_ids, weights, strict=True):
            self._check_probe(layers, t, w)
        top = max(layers)
        passes = [self._pass(buf, s, None) for buf, s in zip(bufs, slots, strict=True)]
        bounds = _row_bounds(slots)
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        x = self._embed(torch.cat(list(token_ids)))  # [1, N, C]
        masses: list[dict[int, torch.Tensor]] = [{} for _ in range(B)]
        for i in range(top + 1):
            qs = self._write_batch(i, x, passes, bounds, tables)  # B x [Hq, N_b, D]
            if i in layers:
                for b, (q, p, w) in enumerate(zip(qs, passes, weights, strict=True)):
                    masses[b][i] = attention.attention_mass(q, p.buf.keys[i, :, :p.length],
                                                            p.window_spec(self.windows[i]), scale=self.scaling,
                                                            weights=w)  # [S_b]
            if i == top:
                break  # NOTE: the mass is read from this layer's queries and keys; its output feeds nothing
            x = self._feed_forward(i, x, self._attend_batch(i, qs, passes))
        return masses

    def _check_probe(self, layers: Sequence[int], token_ids: torch.Tensor, weights: torch.Tensor | None) -> None:
        """Refuse a probe's layers outside the model, or weights that are not one per token."""
        if not layers or not all(0 <= layer < self.num_layers for layer in layers):
            raise ValueError(f"attention layers {list(layers)} must be non-empty and in [0, {self.num_layers})")
        n = int(token_ids.shape[0])
        if weights is not None and weights.shape != (n,):
            raise ValueError(f"weights must be [{n}] (one per scored token), got {list(weights.shape)}")

    @torch.inference_mode()
    def probe_keys(self, buf: KVBuffer, token_ids: torch.Tensor, slots: torch.Tensor, layer: int) -> torch.Tensor:
        """The tokens' fresh post-RoPE keys `[H, N, D]` at `layer`, computed over the buffer below it.

        K/V below `layer` are written into `slots`; nothing at `layer` or above is.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"probe layer must be in [0, {self.num_layers}), got {layer}")
        p = self._pass(buf, slots, None)
        x = self._embed(token_ids)
        for i in range(layer + 1):
            q, k, v = self._project(i, x, p)
            if i == layer:
                return k[0]
            self._store(i, k, v, p)
            x = self._mix(i, x, q, p)
        raise AssertionError("unreachable")

    # ---- the per-layer step ----------------------------------------------------------------------
    def _pass(self, buf: KVBuffer, slots: torch.Tensor, seq_ids: torch.Tensor | None) -> _Pass:
        S = buf.length
        k_valid = buf.valid[:S].clone()
        k_valid[slots] = True
        q_seq = k_seq = None
        if seq_ids is not None:
            if seq_ids.shape != (S,):
                raise ValueError(f"seq_ids must be [{S}] (one id per used buffer slot), got {tuple(seq_ids.shape)}")
            k_seq = seq_ids.to(buf.positions.device)
            q_seq = k_seq[slots]
        spec = attention.MaskSpec(buf.positions[slots], buf.positions[:S], k_valid, None, q_seq, k_seq)
        return _Pass(buf, slots, spec, self.num_heads // self.num_kv_heads, self.dtype)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.parts.embed_tokens(token_ids.to(self.device)[None])  # [1, N, C]

    def _project(self, i: int, x: torch.Tensor, p: _Pass) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `i`'s post-RoPE queries `[1, Hq, N, D]`, keys and values `[1, H, N, D]`."""
        q, k, v = self._qkv(i, x)
        cos, sin = p.rope(self.rope[i])
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _qkv(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `i`'s queries `[1, Hq, N, D]`, keys and values `[1, H, N, D]` of `x` `[1, N, C]`, before RoPE."""
        layer, lin = self.parts.layers[i], self.linears[i]
        attn = layer.self_attn
        N = x.shape[1]
        h = layer.input_layernorm(x)
        q, k, v = lin.qkv(h)
        q = q.view(1, N, self.num_heads, self.head_dim).transpose(1, 2)  # [1, Hq, N, D]
        k = k.view(1, N, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [1, H, N, D]
        v = v.view(1, N, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [1, H, N, D]
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    def _store(self, i: int, k: torch.Tensor, v: torch.Tensor, p: _Pass) -> None:
        p.buf.keys[i, :, p.slots] = k[0]
        p.buf.values[i, :, p.slots] = v[0]

    def _write(self, i: int, x: torch.Tensor, p: _Pass) -> torch.Tensor:
        """Project layer `i`, write its K/V into the pass's slots; returns the queries `[1, Hq, N, D]`."""
        q, k, v = self._project(i, x, p)
        self._store(i, k, v, p)
        return q

    def _mix(self, i: int, x: torch.Tensor, q: torch.Tensor, p: _Pass) -> torch.Tensor:
        """Layer `i`'s attention over the buffer (as planned for its window), output projection and MLP."""
        S = p.length
        keys, values = p.buf.keys[i, :, :S], p.buf.values[i, :, :S]  # [H, S, D]
        o = attention.attend(q[0], keys, values, p.plan(self.windows[i]), scale=self.scaling)  # [Hq, N, D]
        return self._feed_forward(i, x, o)

    def _feed_forward(self, i: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Layer `i` after attention: output projection of `o` `[Hq, N, D]`, residuals and MLP on `x` `[1, N, C]`."""
        layer, lin = self.parts.layers[i], self.linears[i]
        N = x.shape[1]
        o = lin.o(o.transpose(0, 1).reshape(1, N, self.num_heads * self.head_dim))[0]
        mlp = self.one_token_mlps[i] if self.one_token_mlps is not None and N == 1 else lin.mlp
        if self.sandwich_norms:
            x = x + layer.post_attention_layernorm(o)
            return x + layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(x)))
        x = x + o
        return x + mlp(layer.post_attention_layernorm(x))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """`[V]` fp32 logits of the last row of `x` `[1, N, C]`."""
        return self._head(x[0, -1:])[0]

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """`[N, V]` fp32 logits of the hidden states `x` `[N, C]` (final norm, head, soft-cap)."""
        logits = self.head(self.parts.final_norm(x))[0].float()
        cap = self.parts.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _row_bounds(slots: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Each request's `(first, end)` rows in a pass that packs the requests' `[N_b]` slots in order."""
    ends = torch.tensor([int(s.shape[0]) for s in slots]).cumsum(0).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _compiled(module: torch.nn.Module, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module` compiled for one fixed input shape (a one-token pass): CUDA graphs on a GPU."""
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    return torch.compile(module, dynamic=False, mode=mode)
