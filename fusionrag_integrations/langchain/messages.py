"""LangChain messages in, clean text out: the boundary between LangChain and the engine's prompts.

Messages become the role/content dicts that `FusionEngine.prompt_from_messages` renders with the
model's chat template; stored chunks are found there by content, or by the marks of
`fusionrag_core.mark_chunk` (see `format_docs`). Mark characters never leave in output text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import BaseMessage, convert_to_openai_messages

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.recognise.marks import MARK_CHARS, clean_output


def to_chat_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """OpenAI-shaped `[{"role": ..., "content": ...}]` for the model's chat template.

    Roles follow the OpenAI convention ("system", "user", "assistant", "tool", or a ChatMessage's
    own role); text content blocks are joined; an AI message's `tool_calls` and a tool message's
    `tool_call_id` are kept (the engine renders them with the template's tool roles, or the
    fallback format); `name` and message ids are dropped.

    Raises:
        InvalidRequestError: a message holds non-text content (images, audio, files).
    """
    out: list[dict[str, Any]] = []
    for message in convert_to_openai_messages(list(messages), text_format="string"):
        content = message.get("content") or ""
        if not isinstance(content, str):
            kinds = sorted({str(b.get("type")) for b in content if isinstance(b, dict)} - {"text"})
            raise InvalidRequestError(
                f"a {message['role']} message holds {', '.join(kinds) or 'non-text'} content; FusionRAG models "
                "read text only: pass text content"
            )
        kept = {key: message[key] for key in ("tool_calls", "tool_call_id") if message.get(key)}
        out.append({"role": str(message["role"]), "content": content, **kept})
    return out


__all__ = ["MARK_CHARS", "clean_output", "to_chat_dicts"]
