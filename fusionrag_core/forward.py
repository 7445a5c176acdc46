"""One decoder pass over a slot-addressed KV buffer: the only place that runs the model's layers.

Every prefill, selective recompute and decode step is this pass with different tokens. It runs
the transformers modules of a Llama-family decoder (projections, norms, MLP) but owns attention,
so that it can (a) write new K/V in place at arbitrary slots, (b) mask by *position* — causal and
sliding-window — rather than by slot order, and (c) read the question's attention at the last
layer without materialising any `T x T` matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from fusionrag_core import compat
from fusionrag_core.errors import UnsupportedModelError
from fusionrag_core.kv import KVBuffer
from fusionrag_core.rope import apply_rope, cos_sin

Segment = tuple[int, int, int, int]
"""`(r0, r1, k0, k1)`: pass rows `r0:r1` are one packed sequence whose keys are slots `k0:k1`."""


@dataclass
class PassOutput:
    """What a pass returns besides the K/V it wrote into the buffer.

    Attributes:
        logits: `[V]` fp32 logits of the pass's last token, or None if not asked for.
        attention: `[A, S_used]` fp32 attention mass each slot received from the pass's tokens at
            each of the A requested layers (softmax per head over the visible keys, summed over
            heads and tokens), or None.
        probe_keys: `[H, N, D]` post-RoPE keys of the pass's tokens at `probe_layer`, or None.
    """

    logits: torch.Tensor | None = None
    attention: torch.Tensor | None = None
    probe_keys: torch.Tensor | None = None


class Decoder:
    """Runs a Llama-family transformers model layer by layer over a `KVBuffer`."""

    def __init__(self, model: PreTrainedModel) -> None:
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

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """`(L, H, D)` of every K/V tensor this model produces."""
        return (self.num_layers, self.num_kv_heads, self.head_dim)

    def new_buffer(self, capacity: int) -> KVBuffer:
        return KVBuffer(self.num_layers, self.num_kv_heads, capacity, self.head_dim, dtype=self.dtype,
                        device=self.device)

    def _mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor,
              window: int | None) -> torch.Tensor:
        """`[N, S]` bool: query i may see key j iff j is valid, not in its future, and inside its window."""
        mask = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if window is not None:
            mask &= (q_pos[:, None] - k_pos[None, :]) < window
        return mask

    @torch.inference_mode()
    def forward(
        self,
        buf: KVBuffer,
        token_ids: torch.Tensor,
        slots: torch.Tensor,
        *,
        logits: bool = True,
        attention_from: int | None = None,
        attention_layers: Sequence[int] | None = None,
        probe_layer: int | None = None,
        segments: Sequence[Segment] | None = None,
    ) -> PassOutput:
        """Run `token_ids` `[N]` at the positions already reserved for `slots` `[N]` in `buf`.

        All N tokens' K/V are written into their slots at each layer *before* that layer's
        attention, so tokens of one pass see each other causally by position — which is what makes
        a recompute of every token equal a plain prefill.

        Args:
            buf: the request's KV buffer; slots `>= buf.length` are ignored as keys.
            token_ids: `[N]` int64 tokens to compute.
            slots: `[N]` buffer slots reserved for them (their positions are `buf.positions[slots]`).
            logits: compute the last token's logits.
            attention_from: if set, report the attention mass per slot received from the pass's
                tokens at index `>= attention_from` (the question, for query-guided selection).
            attention_layers: the layers to report it at, in this order (default: the last layer).
                Without `logits` the pass stops after the deepest of them: a shallower probe is cheaper.
            probe_layer: if set, stop at this layer and return the tokens' new post-RoPE keys
                there (nothing at this layer or above is written).
            segments: packed independent sequences (a batch of chunk prefills in one pass): rows
                `r0:r1` of the pass attend only to slots `k0:k1`, by position within them. Each
                sequence's slots hold its own context, so sequences never see each other.
        """
        if segments is not None and (logits or attention_from is not None or probe_layer is not None):
            raise ValueError("a packed pass (segments) computes K/V only: pass logits=False, no attention_from/probe")
        N = int(token_ids.shape[0])
        S = buf.length
        q_pos = buf.positions[slots]  # [N]
        k_pos = buf.positions[:S]  # [S]
        k_valid = buf.valid[:S].clone()
        k_valid[slots] = True
        out = PassOutput()
        wanted = self._attention_layers(attention_from, attention_layers)
        stop = max(wanted) if wanted and not logits else None
        masses: dict[int, torch.Tensor] = {}

        blocks = self._query_blocks(q_pos, k_pos) if segments is None else None
        masks: dict[int | None, torch.Tensor | None] = {}
        cos_sin_by_table: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        x = self.parts.embed_tokens(token_ids.to(self.device)[None])  # [1, N, C]
        for i, layer in enumerate(self.parts.layers):
            attn = layer.self_attn
            table = self.rope[i]
            if id(table) not in cos_sin_by_table:
                cos_sin_by_table[id(table)] = cos_sin(q_pos, table, x.dtype)
            cos, sin = cos_sin_by_table[id(table)]  # [N, R]

            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, N, self.num_heads, self.head_dim).transpose(1, 2)  # [1, Hq, N, D]
            k = attn.k_proj(h).view(1, N, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [1, H, N, D]
            v = attn.v_proj(h).view(1, N, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [1, H, N, D]
            if self.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if i == probe_layer:
                out.probe_keys = k[0]
                return out
            buf.keys[i, :, slots] = k[0]
            buf.values[i, :, slots] = v[0]
            last = i == self.num_layers - 1
            if last and not logits and attention_from is None:
                break  # NOTE: only the last layer's K/V are wanted (a chunk prefill): skip its attention and MLP

            window = self.windows[i]
            if segments is None and window not in masks:
                whole_causal = window is None and N == S and bool(k_valid.all()) and bool(
                    (q_pos == torch.arange(S, device=q_pos.device)).all())
                # NOTE: a plain prefill from position 0 takes SDPA's causal fast path, no mask tensor.
                masks[window] = None if whole_causal else self._mask(q_pos, k_pos, k_valid, window)
            mask = masks.get(window)
            if attention_from is not None and i in wanted:
                masses[i] = self._attention_mass(q[0, :, attention_from:], buf.keys[i, :, :S],
                                                 mask[attention_from:] if mask is not None else
                                                 self._mask(q_pos[attention_from:], k_pos, k_valid, window))
                if i == stop:
                    break  # NOTE: a selector's probe pass wants the attention mass, not the layer's output
            keys, values = buf.keys[i, :, :S][None], buf.values[i, :, :S][None]  # [1, H, S, D]
            if segments is None:
                o = self._attend(q, keys, values, mask, blocks)  # [1, Hq, N, D]
            else:
                o = self._attend_segments(q, keys, values, q_pos, k_pos, k_valid, window, segments)

            o = attn.o_proj(o.transpose(1, 2).reshape(1, N, self.num_heads * self.head_dim))
            if self.sandwich_norms:
                x = x + layer.post_attention_layernorm(o)
                x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
            else:
                x = x + o
                x = x + layer.mlp(layer.post_attention_layernorm(x))

        if wanted:
            out.attention = torch.stack([masses[layer] for layer in wanted])  # [A, S]
        if logits:
            final = self.parts.final_norm(x[:, -1:])
            out.logits = self.parts.lm_head(final)[0, 0].float()
            if self.parts.final_logit_softcap is not None:
                cap = self.parts.final_logit_softcap
                out.logits = torch.tanh(out.logits / cap) * cap
        return out

    def _attention_layers(self, attention_from: int | None, layers: Sequence[int] | None) -> tuple[int, ...]:
        """The layers to report attention mass at (none without `attention_from`), range-checked."""
        if attention_from is None:
            return ()
        wanted = tuple(int(layer) for layer in layers) if layers is not None else (self.num_layers - 1,)
        if not wanted or any(not 0 <= layer < self.num_layers for layer in wanted):
            raise ValueError(f"attention layers {list(wanted)} must be non-empty and in [0, {self.num_layers})")
        return wanted

    @staticmethod
    def _query_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor) -> list[tuple[int, int, int]] | None:
        """Split a large sparse pass into query blocks that each read only the keys they can see.

        Returns `(row_start, row_end, key_limit)` triples, or None to attend in one call.
        NOTE: valid only when positions increase with slots (true for every stitched buffer):
        then the keys visible to rows `r0:r1` all lie in slots `< key_limit`. A masked SDPA call
        costs `N x S` regardless of the mask, so this saves about a third of the attention work
        of a recompute pass whose tokens are spread over the context.
        """
        N = int(q_pos.shape[0])
        if N < 256 or bool((q_pos[1:] < q_pos[:-1]).any()) or bool((k_pos[1:] < k_pos[:-1]).any()):
            return None
        bounds = torch.linspace(0, N, steps=min(8, N // 128) + 1).long().tolist()
        limits = torch.searchsorted(k_pos, q_pos[[b - 1 for b in bounds[1:]]], right=True).tolist()
        return [(r0, r1, int(lim)) for r0, r1, lim in zip(bounds[:-1], bounds[1:], limits, strict=True)]

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                blocks: list[tuple[int, int, int]] | None) -> torch.Tensor:
        """SDPA of `q` `[1, Hq, N, D]` over `keys`/`values` `[1, H, S, D]` (GQA without copying K/V)."""
        gqa = self.num_heads != self.num_kv_heads
        if mask is None:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=self.scaling, enable_gqa=gqa)
        if blocks is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=gqa)
        return torch.cat([
            F.scaled_dot_product_attention(q[:, :, r0:r1], keys[:, :, :lim], values[:, :, :lim],
                                           attn_mask=mask[r0:r1, :lim], scale=self.scaling, enable_gqa=gqa)
            for r0, r1, lim in blocks
        ], dim=2)

    def _attend_segments(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
                         k_pos: torch.Tensor, k_valid: torch.Tensor, window: int | None,
                         segments: Sequence[Segment]) -> torch.Tensor:
        """SDPA of each packed sequence's rows over its own key slots only; `[1, Hq, N, D]`.

        NOTE: attention costs sum(rows_i x keys_i), not N x S as one block-diagonal mask would:
        a pass of B fused prefills does B times less attention work than one masked call.
        """
        gqa = self.num_heads != self.num_kv_heads
        out = torch.empty_like(q)
        for r0, r1, k0, k1 in segments:
            mask = self._mask(q_pos[r0:r1], k_pos[k0:k1], k_valid[k0:k1], window)  # [n_i, s_i]
            out[:, :, r0:r1] = F.scaled_dot_product_attention(
                q[:, :, r0:r1], keys[:, :, k0:k1], values[:, :, k0:k1], attn_mask=mask, scale=self.scaling,
                enable_gqa=gqa)
        return out

    def _attention_mass(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention probability each key slot receives, summed over heads and queries.

        Args:
            q: `[Hq, Nq, D]` post-RoPE queries; keys: `[H, S, D]`; mask: `[Nq, S]` bool.

        Returns:
            `[S]` fp32. NOTE: only `Nq x S` scores per head exist at once (Nq = question length).
        """
        group = self.num_heads // self.num_kv_heads
        Hq, Nq, D = q.shape
        qg = q.float().reshape(self.num_kv_heads, group * Nq, D)  # query head h uses kv head h // group
        scores = torch.bmm(qg, keys.float().transpose(1, 2)) * self.scaling  # [H, G*Nq, S]
        scores = scores.view(Hq, Nq, -1).masked_fill(~mask[None], float("-inf"))
        return torch.softmax(scores, dim=-1).sum(dim=(0, 1))  # [S]
