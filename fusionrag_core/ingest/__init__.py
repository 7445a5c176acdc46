"""Ingest: chunking, fused chunk caches, the ingestor and its writer, Chroma access, Ray, the writer lock."""
