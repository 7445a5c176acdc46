"""FusionRAGChain: the explicit RAG step, {"question", "documents"} -> answer, with no text matching.

The documents' ids name their caches directly: the chain asks the chat model for the canonical
prompt (instruction, passages, question) built from `(doc.id, doc.page_content)` pairs, so nothing
depends on finding chunks again inside a rendered prompt.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import AIMessageChunk, BaseMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig, RunnableSerializable

from fusionrag_core.errors import InvalidRequestError
from fusionrag_integrations.langchain.chat_models import ChatFusionRAG


class FusionRAGChain(RunnableSerializable[dict[str, Any], BaseMessage]):
    """Answers `{"question": str, "documents": [Document, ...]}` with ChatFusionRAG, reusing caches by id.

    Streams, batches and runs async like the chat model it wraps (callbacks and tracing see that
    model's run). Per-call options (`max_tokens`, `selector`, ...) pass through.

    Example:
        >>> chain = {"question": RunnablePassthrough(), "documents": retriever} | FusionRAGChain(llm=ChatFusionRAG())
        >>> chain.invoke("Who designed the lighthouse?").content
    """

    llm: ChatFusionRAG
    """The chat model that answers."""
    instruction: str | None = None
    """System instruction of the canonical prompt (None: the engine's configured instruction)."""

    def invoke(self, input: dict[str, Any], config: RunnableConfig | None = None, **kwargs: Any) -> BaseMessage:
        messages, documents = self._request(input)
        return self.llm.invoke(messages, config, documents=documents, **kwargs)

    async def ainvoke(self, input: dict[str, Any], config: RunnableConfig | None = None, **kwargs: Any) -> BaseMessage:
        messages, documents = self._request(input)
        return await self.llm.ainvoke(messages, config, documents=documents, **kwargs)

    def stream(
        self, input: dict[str, Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[AIMessageChunk]:
        messages, documents = self._request(input)
        yield from self.llm.stream(messages, config, documents=documents, **kwargs)

    async def astream(
        self, input: dict[str, Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[AIMessageChunk]:
        messages, documents = self._request(input)
        async for chunk in self.llm.astream(messages, config, documents=documents, **kwargs):
            yield chunk

    def _request(self, input: Mapping[str, Any]) -> tuple[list[BaseMessage], Sequence[Document]]:
        """The chat model's messages and documents for one input."""
        question, documents = input.get("question"), input.get("documents")
        if not isinstance(question, str) or not isinstance(documents, Sequence) or not all(
            isinstance(d, Document) for d in documents
        ):
            raise InvalidRequestError(
                'FusionRAGChain takes {"question": str, "documents": [Document, ...]}, e.g. '
                '{"question": RunnablePassthrough(), "documents": retriever} | FusionRAGChain(llm=...)'
            )
        system: list[BaseMessage] = [SystemMessage(self.instruction)] if self.instruction else []
        return [*system, HumanMessage(question)], documents
