"""Grammar-constrained decoding (llguidance): any model, even a random one, produces text the
grammar accepts, and the constraint leaves cache reuse exactly as it is without it."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.constrained import Grammar
from fusionrag_core.query.sampling import Sampler, SamplingConfig

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tag": {"enum": ["a", "b"]}},
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
CHUNKS = [("c0", "The Lumen lighthouse was designed by Ada Vell."), ("c1", "Ada Vell was born in Marrow.")]


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=len(smollm_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    return FusionEngine(LlamaForCausalLM(config).eval(), smollm_tokenizer, name="tiny")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_model_answers_valid_json_for_the_schema(engine: FusionEngine, temperature: float) -> None:
    sampling = SamplingConfig(max_new_tokens=40, temperature=temperature, seed=0, grammar=Grammar.json_schema(SCHEMA))
    generation = engine.generate(engine.prompt("Answer in JSON.", chunks=CHUNKS), sampling=sampling, selector="all")
    value = json.loads(generation.text)
    assert set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool)
    assert 0 <= value["n"] <= 99 and value["tag"] in ("a", "b")
    assert generation.finish_reason == "stop"  # the grammar closed the object, then allowed only EOS


def test_json_mode_and_regex(engine: FusionEngine) -> None:
    prompt = engine.prompt("Reply.", chunks=CHUNKS)
    regex = engine.generate(prompt, sampling=SamplingConfig(max_new_tokens=8, grammar=Grammar.regex(r"(yes|no)\.")))
    assert re.fullmatch(r"(yes|no)\.", regex.text)
    # NOTE: any object; a random model may not close it within budget, but every prefix stays JSON-shaped
    obj = engine.generate(prompt, sampling=SamplingConfig(max_new_tokens=6, grammar=Grammar.json_object()))
    assert obj.text.startswith("{")


def test_the_constraint_leaves_cache_reuse_unchanged(engine: FusionEngine) -> None:
    caches = {cid: engine.chunk_cache(text) for cid, text in CHUNKS}
    prompt = engine.prompt("Answer in JSON.", chunks=CHUNKS)
    free = engine.generate(prompt, sampling=SamplingConfig(max_new_tokens=4), caches=caches)
    json_sampling = SamplingConfig(max_new_tokens=4, grammar=Grammar.json_schema(SCHEMA))
    constrained = engine.generate(prompt, sampling=json_sampling, caches=caches)
    assert constrained.reused_tokens == free.reused_tokens > 0
    assert constrained.recomputed_tokens == free.recomputed_tokens
    assert torch.equal(constrained.first_token_logits, free.first_token_logits)  # masking happens after the logits


def test_bad_schemas_and_missing_tokenizer_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="cannot constrain"):
        Grammar.json_schema({"type": "object", "properties": {"x": {"type": "no-such-type"}}})
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        Sampler(SamplingConfig(grammar=Grammar.json_object()))


NO_FINITE_VALUE = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"$defs": {"n": {"anyOf": [{"$ref": "#/$defs/m"}]}, "m": {"allOf": [{"$ref": "#/$defs/n"}]}}, "$ref": "#/$defs/n"},
]
FINITE_RECURSION = [
    {"type": "object", "properties": {"next": {"$ref": "#"}}},  # NOTE: `next` may be left out
    {"type": "array", "items": {"$ref": "#"}},  # NOTE: [] ends it
    {"$defs": {"tree": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}},
                        "required": ["kids"]}}, "$ref": "#/$defs/tree"},
    {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}]},
]


@pytest.mark.parametrize("schema", NO_FINITE_VALUE)
def test_a_schema_no_finite_value_satisfies_is_refused_naming_the_recursion(schema: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError, match=r"no finite JSON value.*\$ref '#"):
        Grammar.json_schema(schema)


@pytest.mark.parametrize("schema", FINITE_RECURSION)
def test_a_recursive_schema_with_a_way_out_compiles(schema: dict[str, object]) -> None:
    Grammar.json_schema(schema)


def test_a_grammar_that_allows_nothing_fails_the_request_instead_of_ending_it_empty(engine: FusionEngine) -> None:
    """The matcher of an empty language leaves only EOS unmasked, in its error state: that must be
    the request's error, never an empty answer that "stopped" as if it were complete."""
    empty = Grammar("{\"grammars\": [{\"json_schema\": {\"$ref\": \"#\"}}]}", "an empty language")
    with pytest.raises(InvalidRequestError, match="an empty language"):
        engine.generate(engine.prompt("Reply.", chunks=CHUNKS), sampling=SamplingConfig(max_new_tokens=4,
                                                                                         grammar=empty))
