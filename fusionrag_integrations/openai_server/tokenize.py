"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes.

    /tokenize     {"prompt": text} or {"messages": [...], "tools": [...]}
                  -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize   {"tokens": [ids]} -> {"prompt": text}

A prompt is tokenized exactly as the generation routes tokenize it (`/v1/completions` for a text,
`/v1/chat/completions` for messages, chunks found by content included), so `count` is the
`usage.prompt_tokens` a generation of it reports. vLLM's `add_special_tokens` is not taken: the
prompt layout decides the special tokens, as it does for generation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, Field

from fusionrag_core.errors import InvalidRequestError
from fusionrag_integrations.fields import bound_tools
from fusionrag_integrations.openai_server.errors import HTTPError
from fusionrag_integrations.openai_server.protocol import ChatCompletionRequest
from fusionrag_integrations.request import RequestOptions
from fusionrag_integrations.session import ReuseSession


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: a text prompt, or chat messages (with their tools), never both."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def checked(self) -> None:
        """Raises InvalidRequestError: neither or both of prompt and messages; a chat without its
        generation prompt; tools with a text prompt."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("pass either prompt (a text, tokenized as /v1/completions does) or messages "
                                      "(tokenized as /v1/chat/completions does)")
        if self.messages is None and self.tools is not None:
            raise InvalidRequestError("tools are only shown with messages: pass messages, or drop tools")
        if not self.add_generation_prompt:
            raise InvalidRequestError("add_generation_prompt=false is not supported: messages are tokenized as a chat "
                                      "request's prompt, which ends with the generation prompt")


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`: token ids of the served model."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def tokenize_route(session: ReuseSession) -> Callable[[TokenizeRequest], Awaitable[dict[str, Any]]]:
    """The `/tokenize` handler over `session`'s engine and reuse sources."""

    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        _check_model(body.model, session)
        body.checked()
        ids = await anyio.to_thread.run_sync(_prompt_ids, session, body)
        tokenizer = session.engine.tokenizer
        return {"count": len(ids), "max_model_len": session.engine.context_window, "tokens": ids,
                "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}
    return tokenize


def detokenize_route(session: ReuseSession) -> Callable[[DetokenizeRequest], Awaitable[dict[str, str]]]:
    """The `/detokenize` handler over `session`'s tokenizer."""

    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        _check_model(body.model, session)
        tokenizer = session.engine.tokenizer
        vocabulary = len(tokenizer)
        wrong = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocabulary), None)
        if wrong is not None:
            raise HTTPError(400, f"tokens[{wrong}] is {body.tokens[wrong]}, which is no token of this model: ids are "
                                 f"0 to {vocabulary - 1}", param=f"tokens[{wrong}]")
        return {"prompt": str(tokenizer.decode(body.tokens))}
    return detokenize


def _prompt_ids(session: ReuseSession, body: TokenizeRequest) -> list[int]:
    """The ids a generation of this prompt would read (a worker thread's job: it tokenizes)."""
    options = RequestOptions()
    sources = session.sources(options)
    if body.prompt is not None:
        prompt = session.prompt_from_text(body.prompt, sources)
    else:
        chat = ChatCompletionRequest(messages=body.messages or [], tools=body.tools)
        tools = bound_tools({"tools": body.tools, "tool_choice": None, "parallel_tool_calls": chat.parallel_calls()})
        prompt = session.prompt(chat.chat_messages(), sources, (), tools)
    return [int(t) for t in prompt.token_ids()]


def _check_model(model: str | None, session: ReuseSession) -> None:
    if model not in (None, session.engine.name):
        raise HTTPError(404, f"model {model!r} does not exist: this server serves {session.engine.name!r}",
                        code="model_not_found")


__all__ = ["DetokenizeRequest", "TokenizeRequest", "detokenize_route", "tokenize_route"]
