"""The server's tool calls under hostile input and cut-off output (issue 45, items 3, 5 and 7):
malformed assistant `tool_calls` are 400s in OpenAI's error shape naming the message and field;
a call cut off by `max_tokens` reaches the client as a `tool_calls` entry with the truncated
arguments and `finish_reason: "length"`, never as markup in the content, whole or streamed.

A real server (uvicorn on loopback, `tests.http_server.running_app`) over the 1-layer random
engine: its answers are nonsense, yet grammar-shaped, which is all these tests need.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

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
