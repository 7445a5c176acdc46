"""FusionRAGLLM: a LlamaIndex `FunctionCallingLLM` backed by a `FusionEngine`.

Prompts arrive flattened (one string, or chat messages). Stored chunks whose text occurs in them
(ingested with `FusionKVTransform`, or learned) are found by content (`fusionrag_core.recognise.content_index`),
as are `mark_chunk` marks, and their caches reused; other text is prefilled. Nodes the query
retrieved (seen through LlamaIndex instrumentation, observe.py) that had no cache are learned as
caches. So the standard `index.as_query_engine(llm=FusionRAGLLM(...))` gets reuse with its default
synthesizer and templates; `FusionRAGQueryEngine` builds the canonical prompt directly instead.

It calls tools (`chat_with_tools`, `predict_and_call`, `FunctionAgent`): the tools are shown with
the messages, the answer decodes under the tool grammar and its calls come back as LlamaIndex's own
integrations return them (`tools.py`). A tool's result is a message like any other: the stored
chunks it quotes are reused, and the nodes a retriever inside the tool returned are learned there.

This module translates LlamaIndex's prompts, options and responses; the reuse itself (where caches
come from, learning, the engine call, the no-reuse warning) is `fusionrag_integrations.session`'s,
the same as for the LangChain models.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    LogProb,
)
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
from llama_index.core.types import PydanticProgramMode

from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.paths import DEFAULT_COLLECTION, kv_dir
from fusionrag_core.query.tools import InvalidToolCall, ToolCall, split_calls
from fusionrag_core.recognise.marks import clean_output
from fusionrag_core.runtime.loading import check_device
from fusionrag_core.store import DiskKVStore, KVStore, open_store
from fusionrag_integrations.arguments import normalize_arguments
from fusionrag_integrations.fields import OptionFields, ReuseFields
from fusionrag_integrations.llama_index.aio import call_in_thread, iterate_in_thread
from fusionrag_integrations.llama_index.calls import record, recording
from fusionrag_integrations.llama_index.observe import record_call, retrieved_texts
from fusionrag_integrations.llama_index.tools import Reply, chat_kwargs, message_dict, quoted, tool_selections
from fusionrag_integrations.logprobs import chat_logprob_content
from fusionrag_integrations.request import RESPONSE_FORMAT, TOOL_OPTIONS, generation_stats
from fusionrag_integrations.response_format import json_schema_format
from fusionrag_integrations.session import ReuseSession

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

Model = TypeVar("Model", bound=BaseModel)
_Piece = str | ToolCall | InvalidToolCall | Generation

# NOTE: set while a structured_predict picks its program: LlamaIndex gives a function-calling LLM a
# FunctionCallingProgram, this one keeps its grammar-constrained text program (no tool prompt).
_TEXT_PROGRAM: ContextVar[bool] = ContextVar("fusionrag_text_program", default=False)


class FusionRAGLLM(OptionFields, ReuseFields, FunctionCallingLLM):
    """A LlamaIndex LLM that reuses chunk KV caches (FusionRAG) for the chunks its prompts hold: found by
    mark or by content, or learned from an earlier prompt that held them.

    The model loads lazily on first use (construction is cheap), or pass a built `engine=`.
    Constructor names follow `HuggingFaceLLM` (`model_name`, `device_map`, `generate_kwargs`, ...;
    see `__init__`); sampling and selection (`temperature`, `top_p`, `top_k`, `min_p`,
    `repetition_penalty`, `seed`, `stop`, `selector`, `ratio`, `variant`, `full_attention`) are
    the fields of `fusionrag_integrations.fields.OptionFields`, per LLM or per call.
    `structured_predict` / `as_structured_llm(cls)` decode under the JSON-schema grammar of the
    Pydantic class. Responses carry `request.generation_stats` (TTFT, reused/recomputed tokens,
    ...) in `additional_kwargs` and `raw`; when streaming, the last response (empty `delta`)
    carries it.

    Tools: `chat_with_tools(tools, ..., tool_required=...)` (and its async and streaming forms),
    `predict_and_call`, `FunctionAgent`; or `chat(messages, tools=[OpenAI tool dicts],
    tool_choice=..., parallel_tool_calls=...)`. The answer's calls are `ToolCallBlock`s of the
    response message and OpenAI-shaped dicts in its `additional_kwargs["tool_calls"]` (calls that
    did not parse: `additional_kwargs["invalid_tool_calls"]`); `get_tool_calls_from_response`
    reads them.

    Example:
        >>> llm = FusionRAGLLM(store="./fusionrag-data/kv")
        >>> llm.complete("Context: " + mark_chunk(chunk_id, text) + " Question: ...?").text
    """

    model: str | None = Field(default=None, description="Model to load (None: the packaged SmolLM2-135M-Instruct).")
    device: str | None = Field(default=None, description="Torch device (None: CUDA if available, else CPU).")
    dtype: str | None = Field(default=None, description="Torch dtype name, or a torch.dtype (None: bf16 on GPU, "
                              "fp32 on CPU); alias torch_dtype.")
    store: str | None = Field(
        default=None, description="KV store directory or redis:// URL where chunk caches are looked up by chunk id."
    )
    collection_name: str = Field(
        default=DEFAULT_COLLECTION, description="Collection whose disk KV store under data_dir is read when no store "
        "is given and data_dir or collection_name is (FusionIndex.open(data_dir, collection_name=...))."
    )
    max_new_tokens: int = Field(default=64, description="Generation budget per call (LLMMetadata.num_output).")

    _engine: FusionEngine | None = PrivateAttr(default=None)
    _store: KVStore | None = PrivateAttr(default=None)
    _session: ReuseSession | None = PrivateAttr(default=None)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, *, engine: FusionEngine | None = None, kv_store: KVStore | None = None, **data: Any) -> None:
        """Build the LLM; with `engine=`, the model/device/dtype fields must stay unset (`store` may be set).

        Hugging Face names are accepted where they mean a field, as `HuggingFaceLLM` users write
        them: `model_name` / `model_id` (model), `device_map` (device), `torch_dtype` (dtype, also a
        `torch.dtype`), `model_kwargs` (`torch_dtype`, `device_map`), `generate_kwargs` /
        `pipeline_kwargs` (max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty,
        do_sample, seed, stop_strings). Any other unknown argument is an error naming the closest
        valid one; a CUDA device on a machine without CUDA fails here, before any weight is read.

        `kv_store`: an open KV store to read caches from (instead of opening `store`). Without
        either, the disk store of `collection_name` under `data_dir` is read when one of those two
        is given; else none.

        Raises:
            InvalidRequestError: an unknown argument or a value the engine refuses, or `engine=`
                given together with loading options.
            CacheMismatchError: with `engine=`, the store or learned caches hold another model's
                caches (a lazily loaded model refuses them at its first request).
        """
        data = normalize_arguments(data, type(self).model_fields, type(self).__name__, type(self).FIELD_NAMES)
        if isinstance(data.get("dtype"), torch.dtype):
            data["dtype"] = str(data["dtype"]).removeprefix("torch.")
        loading = sorted(k for k in ("model", "device", "dtype") if data.get(k) is not None)
        if engine is not None and loading:
            raise InvalidRequestError(
                f"FusionRAGLLM got engine= and {', '.join(loading)}=; those options load a model: drop them to use "
                "the given engine, or drop engine= to load lazily"
            )
        if kv_store is not None and data.get("store") is not None:
            raise InvalidRequestError("FusionRAGLLM got kv_store= and store=; pass one")
        check_device(data.get("device"))
        super().__init__(**data)
        self._engine = engine
        self._store = kv_store
        # NOTE: built once here so a bad value fails now, with the core's own message.
        self.request_options({})
        self.reuse_config()
        if engine is not None:
            self.reuse_session()  # NOTE: loads nothing; another model's store is refused now, not per request

    @classmethod
    def class_name(cls) -> str:
        return "fusionrag_llm"

    @property
    def engine(self) -> FusionEngine:
        """The engine, loaded on first access (thread-safe)."""
        with self._lock:
            if self._engine is None:
                self._engine = FusionEngine.from_pretrained(self.model, device=self.device, dtype=self.dtype)
            return self._engine

    @property
    def kv_store(self) -> KVStore | None:
        """Where chunk caches are looked up: the store at `store`, else the disk store of
        `collection_name` under `data_dir` if either is given (opened on first use); None: nowhere.

        NOTE: passed to the engine per request, so one engine can serve several LLMs and stores.
        """
        with self._lock:
            if self._store is None and self.store is not None:
                self._store = open_store(self.store)
            elif self._store is None and self.model_fields_set & {"data_dir", "collection_name"}:
                self._store = DiskKVStore(kv_dir(self.data_dir, self.collection_name))
        return self._store

    def reuse_session(self) -> ReuseSession:
        """This LLM's engine, KV store and learned caches, made on first use (loading the model)."""
        engine, store = self.engine, self.kv_store  # NOTE: before taking the lock: both take it
        with self._lock:
            if self._session is None:
                self._session = ReuseSession(engine, store, self.reuse_config())
            return self._session

    def _logprobs(self, generation: Generation) -> list[list[LogProb]] | None:
        """Each generated token's most likely alternatives (or itself, when none were asked for), as
        LlamaIndex's OpenAI LLM reports `logprobs`; None when `logprobs` was not asked for."""
        if generation.logprobs is None:
            return None
        content = chat_logprob_content(generation.logprobs, self.reuse_session().engine.tokenizer)
        return [[LogProb(token=t["token"], logprob=t["logprob"], bytes=t["bytes"])
                 for t in (entry["top_logprobs"] or [entry])] for entry in content]

    def with_store(self, store: KVStore) -> FusionRAGLLM:
        """A copy of this LLM (same settings and engine) that reads chunk caches from `store`."""
        copy = self.model_copy()
        copy._store, copy._session, copy._lock = store, None, threading.Lock()
        return copy

    @property
    def metadata(self) -> LLMMetadata:
        """Context window and model name come from the engine (this loads the model)."""
        engine = self.engine
        return LLMMetadata(
            context_window=engine.context_window,
            num_output=self.max_new_tokens,
            model_name=engine.name,
            # NOTE: a chat model makes `predict` send messages, rendered by the model's own chat template.
            is_chat_model=engine.layout.has_template,
            is_function_calling_model=not _TEXT_PROGRAM.get(),
        )

    def _get_prompt(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        return super()._get_prompt(prompt, **_as_text(prompt_args))

    def _get_messages(self, prompt: BasePromptTemplate, **prompt_args: Any) -> list[ChatMessage]:
        return super()._get_messages(prompt, **_as_text(prompt_args))

    # ---- the engine call shared by every entry point --------------------------------------------
    # NOTE: every entry point reads the query's retrieved nodes (`retrieved_texts`) when it is called,
    # inside the query's spans: a stream's generator runs as the response is read, after they closed.
    def _answer(self, messages: Sequence[dict[str, Any]], overrides: dict[str, Any],
                retrieved: Sequence[str]) -> Iterator[_Piece]:
        """Text pieces, then the Generation; the `retrieved` node texts are learnable. With tools
        (`overrides`' `tools`, `tool_choice`, `parallel_tool_calls`), each call is parsed out of
        the text as it completes (a ToolCall, or an InvalidToolCall: never an exception)."""
        scope = self.call_scope(overrides)
        options = self.request_options(overrides)
        pieces = self.reuse_session().answer(messages, options, retrieved, scope)
        if options.tools is None:
            return pieces
        return split_calls(pieces, self.engine.tool_format, options.tools)

    # ---- structured output -------------------------------------------------------------------------
    # NOTE: LlamaIndex's structured_predict / as_structured_llm run an LLMTextCompletionProgram here
    # (not the FunctionCallingProgram it picks for function-calling LLMs: `_TEXT_PROGRAM`; a
    # structured answer needs no tool prompt): schema instructions in the prompt, then a Pydantic
    # parse of the answer. Here the program's chat call also carries the schema's response_format, so
    # decoding runs under its grammar (llguidance) and the answer always parses; the context's
    # chunk caches are reused as without it.
    def structured_predict(self, output_cls: type[Model], prompt: PromptTemplate,
                           llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Model:
        """An `output_cls` instance, decoded under the grammar of its JSON schema.

        Raises:
            InvalidRequestError: the answer reached `max_new_tokens` before its JSON closed, or
                `pydantic_program_mode` names a program this LLM cannot run.
        """
        with _structured_call(self) as calls:
            return _parsed(calls, lambda: super(FusionRAGLLM, self).structured_predict(
                output_cls, prompt, _constrained(output_cls, llm_kwargs), **prompt_args))

    async def astructured_predict(self, output_cls: type[Model], prompt: PromptTemplate,
                                  llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Model:
        """`structured_predict`, off the event loop."""
        with _structured_call(self) as calls:
            try:
                return await super().astructured_predict(output_cls, prompt, _constrained(output_cls, llm_kwargs),
                                                         **prompt_args)
            except Exception as exc:
                _raise_if_truncated(calls, exc)
                raise

    def _structured_stream_call(self, output_cls: type[Model], prompt: PromptTemplate,
                                llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Any:
        _check_program_mode(self)
        with _text_program():
            return super()._structured_stream_call(output_cls, prompt, _constrained(output_cls, llm_kwargs),
                                                   **prompt_args)

    async def _structured_astream_call(self, output_cls: type[Model], prompt: PromptTemplate,
                                       llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Any:
        _check_program_mode(self)
        with _text_program():
            return await super()._structured_astream_call(output_cls, prompt,
                                                          _constrained(output_cls, llm_kwargs), **prompt_args)

    # ---- completion ------------------------------------------------------------------------------
    def _completion_messages(self, prompt: str, formatted: bool) -> list[dict[str, str]]:
        messages: list[dict[str, str]] = []
        if not formatted:
            # NOTE: `formatted=True` means LlamaIndex already applied completion_to_prompt/system_prompt.
            assert self.completion_to_prompt is not None  # NOTE: LLM's validator always sets one.
            prompt = self.completion_to_prompt(prompt)
            if self.system_prompt:
                messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": prompt})
        return messages

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Answer a flattened prompt (sent as one user turn through the chat template)."""
        return self._complete(prompt, formatted, kwargs, retrieved_texts())

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Like `complete`, streaming: cumulative `text`, new `delta`; the last response carries the stats."""
        return self._stream_completion(prompt, formatted, kwargs, retrieved_texts())

    # NOTE: the async entry points run the engine in a worker thread, so the event loop keeps
    # running during a generation; each is decorated once (CustomLLM's fallbacks call the decorated
    # sync methods from decorated async ones: every event fired twice).
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """`complete`, off the event loop."""
        return await call_in_thread(self._complete, prompt, formatted, kwargs, retrieved_texts())

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        """`stream_complete`, off the event loop: each piece reaches the loop as soon as it is decoded."""
        retrieved = retrieved_texts()
        return iterate_in_thread(lambda: self._stream_completion(prompt, formatted, kwargs, retrieved))

    def _complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any],
                  retrieved: Sequence[str]) -> CompletionResponse:
        _refuse_tools(kwargs)
        generation = _last(self._answer(self._completion_messages(prompt, formatted), kwargs, retrieved))
        meta = _finished(generation)
        return CompletionResponse(text=clean_output(generation.text), additional_kwargs=meta, raw=meta,
                                  logprobs=self._logprobs(generation))

    def _stream_completion(self, prompt: str, formatted: bool, kwargs: dict[str, Any],
                           retrieved: Sequence[str]) -> CompletionResponseGen:
        _refuse_tools(kwargs)
        messages = self._completion_messages(prompt, formatted)
        for text, delta, meta in _accumulate(self._answer(messages, kwargs, retrieved)):
            yield CompletionResponse(text=text, delta=delta, additional_kwargs=meta, raw=meta or None)

    # ---- chat ------------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer a conversation rendered by the model's chat template; marked chunks are reused."""
        return self._chat(messages, kwargs, retrieved_texts())

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Like `chat`, streaming: cumulative message content, new `delta`; the last response carries the stats."""
        return self._stream_chat(messages, kwargs, retrieved_texts())

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """`chat`, off the event loop."""
        return await call_in_thread(self._chat, messages, kwargs, retrieved_texts())

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        """`stream_chat`, off the event loop: each piece reaches the loop as soon as it is decoded."""
        retrieved = retrieved_texts()
        return iterate_in_thread(lambda: self._stream_chat(messages, kwargs, retrieved))

    def _chat_answer(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any],
                     retrieved: Sequence[str]) -> Iterator[_Piece]:
        """`_answer` on the messages as OpenAI dicts; in a tool loop (tools bound, or tool results
        in the history) the retrieved texts are those the messages quote (`tools.quoted`)."""
        dicts = [message_dict(m) for m in messages]
        if kwargs.get("tools") or any(d["role"] == "tool" for d in dicts):
            retrieved = quoted(retrieved, dicts)
        return self._answer(dicts, kwargs, retrieved)

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], retrieved: Sequence[str]) -> ChatResponse:
        reply, generation = Reply(), None
        for piece in self._chat_answer(messages, kwargs, retrieved):
            if isinstance(piece, Generation):
                generation = piece
            else:
                reply.add(piece)
        assert generation is not None  # NOTE: ReuseSession.run ends with the Generation
        meta = _finished(generation)
        return ChatResponse(message=reply.message(), additional_kwargs=meta, raw=meta,
                            logprobs=self._logprobs(generation))

    def _stream_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any],
                     retrieved: Sequence[str]) -> ChatResponseGen:
        """Cumulative messages (text and the calls completed so far); the last one carries the stats."""
        reply = Reply()
        for piece in self._chat_answer(messages, kwargs, retrieved):
            if isinstance(piece, Generation):
                meta = _finished(piece)
                yield ChatResponse(message=reply.message(), delta="", additional_kwargs=meta, raw=meta,
                                   logprobs=self._logprobs(piece))
            else:
                delta = reply.add(piece)
                yield ChatResponse(message=reply.message(), delta=delta, additional_kwargs={}, raw=None)

    # ---- tools -----------------------------------------------------------------------------------
    def _prepare_chat_with_tools(self, tools: Sequence[BaseTool], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 tool_choice: str | dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        """`chat` keyword arguments: `messages` (history, then `user_msg`), `tools` (OpenAI dicts),
        `tool_choice` ("required" if `tool_required`, else "auto", unless `tool_choice` names one)
        and `parallel_tool_calls`, with the other keyword arguments (per-call options)."""
        return chat_kwargs(tools, user_msg, chat_history, allow_parallel_tool_calls=allow_parallel_tool_calls,
                           tool_required=tool_required, tool_choice=tool_choice, kwargs=kwargs)

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        """The calls in `response`'s message, as ToolSelections.

        Raises:
            InvalidRequestError: (a ValueError) no call, and `error_on_no_tool_call`; it names
                the calls that did not parse, if any.
        """
        return tool_selections(response, error_on_no_tool_call)


def _constrained(output_cls: type[BaseModel], llm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The program's LLM kwargs plus the response_format of `output_cls`'s JSON schema."""
    kwargs = dict(llm_kwargs or {})
    if RESPONSE_FORMAT in kwargs:
        raise InvalidRequestError(
            f"structured_predict got llm_kwargs[{RESPONSE_FORMAT!r}]; the output class decides the format: drop it"
        )
    kwargs[RESPONSE_FORMAT] = json_schema_format(output_cls.model_json_schema())
    return kwargs


def _check_program_mode(llm: FusionRAGLLM) -> None:
    if llm.pydantic_program_mode not in (PydanticProgramMode.DEFAULT, PydanticProgramMode.LLM):
        raise InvalidRequestError(
            f"FusionRAGLLM runs structured output as grammar-constrained text (pydantic_program_mode DEFAULT or "
            f"LLM), not {llm.pydantic_program_mode.value!r}: leave pydantic_program_mode at its default"
        )


@contextmanager
def _structured_call(llm: FusionRAGLLM) -> Iterator[list[dict[str, Any]]]:
    """Check the program mode; collect the statistics of the LLM calls made inside, which run
    the text program."""
    _check_program_mode(llm)
    calls: list[dict[str, Any]] = []
    with recording(calls), _text_program():
        yield calls


@contextmanager
def _text_program() -> Iterator[None]:
    """Within this block, LlamaIndex picks the text-completion program for this LLM (see `_TEXT_PROGRAM`)."""
    token = _TEXT_PROGRAM.set(True)
    try:
        yield
    finally:
        _TEXT_PROGRAM.reset(token)


def _parsed(calls: list[dict[str, Any]], predict: Callable[[], Model]) -> Model:
    try:
        return predict()
    except Exception as exc:
        _raise_if_truncated(calls, exc)
        raise


def _raise_if_truncated(calls: list[dict[str, Any]], exc: Exception) -> None:
    """Say so when a parse failed because the answer hit max_new_tokens (the grammar admits only
    valid JSON, so that is the one way it fails to parse).

    Raises:
        InvalidRequestError: the last call ended at max_new_tokens.
    """
    if calls and calls[-1].get("finish_reason") == "length":
        raise InvalidRequestError(
            f"the structured answer reached max_new_tokens ({calls[-1].get('completion_tokens')} tokens) before its "
            "JSON was complete; raise max_new_tokens (FusionRAGLLM(max_new_tokens=...) or llm_kwargs)"
        ) from exc


def _refuse_tools(kwargs: dict[str, Any]) -> None:
    """Completions have no place for calls.

    Raises:
        InvalidRequestError: tool options were given.
    """
    given = sorted(set(kwargs) & set(TOOL_OPTIONS))
    if given:
        raise InvalidRequestError(f"complete() got {', '.join(given)}; tools are chat options: use chat(messages, "
                                  "tools=...) or chat_with_tools(tools, ...)")


def _as_text(prompt_args: dict[str, Any]) -> dict[str, Any]:
    """Template arguments with lists of strings joined as text.

    NOTE: LlamaIndex's simple_summarize synthesizer passes `context_str` as a one-element list, which
    a template renders as its Python repr (escaped newlines and quotes): the model would read
    escaped text, and no stored chunk could be found in it.
    """
    return {k: "\n\n".join(v) if isinstance(v, list | tuple) and all(isinstance(x, str) for x in v) else v
            for k, v in prompt_args.items()}


def _finished(generation: Generation) -> dict[str, Any]:
    """A call's statistics, recorded for the response of the query it belongs to."""
    meta = generation_stats(generation)
    record_call(meta)
    record(meta)  # NOTE: a streamed query's statistics (its synthesis span has ended by now)
    return meta


def _last(pieces: Iterator[_Piece]) -> Generation:
    """The finished Generation at the end of `ReuseSession.run`'s pieces."""
    for piece in pieces:
        if isinstance(piece, Generation):
            return piece
    raise AssertionError("ReuseSession.run ends with the Generation")


def _accumulate(pieces: Iterator[_Piece]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """`(text so far, delta, metadata)` per text piece, then a final `(text, "", stats)` once generation
    ends (a completion's pieces: it binds no tools, so holds no calls)."""
    text = ""
    for piece in pieces:
        if isinstance(piece, Generation):
            yield text, "", _finished(piece)
        elif isinstance(piece, str):
            text += piece
            yield text, piece, {}


__all__ = ["FusionRAGLLM"]
