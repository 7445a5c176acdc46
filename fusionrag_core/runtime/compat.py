"""Every transformers call whose name or shape moved within 5.x lives here, and only here.

The rest of the package talks to a decoder through `DecoderParts` and `RopeTable`, which are
plain data; when transformers moves an attribute again, this is the one file to change.
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import safetensors.torch
import torch
from tokenizers import Tokenizer
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fusionrag_core.errors import UnsupportedModelError

log = logging.getLogger(__name__)

# RoPE variants whose angles are `position * inv_freq` with a position-independent inv_freq and
# a constant attention scaling: a shift by `delta` is then an exact rotation by `delta * inv_freq`.
EXACT_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional"})
# Position- or length-dependent variants: the rotation a key got depends on more than its position.
INEXACT_ROPE_TYPES = {
    "dynamic": "dynamic NTK scaling recomputes inv_freq from the sequence length",
    "longrope": "LongRoPE switches frequency tables (and scaling) with the sequence length",
}


@dataclass(frozen=True)
class RopeTable:
    """What one attention layer's rotary embedding is made of.

    Attributes:
        rope_type: transformers' name for the variant ("default", "llama3", "yarn", ...).
        inv_freq: `[R/2]` fp32 inverse frequencies; the first `R` head dims are rotated.
        attention_scaling: constant factor transformers multiplies into cos/sin (YaRN, longrope).
    """

    rope_type: str
    inv_freq: torch.Tensor
    attention_scaling: float

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.shape[0])


@dataclass(frozen=True)
class DecoderParts:
    """The modules of a Llama-family decoder, addressed uniformly across architectures."""

    embed_tokens: nn.Module
    layers: list[Any]  # decoder layers; Any because transformers types them loosely
    final_norm: nn.Module
    lm_head: nn.Linear
    final_logit_softcap: float | None


# Per tokenizer, its private fixed-setting backends (see `_backends`); dropped with the tokenizer.
_BACKENDS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, tuple[Tokenizer, Tokenizer]] = (
    weakref.WeakKeyDictionary()
)
_BACKENDS_LOCK = threading.Lock()


def _rope_parameters(config: Any, layer_type: str | None) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None)  # transformers >= 5.0
    if params is None:
        params = getattr(config, "rope_scaling", None) or {"rope_type": "default"}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    return dict(params)


def load_model(
    source: str | Path, *, gguf_file: str | None, dtype: torch.dtype, device: torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from an HF id, a local directory or a .gguf file."""
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(source), **kwargs)
    cast(Any, model).to(device)
    model.eval()
    return model, tokenizer


