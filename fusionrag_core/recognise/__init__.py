"""Recognising stored chunks in a prompt: `mark_chunk` marks and the content index."""
