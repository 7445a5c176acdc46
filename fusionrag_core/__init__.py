"""FusionRAG core: fused chunk KV caches and query-guided selective recompute (pure torch + transformers)."""