def save_dequantized(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """Save a model whose .gguf weights were dequantized on load as plain safetensors, with its
    config (less the GGUF quantization marker), generation config and tokenizer files: what
    `load_model(directory, gguf_file=None, ...)` reads back. The model itself is not changed."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # NOTE: the weights are plain tensors now; nothing is quantized
    config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    # NOTE: save_model (not save_file) drops the tied copies (lm_head = embed_tokens), which
    # from_pretrained ties again from the config
    safetensors.torch.save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(directory)


# The projections the decoder reads (and packs) from each layer, by name.
_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _check_linears(model: PreTrainedModel, attn: Any, mlp: Any) -> None:
    """The decoder reads every projection's and the head's `.weight` (and packs it): refuse
    models whose projections are other modules (a quantized `QuantLinear`, a LoRA wrapper)."""
    mods = {f"self_attn.{n}": getattr(attn, n) for n in _ATTENTION_PROJECTIONS}
    mods |= {f"mlp.{n}": getattr(mlp, n) for n in _MLP_PROJECTIONS}
    mods["lm_head"] = model.lm_head
    for name, module in mods.items():
        if not isinstance(module, nn.Linear):
            raise UnsupportedModelError(
                f"{type(model).__name__}'s {name} is a {type(module).__name__}, not an nn.Linear: the "
                "decoder reads projection weights directly; load the model unquantized (merge adapters "
                "first) in float32, bfloat16 or float16"
            )


def text_config(model: PreTrainedModel) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def decoder_parts(model: PreTrainedModel) -> DecoderParts:
    """Find the embedding, decoder layers, final norm and head of a Llama-family model.

    Raises:
        UnsupportedModelError: if the model is not a pre-norm RoPE decoder of that family.
    """
    config = text_config(model)
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or not hasattr(model, "lm_head"):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a Llama-family decoder (model.model.layers + lm_head); "
            "FusionRAG supports Llama, Mistral, Qwen2/2.5/3 and Gemma 3 text models"
        )
    if getattr(base, "rotary_emb", None) is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no rotary embedding (learned absolute positions or ALiBi): "
            "its cached keys cannot be moved to new positions exactly; use a RoPE model"
        )
    attn = layers[0].self_attn
    for name in _ATTENTION_PROJECTIONS:
        if not hasattr(attn, name):
            raise UnsupportedModelError(
                f"{type(model).__name__} attention has no {name} (fused QKV?); not supported yet"
            )
    mlp = layers[0].mlp
    for name in (*_MLP_PROJECTIONS, "act_fn"):
        if not hasattr(mlp, name):
            raise UnsupportedModelError(
                f"{type(model).__name__} MLP has no {name} (not a gated MLP: down(act(gate(x)) * up(x))); "
                "not supported yet"
            )
    _check_linears(model, attn, mlp)
    return DecoderParts(
        # NOTE: Gemma's sqrt(hidden) embedding scale is applied inside its embedding module.
        embed_tokens=base.embed_tokens,
        layers=list(layers),
        final_norm=base.norm,
        lm_head=model.lm_head,
        final_logit_softcap=getattr(config, "final_logit_softcapping", None),
    )


def layer_types(model: PreTrainedModel) -> list[str]:
    config = text_config(model)
    types = getattr(config, "layer_types", None)
    return list(types) if types else ["full_attention"] * config.num_hidden_layers


def sliding_windows(model: PreTrainedModel) -> list[int | None]:
    """Per layer, the sliding window length (keys with `q_pos - k_pos >= window` are masked), or None."""
    config = text_config(model)
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "layer_types", None):
        # NOTE: Mistral-style configs set one window for every layer and carry no layer_types.
        return [window] * config.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in layer_types(model)]


def rope_tables(model: PreTrainedModel) -> list[RopeTable]:
    """Per layer, the rotary table transformers applies, refusing variants we cannot shift exactly."""
    config = text_config(model)
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("bidirectional attention cannot reuse causal chunk caches")
    rotary = model.model.rotary_emb
    if "mrope_section" in _rope_parameters(config, None) or getattr(rotary, "mrope_section", None):
        raise UnsupportedModelError(
            "multimodal RoPE (M-RoPE) rotates by 3-D positions; shifting cached keys is not exact: "
            "use a text-only model"
        )
    tables: dict[str, RopeTable] = {}
    out: list[RopeTable] = []
    for layer_type in layer_types(model):
        if layer_type not in tables:
            per_type = hasattr(rotary, f"{layer_type}_inv_freq")  # Gemma 3: one table per layer type
            rope_type = _rope_parameters(config, layer_type if per_type else None).get("rope_type", "default")
            if rope_type in INEXACT_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"RoPE type {rope_type!r} cannot be re-positioned exactly ({INEXACT_ROPE_TYPES[rope_type]}); "
                    "use a model with default, linear, llama3 or YaRN RoPE"
                )
            if rope_type not in EXACT_ROPE_TYPES:
                raise UnsupportedModelError(f"unknown RoPE type {rope_type!r}; cannot prove a position shift is exact")
            inv = getattr(rotary, f"{layer_type}_inv_freq" if per_type else "inv_freq")
            scaling = getattr(rotary, f"{layer_type}_attention_scaling" if per_type else "attention_scaling")
            tables[layer_type] = RopeTable(rope_type, inv.detach().to("cpu", torch.float32).clone(), float(scaling))
        out.append(tables[layer_type])
    return out


def hf_logits(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Plain transformers forward of `[N]` ids -> `[N, V]` logits, the reference our passes must match."""
    with torch.inference_mode():
        return model(input_ids=input_ids[None].to(model.device), use_cache=False).logits[0]


def _backends(tokenizer: PreTrainedTokenizerBase) -> tuple[Tokenizer, Tokenizer] | None:
    """`(plain, template)` private copies of a fast tokenizer's Rust backend, or None (slow tokenizer).

    NOTE: transformers implements `split_special_tokens` by setting `encode_special_tokens` on the
    backend every caller shares, then encoding: two threads tokenizing with different settings
    read each other's flag (document text parsed into control tokens). Each copy here is built
    with one setting and never changed, so a call's result depends on its own arguments only.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    with _BACKENDS_LOCK:
        pair = _BACKENDS.get(tokenizer)
        if pair is None:
            pair = (_private_copy(backend, split_special=True), _private_copy(backend, split_special=False))
            _BACKENDS[tokenizer] = pair
    return pair


def _private_copy(backend: Tokenizer, *, split_special: bool) -> Tokenizer:
    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()  # NOTE: transformers sets these per call on the shared one; we never do.
    copy.no_padding()
    copy.encode_special_tokens = split_special
    return copy


def tokenize_plain(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of user or document text: no BOS/EOS, and special-token strings in it are *not*
    parsed as specials, whatever other threads tokenize at the same time."""
    pair = _backends(tokenizer)
    if pair is None:  # NOTE: slow tokenizers read split_special_tokens per call, holding no state.
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    return list(pair[0].encode(text, add_special_tokens=False).ids)


def tokenize_template(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of rendered chat-template text, where special-token strings *are* specials."""
    pair = _backends(tokenizer)
    if pair is None:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=False)["input_ids"])
    return list(pair[1].encode(text, add_special_tokens=False).ids)


# ---- torch attention kernels that also return the log-sum-exp (private ops: their names move) --------
def sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its per-row log-sum-exp, for merging attention over disjoint key sets.

    Args:
        q: `[B, H, M, D]`; k, v: `[B, H, S, D]` (as many heads as `q`: fold GQA groups into `M`).
        bias: additive mask broadcastable to `[B, H, M, S]` in `q`'s dtype (0 / -inf), or None.
        scale: softmax scale.

    Returns:
        `[B, H, M, D]` output and `[B, H, M]` fp32 log-sum-exp. NOTE: rows whose keys are all
        masked come back with undefined values (the CPU kernel returns 0 and lse 0): callers mask them.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)
        return out, lse
    if q.device.type == "cuda":
        if bias is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)
            return res[0], res[1]
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, scale=scale)
        return out, lse[..., : q.shape[2]]  # NOTE: the kernel pads the lse's row axis
    return sdpa_math_with_lse(q, k, v, bias, scale)


def causal_sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`sdpa_with_lse` of `[B, H, N, D]` queries over their own `N` keys, causal (row i sees keys 0..i)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True, scale=scale)
        return out, lse
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    bias = torch.zeros(n, n, dtype=q.dtype, device=q.device).masked_fill(~causal, float("-inf"))
    return sdpa_math_with_lse(q, k, v, bias, scale)


def sdpa_math_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`sdpa_with_lse` by explicit scores (any device; the reference the kernels are tested against)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, M, S]
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.matmul(probs, v.float()).to(q.dtype), lse


def aligned_bias(bias: torch.Tensor) -> torch.Tensor:
    """`bias` `[..., W]` in memory whose row stride is a multiple of 16 (CUDA's memory-efficient
    kernel refuses others); on other devices `bias` itself."""
    if bias.device.type != "cuda" or bias.shape[-1] % 16 == 0:
        return bias
    width = bias.shape[-1]
    padded = bias.new_full((*bias.shape[:-1], -(-width // 16) * 16), float("-inf"))
    padded[..., :width] = bias
    return padded[..., :width]


# ---- oneDNN linear with a prepacked weight (private ops of torch's mkldnn fusion: their names move) -------
def packed_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` `[N, K]` reordered into oneDNN's blocked layout for `packed_linear`, or None where
    this torch cannot (no oneDNN, not a CPU fp32 weight)."""
    ops = getattr(torch.ops, "mkldnn", None)
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available()
            or not hasattr(ops, "_reorder_linear_weight") or not hasattr(ops, "_linear_pointwise")):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for `x` `[M, K]` through oneDNN with `packed_linear_weight(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# ---- storage use count (a private torch binding: its name may move) --------------------------------------
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
_warned_use_count = threading.Event()


def counts_storage_users() -> bool:
    """Whether this torch can tell how many tensors hold a storage (`storage_users`); logs once when not."""
    if _USE_COUNT is None and not _warned_use_count.is_set():
        _warned_use_count.set()
        log.warning("torch._C._storage_Use_Count is missing in torch %s: request K/V memory is not reused",
                    torch.__version__)
    return _USE_COUNT is not None


def storage_users(t: torch.Tensor) -> int:
    """How many tensors (`t` itself, its views) hold `t`'s storage; only where `counts_storage_users()`."""
    assert _USE_COUNT is not None
    storage = t.untyped_storage()
    return int(_USE_COUNT(storage._cdata)) - 1  # NOTE: minus the Python storage object made here
