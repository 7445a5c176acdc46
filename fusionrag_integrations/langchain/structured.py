"""Structured output for the LangChain models: JSON guaranteed by grammar-constrained decoding.

`with_structured_output(schema)` binds an OpenAI-shaped `response_format` call option; the
request then decodes under an llguidance grammar of the schema (`fusionrag_core.query.constrained`), so
the answer always parses (unless `max_tokens` ends it first, which the parser reports). Chunk
caches are reused exactly as without the constraint: only sampling changes.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Literal

from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, Generation
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass

from fusionrag_core.errors import InvalidRequestError
from fusionrag_integrations.response_format import json_schema_format, response_grammar

Method = Literal["json_schema", "json_mode", "function_calling"]
METHODS = ("json_schema", "json_mode", "function_calling")


class _CompleteJsonMixin:
    """Parsers that say when `max_tokens` ended the answer before its JSON closed."""

    def parse_result(self, result: list[Generation], *, partial: bool = False) -> Any:
        if not partial and result and isinstance(result[0], ChatGeneration):
            meta = result[0].message.response_metadata
            if meta.get("finish_reason") == "length":
                raise OutputParserException(
                    f"the answer reached max_tokens ({meta.get('completion_tokens')} tokens) before its JSON was "
                    "complete; raise max_tokens: the constructor's max_tokens, or model.with_structured_output(schema)"
                    ".bind(max_tokens=...) (a model.bind(max_tokens=...) before with_structured_output is dropped "
                    "by LangChain's binding)",
                    llm_output=result[0].text,
                )
        return super().parse_result(result, partial=partial)  # type: ignore[misc]


class CompleteJsonOutputParser(_CompleteJsonMixin, JsonOutputParser):
    """`JsonOutputParser` that reports a truncated answer."""


class CompletePydanticOutputParser(_CompleteJsonMixin, PydanticOutputParser):
    """`PydanticOutputParser` that reports a truncated answer."""


def with_structured_output(
    model: BaseChatModel,
    schema: Any,
    *,
    method: Method = "json_schema",
    include_raw: bool = False,
    strict: bool | None = None,
    **kwargs: Any,
) -> Runnable[Any, Any]:
    """`model` answering with `schema`'s object, through grammar-constrained decoding.

    Args:
        model: a ChatFusionRAG.
        schema: a Pydantic class (returns instances), a TypedDict or a JSON schema / OpenAI tool
            dict (returns dicts); with method="json_mode" it may be None (any JSON object).
        method: "json_schema" (the schema's grammar), "json_mode" (any JSON object; the prompt
            must ask for the shape) or "function_calling" (the same as "json_schema": the
            arguments' JSON is decoded directly, there is no tool-call round trip).
        include_raw: return `{"raw": AIMessage, "parsed": ..., "parsing_error": ...}`.
        strict: None/True (default): as OpenAI's strict mode, objects admit only their listed
            properties (`additionalProperties: false` unless the schema says otherwise); False:
            the schema as written (JSON Schema then allows extra keys). Either way the grammar
            admits only schema-valid JSON.

    Raises:
        InvalidRequestError: an unknown method or argument, or a schema that cannot be compiled.
    """
    if kwargs:
        raise InvalidRequestError(f"with_structured_output got unsupported argument(s) {sorted(kwargs)}")
    if method not in METHODS:
        raise InvalidRequestError(f"unknown method {method!r}; use one of {list(METHODS)}")
    if schema is None and method != "json_mode":
        raise InvalidRequestError("pass a schema (Pydantic class, TypedDict or JSON schema), or method='json_mode'")
    json_schema = convert_to_json_schema(schema) if schema is not None else None
    if method == "json_mode" or json_schema is None:
        response_format: dict[str, Any] = {"type": "json_object"}
    else:
        response_format = json_schema_format(json_schema, strict=strict)
    response_grammar(response_format)  # NOTE: compiled now, so a bad schema fails here, not at invoke
    bound = model.bind(
        response_format=response_format,
        ls_structured_output_format={"kwargs": {"method": method}, "schema": schema if schema is not None else {}},
    )
    parser: Runnable[Any, Any]
    if isinstance(schema, type) and is_basemodel_subclass(schema):
        parser = CompletePydanticOutputParser(pydantic_object=schema)
    else:
        parser = CompleteJsonOutputParser()
    if not include_raw:
        return bound | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=bound) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")


__all__ = ["METHODS", "with_structured_output"]
