"""LlamaIndex `FusionRAGLLM` as llama-index-llms-huggingface users write it: HF names map onto fields,
arguments the engine cannot honour are refused by name, top_k / min_p / repetition_penalty reach
the core sampler, and `structured_predict` / `as_structured_llm` return objects guaranteed by
grammar-constrained decoding. A tiny random Llama (its answers are nonsense, yet they parse); the
packaged SmolLM2 only in the `slow` test."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest
import torch
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.prompts import PromptTemplate
from llama_index.core.types import PydanticProgramMode
from pydantic import BaseModel, Field

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.recognise.marks import mark_chunk
from fusionrag_core.store import DiskKVStore, KVStore
from fusionrag_integrations.llama_index import FusionRAGLLM
from fusionrag_integrations.llama_index.calls import recording

TEXT = "The Lumen lighthouse on Gull Point was designed by the engineer Ada Vell in 1891."
PROMPT = PromptTemplate("Context:\n{context}\nWho designed the lighthouse? Say whether the context answers it.")


class Verdict(BaseModel):
    """Whether the context answers the question."""

    answered: bool
    confidence: int = Field(ge=0, le=9)
    kind: Literal["person", "place"]


@pytest.fixture(scope="module")
def store(one_layer_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> KVStore:
    store = DiskKVStore(tmp_path_factory.mktemp("kv"), storage_dtype="float32")
    store.put("lumen", one_layer_engine.chunk_cache(TEXT))
    return store


# ---- aliases: one test each ---------------------------------------------------------------------
@pytest.mark.parametrize(("given", "field", "expected"), [
    ({"model_name": "gemma3-270m"}, "model", "gemma3-270m"),
    ({"model_id": "gemma3-270m"}, "model", "gemma3-270m"),
    ({"device_map": "cpu"}, "device", "cpu"),
    ({"device_map": "auto"}, "device", None),
    ({"device": -1}, "device", "cpu"),
    ({"torch_dtype": "bfloat16"}, "dtype", "bfloat16"),
    ({"torch_dtype": torch.float16}, "dtype", "float16"),
    ({"dtype": torch.bfloat16}, "dtype", "bfloat16"),
    ({"model_kwargs": {"torch_dtype": torch.bfloat16}}, "dtype", "bfloat16"),
    ({"model_kwargs": {"device_map": "cpu"}}, "device", "cpu"),
    ({"generate_kwargs": {"max_new_tokens": 5}}, "max_new_tokens", 5),
    ({"generate_kwargs": {"do_sample": True}}, "temperature", 1.0),
    ({"generate_kwargs": {"do_sample": False}}, "temperature", 0.0),
    ({"generate_kwargs": {"top_k": 7}}, "top_k", 7),
    ({"generate_kwargs": {"min_p": 0.05}}, "min_p", 0.05),
    ({"generate_kwargs": {"repetition_penalty": 1.2}}, "repetition_penalty", 1.2),
    ({"generate_kwargs": {"stop_strings": "###"}}, "stop", ["###"]),
    ({"pipeline_kwargs": {"top_p": 0.9}}, "top_p", 0.9),
    ({"top_k": 3, "min_p": 0.1, "repetition_penalty": 1.3}, "repetition_penalty", 1.3),
])
def test_hf_alias_sets_its_field(given: dict[str, Any], field: str, expected: Any) -> None:
    assert getattr(FusionRAGLLM(**given), field) == expected


def test_model_name_reaches_the_loader(loads: list[dict[str, Any]]) -> None:
    llm = FusionRAGLLM(model_name="gemma3-270m", torch_dtype=torch.bfloat16, device_map="cpu")
    assert not loads  # construction stays cheap
    llm.engine  # noqa: B018 (loads)
    assert loads == [{"model": "gemma3-270m", "dtype": "bfloat16", "device": "cpu"}]


# ---- refused arguments: one test each -----------------------------------------------------------
@pytest.mark.parametrize(("given", "message"), [
    ({"max_tokens": 3}, "did you mean 'max_new_tokens'"),
    ({"temprature": 0.5}, "did you mean 'temperature'"),
    ({"tokenizer_name": "x"}, "unknown argument 'tokenizer_name'"),
    ({"model_name": "a", "model": "b"}, "pass only one"),
    ({"generate_kwargs": {"max_new_tokens": 3}, "max_new_tokens": 5}, "pass only one"),
    ({"device_map": {"": 0}}, "one device"),
    ({"device": "cuda"}, "no CUDA device"),
    ({"device": "tpu:0"}, "unknown device"),
    ({"model_kwargs": {"trust_remote_code": True}}, "cannot honour model_kwargs\\['trust_remote_code'\\]"),
    ({"generate_kwargs": {"num_beams": 4}}, "cannot honour generate_kwargs\\['num_beams'\\]"),
    ({"generate_kwargs": {"do_sample": False, "temperature": 0.7}}, "greedy decoding has no temperature"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_unusable_argument_is_refused_by_name(given: dict[str, Any], message: str) -> None:
    if given.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(InvalidRequestError, match=message):
        FusionRAGLLM(**given)


@pytest.mark.usefixtures("weights_never_read")
def test_cuda_without_cuda_fails_before_reading_weights() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(InvalidRequestError, match="no CUDA device"):
        FusionRAGLLM(model_name="smollm2-135m", device_map=0)


# ---- sampling: the core SamplingConfig, per construction and per call -----------------------------
def test_sampling_options_reach_the_core_sampler(one_layer_engine: FusionEngine) -> None:
    prompt = "Hello there, lighthouse keeper. Tell me about the lamp."
    messages = [{"role": "user", "content": prompt}]

    def core(**sampling: Any) -> str:
        request = one_layer_engine.prompt_from_messages(messages)
        return one_layer_engine.generate(request, sampling=SamplingConfig(max_new_tokens=12, **sampling)).text

    def ours(**options: Any) -> str:
        return FusionRAGLLM(engine=one_layer_engine, max_new_tokens=12, learn=False, **options).complete(prompt).text

    # greedy with a penalty is what the core's SamplingConfig gives, and not plain greedy (a penalty
    # below 1 favours the prompt's tokens, which a random model would not pick otherwise)
    assert ours(repetition_penalty=0.05) == core(repetition_penalty=0.05) != core()
    # sampling with top_k is the core's, seed for seed, and differs from sampling without it
    assert ours(temperature=1.0, top_k=3, seed=1) == core(temperature=1.0, top_k=3, seed=1) != core(temperature=1.0,
                                                                                                 seed=1)
    # top_k=1 keeps only the argmax: sampling at any temperature is then greedy
    assert ours(temperature=1.5, top_k=1, seed=5) == core()
    # min_p near 1 keeps only the top token too; per-call options override the fields
    llm = FusionRAGLLM(engine=one_layer_engine, max_new_tokens=12, learn=False, temperature=1.5, seed=5)
    assert llm.complete(prompt, min_p=0.999).text == core()
    assert llm.complete(prompt, top_k=1, repetition_penalty=0.05).text == core(repetition_penalty=0.05)
    with pytest.raises(InvalidRequestError, match="top_k"):
        llm.complete(prompt, top_k=-1)
    with pytest.raises(InvalidRequestError, match="num_beams"):
        llm.complete(prompt, num_beams=2)


# ---- structured output ----------------------------------------------------------------------------
def _llm(engine: FusionEngine, store: KVStore, **options: Any) -> FusionRAGLLM:
    return FusionRAGLLM(engine=engine, kv_store=store, learn=False, **{"max_new_tokens": 48, **options})


def test_structured_predict_returns_the_object_and_reuse_is_unchanged(one_layer_engine: FusionEngine,
                                                                      store: KVStore) -> None:
    llm = _llm(one_layer_engine, store)
    calls: list[dict[str, Any]] = []
    with recording(calls):
        verdict = llm.structured_predict(Verdict, PROMPT, context=mark_chunk("lumen", TEXT))
        free = llm.complete(PROMPT.format(context=mark_chunk("lumen", TEXT)), max_new_tokens=2)
    assert isinstance(verdict, Verdict) and 0 <= verdict.confidence <= 9
    assert calls[0]["finish_reason"] == "stop"
    assert calls[0]["reused_tokens"] > 0 and calls[0]["cache_misses"] == 0
    # NOTE: the program adds its schema instructions after the context, so the chunk is reused alike
    assert free.additional_kwargs["reused_tokens"] == calls[0]["reused_tokens"]


def test_as_structured_llm_and_async_and_stream(one_layer_engine: FusionEngine, store: KVStore) -> None:
    llm = _llm(one_layer_engine, store)
    context = mark_chunk("lumen", TEXT)
    response = llm.as_structured_llm(Verdict).chat([ChatMessage(role=MessageRole.USER, content=PROMPT.format(
        context=context))])
    assert isinstance(response.raw, Verdict)
    assert Verdict.model_validate_json(response.message.content or "") == response.raw

    verdict = asyncio.run(llm.astructured_predict(Verdict, PROMPT, context=context))
    assert isinstance(verdict, Verdict)

    partials = list(llm.stream_structured_predict(Verdict, PROMPT, context=context))
    assert partials and Verdict.model_validate(partials[-1].model_dump()) == verdict

    async def astream() -> list[Any]:
        return [p async for p in await llm.astream_structured_predict(Verdict, PROMPT, context=context)]

    apartials = asyncio.run(astream())
    assert apartials and Verdict.model_validate(apartials[-1].model_dump()) == verdict


def test_truncated_structured_answer_says_to_raise_max_new_tokens(one_layer_engine: FusionEngine,
                                                                  store: KVStore) -> None:
    llm = _llm(one_layer_engine, store, max_new_tokens=3)
    with pytest.raises(InvalidRequestError, match="raise max_new_tokens"):
        llm.structured_predict(Verdict, PROMPT, context=TEXT)
    with pytest.raises(InvalidRequestError, match="raise max_new_tokens"):
        asyncio.run(_llm(one_layer_engine, store).astructured_predict(Verdict, PROMPT, context=TEXT,
                                                                 llm_kwargs={"max_new_tokens": 3}))


def test_structured_output_refuses_what_it_cannot_honour(one_layer_engine: FusionEngine, store: KVStore) -> None:
    llm = _llm(one_layer_engine, store, pydantic_program_mode=PydanticProgramMode.OPENAI)
    with pytest.raises(InvalidRequestError, match="pydantic_program_mode"):
        llm.structured_predict(Verdict, PROMPT, context=TEXT)
    with pytest.raises(InvalidRequestError, match="drop it"):
        _llm(one_layer_engine, store).structured_predict(Verdict, PROMPT, context=TEXT,
                                                    llm_kwargs={"response_format": {"type": "json_object"}})


class Designer(BaseModel):
    """Who designed it, and when."""

    name: str = Field(max_length=24, description="the designer's name")
    year: int = Field(ge=1000, le=2100)


@pytest.mark.slow
def test_packaged_model_structured_predict_parses(default_engine: FusionEngine) -> None:
    llm = FusionRAGLLM(engine=default_engine, max_new_tokens=40, learn=False)
    prompt = PromptTemplate("{text}\nWho designed the Lumen lighthouse, and in which year?")
    designer = llm.structured_predict(Designer, prompt, text=TEXT)
    assert isinstance(designer, Designer) and designer.name.strip()
    print("->", designer)
