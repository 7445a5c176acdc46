"""Reuse through LlamaIndex's standard response synthesizer: mark retrieved chunks in the prompt.

The standard synthesizer (`index.as_query_engine(...)`) formats node texts into one QA prompt
string, so the LLM sees no chunk ids. `FusionChunkMarker`, a node postprocessor, wraps each node's
text in `fusionrag_core.mark_chunk(node_id, text)`; `FusionRAGLLM` hands the flattened
prompt to `FusionEngine.prompt_from_messages`, which finds the marks and reuses the caches stored
under those ids. `fusion_text_qa_template` lays the QA prompt out like the canonical FusionRAG
prompt (same system instruction as at ingest), so the reused caches see the prefix they were
computed after.

    query_engine = index.as_query_engine(
        llm=FusionRAGLLM(...),
        node_postprocessors=[FusionChunkMarker()],
        text_qa_template=fusion_text_qa_template(),
    )

NOTE: the synthesizer is used in its default "compact" mode. A chunk is reused only when its text
reaches the LLM whole: when the retrieved nodes overflow the context window, LlamaIndex re-splits
the joined text and a chunk cut apart is prefilled like any other text.
"""

from __future__ import annotations

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import ChatPromptTemplate
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.prompt import DEFAULT_INSTRUCTION, QUESTION_TEMPLATE
from fusionrag_core.recognise.marks import mark_chunk


class FusionChunkMarker(BaseNodePostprocessor):
    """Marks each retrieved node's text with its node id (the chunk id caches are stored under).

    Returns copies: the retriever's nodes are left untouched, but the response's `source_nodes` hold
    the marked copies (`fusionrag_core.strip_marks(node.text)` gives the plain text back).
    Metadata the node shows the LLM stays outside the mark, as plain text.
    """

    @classmethod
    def class_name(cls) -> str:
        return "fusionrag_chunk_marker"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        marked: list[NodeWithScore] = []
        for hit in nodes:
            if not isinstance(hit.node, TextNode):
                raise InvalidRequestError(
                    f"node {hit.node.node_id} is a {type(hit.node).__name__}; FusionChunkMarker marks text nodes "
                    "only: drop it from the retrieved nodes or remove the marker"
                )
            node = hit.node.model_copy()
            # NOTE: the marked text must equal the text the cache was computed on, i.e. the node
            # text without metadata (FusionKVTransform caches exactly that).
            node.set_content(mark_chunk(node.node_id, hit.node.get_content(metadata_mode=MetadataMode.NONE)))
            marked.append(NodeWithScore(node=node, score=hit.score))
        return marked


def fusion_text_qa_template(instruction: str = DEFAULT_INSTRUCTION) -> ChatPromptTemplate:
    """A text QA template laid out like the canonical FusionRAG prompt.

    Args:
        instruction: the system instruction; use the one the caches were built with
            (`engine.config.instruction`, the default).

    Returns:
        A chat template with a system turn (`instruction`) and a user turn holding the passages,
        then `Question: ...`.
    """
    # NOTE: each marked chunk is tokenized with the passage separator after it, so the question line
    # follows the context directly, as in `PromptLayout.build`.
    question = QUESTION_TEMPLATE.format(question="{query_str}")
    return ChatPromptTemplate(
        message_templates=[
            ChatMessage(role=MessageRole.SYSTEM, content=instruction),
            ChatMessage(role=MessageRole.USER, content="{context_str}" + question),
        ]
    )


__all__ = ["FusionChunkMarker", "fusion_text_qa_template"]
