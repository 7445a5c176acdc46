"""Where an index keeps its data by default: one home for the data directory's layout.

    <data_dir>/chroma/                 the embedded Chroma database (unless a Chroma server is used)
    <data_dir>/kv/<collection_name>/   the disk KV store of one collection (unless Redis is used)
    <data_dir>/learned/<model>/        caches learned from traffic by one model (see reuse/learned.py)

NOTE: standard library only: the CLI reads these defaults before it imports torch or chromadb.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DATA_DIR = "./fusionrag-data"
DEFAULT_COLLECTION = "fusionrag"


def chroma_dir(data_dir: str | Path) -> Path:
    """The embedded Chroma database of `data_dir`."""
    return Path(data_dir).expanduser() / "chroma"


def kv_dir(data_dir: str | Path, collection_name: str) -> Path:
    """The disk KV store of `collection_name` under `data_dir` (one store per collection)."""
    return Path(data_dir).expanduser() / "kv" / collection_name


def learned_dir(data_dir: str | Path, fingerprint: str) -> Path:
    """The learned caches of the model `fingerprint` under `data_dir` (one directory per model)."""
    return Path(data_dir).expanduser() / "learned" / fingerprint[:16]


__all__ = ["DEFAULT_COLLECTION", "DEFAULT_DATA_DIR", "chroma_dir", "kv_dir", "learned_dir"]
