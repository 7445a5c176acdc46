"""Constructor arguments the way langchain-huggingface and llama-index-llms-huggingface users write them.

The LangChain `ChatFusionRAG(...)` / `FusionRAGLLM(...)` and the LlamaIndex `FusionRAGLLM(...)`
accept the Hugging Face ecosystem's names where they mean the same thing as a field (`model_id`,
`model_name`, `max_new_tokens`, `device_map`, `torch_dtype`, `model_kwargs`, `pipeline_kwargs` /
`generate_kwargs`), fold them into that field, and refuse everything else: an unknown argument,
or a known one this engine cannot honour, is an error that names the closest valid argument.
Nothing is dropped silently.

Targets are spelled as the per-request options (`request.OPTION_NAMES`: `max_new_tokens`) and
the loading fields (`model`, `device`, `dtype`); a model whose field is named otherwise passes
`rename` (LangChain: `{"max_new_tokens": "max_tokens"}`), and then also accepts the option's name.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fusionrag_core.errors import InvalidRequestError
from fusionrag_integrations.request import SAMPLING_OPTIONS

__all__ = ["closest", "device_name", "normalize_arguments", "refuse_unknown"]

# alias -> field: the same meaning under the names langchain-huggingface / transformers use.
FIELD_ALIASES = {
    "model_id": "model",
    "model_name": "model",
    "device_map": "device",
    "torch_dtype": "dtype",
}
# model_kwargs (from_pretrained's arguments) this engine honours, and the field each sets.
MODEL_KWARGS = {"torch_dtype": "dtype", "dtype": "dtype", "device_map": "device"}
# pipeline_kwargs / generate_kwargs (generate's arguments) this engine honours, and their option:
# every sampling option under its own name, and transformers' name for stop strings.
GENERATE_KWARGS = {**{name: name for name in SAMPLING_OPTIONS}, "stop_strings": "stop"}
GENERATE_FLAGS = frozenset({"do_sample", "return_full_text"})


def closest(name: str, valid: Iterable[str]) -> str:
    """' (did you mean X?)' for the valid name closest to `name`, or '' when none is close."""
    match = difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def refuse_unknown(kwargs: Mapping[str, Any], valid: Iterable[str], owner: str) -> None:
    """Keyword arguments left over after a signature's own are an error naming the closest valid ones.

    Args:
        kwargs: the leftover keyword arguments (none: nothing happens).
        valid: the names the callee accepts.
        owner: the callee, for the message (e.g. "FusionRAGVectorStore.similarity_search").

    Raises:
        InvalidRequestError: `kwargs` is not empty.
    """
    if kwargs:
        names = set(valid)
        unknown = ", ".join(f"{name!r}{closest(name, names)}" for name in sorted(kwargs))
        raise InvalidRequestError(f"{owner} got unknown argument(s) {unknown}; it takes {sorted(names)}")


def normalize_arguments(data: Mapping[str, Any], fields: Iterable[str], owner: str,
                        rename: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Constructor keyword arguments with every HF-ecosystem alias folded into its field.

    Args:
        data: the keyword arguments as given.
        fields: the model's field names (what stays as is).
        owner: class name, for messages.
        rename: option name -> the model's field for it (e.g. `{"max_new_tokens": "max_tokens"}`).

    Raises:
        InvalidRequestError: an unknown argument, a value the engine cannot honour, or an alias
            and its field both given with different values.
    """
    valid = set(fields)
    names = dict(rename or {})
    aliases = {alias: field for alias, field in FIELD_ALIASES.items() if alias not in valid}
    aliases.update({option: option for option in names if option not in valid})
    out: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def put(field: str, value: Any, source: str) -> None:
        field = names.get(field, field)
        if field in out and out[field] != value:
            raise InvalidRequestError(
                f"{owner} got {sources[field]}={out[field]!r} and {source}={value!r}: they set the same thing "
                f"({field}); pass only one"
            )
        out[field] = value
        sources[field] = source

    for name, value in data.items():
        if name in ("model_kwargs",):
            for key, field, val in _model_kwargs(value, owner):
                put(field, val, f"model_kwargs[{key!r}]")
        elif name in ("pipeline_kwargs", "generate_kwargs"):
            for key, field, val in _generate_kwargs(value, owner, name):
                put(field, val, f"{name}[{key!r}]")
        elif name in valid:
            put(name, device_name(value, owner) if name == "device" else value, name)
        elif name in aliases:
            field = aliases[name]
            put(field, device_name(value, owner) if field == "device" else value, name)
        else:
            hint = closest(name, valid | set(aliases) | {"model_kwargs", "pipeline_kwargs", "generate_kwargs"})
            raise InvalidRequestError(f"{owner} got an unknown argument {name!r}{hint}")
    return out


