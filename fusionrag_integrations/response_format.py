"""OpenAI-shaped `response_format` values -> the grammar a request decodes under (both integrations).

`{"type": "json_object"}` is any JSON object; `{"type": "json_schema", "json_schema": {"schema":
...}}` is JSON valid under the schema, compiled by llguidance (`fusionrag_core.query.constrained`). The
LangChain models take it as a call option (`with_structured_output` binds it); the LlamaIndex LLM
passes it from `structured_predict` / `as_structured_llm` to its own chat call.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.constrained import Grammar, closed_objects


def json_schema_format(json_schema: Mapping[str, Any], *, strict: bool | None = None) -> dict[str, Any]:
    """The `response_format` that constrains an answer to `json_schema`.

    Args:
        json_schema: a JSON schema (e.g. a Pydantic class's `model_json_schema()`).
        strict: None/True: as OpenAI's strict mode, objects admit only their listed properties
            (`closed_objects`); False: the schema as written.
    """
    schema = dict(json_schema) if strict is False else closed_objects(json_schema)
    name = json_schema.get("title", "output")
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict is not False}}


def response_grammar(response_format: Any) -> Grammar:
    """The grammar of an OpenAI-shaped `response_format` call option.

    Accepts `{"type": "json_object"}` (any JSON object) and
    `{"type": "json_schema", "json_schema": {"schema": {...}, "strict": bool, ...}}` (strict: every
    object closed to its listed properties, as OpenAI's strict mode; else the schema as written).

    Raises:
        InvalidRequestError: another shape, or a schema llguidance cannot compile.
    """
    if isinstance(response_format, Mapping):
        kind = response_format.get("type")
        if kind == "json_object":
            return Grammar.json_object()
        spec = response_format.get("json_schema")
        if kind == "json_schema" and isinstance(spec, Mapping) and isinstance(spec.get("schema"), Mapping):
            strict = spec.get("strict")
            if strict not in (None, True, False):
                raise InvalidRequestError(f"response_format.json_schema.strict must be true or false, got {strict!r}")
            # NOTE: strict: as OpenAI's strict mode, objects admit only their listed properties;
            # otherwise the schema as written (decoded under its grammar either way)
            schema = closed_objects(spec["schema"]) if strict else spec["schema"]
            return _schema_grammar(json.dumps(schema, sort_keys=True))
    raise InvalidRequestError(
        f"unsupported response_format {response_format!r}; use {{'type': 'json_object'}} or "
        "{'type': 'json_schema', 'json_schema': {'schema': <JSON schema>}} (or with_structured_output(schema))"
    )


@functools.lru_cache(maxsize=64)
def _schema_grammar(schema_json: str) -> Grammar:
    # NOTE: a Grammar is immutable, so one compiled schema serves every request that binds it.
    return Grammar.json_schema(json.loads(schema_json))


__all__ = ["closed_objects", "json_schema_format", "response_grammar"]
