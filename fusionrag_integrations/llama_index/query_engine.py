"""FusionRAGQueryEngine: LlamaIndex's `RetrieverQueryEngine`, wired for fused-cache reuse.

Retriever (a FusionIndex or a vector store filled by `FusionKVTransform`) -> the user's node
postprocessors -> `FusionChunkMarker` (marks each node's text with its chunk id) -> a standard
response synthesizer (any `response_mode`, the user's templates, streaming) -> `FusionRAGLLM`,
which recognises the marked chunks in the prompt and reuses their caches. With the default
`fusion_text_qa_template` and "compact" mode, the prompt is the canonical FusionRAG prompt, so the
answer is what `FusionEngine.generate` gives for the same question and chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import BaseSynthesizer, ResponseMode, get_response_synthesizer
from llama_index.core.response_synthesizers.context_only import ContextOnly
from llama_index.core.response_synthesizers.no_text import NoText
from llama_index.core.vector_stores.types import BasePydanticVectorStore

from fusionrag_core.errors import InvalidRequestError
from fusionrag_integrations.llama_index.llm import FusionRAGLLM
from fusionrag_integrations.llama_index.marking import FusionChunkMarker, fusion_text_qa_template
from fusionrag_integrations.llama_index.retriever import FusionRAGRetriever

if TYPE_CHECKING:
    from fusionrag_core.index import FusionIndex

_NO_LLM_MODES: dict[ResponseMode, type[BaseSynthesizer]] = {ResponseMode.NO_TEXT: NoText,
                                                            ResponseMode.CONTEXT_ONLY: ContextOnly}


class FusionRAGQueryEngine(RetrieverQueryEngine):
    """A `RetrieverQueryEngine` whose synthesizer prompts reuse the retrieved chunks' caches.

    `Response.metadata` is RetrieverQueryEngine's (node id -> node metadata) plus the statistics
    of the query's LLM calls combined (`observe.combined`: counts summed, `llm_calls`; refine and
    tree_summarize make several). For a `StreamingResponse` they fill in once it is exhausted.

    Example:
        >>> qe = FusionRAGQueryEngine.from_index(index, response_mode="compact", streaming=False)
        >>> response = qe.query("Who designed the lighthouse?")
        >>> response.metadata["reused_tokens"], response.metadata["llm_calls"]
    """

    @classmethod
    def from_index(
        cls,
        index: FusionIndex,
        *,
        llm: FusionRAGLLM | None = None,
        similarity_top_k: int = 4,
        **kwargs: Any,
    ) -> FusionRAGQueryEngine:
        """Query a FusionIndex: its engine answers (unless `llm` is given), its KV store holds the caches.

        Args:
            index: the FusionIndex the chunks were ingested into.
            llm: generation settings; without its own store it reads the index's.
            similarity_top_k: how many chunks to retrieve.
            **kwargs: as `from_retriever` (response_mode, node_postprocessors, text_qa_template, ...).
        """
        if llm is None:
            llm = FusionRAGLLM(engine=index.engine, kv_store=index.store)
        elif llm.kv_store is None:
            llm = llm.with_store(index.store)  # NOTE: a copy: the caller's LLM keeps reading nothing
        return cls.from_retriever(FusionRAGRetriever.from_index(index, similarity_top_k=similarity_top_k), llm,
                                  **kwargs)

    @classmethod
    def from_vector_store(
        cls,
        vector_store: BasePydanticVectorStore,
        llm: FusionRAGLLM,
        *,
        embed_model: BaseEmbedding | None = None,
        similarity_top_k: int = 4,
        **kwargs: Any,
    ) -> FusionRAGQueryEngine:
        """Query a vector store filled through `FusionKVTransform`; `llm.kv_store` must hold its caches.

        Raises:
            InvalidRequestError: `llm` has no KV store to find the caches in.
        """
        if llm.kv_store is None:
            raise InvalidRequestError(
                "FusionRAGQueryEngine has no KV store to find chunk caches in: build FusionRAGLLM(store=...) with the "
                "store FusionKVTransform wrote to, or use FusionRAGQueryEngine.from_index(index)"
            )
        retriever = FusionRAGRetriever.from_vector_store(vector_store, embed_model=embed_model,
                                                         similarity_top_k=similarity_top_k)
        return cls.from_retriever(retriever, llm, **kwargs)

    @classmethod
    def from_retriever(
        cls,
        retriever: BaseRetriever,
        llm: FusionRAGLLM,
        *,
        response_mode: ResponseMode | str = ResponseMode.COMPACT,
        node_postprocessors: Sequence[BaseNodePostprocessor] | None = None,
        text_qa_template: BasePromptTemplate | None = None,
        refine_template: BasePromptTemplate | None = None,
        summary_template: BasePromptTemplate | None = None,
        streaming: bool = False,
        response_synthesizer: BaseSynthesizer | None = None,
        **synthesizer_kwargs: Any,
    ) -> FusionRAGQueryEngine:
        """Build on any retriever whose node ids are chunk ids.

        Args:
            retriever: returns nodes whose node_id is a chunk id.
            llm: the FusionRAGLLM that answers.
            response_mode: any LlamaIndex response mode ("compact", "refine", "tree_summarize",
                "simple_summarize", "accumulate", "compact_accumulate", "generation", "no_text",
                "context_only").
            node_postprocessors: run before the chunk marker (rerankers, filters...).
            text_qa_template: default `fusion_text_qa_template()` (the canonical FusionRAG layout).
            refine_template, summary_template, streaming, **synthesizer_kwargs: as
                `get_response_synthesizer`.
            response_synthesizer: a ready synthesizer instead (then the arguments above that
                configure one must stay unset).

        Raises:
            InvalidRequestError: both a synthesizer and arguments to build one.
        """
        if response_synthesizer is not None:
            configured = [name for name, value in (("text_qa_template", text_qa_template),
                                                    ("refine_template", refine_template),
                                                    ("summary_template", summary_template),
                                                    ("streaming", streaming or None)) if value is not None]
            if configured or synthesizer_kwargs or response_mode != ResponseMode.COMPACT:
                raise InvalidRequestError(
                    f"pass either response_synthesizer= or the arguments that build one "
                    f"({', '.join(configured + sorted(synthesizer_kwargs)) or 'response_mode'}), not both"
                )
        elif ResponseMode(response_mode) in _NO_LLM_MODES:
            # NOTE: LlamaIndex's factory builds these without the llm, and they then resolve
            # Settings.llm (OpenAI by default) though they never call it.
            response_synthesizer = _NO_LLM_MODES[ResponseMode(response_mode)](llm=llm, streaming=streaming)
        else:
            response_synthesizer = get_response_synthesizer(
                llm=llm,
                response_mode=ResponseMode(response_mode),
                text_qa_template=text_qa_template or fusion_text_qa_template(llm.engine.config.instruction),
                refine_template=refine_template,
                summary_template=summary_template,
                streaming=streaming,
                **synthesizer_kwargs,
            )
        # NOTE: the marker runs last: a postprocessor that reads or rewrites node text sees it unmarked.
        postprocessors = [*(node_postprocessors or []), FusionChunkMarker()]
        return cls(retriever=retriever, response_synthesizer=response_synthesizer,
                   node_postprocessors=postprocessors)


__all__ = ["FusionRAGQueryEngine"]