def device_name(value: Any, owner: str) -> str | None:
    """A `device` / `device_map` value as the one device name the engine loads on.

    `"auto"` and None pick automatically (CUDA if present); an int is a pipeline's device index
    (-1: CPU, n: cuda:n); a dict (a multi-device map) is refused: the engine runs on one device.
    """
    if value is None or value == "auto":
        return None
    if isinstance(value, bool):
        raise InvalidRequestError(f"{owner} got device={value!r}; use a device name such as 'cpu' or 'cuda'")
    if isinstance(value, int):
        return "cpu" if value < 0 else f"cuda:{value}"
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, str):
        return value
    raise InvalidRequestError(
        f"{owner} got device_map={value!r}; FusionRAG runs a model on one device: pass a device name "
        "('cpu', 'cuda', 'cuda:1') or 'auto'"
    )


def _mapping(value: Any, name: str, owner: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{owner} got {name}={value!r}; pass a dict")
    return value


def _model_kwargs(value: Any, owner: str) -> list[tuple[str, str, Any]]:
    out = []
    for key, val in _mapping(value, "model_kwargs", owner).items():
        if key not in MODEL_KWARGS:
            raise InvalidRequestError(
                f"{owner} cannot honour model_kwargs[{key!r}]{closest(key, MODEL_KWARGS)}: the engine loads weights "
                f"itself and takes only {sorted(MODEL_KWARGS)} (the model itself: model_id=)"
            )
        field = MODEL_KWARGS[key]
        out.append((key, field, device_name(val, owner) if field == "device" else val))
    return out


def _generate_kwargs(value: Any, owner: str, name: str) -> list[tuple[str, str, Any]]:
    kwargs = dict(_mapping(value, name, owner))
    out: list[tuple[str, str, Any]] = []
    for key in kwargs:
        if key not in GENERATE_KWARGS and key not in GENERATE_FLAGS:
            raise InvalidRequestError(
                f"{owner} cannot honour {name}[{key!r}]{closest(key, [*GENERATE_KWARGS, *GENERATE_FLAGS])}; supported: "
                f"{sorted([*GENERATE_KWARGS, *GENERATE_FLAGS])}"
            )
    if kwargs.pop("return_full_text", False):
        raise InvalidRequestError(
            f"{owner} got {name}['return_full_text']=True; answers never repeat the prompt: drop it"
        )
    # NOTE: transformers samples only with do_sample=True (temperature then defaults to 1.0);
    # do_sample=False is greedy, which here is temperature 0.
    do_sample = kwargs.pop("do_sample", None)
    if do_sample is False:
        if kwargs.get("temperature", 0) not in (0, 0.0, None):
            raise InvalidRequestError(
                f"{owner} got {name} with do_sample=False and temperature={kwargs['temperature']}: greedy decoding "
                "has no temperature; drop one of them"
            )
        kwargs["temperature"] = 0.0
    elif do_sample is True:
        kwargs.setdefault("temperature", 1.0)
        if kwargs["temperature"] == 0:
            raise InvalidRequestError(f"{owner} got {name} with do_sample=True and temperature=0; pick one")
    for key, val in kwargs.items():
        field = GENERATE_KWARGS[key]
        out.append((key, field, [val] if field == "stop" and isinstance(val, str) else val))
    return out
