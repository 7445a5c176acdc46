"""ChatFusionRAG: a LangChain chat model that reuses fused chunk KV caches.

Drop it into an ordinary RAG chain whose context is rendered with `format_docs`: every retrieved
chunk is recognised by its chunk id, its cache is loaded from the KV store, re-positioned and
partly recomputed (FusionRAG's query-guided selection), and only the rest of the prompt is
prefilled.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import generate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable

from fusionrag_core.engine import Generation
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.tools import InvalidToolCall, ToolCall, ToolRequest, split_calls
from fusionrag_core.reuse.sources import ReuseSources
from fusionrag_integrations.langchain.binding import FusionRAGModelFields, generation_metadata
from fusionrag_integrations.langchain.documents import chunk_inputs
from fusionrag_integrations.langchain.messages import to_chat_dicts
from fusionrag_integrations.langchain.structured import Method, with_structured_output
from fusionrag_integrations.langchain.tools import artifact_texts, call_chunk, langchain_invalid_call, tool_options
from fusionrag_integrations.logprobs import chat_logprobs


@dataclass(frozen=True)
class _IndexedCall:
    """A call of the answer and its position among the answer's calls (a chunk's `index`)."""

    call: ToolCall | InvalidToolCall
    index: int


_Event = str | _IndexedCall | Generation


class ChatFusionRAG(FusionRAGModelFields, BaseChatModel):
    """Chat model over a FusionEngine: the caches of chunks the prompt holds (found by mark or by
    content, or learned from an earlier prompt) are reused.

    Construction is cheap: weights load on first use (or pass an already loaded `engine=` or an
    `index=`). With no arguments it answers with the packaged SmolLM2-135M-Instruct and looks
    chunk caches up in the KV store of `./fusionrag-data`.

    Two ways to name the chunks of a request: marks in the prompt text (`format_docs`, any prompt
    template), or the documents themselves, `invoke(question, documents=docs)`, which builds the
    model's canonical prompt (instruction, passages, question) from their ids and texts; the
    messages are then one human question, optionally after one system instruction.

    Response metadata holds `Generation.stats()` (ttft_s, reused_tokens, recomputed_tokens, ...);
    usage metadata counts prompt and generated tokens, with the tokens served from a cache (reused
    chunk tokens and prefix-cache tokens) as `cache_read`.

    Example:
        >>> from langchain_core.prompts import ChatPromptTemplate
        >>> from langchain_core.output_parsers import StrOutputParser
        >>> from langchain_core.runnables import RunnablePassthrough
        >>> prompt = ChatPromptTemplate.from_messages([("human", "{context}\\nQuestion: {question}")])
        >>> chain = (
        ...     {"context": retriever | format_docs, "question": RunnablePassthrough()}
        ...     | prompt | ChatFusionRAG(index=index) | StrOutputParser()
        ... )
        >>> chain.invoke("Who designed the lighthouse?")
    """

    streaming: bool = False
    """Whether `invoke` streams internally (callbacks then see every token)."""

    @property
    def _llm_type(self) -> str:
        return "fusionrag-chat"

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Method = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """Answer with `schema`'s object (Pydantic instance, or dict for TypedDict / JSON schema).

        Decoding is constrained by the schema's grammar (llguidance), so the JSON always parses
        unless `max_tokens` cuts it (an OutputParserException then says so). Chunk caches are
        reused as without the constraint. See `structured.with_structured_output` for `method`.
        """
        return with_structured_output(self, schema, method=method, include_raw=include_raw, strict=strict,
                                      **kwargs)

    def bind_tools(
        self,
        tools: Sequence[Any],
        *,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with `tools` it may call; answers carry them in `AIMessage.tool_calls`.

        Tools are shown through the model's chat template where it renders tools, else through
        FusionRAG's fallback format (said once, with a warning); the answer decodes under a grammar,
        so every call names a bound tool and its arguments satisfy that tool's JSON schema.

        Args:
            tools: `@tool` functions, BaseTools, Pydantic classes, TypedDicts, JSON schemas or
                OpenAI tool dicts (anything `convert_to_openai_tool` takes).
            tool_choice: None/"auto"/False (the model decides), "any"/"required"/True (it must
                call), "none" (it must not), a tool's name or `{"type": "function", "function":
                {"name": ...}}` (that tool).
            parallel_tool_calls: True lets one answer make several calls; None/False: one at most.
            strict: passed to `convert_to_openai_tool`; the grammar admits only the listed
                properties of each arguments object either way.
            **kwargs: other call options to bind (e.g. `max_tokens`).

        Raises:
            InvalidRequestError: an unknown tool choice, duplicate names, or a schema the grammar
                cannot enforce (the message names the tool and the construct).
        """
        return self.bind(**tool_options(tools, tool_choice, parallel_tool_calls, strict), **kwargs)

    def fusion_prompt(self, messages: list[BaseMessage], documents: Sequence[Document] | None = None,
                      run_id: UUID | None = None, sources: ReuseSources | None = None,
                      tools: ToolRequest | None = None) -> FusionPrompt:
        """The engine request `invoke(messages, documents=documents)` runs.

        Args:
            messages: the conversation; chunks marked in its text are recognised, and the
                Documents tool messages carry as artifacts are learnable (`tools.artifact_texts`).
            documents: None, or the passages of a canonical prompt (then `messages` is one human
                question, optionally after one system instruction).
            run_id: this model's LangChain run, whose retrieved documents may be learned (see `reuse_prompt`).
            sources: the request's sources (see `reuse_prompt`).
            tools: the bound tools, shown with the messages.

        Raises:
            InvalidRequestError: `documents` given with other messages than that, or with tools.
        """
        engine = self.fusion_engine()
        if documents is None:
            return self.reuse_prompt(to_chat_dicts(messages), run_id, sources, documents=artifact_texts(messages),
                                     tools=tools)
        if tools is not None:
            raise InvalidRequestError("documents= builds the canonical prompt, which shows no tools: pass the "
                                      "documents in the messages (format_docs) to call tools")
        system, question = messages[:-1], messages[-1] if messages else None
        if not isinstance(question, HumanMessage) or len(system) > 1 or not all(
            isinstance(m, SystemMessage) for m in system
        ):
            raise InvalidRequestError(
                "with documents=, pass the question as one human message (optionally after one system message "
                "holding the instruction); for conversations, put format_docs(documents) in the prompt instead"
            )
        instruction = to_chat_dicts(system)[0]["content"] if system else None
        return engine.prompt(to_chat_dicts([question])[0]["content"], chunk_inputs(documents), instruction=instruction)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # NOTE: the chunks' sum, with invalid calls kept whole (their parse error too, which chunk
        # aggregation would drop).
        invalid: list[InvalidToolCall] = []
        chunks = (self._chunk(event, run_manager, invalid)
                  for event in self._answer(messages, stop, run_manager, kwargs))
        result = generate_from_stream(chunks)
        message = result.generations[0].message
        if invalid and isinstance(message, AIMessage):
            ids = {call.id for call in invalid}
            message.tool_calls = [call for call in message.tool_calls if call["id"] not in ids]
            message.invalid_tool_calls = [langchain_invalid_call(call) for call in invalid]
        return result

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # NOTE: async (`ainvoke`, `astream`) is LangChain's default: this generator runs in an
        # executor thread, so the blocking engine never stalls the event loop.
        for event in self._answer(messages, stop, run_manager, kwargs):
            yield self._chunk(event, run_manager, [])

    def _answer(self, messages: list[BaseMessage], stop: list[str] | None,
                run_manager: CallbackManagerForLLMRun | None, kwargs: dict[str, Any]) -> Iterator[_Event]:
        """The request's text pieces, its tool calls as each completes, then its Generation."""
        documents = kwargs.pop("documents", None)
        scope = self.call_scope(kwargs)
        options = self.request_options(kwargs, stop=stop)
        session = self.reuse_session()
        sources = session.sources(options, scope)
        # NOTE: LangChain's stream/astream (and streaming invoke) pass no run manager; None then finds
        # the trace through the step calling this model (`observe.retrieved_texts`).
        run_id = run_manager.run_id if run_manager is not None else None
        prompt = self.fusion_prompt(messages, documents, run_id, sources, options.tools)
        pieces = session.run(prompt, options, sources)
        if options.tools is None:
            yield from pieces
            return
        calls = 0
        for event in split_calls(pieces, self.fusion_engine().tool_format, options.tools):
            if isinstance(event, ToolCall | InvalidToolCall):
                yield _IndexedCall(event, calls)
                calls += 1
            else:
                yield event

    def _chunk(self, event: _Event, run_manager: CallbackManagerForLLMRun | None,
               invalid: list[InvalidToolCall]) -> ChatGenerationChunk:
        if isinstance(event, Generation):
            return self._final_chunk(event)
        if isinstance(event, _IndexedCall):
            if isinstance(event.call, InvalidToolCall):
                invalid.append(event.call)
            message = AIMessageChunk(content="", tool_call_chunks=[call_chunk(event.call, event.index)])
            return ChatGenerationChunk(message=message)
        chunk = ChatGenerationChunk(message=AIMessageChunk(content=event))
        if run_manager is not None:
            run_manager.on_llm_new_token(event, chunk=chunk)
        return chunk

    def _final_chunk(self, generation: Generation) -> ChatGenerationChunk:
        """The last, empty chunk: it alone carries usage and response metadata (chunks are summed)."""
        usage = UsageMetadata(
            input_tokens=generation.prompt_tokens,
            output_tokens=len(generation.token_ids),
            total_tokens=generation.prompt_tokens + len(generation.token_ids),
            # NOTE: a cache hit is any prompt token not computed here: kept chunk caches and the prefix cache
            input_token_details={"cache_read": generation.reused_tokens + generation.prefix_cached_tokens},
        )
        metadata = generation_metadata(generation, self.model_name)
        if generation.logprobs is not None:  # NOTE: where ChatOpenAI puts them (`logprobs=True`)
            metadata["logprobs"] = chat_logprobs(generation.logprobs, self.fusion_engine().tokenizer)
        message = AIMessageChunk(
            content="",
            chunk_position="last",  # NOTE: also what turns the summed tool_call_chunks into tool_calls
            usage_metadata=usage,
            response_metadata=metadata,
        )
        return ChatGenerationChunk(message=message)
