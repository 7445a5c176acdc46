"""The server's tool calls under hostile input and cut-off output (issue 45, items 3, 5 and 7):
malformed assistant `tool_calls` are 400s in OpenAI's error shape naming the message and field;
a call cut off by `max_tokens` reaches the client as a `tool_calls` entry with the truncated
arguments and `finish_reason: "length"`, never as markup in the content, whole or streamed.

A real server (uvicorn on loopback, `tests.http_server.running_app`) over the 1-layer random
engine: its answers are nonsense, yet grammar-shaped, which is all these tests need.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from fusionrag_core.engine import FusionEngine
from fusionrag_integrations.openai_server import ServerConfig, create_app
from fusionrag_integrations.session import ReuseConfig, ReuseSession
from tests.http_server import running_app

CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.fixture(scope="module")
def client(one_layer_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    session = ReuseSession(one_layer_engine, None, ReuseConfig(data_dir=tmp_path_factory.mktemp("tools"), learn=False))
    with running_app(create_app(session, ServerConfig())) as url, httpx.Client(base_url=url, timeout=60) as c:
        yield c


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    return dict(body["error"])


# ---- malformed assistant tool_calls ----------------------------------------------------------------------
@pytest.mark.parametrize(("calls", "field"), [
    ("notalist", r"messages\[1\]\.tool_calls must be a list"),
    ([{"foo": 1}], r"messages\[1\]\.tool_calls\[0\] has unsupported field\(s\) \['foo'\]"),
    ([{"id": "c1", "type": "function"}], r"messages\[1\]\.tool_calls\[0\]\.function must be an object"),
    ([7], r"messages\[1\]\.tool_calls\[0\] must be an object"),
    ([{**CALL, "type": "code"}], r"messages\[1\]\.tool_calls\[0\]\.type must be 'function'"),
    ([{**CALL, "id": 3}], r"messages\[1\]\.tool_calls\[0\]\.id must be a string"),
    ([{**CALL, "function": {"name": 5, "arguments": "{}"}}], r"messages\[1\]\.tool_calls\[0\]\.function\.name"),
    ([{**CALL, "function": {"name": "f", "arguments": "[1]"}}],
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be the JSON text of an object"),
    ([{**CALL, "function": {"name": "f", "arguments": "{nope"}}],
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments .*not JSON"),
    ([{**CALL, "function": {"name": "f", "arguments": "{}", "extra": 1}}],
     r"messages\[1\]\.tool_calls\[0\]\.function has unsupported field\(s\) \['extra'\]"),
])
def test_malformed_assistant_tool_calls_are_a_400_naming_the_field(client: httpx.Client, calls: Any,
                                                                     field: str) -> None:
    messages = [USER, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]
    response = client.post(CHAT, json={"messages": messages, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert re.search(field, error["message"]), error["message"]


@pytest.mark.parametrize("tool", [{"role": "tool", "content": "Sunny"},
                                  {"role": "tool", "tool_call_id": 7, "content": "Sunny"},
                                  {"role": "tool", "tool_call_id": "", "content": "Sunny"}],
                         ids=["missing", "not-a-string", "empty"])
def test_a_tool_message_without_its_call_id_is_a_400(client: httpx.Client, tool: dict[str, Any]) -> None:
    """As OpenAI answers it: the result must say which call it answers."""
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, tool]
    response = client.post(CHAT, json={"messages": messages, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert "messages[2].tool_call_id" in error_of(response)["message"]


def test_a_well_formed_tool_round_trip_is_answered(client: httpx.Client) -> None:
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]
    assert client.post(CHAT, json={"messages": messages, "max_tokens": 2}).status_code == 200


# ---- schemas no finite value satisfies ------------------------------------------------------------------
@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
])
def test_a_response_format_no_finite_value_satisfies_is_a_400(client: httpx.Client, schema: Any) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "loop", "schema": schema}}
    response = client.post(CHAT, json={"messages": [USER], "max_tokens": 8, "response_format": response_format})
    assert response.status_code == 400, response.text
    assert "no finite JSON value" in error_of(response)["message"]


def test_a_tool_whose_parameters_recurse_without_end_is_a_400(client: httpx.Client) -> None:
    parameters = {"type": "object", "properties": {"sub": {"$ref": "#"}}, "required": ["sub"]}
    tool = {"type": "function", "function": {"name": "nest", "parameters": parameters}}
    response = client.post(CHAT, json={"messages": [USER], "max_tokens": 8, "tools": [tool]})
    assert response.status_code == 400, response.text
    assert re.search(r"tool 'nest'.*no finite JSON value", error_of(response)["message"])


# ---- a call cut off by max_tokens --------------------------------------------------------------------------
# NOTE: a string of at least 6,000 characters cannot close within 64 tokens (none is over 81
# characters), and the call's opening text, name included, takes at most 56 (one character each):
# every answer is a get_weather call cut off inside its argument.
LONG_CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 6000}}, "required": ["city"]}}}
CUT = {"messages": [USER], "max_tokens": 64, "temperature": 0, "tools": [LONG_CITY],
       "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}


def assert_cut_call(call: dict[str, Any]) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    arguments = call["function"]["arguments"]
    assert arguments.startswith('{"city": "') and "<tool_call>" not in arguments, arguments
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)


def test_a_call_cut_off_by_max_tokens_is_a_tool_call_with_finish_reason_length(client: httpx.Client) -> None:
    response = client.post(CHAT, json=CUT)
    assert response.status_code == 200, response.text
    body = response.json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert not choice["message"]["content"]  # NOTE: no markup posing as the answer
    (call,) = choice["message"]["tool_calls"]
    assert_cut_call(call)
    (invalid,) = body["fusionrag"]["invalid_tool_calls"]
    assert "closing tag" in invalid["error"]


def test_a_streamed_call_cut_off_by_max_tokens_is_a_tool_call_delta_then_length(client: httpx.Client) -> None:
    with client.stream("POST", CHAT, json={**CUT, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert not "".join(d.get("content") or "" for d in deltas)
    (calls,) = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    (call,) = calls
    assert call["index"] == 0
    assert_cut_call(call)
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"


def test_chat_openai_reports_a_cut_off_call_as_invalid_not_as_its_answer(client: httpx.Client) -> None:
    """What the issue saw: LangChain's ChatOpenAI took the markup for the answer, so an agent ended
    with it. Now the call reaches it as a call whose arguments do not parse: `invalid_tool_calls`."""
    chat = ChatOpenAI(base_url=f"{client.base_url}/v1", api_key=SecretStr("x"), model="tiny-llama", max_retries=0,
                      temperature=0, max_completion_tokens=64)
    message = chat.bind_tools([LONG_CITY], tool_choice="get_weather").invoke("Weather in Paris?")
    assert message.content == "" and message.tool_calls == []
    (invalid,) = message.invalid_tool_calls
    assert invalid["name"] == "get_weather" and str(invalid["args"]).startswith('{"city": "')
    assert message.response_metadata["finish_reason"] == "length"
