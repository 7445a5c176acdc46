"""Faults a corpus must survive (issue #12): corpora sharing servers, bad blobs at query time,
servers going away, ingests too large for the disk, two writers at once.

Every test here failed on the main branch it was written against; each says which defect it pins.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from fusionrag_core.corpus import CORPUS_ID_KEY, corpus_id_of
from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest import IngestConfig
from tests.ingest_worker import tiny_engine
from tests.servers import running_redis_server

CONFIG = IngestConfig(chunk_tokens=32, neighbors=2)
CORPUS_A = [
    "The Lumen lighthouse on the northern cape was designed by the engineer Ada Vell in 1871.",
    "Ada Vell was born in the fishing village of Marrow, where her father repaired nets.",
    "Marrow salt was sold in markets all along the coast and was famous for its pale pink colour.",
]
CORPUS_B = [
    "The river Tell floods every spring and feeds the orchards of the lower valley.",
    "Orchards of the lower valley grow a bitter green apple used only for cider.",
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with running_redis_server() as url:
        yield url


# ---- defect 2: corpora sharing one Redis -------------------------------------------------------------
@pytest.mark.servers
def test_two_data_dirs_on_one_redis_keep_their_caches(engine: FusionEngine, tmp_path: Path, redis_url: str) -> None:
    a = FusionIndex.open(engine, tmp_path / "a", redis_url=redis_url, config=CONFIG)
    a.add_texts(CORPUS_A)
    b = FusionIndex.open(engine, tmp_path / "b", redis_url=redis_url, config=CONFIG)
    b.add_texts(CORPUS_B)  # NOTE: its orphan sweep deleted a's blobs while both shared a namespace
    assert a.verify(repair=False).ok and b.verify(repair=False).ok
    generation, _ = a.answer("Who designed the Lumen lighthouse?", k=2)
    assert generation.cache_misses == {}
    assert corpus_id_of(a.collection.metadata) != corpus_id_of(b.collection.metadata)
    assert a.store.namespace != b.store.namespace  # type: ignore[attr-defined]


@pytest.mark.servers
def test_a_corpus_from_before_ids_keeps_its_namespace_and_is_warned_about(
    engine: FusionEngine, tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    index = FusionIndex.open(engine, tmp_path, redis_url=redis_url, collection_name="old-corpus", config=CONFIG)
    index.add_texts(CORPUS_A)
    # NOTE: what an older fusionrag left: the same collection, no corpus id, caches keyed by name.
    metadata = {k: v for k, v in (index.collection.metadata or {}).items() if k != CORPUS_ID_KEY}
    index.collection.modify(metadata=metadata)
    legacy = FusionIndex.open(engine, tmp_path, redis_url=redis_url, collection_name="old-corpus")
    with caplog.at_level(logging.WARNING, logger="fusionrag_core.index"):
        legacy = FusionIndex.open(engine, tmp_path, redis_url=redis_url, collection_name="old-corpus")
    assert corpus_id_of(legacy.collection.metadata) is None, "an existing corpus is not re-keyed behind its back"
    assert legacy.store.namespace == "fusionrag.old-corpus"  # type: ignore[attr-defined]
    assert "built before corpus ids" in caplog.text and "--collection" in caplog.text
