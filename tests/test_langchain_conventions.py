"""LangChain constructors as langchain-huggingface users write them: every HF-ecosystem alias maps
onto its field, every argument the engine cannot honour is refused by name, `from_model_id` loads,
`get_token_ids` counts with the model's own tokenizer. No weights load here (a tiny engine or a
monkeypatched loader)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, trim_messages
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_integrations.langchain import ChatFusionRAG, FusionRAGLLM

MODELS = [ChatFusionRAG, FusionRAGLLM]


# ---- aliases: one test each ---------------------------------------------------------------------
@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize(("given", "field", "expected"), [
    ({"model_id": "gemma3-270m"}, "model", "gemma3-270m"),
    ({"model_name": "gemma3-270m"}, "model", "gemma3-270m"),
    ({"max_new_tokens": 8}, "max_tokens", 8),
    ({"device_map": "cpu"}, "device", "cpu"),
    ({"device_map": "auto"}, "device", None),
    ({"device": -1}, "device", "cpu"),
    ({"torch_dtype": "bfloat16"}, "dtype", "bfloat16"),
    ({"torch_dtype": torch.float16}, "dtype", torch.float16),
    ({"dtype": torch.bfloat16}, "dtype", torch.bfloat16),
    ({"model_kwargs": {"torch_dtype": torch.bfloat16}}, "dtype", torch.bfloat16),
    ({"model_kwargs": {"device_map": "cpu"}}, "device", "cpu"),
    ({"pipeline_kwargs": {"max_new_tokens": 5}}, "max_tokens", 5),
    ({"pipeline_kwargs": {"do_sample": True}}, "temperature", 1.0),
    ({"pipeline_kwargs": {"do_sample": False}}, "temperature", 0.0),
    ({"pipeline_kwargs": {"temperature": 0.7, "do_sample": True}}, "temperature", 0.7),
    ({"pipeline_kwargs": {"top_k": 7}}, "top_k", 7),
    ({"pipeline_kwargs": {"top_p": 0.9}}, "top_p", 0.9),
    ({"pipeline_kwargs": {"min_p": 0.05}}, "min_p", 0.05),
    ({"pipeline_kwargs": {"repetition_penalty": 1.2}}, "repetition_penalty", 1.2),
    ({"pipeline_kwargs": {"stop_strings": "###"}}, "stop", ["###"]),
    ({"pipeline_kwargs": {"return_full_text": False}}, "max_tokens", 256),
    ({"generate_kwargs": {"max_new_tokens": 3}}, "max_tokens", 3),
])
def test_hf_alias_sets_its_field(cls: type, given: dict[str, Any], field: str, expected: Any) -> None:
    model = cls(**given)
    assert getattr(model, field) == expected
    assert model._identifying_params.get(field if field != "model" else "model_name", expected) == expected


def test_max_new_tokens_really_bounds_the_generation(one_layer_engine: FusionEngine) -> None:
    eos, one_layer_engine.eos_ids = one_layer_engine.eos_ids, set()
    try:
        message = ChatFusionRAG(engine=one_layer_engine, max_new_tokens=3).invoke("Hello")
        assert isinstance(message, AIMessage)
        assert message.usage_metadata is not None and message.usage_metadata["output_tokens"] == 3
        per_call = ChatFusionRAG(engine=one_layer_engine).invoke("Hello", max_new_tokens=2)
        assert per_call.usage_metadata is not None and per_call.usage_metadata["output_tokens"] == 2
    finally:
        one_layer_engine.eos_ids = eos


def test_model_name_reaches_the_loader(loads: list[dict[str, Any]]) -> None:
    llm = FusionRAGLLM(model_name="gemma3-270m", torch_dtype=torch.bfloat16, device_map="cpu")
    llm.fusion_engine()
    assert loads[0]["model"] == "gemma3-270m"
    assert loads[0]["dtype"] == torch.bfloat16 and loads[0]["device"] == "cpu"


# ---- refused arguments: one test each -----------------------------------------------------------
@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize(("given", "message"), [
    ({"max_new_token": 3}, "did you mean 'max_new_tokens'"),
    ({"temprature": 0.5}, "did you mean 'temperature'"),
    ({"model_path": "x"}, "unknown argument 'model_path'"),
    ({"model_id": "a", "model": "b"}, "pass only one"),
    ({"max_new_tokens": 3, "max_tokens": 4}, "pass only one"),
    ({"device_map": {"": 0}}, "one device"),
    ({"device": "cuda"}, "no CUDA device"),
    ({"device": "tpu:0"}, "unknown device"),
    ({"model_kwargs": {"trust_remote_code": True}}, "cannot honour model_kwargs\\['trust_remote_code'\\]"),
    ({"model_kwargs": "bf16"}, "pass a dict"),
    ({"pipeline_kwargs": {"num_beams": 4}}, "cannot honour pipeline_kwargs\\['num_beams'\\]"),
    ({"pipeline_kwargs": {"return_full_text": True}}, "never repeat the prompt"),
    ({"pipeline_kwargs": {"do_sample": False, "temperature": 0.7}}, "greedy decoding has no temperature"),
    ({"pipeline_kwargs": {"top_k": -2}}, "top_k"),
    ({"pipeline_kwargs": {"max_new_tokens": 3}, "max_tokens": 5}, "pass only one"),
])
def test_unusable_argument_is_refused_by_name(cls: type, given: dict[str, Any], message: str) -> None:
    if given.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValidationError, match=message):
        cls(**given)


def test_loading_options_with_a_loaded_engine_are_refused(one_layer_engine: FusionEngine) -> None:
    with pytest.raises(ValidationError, match="only apply when this model loads weights"):
        ChatFusionRAG(engine=one_layer_engine, torch_dtype="bfloat16")


@pytest.mark.usefixtures("weights_never_read")
def test_cuda_without_cuda_fails_before_reading_weights() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="no CUDA device"):
        FusionEngine.from_pretrained(device="cuda")
    with pytest.raises(ValueError, match="no CUDA device"):
        ChatFusionRAG.from_model_id("smollm2-135m", device=0)


# ---- from_model_id ------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", MODELS)
def test_from_model_id_loads_like_huggingface_pipeline(cls: type, loads: list[dict[str, Any]]) -> None:
    model = cls.from_model_id(model_id="gemma3-270m", task="text-generation", device=-1,
                              model_kwargs={"torch_dtype": torch.float32},
                              pipeline_kwargs={"max_new_tokens": 10, "do_sample": True, "top_k": 4})
    assert len(loads) == 1  # loaded at once, as HuggingFacePipeline.from_model_id does
    assert loads[0]["model"] == "gemma3-270m" and loads[0]["device"] == "cpu" and loads[0]["dtype"] == torch.float32
    assert (model.max_tokens, model.temperature, model.top_k) == (10, 1.0, 4)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"task": "summarization"}, "task='summarization'"),
    ({"backend": "openvino"}, "backend='openvino'"),
    ({"batch_size": 8}, "batch_size"),
])
def test_from_model_id_refuses_what_it_cannot_do(kwargs: dict[str, Any], message: str,
                                                 loads: list[dict[str, Any]]) -> None:
    with pytest.raises(ValueError, match=message):
        ChatFusionRAG.from_model_id("smollm2-135m", **kwargs)
    assert loads == []


# ---- token counting -----------------------------------------------------------------------------
@pytest.mark.parametrize("cls", MODELS)
def test_get_token_ids_uses_the_model_tokenizer(cls: type, one_layer_engine: FusionEngine,
                                                smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    model = cls(engine=one_layer_engine)
    text = "The Lumen lighthouse was designed by Ada Vell."
    assert model.get_token_ids(text) == smollm_tokenizer.encode(text, add_special_tokens=False)
    assert model.get_num_tokens(text) == len(model.get_token_ids(text)) > 0


def test_trim_messages_trims_with_the_model_as_counter(one_layer_engine: FusionEngine) -> None:
    chat = ChatFusionRAG(engine=one_layer_engine)
    history = [SystemMessage("Be brief."), *[HumanMessage(f"Question number {i} about the lighthouse?")
                                              for i in range(10)]]
    trimmed = trim_messages(history, max_tokens=40, token_counter=chat, strategy="last", include_system=True)
    assert 1 < len(trimmed) < len(history)
    assert chat.get_num_tokens_from_messages(trimmed) <= 40
