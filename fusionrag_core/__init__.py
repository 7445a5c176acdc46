"""FusionRAG core: fused chunk KV caches and query-guided selective recompute (pure torch + transformers).

Typical use::

    from fusionrag_core import FusionEngine, FusionIndex

    engine = FusionEngine.from_pretrained()           # packaged SmolLM2-135M-Instruct
    index = FusionIndex.open(engine, "./fusionrag-data")
    index.add_texts(["...", "..."])                    # chunk, cache, fuse, then add to Chroma
    generation, sources = index.answer("a question")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# NOTE: names resolve lazily so that `import fusionrag_core` (e.g. for the CLI's --help) does not
# pay for importing torch, transformers and chromadb.
_EXPORTS = {
    "FusionEngine": "fusionrag_core.engine",
    "EngineConfig": "fusionrag_core.engine",
    "Generation": "fusionrag_core.engine",
    "SamplingConfig": "fusionrag_core.query.sampling",
    "SelectConfig": "fusionrag_core.query.select",
    "ChunkKV": "fusionrag_core.runtime.kv",
    "FusionPrompt": "fusionrag_core.query.prompt",
    "mark_chunk": "fusionrag_core.recognise.marks",
    "strip_marks": "fusionrag_core.recognise.marks",
    "FusionIndex": "fusionrag_core.index",
    "IngestConfig": "fusionrag_core.ingest.config",
    "open_store": "fusionrag_core.store",
}

if TYPE_CHECKING:
    from fusionrag_core.engine import EngineConfig, FusionEngine, Generation
    from fusionrag_core.index import FusionIndex
    from fusionrag_core.ingest.config import IngestConfig
    from fusionrag_core.query.prompt import FusionPrompt
    from fusionrag_core.query.sampling import SamplingConfig
    from fusionrag_core.query.select import SelectConfig
    from fusionrag_core.recognise.marks import mark_chunk, strip_marks
    from fusionrag_core.runtime.kv import ChunkKV
    from fusionrag_core.store import open_store


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fusionrag_core' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = [
    "ChunkKV",
    "EngineConfig",
    "FusionEngine",
    "FusionIndex",
    "FusionPrompt",
    "Generation",
    "IngestConfig",
    "SamplingConfig",
    "SelectConfig",
    "__version__",
    "mark_chunk",
    "open_store",
    "strip_marks",
]
