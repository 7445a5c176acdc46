"""Where a request's caches come from when no retriever named them: learned caches and reuse sources."""
