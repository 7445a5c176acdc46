"""LlamaIndex integration: FusionRAG's cache reuse behind LlamaIndex's LLM, retriever, query engine
and ingestion interfaces.

* `FusionRAGLLM`: a `FunctionCallingLLM`; reuses caches of the chunks its prompts hold, and calls tools
  (FunctionAgent, predict_and_call).
* `FusionRAGEmbedding`: the offline all-MiniLM-L6-v2 as a LlamaIndex embed model.
* `FusionKVTransform`: an `IngestionPipeline` step that names nodes by chunk id and builds their
  (fused) KV caches.
* `FusionRAGRetriever`: nodes whose `node_id` is the chunk id, from a FusionIndex or a vector store.
* `FusionRAGQueryEngine`: retrieve, then answer with fused-cache reuse and query-guided recompute.
* `FusionChunkMarker` + `fusion_text_qa_template`: reuse through the standard response synthesizer.

See docs/integrations/llama_index.md for which path gets reuse and why.
"""

from fusionrag_integrations.llama_index.embedding import FusionRAGEmbedding
from fusionrag_integrations.llama_index.llm import FusionRAGLLM
from fusionrag_integrations.llama_index.marking import FusionChunkMarker, fusion_text_qa_template
from fusionrag_integrations.llama_index.query_engine import FusionRAGQueryEngine
from fusionrag_integrations.llama_index.retriever import FusionRAGRetriever
from fusionrag_integrations.llama_index.transform import FusionKVTransform

__all__ = [
    "FusionChunkMarker",
    "FusionKVTransform",
    "FusionRAGEmbedding",
    "FusionRAGLLM",
    "FusionRAGQueryEngine",
    "FusionRAGRetriever",
    "fusion_text_qa_template",
]
