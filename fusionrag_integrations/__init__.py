"""Thin adapters from LangChain and LlamaIndex to fusionrag_core."""
