"""The decoder's projections on CPU through oneDNN with weights packed once, not MKL per call.

torch's CPU `F.linear` is MKL's sgemm. For the few-row products of a query — the query-guided
probe (the question's ~25 tokens through most layers) and the recompute pass (~15% of the
context) — it runs well below the core's rate, and oneDNN with a prepacked weight runs them
faster. A packed weight also skips oneDNN's per-call reorder.

Projections that read the same input are packed as one weight — q/k/v, and the MLP's gate/up —
so a layer runs 4 products instead of 7: fewer, wider calls, which matters most with two threads
on a shared machine (every parallel region waits for its slowest thread). oneDNN computes each
output column the same way however many columns a call has: the fused products equal the
separate ones bit for bit (`tests/test_linear.py`).

Single-row products (a decode step) go through it too: there every weight streams from memory,
and oneDNN reads a packed weight faster than MKL's matrix-vector product does (on a 2-core AMD
EPYC, a SmolLM2-135M decode step took 0.72x the time, `benchmarks/decode_step.py`). The
vocabulary head is packed the same way (`Decoder.head`): it is the largest single product of a
decode step. The packed copies double the projection and head weights in memory, so they are an
engine option (`EngineConfig.packed_linears`); GPUs and non-fp32 weights use `F.linear`.
The copy is taken when the `Decoder` is built: weights changed in place afterwards (an adapter
merged into the model) do not reach it, so build the engine after such changes.
Results equal `F.linear`'s up to float rounding (another blocking of the same sums).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fusionrag_core.runtime import compat


class Linears:
    """Several `nn.Linear`s of one input as one product: `x -> (x @ W_i.T + b_i for each i)`.

    Uses a packed oneDNN weight (the modules' weights concatenated) where one can be built;
    otherwise each module's own `F.linear`, exactly as the model computes it.
    """

    def __init__(self, modules: list[torch.nn.Linear], *, packed: bool) -> None:
        """Args:
            modules: projections with the same input width (their weights are read, never changed).
            packed: pack for oneDNN (ignored where `compat.packed_linear_weight` cannot, or where
                some modules have a bias and others not).
        """
        self.weights = [m.weight for m in modules]
        self.biases = [m.bias for m in modules]
        self.widths = [int(m.weight.shape[0]) for m in modules]
        self.packed: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        has_bias = [b is not None for b in self.biases]
        if packed and (all(has_bias) or not any(has_bias)):
            weight = self.weights[0] if len(modules) == 1 else torch.cat([w.detach() for w in self.weights])
            self.packed = compat.packed_linear_weight(weight)  # [sum N_i, K] blocked
            if all(has_bias):
                self.bias = torch.cat([b.detach() for b in self.biases if b is not None])

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """`x` `[..., K]` -> one `[..., N_i]` per module (views of one output when packed)."""
        if self.packed is None:
            return [F.linear(x, w, b) for w, b in zip(self.weights, self.biases, strict=True)]
        # NOTE: the packed op has no autograd: the decoder's passes all run in inference mode
        out = compat.packed_linear(x.reshape(-1, x.shape[-1]), self.packed, self.bias)  # [M, sum N_i]
        out = out.view(*x.shape[:-1], out.shape[-1])
        return list(out.split(self.widths, dim=-1))


class LayerLinears:
    """A decoder layer's projections: q/k/v, o, the MLP's gate/up, and down."""

    def __init__(self, layer: Any, *, packed: bool) -> None:
        """Args:
            layer: a transformers decoder layer (`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`).
            packed: as for `Linears`.
        """
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = Linears([attn.q_proj, attn.k_proj, attn.v_proj], packed=packed)
        self.o = Linears([attn.o_proj], packed=packed)
        self.gate_up = Linears([mlp.gate_proj, mlp.up_proj], packed=packed)
        self.down = Linears([mlp.down_proj], packed=packed)
        self.act: Any = mlp.act_fn

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP `down(act(gate(x)) * up(x))` (Llama, Qwen, Mistral and Gemma 3 alike)."""
        gate, up = self.gate_up(x)
        return self.down(self.act(gate) * up)[0]
