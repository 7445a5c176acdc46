"""The disk-space check of ingest: projected cache size, free-space check, chunking progress."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from fusionrag_core.errors import InsufficientSpaceError
from fusionrag_core.ingest.chunking import Chunker, ChunkingConfig
from fusionrag_core.ingest.space import check_room, project
from fusionrag_core.store import DiskKVStore

SMOLLM2_KV = (30, 3, 64)  # (layers, kv heads, head dim) of SmolLM2-135M


def test_projection_of_the_default_model(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "kv")  # float16
    one = project(store, SMOLLM2_KV, [256], variants=1)
    assert 5.8e6 < one.bytes < 6.0e6, "2 x 30 x 3 x 64 values x 2 bytes x 256 tokens, plus header and ids"
    five_mb = project(store, SMOLLM2_KV, [256] * 6500, variants=2)  # ~5 MB of English text
    assert 75e9 < five_mb.bytes < 78e9 and five_mb.free_bytes == store.free_bytes() > 0


def test_an_ingest_that_does_not_fit_is_refused_with_the_numbers(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskKVStore(tmp_path / "kv")
    monkeypatch.setattr(store, "free_bytes", lambda: 3_000_000_000)
    check_room(project(store, SMOLLM2_KV, [256] * 200, variants=2), "kv")  # 2.4 GB fits in 3 GB
    with pytest.raises(InsufficientSpaceError) as e:
        check_room(project(store, SMOLLM2_KV, [256] * 1000, variants=2), "kv")
    message = str(e.value)
    assert "~11.8 GB of KV caches (1000 chunk(s)" in message and "3.0 GB free" in message, message
    assert "--no-space-check" in message


def test_chunking_reports_progress_and_cuts_the_same(tokenizer: PreTrainedTokenizerBase) -> None:
    chunker = Chunker(tokenizer, ChunkingConfig(chunk_tokens=64))
    text = " ".join(f"Sentence {i} is about the harbour." for i in range(600))  # one long line
    seen: list[int] = []
    assert chunker.split(text, seen.append) == chunker.split(text)
    assert len(seen) > 10 and seen == sorted(seen) and len(text) - 400 < seen[-1] < len(text)
