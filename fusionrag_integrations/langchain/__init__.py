"""LangChain integration: chat and completion models that reuse fused chunk KV caches, and the
retriever, vector store and prompt helper that pair retrieved chunks with their caches by chunk id.

    >>> from fusionrag_integrations.langchain import ChatFusionRAG, FusionRAGVectorStore, format_docs
"""

from fusionrag_integrations.langchain.chains import FusionRAGChain
from fusionrag_integrations.langchain.chat_models import ChatFusionRAG
from fusionrag_integrations.langchain.documents import format_docs
from fusionrag_integrations.langchain.llms import FusionRAGLLM
from fusionrag_integrations.langchain.retrievers import FusionRAGRetriever
from fusionrag_integrations.langchain.vectorstores import FusionRAGVectorStore

__all__ = [
    "ChatFusionRAG",
    "FusionRAGChain",
    "FusionRAGLLM",
    "FusionRAGRetriever",
    "FusionRAGVectorStore",
    "format_docs",
]
