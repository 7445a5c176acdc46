"""Chat-completions fields a client may send (issue 46, item 4), through the real `openai` SDK
against a real server: `logprobs` / `top_logprobs` in OpenAI's shapes (streamed too), vLLM's
`top_k` / `min_p` / `repetition_penalty`, a message's `name`, `json_schema.strict`, and
`parallel_tool_calls` defaulting to OpenAI's true; each one honoured or refused with a 400 that
names it.

The 1-layer random engine answers (the weights do not matter here); answers are compared with the
in-process session's for the same request, so nothing is compared with a hard-coded result.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_integrations.openai_server import ServerConfig, create_app
from fusionrag_integrations.openai_server.protocol import ChatCompletionRequest
from fusionrag_integrations.request import RequestOptions
from fusionrag_integrations.response_format import response_grammar
from fusionrag_integrations.session import ReuseConfig, ReuseSession
from tests.http_server import running_app

USER: Any = [{"role": "user", "content": "Say something about lighthouses."}]


@pytest.fixture(scope="module")
def session(one_layer_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> ReuseSession:
    return ReuseSession(one_layer_engine, None, ReuseConfig(data_dir=tmp_path_factory.mktemp("fields"), learn=False))


@pytest.fixture(scope="module")
def base_url(session: ReuseSession) -> Iterator[str]:
    with running_app(create_app(session, ServerConfig())) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def in_process(session: ReuseSession, messages: list[dict[str, Any]], **values: Any) -> Generation:
    """The same request answered in process (the server adds nothing to what the engine generates)."""
    options = RequestOptions.from_values({"temperature": 0.0, **values})
    pieces = list(session.answer(messages, options))
    generation = pieces[-1]
    assert isinstance(generation, Generation)
    return generation


# ---- logprobs -----------------------------------------------------------------------------------------
def test_chat_logprobs_are_the_engines_in_openais_shape(client: openai.OpenAI, session: ReuseSession) -> None:
    response = client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3)
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    local = in_process(session, USER, max_new_tokens=6, logprobs=True, top_logprobs=3)
    assert local.logprobs is not None
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx([e.logprob for e in local.logprobs], abs=1e-5)
    tokenizer = session.engine.tokenizer
    assert [e.token for e in choice.logprobs.content] == [tokenizer.decode([e.token_id]) for e in local.logprobs]
    assert "".join(e.token for e in choice.logprobs.content).startswith(choice.message.content or "")
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.top_logprobs[0].token == entry.token  # NOTE: greedy picks the most likely token


def test_streamed_chat_logprobs_cover_every_token_once(client: openai.OpenAI) -> None:
    body: Any = {"model": "tiny-llama", "messages": USER, "max_tokens": 8, "temperature": 0, "logprobs": True,
                 "top_logprobs": 2}
    whole = client.chat.completions.create(**body).choices[0].logprobs
    streamed = [e for chunk in client.chat.completions.create(**body, stream=True) for c in chunk.choices
                if c.logprobs is not None and c.logprobs.content for e in c.logprobs.content]
    assert whole is not None and whole.content is not None
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.content]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_in_openais_shape(client: openai.OpenAI, stream: bool) -> None:
    body: Any = {"model": "tiny-llama", "prompt": "The lighthouse", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks if c.logprobs is not None for t in c.logprobs.tokens or ()]
        offsets = [o for c in chunks if c.logprobs is not None for o in c.logprobs.text_offset or ()]
    else:
        choice = client.completions.create(**body).choices[0]
        assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
        assert len(choice.logprobs.token_logprobs or ()) == len(choice.logprobs.tokens or ())
        text, tokens, offsets = choice.text, list(choice.logprobs.tokens or ()), list(choice.logprobs.text_offset or ())
    assert len(tokens) == 6
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert "".join(tokens).startswith(text)


@pytest.mark.parametrize(("body", "named"), [
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"messages": USER, "top_k": -2}, "top_k"),
    ({"messages": USER, "min_p": 1.5}, "min_p"),
    ({"messages": USER, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": USER, "repetition_penalty": 2.5}, "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "hi", "name": "<|im_start|>"}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "hi", "name": "two words"}]}, "messages[0].name"),
    ({"messages": [{"role": "assistant", "content": None, "name": "bot",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].name"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "g", "content": "ok"}]}, "messages[1].name"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "strict": "yes", "schema": {"type": "object"}}}}, "strict"),
    ({"messages": USER, "parallel_tool_calls": False}, "without tools"),
])
def test_bad_values_are_400_naming_the_field(http: httpx.Client, body: dict[str, Any], named: str) -> None:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    response = http.post(path, json={"max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]


# ---- vLLM's extra sampling fields ---------------------------------------------------------------------
def test_vllm_sampling_fields_reach_the_engine(client: openai.OpenAI, session: ReuseSession) -> None:
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3}
    response = client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=8, temperature=0.9,
                                              seed=11, extra_body=extra)
    local = in_process(session, USER, max_new_tokens=8, temperature=0.9, seed=11, **extra)
    assert response.choices[0].message.content == local.text
    plain = in_process(session, USER, max_new_tokens=8, temperature=0.9, seed=11)
    assert local.token_ids != plain.token_ids  # NOTE: the fields change this answer: dropping them would show


def test_top_k_1_is_greedy_over_http(client: openai.OpenAI) -> None:
    greedy = client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=8, temperature=0)
    top1 = client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=8, temperature=1.5,
                                          extra_body={"top_k": 1})
    assert top1.choices[0].message.content == greedy.choices[0].message.content


# ---- name, strict, parallel_tool_calls ------------------------------------------------------------------
def test_a_message_name_is_shown_before_its_text() -> None:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi", "name": "alice"},
                                           {"role": "assistant", "content": "hello", "name": "bot"}])
    assert [m["content"] for m in body.chat_messages()] == ["alice: hi", "bot: hello"]


def test_a_named_message_changes_the_prompt(session: ReuseSession) -> None:
    sources = session.sources(RequestOptions())
    named = ChatCompletionRequest(messages=[{"role": "user", "content": "hi", "name": "alice"}]).chat_messages()
    plain = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).chat_messages()
    tokenizer = session.engine.tokenizer
    assert "alice: hi" in tokenizer.decode(session.prompt(named, sources).token_ids())
    assert "alice" not in tokenizer.decode(session.prompt(plain, sources).token_ids())


def test_a_tool_message_may_name_its_calls_function(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"}]
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_strict_closes_the_schemas_objects(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for strict in (True, False):
        response = client.chat.completions.create(
            model="tiny-llama", messages=USER, max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": strict}})
        assert response.choices[0].message.content is not None
    strict_grammar = response_grammar({"type": "json_schema", "json_schema": {"schema": schema, "strict": True}})
    loose_grammar = response_grammar({"type": "json_schema", "json_schema": {"schema": schema}})
    assert strict_grammar is not loose_grammar
    closed = response_grammar({"type": "json_schema", "json_schema": {
        "schema": {**schema, "additionalProperties": False}}})
    assert closed is strict_grammar  # NOTE: strict compiles the closed schema (one cached grammar)


def test_parallel_tool_calls_defaults_as_openais() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert ChatCompletionRequest(messages=USER, tools=[tool]).parallel_calls() is True
    assert ChatCompletionRequest(messages=USER, tools=[tool], parallel_tool_calls=False).parallel_calls() is False
    assert ChatCompletionRequest(messages=USER).parallel_calls() is None
    named = {"type": "function", "function": {"name": "f"}}
    assert ChatCompletionRequest(messages=USER, tools=[tool], tool_choice=named).parallel_calls() is False
    assert ChatCompletionRequest(messages=USER, tools=[tool], tool_choice=named,
                                 parallel_tool_calls=True).parallel_calls() is True
    assert ChatCompletionRequest(messages=USER, tools=[tool], tool_choice="required").parallel_calls() is True


# ---- /tokenize, /detokenize -------------------------------------------------------------------------------
def test_tokenize_counts_what_a_generation_reports(http: httpx.Client, client: openai.OpenAI) -> None:
    for path_body, generated in (
        ({"messages": USER}, client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=1)),
        ({"prompt": "The lighthouse"}, client.completions.create(model="tiny-llama", prompt="The lighthouse",
                                                                 max_tokens=1)),
    ):
        response = http.post("/tokenize", json={**path_body, "return_token_strs": True})
        assert response.status_code == 200, response.text
        body = response.json()
        assert generated.usage is not None and body["count"] == generated.usage.prompt_tokens == len(body["tokens"])
        assert len(body["token_strs"]) == body["count"] and body["max_model_len"] > body["count"]
        back = http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
        assert "Say something about lighthouses." in back or "The lighthouse" in back


@pytest.mark.parametrize(("path", "body", "named"), [
    ("/tokenize", {"prompt": "a", "messages": USER}, "either prompt"),
    ("/tokenize", {}, "either prompt"),
    ("/tokenize", {"messages": USER, "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": True}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [10**9]}, "tokens[0]"),
])
def test_token_routes_refuse_what_they_do_not_do(http: httpx.Client, path: str, body: dict[str, Any],
                                                 named: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]


# ---- /v1/embeddings -----------------------------------------------------------------------------------------
def test_embeddings_are_the_corpus_models(client: openai.OpenAI, http: httpx.Client) -> None:
    from fusionrag_core.ingest.chroma import EMBEDDING_ID, default_embedding_function

    texts = ["The Lumen lighthouse was designed by Ada Vell.", "Ada Vell was born in Marrow."]
    expected = default_embedding_function()(texts)
    by_sdk = client.embeddings.create(model=EMBEDDING_ID, input=texts)  # NOTE: the SDK asks for base64
    as_floats = http.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": texts[0],
                                                  "encoding_format": "float"}).json()
    assert [d.index for d in by_sdk.data] == [0, 1] and by_sdk.model == EMBEDDING_ID
    for got, want in zip(by_sdk.data, expected, strict=True):
        assert got.embedding == pytest.approx(list(want), abs=1e-6)
    assert as_floats["data"][0]["embedding"] == pytest.approx(list(expected[0]), abs=1e-6)
    assert by_sdk.usage.prompt_tokens == by_sdk.usage.total_tokens > as_floats["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize(("body", "status", "named"), [
    ({"model": "text-embedding-3-small", "input": "x"}, 404, "all-MiniLM-L6-v2"),
    ({"model": "all-MiniLM-L6-v2", "input": [[1, 2, 3]]}, 400, "token ids"),
    ({"model": "all-MiniLM-L6-v2", "input": ""}, 400, "input[0] is empty"),
    ({"model": "all-MiniLM-L6-v2", "input": "x", "dimensions": 64}, 400, "dimensions"),
    ({"model": "all-MiniLM-L6-v2", "input": "word " * 400}, 400, "split the text"),
    ({"model": "all-MiniLM-L6-v2", "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
])
def test_embeddings_refuse_what_they_do_not_do(http: httpx.Client, body: dict[str, Any], status: int,
                                               named: str) -> None:
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code == status, response.text
    assert named in response.json()["error"]["message"]


# ---- n choices ------------------------------------------------------------------------------------------------
def test_n_choices_equal_separate_requests_of_consecutive_seeds(client: openai.OpenAI, session: ReuseSession) -> None:
    response = client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=6, temperature=1.0,
                                              seed=21, n=3, logprobs=True)
    assert [c.index for c in response.choices] == [0, 1, 2]
    locals_ = [in_process(session, USER, max_new_tokens=6, temperature=1.0, seed=21 + i) for i in range(3)]
    assert [c.message.content for c in response.choices] == [g.text for g in locals_]
    assert all(c.logprobs is not None and c.logprobs.content is not None and
               len(c.logprobs.content) == len(g.token_ids) for c, g in zip(response.choices, locals_, strict=True))
    assert response.usage is not None
    assert response.usage.prompt_tokens == locals_[0].prompt_tokens  # NOTE: one prompt, counted once
    assert response.usage.completion_tokens == sum(len(g.token_ids) for g in locals_)


def test_streamed_choices_are_the_whole_ones(client: openai.OpenAI) -> None:
    body: Any = {"model": "tiny-llama", "messages": USER, "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 2}
    whole = client.chat.completions.create(**body)
    texts, finished, usage = {0: "", 1: ""}, set(), None
    for chunk in client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices] and finished == {0, 1}
    assert usage is not None and whole.usage is not None and usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_completion_choices(client: openai.OpenAI, stream: bool) -> None:
    body: Any = {"model": "tiny-llama", "prompt": "The lighthouse", "max_tokens": 5, "temperature": 1.0, "seed": 8,
                 "n": 2}
    if stream:
        texts = {0: "", 1: ""}
        for chunk in client.completions.create(**body, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.text
        got = [texts[0], texts[1]]
    else:
        got = [c.text for c in client.completions.create(**body).choices]
    single = [client.completions.create(**{**body, "n": 1, "seed": 8 + i}).choices[0].text for i in range(2)]
    assert got == single


def test_more_choices_than_running_slots_is_400(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "n": 100})
    assert response.status_code == 400, response.text
    assert "max_running" in response.json()["error"]["message"]
    after = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "n": 2})
    assert after.status_code == 200 and len(after.json()["choices"]) == 2


def test_a_client_that_leaves_a_streamed_n_request_frees_every_slot(http: httpx.Client, session: ReuseSession) -> None:
    body = {"messages": USER, "max_tokens": 200, "temperature": 1.0, "n": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert any('"index": 2' in line for line, _ in zip(lines, range(20), strict=False))
    scheduler = session.engine.scheduler
    assert scheduler is not None
    deadline = time.monotonic() + 30
    while scheduler.load["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler.load["running"] == 0
