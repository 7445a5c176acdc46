"""FusionRAGLLM: the text-completion flavour of ChatFusionRAG, for string-prompt chains."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LLM
from langchain_core.messages import HumanMessage
from langchain_core.outputs import GenerationChunk, LLMResult
from langchain_core.runnables.config import run_in_executor

from fusionrag_core.engine import Generation
from fusionrag_integrations.langchain.binding import FusionRAGModelFields, generation_metadata
from fusionrag_integrations.langchain.messages import to_chat_dicts


class FusionRAGLLM(FusionRAGModelFields, LLM):
    """Text-completion model over a FusionEngine; the caches of chunks the prompt holds (found by mark
    or by content, or learned from an earlier prompt) are reused.

    The prompt string is sent as one user turn of the model's chat template (as Ollama's generate
    endpoint does): the supported models are instruction-tuned and answer only inside their template.
    Generation info holds `Generation.stats()` (ttft_s, reused_tokens, recomputed_tokens, ...).
    Same fields as `ChatFusionRAG`.

    Example:
        >>> from langchain_core.prompts import PromptTemplate
        >>> prompt = PromptTemplate.from_template("{context}\\nQuestion: {question}")
        >>> chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | FusionRAGLLM()
    """

    @property
    def _llm_type(self) -> str:
        return "fusionrag"

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        # NOTE: overridden (LLM's version goes through `_call`) to keep the statistics of each answer.
        return LLMResult(generations=[[self._complete(p, stop, run_manager, kwargs)] for p in prompts])

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        # NOTE: the blocking engine runs in an executor thread (LLM's default goes through `_acall`,
        # which would drop the statistics).
        sync_manager = run_manager.get_sync() if run_manager is not None else None
        return await run_in_executor(None, self._generate, prompts, stop, sync_manager, **kwargs)

    def _complete(
        self, prompt: str, stop: list[str] | None, run_manager: CallbackManagerForLLMRun | None, kwargs: dict[str, Any]
    ) -> GenerationChunk:
        """One prompt's answer: its streamed chunks merged (the last carries the statistics)."""
        merged = GenerationChunk(text="")
        for chunk in self._stream(prompt, stop=stop, run_manager=run_manager, **kwargs):
            merged += chunk
        return merged

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return "".join(chunk.text for chunk in self._stream(prompt, stop=stop, run_manager=run_manager, **kwargs))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        scope = self.call_scope(kwargs)
        options = self.request_options(kwargs, stop=stop)
        session = self.reuse_session()
        sources = session.sources(options, scope)
        run_id = run_manager.run_id if run_manager is not None else None
        request = self.reuse_prompt(to_chat_dicts([HumanMessage(content=prompt)]), run_id, sources)
        for piece in session.run(request, options, sources):
            if isinstance(piece, Generation):
                yield GenerationChunk(text="", generation_info=generation_metadata(piece, self.model_name))
                return
            chunk = GenerationChunk(text=piece)
            if run_manager is not None:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk

