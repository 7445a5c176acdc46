"""How a LangChain model binds to a FusionEngine: the fields ChatFusionRAG and FusionRAGLLM share.

A model is described by cheap fields (model id, data directory, sampling and selection knobs) and
resolved to a `FusionEngine` on first use, so constructing one never loads weights. Its KV store is
passed to the engine with each request (as `FusionIndex.answer` does): that is where the engine
looks chunk caches up by chunk id, and why one engine can serve models reading different stores.

The reuse itself (where caches come from, learning, the engine call, the no-reuse warning) is the
model's `fusionrag_integrations.session.ReuseSession`, the same as for the LlamaIndex LLM; the
models translate LangChain's messages, options and callbacks.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar
from uuid import UUID

import torch
from langchain_core.language_models import LangSmithParams
from pydantic import ConfigDict, Field, PrivateAttr, model_validator
from typing_extensions import Self

from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.index import FusionIndex
from fusionrag_core.paths import DEFAULT_COLLECTION, kv_dir
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.tools import ToolRequest
from fusionrag_core.reuse.sources import ReuseSources
from fusionrag_core.runtime.loading import DEFAULT_MODEL, check_device
from fusionrag_core.store import DiskKVStore, KVStore
from fusionrag_integrations.arguments import normalize_arguments
from fusionrag_integrations.fields import OptionFields, ReuseFields
from fusionrag_integrations.langchain.observe import retrieved_texts
from fusionrag_integrations.request import generation_stats
from fusionrag_integrations.session import ReuseSession

PROVIDER = "fusionrag"


class FusionRAGModelFields(OptionFields, ReuseFields):
    """Fields and engine binding shared by `ChatFusionRAG` and `FusionRAGLLM`.

    Where engine and caches come from, in order: `index` (its engine and KV store); `engine` (an
    already loaded FusionEngine) with `store`, else the disk store that `FusionIndex.open(data_dir,
    collection_name=...)` writes when `data_dir` or `collection_name` is given (neither: no chunk
    cache is reused, every chunk is prefilled and reported in `cache_miss_ids`); else `model` is
    loaded on first use and reads `store`, or that disk store. A store or learned caches of another
    model are refused with `CacheMismatchError` when the session is made: at construction with
    `engine` or `index`, at the first request with `model`.
    Sampling and selection fields (`OptionFields`) are the defaults of every call; learning
    fields (`ReuseFields`) configure the model's `ReuseSession`. Documents a LangChain retriever
    returned in this model's run (same chain) are the ones it may learn.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    FIELD_NAMES: ClassVar[Mapping[str, str]] = {"max_new_tokens": "max_tokens"}

    model: str | None = None
    """Model to load on first use: a packaged alias ("smollm2-135m", "gemma3-270m"), a .gguf file, a
    local directory or an HF id. None: the packaged default (SmolLM2-135M-Instruct)."""
    engine: FusionEngine | None = Field(default=None, exclude=True, repr=False)
    """An already loaded engine (shared with an index, a benchmark or other models)."""
    index: FusionIndex | None = Field(default=None, exclude=True, repr=False)
    """A FusionIndex: its engine answers and its KV store supplies the caches."""
    store: KVStore | None = Field(default=None, exclude=True, repr=False)
    """KV store of chunk caches (e.g. `fusionrag_core.store.open_store(...)`)."""
    collection_name: str = DEFAULT_COLLECTION
    """Collection whose disk KV store under `data_dir` is read when neither `index` nor `store` names
    one (`FusionIndex.open(data_dir, collection_name=...)`); with `engine`, only when this or
    `data_dir` is given."""
    device: str | None = None
    """Device to load `model` on (default CUDA if available, else CPU); alias `device_map` (one
    device: "auto", "cpu", "cuda:N"; an int is a pipeline index, -1 = CPU)."""
    dtype: str | torch.dtype | None = None
    """dtype to load `model` in, a name or a `torch.dtype` (default bf16 on GPU, fp32 on CPU);
    alias `torch_dtype`."""
    max_tokens: int = 256
    """Most tokens to generate; alias `max_new_tokens`."""

    _session: ReuseSession | None = PrivateAttr(default=None)
    _load_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @model_validator(mode="before")
    @classmethod
    def _accept_hf_names(cls, data: Any) -> Any:
        # NOTE: HF-ecosystem names (model_id, max_new_tokens, device_map, torch_dtype, model_kwargs,
        # pipeline_kwargs) fold into their fields; any other unknown argument is an error.
        if isinstance(data, Mapping):
            return normalize_arguments(data, cls.model_fields, cls.__name__, cls.FIELD_NAMES)
        return data

    @model_validator(mode="after")
    def _check_sources_and_options(self) -> FusionRAGModelFields:
        sources = [name for name in ("model", "engine", "index") if getattr(self, name) is not None]
        same_engine = self.index is not None and self.engine is self.index.engine
        if len(sources) > 1 and not (sources == ["engine", "index"] and same_engine):
            raise InvalidRequestError(
                f"pass only one of model=, engine= or index= (got {', '.join(sources)}); an index brings its engine"
            )
        if self.index is not None and self.store is not None:
            raise InvalidRequestError("pass either index= or store=: an index brings its own KV store")
        loading = [name for name in ("device", "dtype") if getattr(self, name) is not None]
        if loading and (self.engine is not None or self.index is not None):
            raise InvalidRequestError(
                f"{', '.join(loading)}= only apply when this model loads weights; an engine= or index= is already "
                "loaded: drop them (or pass model= instead)"
            )
        check_device(self.device)  # NOTE: here, so a missing CUDA fails before any weight is read
        # NOTE: built once here so a bad value fails at construction, with the core's own message.
        self.request_options({})
        self.reuse_config()
        if self.engine is not None or self.index is not None:
            self.reuse_session()  # NOTE: loads nothing; another model's store is refused now, not per request
        return self

    @classmethod
    def from_model_id(
        cls,
        model_id: str,
        task: str | None = None,
        *,
        device: int | str | None = None,
        device_map: str | None = None,
        model_kwargs: Mapping[str, Any] | None = None,
        pipeline_kwargs: Mapping[str, Any] | None = None,
        backend: str = "default",
        batch_size: int | None = None,
        **kwargs: Any,
    ) -> Self:
        """Load `model_id` now, like `langchain_huggingface.HuggingFacePipeline.from_model_id`.

        Args:
            model_id: a packaged alias, .gguf file, local directory or HF id.
            task: None or "text-generation" (the only task a FusionRAG model performs).
            device, device_map: one device (pipeline int index, "cpu", "cuda:N", "auto").
            model_kwargs: `torch_dtype`/`dtype`, `device_map`.
            pipeline_kwargs: generate's sampling arguments (max_new_tokens, temperature, top_p,
                top_k, min_p, repetition_penalty, do_sample, stop_strings).
            backend: "default" or "pt" (PyTorch); other backends are refused.
            batch_size: refused: prompts of a batch run one after another through one engine.
            **kwargs: any other field (store=, data_dir=, selector=, ...).

        Raises:
            InvalidRequestError: an argument the engine cannot honour (before loading any weight).
        """
        if task not in (None, "text-generation"):
            raise InvalidRequestError(f"task={task!r} is not supported; FusionRAG models do 'text-generation'")
        if backend not in ("default", "pt"):
            raise InvalidRequestError(f"backend={backend!r} is not supported; FusionRAG runs PyTorch ('default')")
        if batch_size is not None:
            raise InvalidRequestError(
                "batch_size is not supported: a batch's prompts run one after another on one engine; drop it"
            )
        given: dict[str, Any] = {"device": device, "device_map": device_map, "model_kwargs": model_kwargs,
                                 "pipeline_kwargs": pipeline_kwargs}
        given["model_id"] = model_id
        model = cls(**{k: v for k, v in given.items() if v is not None}, **kwargs)
        model.fusion_engine()  # NOTE: loaded now, as from_model_id does
        return model

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` under the model's own tokenizer (no special tokens added).

        `trim_messages(token_counter=model)` and `get_num_tokens` count with this (it loads the
        model on first use); a `custom_get_token_ids` still takes precedence.
        """
        custom = getattr(self, "custom_get_token_ids", None)
        if custom is not None:
            return list(custom(text))
        return [int(t) for t in self.fusion_engine().tokenizer.encode(text, add_special_tokens=False)]

    # ---- engine ----------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        """The model's name as reported to LangChain (tracing, response metadata)."""
        if self.index is not None:
            return self.index.engine.name
        if self.engine is not None:
            return self.engine.name
        return self.model or DEFAULT_MODEL

    def fusion_engine(self) -> FusionEngine:
        """The engine, loaded on first use."""
        return self.reuse_session().engine

    def kv_store(self) -> KVStore | None:
        """The KV store this model passes with each request (None: no chunk cache is reused)."""
        return self.reuse_session().store

    def reuse_session(self) -> ReuseSession:
        """This model's engine, KV store and learned caches, made on first use (loading the model)."""
        if self._session is None:
            # NOTE: a lock, because abatch/ainvoke may reach an unloaded model from several threads.
            with self._load_lock:
                if self._session is None:
                    index_dir = self.index.data_dir if self.index is not None else None
                    self._session = ReuseSession(*self._load(), self.reuse_config(index_dir))
        return self._session

    def _load(self) -> tuple[FusionEngine, KVStore | None]:
        if self.index is not None:
            return self.index.engine, self.index.store
        store = self.store
        # NOTE: the disk store FusionIndex.open(data_dir, collection_name=...) writes; a given engine
        # reads it only when named, so an engine alone touches no directory.
        if store is None and (self.engine is None or self.model_fields_set & {"data_dir", "collection_name"}):
            store = DiskKVStore(kv_dir(self.data_dir, self.collection_name))
        if self.engine is not None:
            return self.engine, store
        return FusionEngine.from_pretrained(self.model, device=self.device, dtype=self.dtype), store

    def reuse_prompt(self, messages: Sequence[Mapping[str, Any]], run_id: UUID | None,
                     sources: ReuseSources | None = None, *, documents: Sequence[str] = (),
                     tools: ToolRequest | None = None) -> FusionPrompt:
        """`messages` as a FusionPrompt: stored chunks found by mark or content; documents a retriever
        returned in the trace of `run_id` (this model's run), and `documents`, become learnable chunks.

        Args:
            messages: OpenAI-shaped dicts (`messages.to_chat_dicts`).
            run_id: this model's LangChain run (None, when LangChain streams without handing the model
                its run: the run of the step calling it, `observe.calling_run_id`).
            sources: the request's sources (default: those of a call with this model's own options).
            documents: more texts known to be documents (e.g. a retrieval tool's artifact).
            tools: the bound tools, shown with the messages.
        """
        session = self.reuse_session()
        if sources is None:
            sources = session.sources(self.request_options({}))
        return session.prompt(messages, sources, [*retrieved_texts(run_id), *documents], tools)

    # ---- LangChain overrides shared by both models ----------------------------------------------
    # NOTE: this mixin comes before BaseChatModel / LLM in their bases, so these override those
    # classes' versions and super() reaches them.
    @property
    def _identifying_params(self) -> dict[str, Any]:
        """What distinguishes this model's answers (LangChain's cache key and tracing)."""
        return {"model_name": self.model_name, **{field: getattr(self, field) for field in self.option_fields()}}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        """LangSmith parameters: the base class's, plus provider, model name and default stop."""
        params: LangSmithParams = super()._get_ls_params(stop=stop, **kwargs)  # type: ignore[misc]
        model = kwargs.get("model")
        params["ls_provider"] = PROVIDER
        params["ls_model_name"] = model if isinstance(model, str) else self.model_name
        if not stop and self.stop:
            params["ls_stop"] = list(self.stop)
        return params


def generation_metadata(generation: Generation, model_name: str) -> dict[str, Any]:
    """Response metadata of a finished generation: model name plus `Generation.stats()`.

    Keys: model_name, model_provider, every key of `Generation.stats()` (ttft_s, total_s,
    prompt_tokens, completion_tokens, reused_tokens, recomputed_tokens, selector, ratio,
    finish_reason, cache_misses as a count, fused_chunks / independent_chunks, ...) and
    cache_miss_ids, the chunk ids that had no usable cache and were prefilled, and
    cache_miss_reasons, chunk id -> why.
    """
    return {
        "model_name": model_name,
        "model_provider": PROVIDER,
        **generation_stats(generation),
        "cache_miss_ids": sorted(generation.cache_misses),
    }
