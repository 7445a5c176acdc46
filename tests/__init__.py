"""FusionRAG test suite (importable so tests can share helpers from tests.servers)."""
