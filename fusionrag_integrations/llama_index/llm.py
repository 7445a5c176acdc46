"""FusionRAGLLM: a LlamaIndex `CustomLLM` backed by a `FusionEngine`.

Prompts arrive flattened (one string, or chat messages). Chunks marked with
`fusionrag_core.prompt.mark_chunk` inside them are recognised by the core
(`FusionEngine.prompt_from_messages`) and their stored caches reused; unmarked text is prefilled.
`FusionChunkMarker` (marking.py) marks retrieved nodes so the standard response synthesizer
gets reuse; `FusionRAGQueryEngine` builds the canonical prompt directly instead.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from fusionrag_core.engine import FusionEngine, Generation, GenerationStream
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.prompt import FusionPrompt, clean_output
from fusionrag_core.store import KVStore, open_store
from fusionrag_integrations.llama_index.aio import call_in_thread, iterate_in_thread
from fusionrag_integrations.request import check_call_options, generation_stats, request_options, text_pieces

# Per-call keyword arguments `complete`/`chat` accept (they override the LLM's fields for one call).
GENERATION_KWARGS = frozenset({"max_new_tokens", "temperature", "top_p", "seed", "stop", "selector", "ratio"})


def generation_metadata(generation: Generation) -> dict[str, Any]:
    """What responses report about a generation: `Generation.stats()` plus the per-chunk cache misses
    (`fusionrag_integrations.request.generation_stats`, shared with the LangChain models)."""
    return generation_stats(generation)


class FusionRAGLLM(CustomLLM):
    """A LlamaIndex LLM that reuses chunk KV caches (FusionRAG) for chunks marked in its prompts.

    The model loads lazily on first use (construction is cheap), or pass a built `engine=`.
    Responses carry `generation_metadata` (TTFT, reused/recomputed tokens, ...) in
    `additional_kwargs` and `raw`; when streaming, the last response (empty `delta`) carries it.

    Example:
        >>> llm = FusionRAGLLM(store="./fusionrag-data/kv")
        >>> llm.complete("Context: " + mark_chunk(chunk_id, text) + " Question: ...?").text
    """

    model: str | None = Field(default=None, description="Model to load (None: the packaged SmolLM2-135M-Instruct).")
    device: str | None = Field(default=None, description="Torch device (None: CUDA if available, else CPU).")
    dtype: str | None = Field(default=None, description="Torch dtype name (None: bf16 on GPU, fp32 on CPU).")
    store: str | None = Field(
        default=None, description="KV store directory or redis:// URL where chunk caches are looked up by chunk id."
    )
    max_new_tokens: int = Field(default=64, gt=0, description="Generation budget per call (LLMMetadata.num_output).")
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, description="Sampling seed (only matters when temperature > 0).")
    stop: list[str] = Field(default_factory=list, description="Stop strings (excluded from the text).")
    selector: str | None = Field(default=None, description="Recompute selector (None: the engine's default).")
    ratio: float | None = Field(default=None, description="Recompute ratio (None: the engine's default).")

    _engine: FusionEngine | None = PrivateAttr(default=None)
    _store: KVStore | None = PrivateAttr(default=None)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, *, engine: FusionEngine | None = None, **data: Any) -> None:
        """Build the LLM; with `engine=`, the model/device/dtype fields must stay unset (`store` may be set).

        Raises:
            InvalidRequestError: `engine=` given together with loading options.
        """
        loading = sorted(k for k in ("model", "device", "dtype") if data.get(k) is not None)
        if engine is not None and loading:
            raise InvalidRequestError(
                f"FusionRAGLLM got engine= and {', '.join(loading)}=; those options load a model: drop them to use "
                "the given engine, or drop engine= to load lazily"
            )
        super().__init__(**data)
        self._engine = engine

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
        """Where chunk caches are looked up: the store at `store` (opened on first use); None: nowhere.

        NOTE: passed to the engine per request, so one engine can serve several LLMs and stores.
        """
        with self._lock:
            if self._store is None and self.store is not None:
                self._store = open_store(self.store)
        return self._store

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
        )

    # ---- the engine call shared by every entry point --------------------------------------------
    def stream_prompt(
        self, prompt: FusionPrompt, *, store: KVStore | None = None, **overrides: Any
    ) -> GenerationStream:
        """Run a FusionPrompt with this LLM's sampling and selection settings.

        Args:
            prompt: from `engine.prompt(...)` or `engine.prompt_from_messages(...)`.
            store: where to look chunk caches up for this call (default `kv_store`).
            **overrides: any of `GENERATION_KWARGS`, for this call only.

        Raises:
            InvalidRequestError: an unknown keyword argument.
        """
        check_call_options(overrides, GENERATION_KWARGS, owner="FusionRAGLLM")
        options = request_options({**{k: getattr(self, k) for k in GENERATION_KWARGS}, **overrides})
        return options.stream(self.engine, prompt, store=store if store is not None else self.kv_store)

    # ---- completion ------------------------------------------------------------------------------
    def _completion_prompt(self, prompt: str, formatted: bool) -> FusionPrompt:
        messages: list[dict[str, str]] = []
        if not formatted:
            # NOTE: `formatted=True` means LlamaIndex already applied completion_to_prompt/system_prompt.
            assert self.completion_to_prompt is not None  # NOTE: LLM's validator always sets one.
            prompt = self.completion_to_prompt(prompt)
            if self.system_prompt:
                messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": prompt})
        return self.engine.prompt_from_messages(messages)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Answer a flattened prompt (sent as one user turn through the chat template)."""
        return self._complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Like `complete`, streaming: cumulative `text`, new `delta`; the last response carries the stats."""
        return _completion_responses(self.stream_prompt(self._completion_prompt(prompt, formatted), **kwargs))

    # NOTE: the async entry points run the engine in a worker thread, so the event loop keeps
    # running during a generation; each is decorated once (CustomLLM's fallbacks call the decorated
    # sync methods from decorated async ones: every event fired twice).
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """`complete`, off the event loop."""
        return await call_in_thread(self._complete, prompt, formatted, kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        """`stream_complete`, off the event loop: each piece reaches the loop as soon as it is decoded."""
        return iterate_in_thread(
            lambda: _completion_responses(self.stream_prompt(self._completion_prompt(prompt, formatted), **kwargs))
        )

    def _complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponse:
        generation = self.stream_prompt(self._completion_prompt(prompt, formatted), **kwargs).collect()
        meta = generation_metadata(generation)
        return CompletionResponse(text=clean_output(generation.text), additional_kwargs=meta, raw=meta)

    # ---- chat ------------------------------------------------------------------------------------
    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> FusionPrompt:
        return self.engine.prompt_from_messages([_message_dict(m) for m in messages])

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer a conversation rendered by the model's chat template; marked chunks are reused."""
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Like `chat`, streaming: cumulative message content, new `delta`; the last response carries the stats."""
        return _chat_responses(self.stream_prompt(self._chat_prompt(messages), **kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """`chat`, off the event loop."""
        return await call_in_thread(self._chat, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        """`stream_chat`, off the event loop: each piece reaches the loop as soon as it is decoded."""
        return iterate_in_thread(lambda: _chat_responses(self.stream_prompt(self._chat_prompt(messages), **kwargs)))

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        generation = self.stream_prompt(self._chat_prompt(messages), **kwargs).collect()
        meta = generation_metadata(generation)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=clean_output(generation.text)),
                            additional_kwargs=meta, raw=meta)


def _message_dict(message: ChatMessage) -> dict[str, str]:
    """A ChatMessage as the `{"role", "content"}` dict chat templates take.

    Raises:
        InvalidRequestError: the message holds non-text blocks (images, audio, tool calls...).
    """
    others = sorted({type(b).__name__ for b in message.blocks if not isinstance(b, TextBlock)})
    if others:
        raise InvalidRequestError(
            f"a {message.role.value} message holds {', '.join(others)} blocks; FusionRAGLLM is text-only: "
            "send text content"
        )
    content = message.content or ""
    return {"role": message.role.value, "content": content}


def _completion_responses(stream: GenerationStream) -> CompletionResponseGen:
    for text, delta, meta in _accumulate(stream):
        yield CompletionResponse(text=text, delta=delta, additional_kwargs=meta, raw=meta or None)


def _chat_responses(stream: GenerationStream) -> ChatResponseGen:
    for text, delta, meta in _accumulate(stream):
        yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta,
                           additional_kwargs=meta, raw=meta or None)


def _accumulate(stream: GenerationStream) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """`(text so far, delta, metadata)` per piece, then a final `(text, "", stats)` once the stream ends."""
    text = ""
    for piece in text_pieces(stream):
        if isinstance(piece, Generation):
            yield text, "", generation_metadata(piece)
        else:
            text += piece
            yield text, piece, {}


__all__ = ["GENERATION_KWARGS", "FusionRAGLLM", "clean_output", "generation_metadata"]
