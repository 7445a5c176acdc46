"""FusionRAGVectorStore against langchain-chroma's interface and LangChain's standard suites.

A 2-layer random Llama (tests.ingest_worker.tiny_engine) computes the caches; chunks are a few
tokens and fuse after at most 2 neighbours, so every ingest is a handful of tiny prefills.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import chromadb
import numpy as np
import pytest
from chromadb.config import Settings
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding, Embeddings
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import VectorStore, VectorStoreRetriever
from langchain_tests.integration_tests import RetrieversIntegrationTests, VectorStoreIntegrationTests
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import CorpusLockedError, InvalidRequestError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.lock import writing
from fusionrag_core.ingest.records import NEIGHBOURS_KEY
from fusionrag_core.paths import kv_dir
from fusionrag_core.runtime.kv import neighbours_digest
from fusionrag_integrations.langchain import FusionRAGRetriever, FusionRAGVectorStore
from fusionrag_integrations.langchain.embeddings import ChromaEmbeddings
from tests.ingest_worker import tiny_engine

CONFIG = IngestConfig(chunk_tokens=24, neighbours=2)
TEXTS = [
    "The Lumen lighthouse was designed by Ada Vell.",
    "Ada Vell was born in the port town of Marrow.",
    "Marrow is known for its salt market and ferries.",
    "Tessaly Instruments was founded by Piet Orran.",
    "Piet Orran studied optics in the city of Brell.",
]
# NOTE: langchain-chroma's `Chroma.__init__` parameters (langchain-chroma 1.x), with its defaults.
CHROMA_PARAMETERS = {
    "collection_name": "langchain", "embedding_function": None, "persist_directory": None, "host": None,
    "port": None, "headers": None, "chroma_cloud_api_key": None, "tenant": None, "database": None,
    "client_settings": None, "collection_metadata": None, "collection_configuration": None, "client": None,
    "relevance_score_fn": None, "create_collection_if_not_exists": True, "ssl": False,
}


@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(tokenizer)


def _store(engine: FusionEngine, path: Path, embeddings: Embeddings | None = None, collection_name: str = "corpus",
           **kwargs: Any) -> FusionRAGVectorStore:
    return FusionRAGVectorStore(collection_name=collection_name, persist_directory=path, engine=engine, config=CONFIG,
                                embedding_function=embeddings or DeterministicFakeEmbedding(size=8), **kwargs)


class TableEmbeddings(Embeddings):
    """Hand-set vectors per text (documents) and per query, to make rankings predictable."""

    def __init__(self, documents: dict[str, list[float]], queries: dict[str, list[float]]) -> None:
        self.documents, self.queries = documents, queries
        self.document_calls: list[list[str]] = []
        self.query_calls: list[str] = []

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        self.document_calls.append(list(texts))
        return [self.documents[t] for t in texts]

    def embed_query(self, text: str) -> list[float]:
        self.query_calls.append(text)
        return self.queries[text]


# ---- LangChain's standard suites -----------------------------------------------------------------------
@pytest.mark.anyio
class TestFusionRAGVectorStoreStandard(VectorStoreIntegrationTests):
    """langchain-tests' vector store suite, sync and async, with its DeterministicFakeEmbedding(size=6), on an
    in-memory Chroma as langchain-chroma's own standard test (`Chroma(embedding_function=...)`)."""

    @pytest.fixture(autouse=True)
    def _engine(self, engine: FusionEngine) -> None:
        self.engine = engine

    @pytest.fixture
    def vectorstore(self) -> Iterator[VectorStore]:
        store = FusionRAGVectorStore(embedding_function=self.get_embeddings(), engine=self.engine, config=CONFIG)
        try:
            yield store
        finally:
            store.delete_collection()


@pytest.fixture(scope="module")
def retrieval_store(engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> FusionRAGVectorStore:
    store = _store(engine, tmp_path_factory.mktemp("retrieval"))
    store.add_texts(TEXTS, [{"i": i} for i in range(len(TEXTS))])
    return store


@pytest.mark.anyio
class TestStoreAsRetriever(RetrieversIntegrationTests):
    """langchain-tests' retriever suite on `store.as_retriever()` (LangChain's own VectorStoreRetriever)."""

    @pytest.fixture(autouse=True)
    def _store(self, retrieval_store: FusionRAGVectorStore) -> None:
        self.store = retrieval_store

    @property
    def retriever_constructor(self) -> type[BaseRetriever]:
        return VectorStoreRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"vectorstore": self.store}

    @property
    def retriever_query_example(self) -> str:
        return "Who designed the Lumen lighthouse?"

    @pytest.mark.xfail(reason="VectorStoreRetriever takes k inside search_kwargs, not as a constructor argument "
                              "(the suite documents this xfail); k through invoke is tested", strict=True)
    def test_k_constructor_param(self) -> None:
        super().test_k_constructor_param()


# NOTE: the same suite on FusionRAGRetriever runs in tests/test_langchain_standard.py (real model).


# ---- langchain-chroma's constructor ---------------------------------------------------------------------
def test_constructor_takes_langchain_chromas_arguments_with_its_defaults() -> None:
    parameters = inspect.signature(FusionRAGVectorStore.__init__).parameters
    assert {name: parameters[name].default for name in CHROMA_PARAMETERS} == CHROMA_PARAMETERS


@pytest.mark.parametrize(("argument", "suggestion"), [
    ("embedding", "embedding_function"), ("persist_dir", "persist_directory"), ("collection", "collection_name"),
    ("kvstore", "kv_store"), ("collection_meta", "collection_metadata"), ("engines", "engine"),
])
def test_unknown_constructor_argument_names_the_closest(engine: FusionEngine, argument: str, suggestion: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"unknown argument.*'{argument}' \\(did you mean '{suggestion}'"):
        FusionRAGVectorStore(engine=engine, **{argument: None})


def test_arguments_that_pick_different_places_are_refused(engine: FusionEngine, tmp_path: Path) -> None:
    client = chromadb.PersistentClient(str(tmp_path / "c"), settings=Settings(anonymized_telemetry=False))
    with pytest.raises(InvalidRequestError, match="persist_directory and client"):
        FusionRAGVectorStore(persist_directory=tmp_path / "p", client=client, engine=engine)
    with pytest.raises(InvalidRequestError, match="cloud_api_key needs tenant"):
        FusionRAGVectorStore(chroma_cloud_api_key="k", engine=engine)
    store = _store(engine, tmp_path / "p")
    with pytest.raises(InvalidRequestError, match=r"index= and \['persist_directory'\]"):
        FusionRAGVectorStore(index=store.index, persist_directory=tmp_path)
    with pytest.raises(InvalidRequestError, match="drop embedding_function"):
        FusionRAGVectorStore(index=store.index, embedding_function=DeterministicFakeEmbedding(size=9))
    assert FusionRAGVectorStore(index=store.index).embeddings is store.embeddings
    with pytest.raises(InvalidRequestError, match="kv_store= with data_dir"):
        _store(engine, tmp_path / "q", kv_store=store.index.store, data_dir=tmp_path)
    with pytest.raises(InvalidRequestError, match="does not exist"):
        FusionRAGVectorStore(collection_name="absent", persist_directory=tmp_path / "p", engine=engine, config=CONFIG,
                             create_collection_if_not_exists=False)
    with pytest.raises(InvalidRequestError, match="cosine"):
        FusionRAGVectorStore(collection_name="l2", persist_directory=tmp_path / "p", engine=engine, config=CONFIG,
                             collection_metadata={"hnsw:space": "l2"})
    with pytest.raises(InvalidRequestError, match="holds embeddings of"):
        _store(engine, tmp_path / "p", embeddings=DeterministicFakeEmbedding(size=9)).add_texts(["x"])


def test_persisted_store_keeps_caches_beside_chroma_and_reopens(engine: FusionEngine, tmp_path: Path) -> None:
    store = _store(engine, tmp_path, collection_metadata={"owner": "tests"},
                   collection_configuration={"hnsw": {"ef_search": 20}})
    ids = store.add_texts(TEXTS[:2], [{"i": 0}, {"i": 1}], ids=["a", None])  # type: ignore[list-item]
    assert ids[0] == "a" and len(ids[1]) == 36  # NOTE: a missing id becomes a UUID, as in langchain-chroma.
    chunk_ids = set(store.index.collection.get()["ids"])
    assert store.index.store.list_ids() == chunk_ids and len(chunk_ids) == 2
    assert Path(store.index.store.root) == kv_dir(tmp_path, "corpus")  # type: ignore[attr-defined]
    assert store.index.collection.metadata["owner"] == "tests"
    again = _store(engine, tmp_path)
    assert [d.page_content for d in again.get_by_ids(ids)] == TEXTS[:2]
    client = chromadb.PersistentClient(str(tmp_path), settings=Settings(anonymized_telemetry=False))
    through_client = FusionRAGVectorStore(collection_name="corpus", client=client, engine=engine,
                                          embedding_function=DeterministicFakeEmbedding(size=8))
    assert through_client.index.store.list_ids() == chunk_ids
    # NOTE: langchain-chroma's way to ask for cosine; Chroma refuses index keys in later metadata updates.
    legacy = _store(engine, tmp_path, collection_name="legacy", collection_metadata={"hnsw:space": "cosine"})
    legacy.add_texts(TEXTS[:1], ids=["x"])
    assert legacy.similarity_search_with_score(TEXTS[0], k=1)[0][1] == pytest.approx(0.0, abs=1e-6)


def test_in_memory_stores_of_one_collection_share_its_caches(engine: FusionEngine) -> None:
    first = FusionRAGVectorStore(collection_name="shared-memory", embedding_function=DeterministicFakeEmbedding(size=8),
                                 engine=engine, config=CONFIG)
    first.add_texts(TEXTS[:1], ids=["x"])
    second = FusionRAGVectorStore(collection_name="shared-memory",
                                  embedding_function=DeterministicFakeEmbedding(size=8), engine=engine)
    assert second.index.store.list_ids() == set(first.index.collection.get()["ids"]) != set()
    root = Path(second.index.store.root)  # type: ignore[attr-defined]
    first.delete_collection()
    assert not root.exists()
    with pytest.raises(InvalidRequestError, match="reset_collection"):
        first.similarity_search("x")
    first.reset_collection()
    assert first.similarity_search("x") == []
    first.delete_collection()


# ---- embeddings: the LangChain object's, for Chroma and for fusion --------------------------------------
def _unit(v: list[float]) -> np.ndarray:
    a = np.asarray(v, dtype=np.float32)
    return a / np.linalg.norm(a)


def test_chroma_and_fusion_use_the_langchain_embeddings(engine: FusionEngine, tmp_path: Path) -> None:
    texts = ["Alpha is here.", "Beta is near alpha.", "Gamma is far away.", "Delta sits between."]
    vectors = {texts[0]: [1.0, 0.0, 0.0], texts[1]: [0.9, 0.3, 0.0], texts[2]: [0.0, 0.0, 1.0],
               texts[3]: [0.6, 0.2, 0.7]}
    embeddings = TableEmbeddings(vectors, {"where is gamma": [0.1, 0.0, 1.0]})
    store = _store(engine, tmp_path, embeddings)
    store.add_texts(texts, ids=["a", "b", "g", "d"])
    assert sorted(t for call in embeddings.document_calls for t in call) == sorted(texts)  # NOTE: once each.
    rows = store.index.collection.get(include=["documents", "embeddings", "metadatas"])
    stored = dict(zip(rows["documents"], rows["embeddings"], strict=True))
    for text in texts:
        np.testing.assert_allclose(stored[text], _unit(vectors[text]), atol=1e-6)
    # NOTE: each chunk was fused after its 2 nearest others by these vectors, nearest first.
    ids = dict(zip(rows["documents"], rows["ids"], strict=True))
    for text, meta in zip(rows["documents"], rows["metadatas"], strict=True):
        others = sorted((t for t in texts if t != text), key=lambda t: -float(_unit(vectors[t]) @ _unit(vectors[text])))
        assert meta[NEIGHBOURS_KEY].split() == [ids[t] for t in others[:2]]
        fused = store.index.store.get(ids[text], "fused", fingerprint=engine.fingerprint)
        assert fused.fused_after == neighbours_digest([ids[t] for t in others[:2]])
    # NOTE: queries go through embed_query, for the store and for FusionRAGRetriever alike.
    assert store.similarity_search("where is gamma", k=1)[0].id == "g"
    assert FusionRAGRetriever(index=store.index, k=1).invoke("where is gamma")[0].page_content == texts[2]
    assert embeddings.query_calls == ["where is gamma"] * 2
    assert isinstance(store.index.ingestor.embedding_function, ChromaEmbeddings) and store.embeddings is embeddings


# ---- search ---------------------------------------------------------------------------------------------
TABLE = {"A": [1.0, 0.0, 0.0], "B": [0.99, 0.14, 0.0], "C": [0.5, 0.0, 0.87], "D": [-1.0, 0.0, 0.0]}
TABLE_TEXTS = ["Item A: the red lamp.", "Item B: the red lamp too.", "Item C: a blue chair.", "Item D: nothing alike."]
Q = [1.0, 0.0, 0.3]


@pytest.fixture(scope="module")
def table_store(engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> FusionRAGVectorStore:
    """Four documents: A, its near-copy B, C aside, D opposite; query q is nearest A, then B, C, D."""
    store = _store(engine, tmp_path_factory.mktemp("table"),
                   TableEmbeddings(dict(zip(TABLE_TEXTS, TABLE.values(), strict=True)), {"q": Q, "c": [0.0, 0.0, 1.0]}))
    store.add_texts(TABLE_TEXTS, [{"kind": k, "n": n} for k, n in (("lamp", 1), ("lamp", 2), ("chair", 3),
                                                                          ("none", 4))], ids=["A", "B", "C", "D"])
    return store


def test_similarity_search_filters_scores_and_vectors(table_store: FusionRAGVectorStore) -> None:
    assert [d.id for d in table_store.similarity_search("q", k=4)] == ["A", "B", "C", "D"]
    assert table_store.similarity_search("q", k=1) == [
        Document(id="A", page_content="Item A: the red lamp.", metadata={"kind": "lamp", "n": 1})]
    assert [d.id for d in table_store.similarity_search("q", k=4, filter={"kind": "chair"})] == ["C"]
    assert [d.id for d in table_store.similarity_search("q", k=4, filter={"n": {"$gte": 3}})] == ["C", "D"]
    assert [d.id for d in table_store.similarity_search("q", k=4, where_document={"$contains": "lamp"})] == ["A", "B"]
    scored = table_store.similarity_search_with_score("q", k=4)
    distances = [1 - float(_unit(Q) @ _unit(v)) for v in TABLE.values()]
    np.testing.assert_allclose([s for _, s in scored], distances, atol=1e-5)
    relevance = table_store.similarity_search_with_relevance_scores("q", k=2)
    np.testing.assert_allclose([s for _, s in relevance], [1 - d for d in distances[:2]], atol=1e-5)
    threshold = table_store.as_retriever(search_type="similarity_score_threshold",
                                         search_kwargs={"k": 4, "score_threshold": 0.9})
    # NOTE: relevance 0.96, 0.95, 0.73, -0.96: cosine's 1 - distance goes below 0 for an opposite
    # vector, and LangChain warns about it (as it does for langchain-chroma, whose default this is).
    with pytest.warns(UserWarning, match="Relevance scores must be between 0 and 1"):
        assert [d.id for d in threshold.invoke("q")] == ["A", "B"]
    assert [d.id for d in table_store.similarity_search_by_vector([0.0, 0.0, 1.0], k=1)] == ["C"]
    by_vector = table_store.similarity_search_by_vector_with_relevance_scores([0.0, 1.0, 0.0], k=1,
                                                                              filter={"kind": "lamp"})
    assert by_vector[0][0].id == "B"
    with pytest.raises(InvalidRequestError, match=r"'wher_document' \(did you mean 'where_document'"):
        table_store.similarity_search("q", wher_document={"$contains": "x"})


def test_relevance_score_fn_overrides_the_cosine_default(table_store: FusionRAGVectorStore) -> None:
    halved = FusionRAGVectorStore(index=table_store.index, relevance_score_fn=lambda d: 1 - d / 2)
    assert halved.similarity_search_with_relevance_scores("c", k=4)[-1][1] == pytest.approx(1 - 1.0 / 2, abs=1e-5)
    assert table_store.similarity_search_with_relevance_scores("c", k=4)[-1][1] == pytest.approx(0.0, abs=1e-5)


def test_mmr_trades_the_near_copy_for_a_diverse_document(table_store: FusionRAGVectorStore) -> None:
    assert [d.id for d in table_store.similarity_search("q", k=2)] == ["A", "B"]
    assert [d.id for d in table_store.max_marginal_relevance_search("q", k=2, fetch_k=4)] == ["A", "C"]
    assert [d.id for d in table_store.max_marginal_relevance_search("q", k=2, fetch_k=4, lambda_mult=1.0)] == [
        "A", "B"]
    assert [d.id for d in table_store.max_marginal_relevance_search("q", k=2, filter={"kind": "lamp"})] == ["A", "B"]
    mmr = table_store.as_retriever(search_type="mmr", search_kwargs={"k": 2, "fetch_k": 4})
    assert [d.id for d in mmr.invoke("q")] == ["A", "C"]


# ---- ids, replacement and deletion ----------------------------------------------------------------------
def _cached(store: FusionRAGVectorStore, chunk_id: str) -> set[str]:
    return {v for v in ("independent", "fused") if store.index.store.has(chunk_id, v)}


def test_a_long_document_reads_back_as_its_chunks(engine: FusionEngine, tmp_path: Path) -> None:
    store = _store(engine, tmp_path)
    long_text = " ".join(TEXTS)  # NOTE: about 60 tokens: three chunks of at most 24.
    store.add_documents([Document(page_content=long_text, metadata={"src": "all"}, id="long"),
                         Document(page_content=TEXTS[0], id="short")])
    chunks = store.get_by_ids(["long", "missing", "short"])
    assert [d.id for d in chunks][-1] == "short" and {d.id for d in chunks[:-1]} == {"long"} and len(chunks) > 2
    assert all(d.metadata == {"src": "all"} for d in chunks[:-1]) and chunks[-1].metadata == {}
    assert " ".join(d.page_content for d in chunks[:-1]) == long_text  # NOTE: cut at spaces, in order.


def test_replacing_and_deleting_documents_removes_their_caches(engine: FusionEngine, tmp_path: Path) -> None:
    store = _store(engine, tmp_path)
    store.add_texts(TEXTS, [{"i": i} for i in range(len(TEXTS))], ids=[f"d{i}" for i in range(len(TEXTS))])
    index = store.index
    entries = {r.chunk_id: r for page in _scan(index) for r in page.values()}
    old = next(cid for cid, r in entries.items() if r.metadata["doc_id"] == "d1")
    dependants = [cid for cid, r in entries.items() if old in r.metadata[NEIGHBOURS_KEY].split()]
    assert _cached(store, old) == {"independent", "fused"} and dependants

    store.add_documents([Document(page_content="A ferry crosses to Marrow each hour.", metadata={"i": 9})], ids=["d1"])
    assert _cached(store, old) == set() and old not in set(index.collection.get()["ids"])
    assert store.get_by_ids(["d1"]) == [Document(id="d1", page_content="A ferry crosses to Marrow each hour.",
                                                 metadata={"i": 9})]
    for cid in dependants:  # NOTE: re-fused after their current neighbours, the replaced chunk gone.
        row = index.collection.get(ids=[cid])["metadatas"][0]
        assert old not in row[NEIGHBOURS_KEY].split()
        kv = index.store.get(cid, "fused", fingerprint=engine.fingerprint)
        assert kv.fused_after == neighbours_digest(row[NEIGHBOURS_KEY].split())
    report = index.verify(repair=False)
    assert report.ok and report.chunks == len(TEXTS) == report.blobs

    gone = set(index.collection.get(where={"doc_id": {"$in": ["d0", "d4"]}})["ids"])
    assert store.delete(["d0", "d4", "never-added"]) is True
    assert all(_cached(store, cid) == set() for cid in gone) and len(index) == len(TEXTS) - 2
    assert store.get_by_ids(["d0", "d4"]) == [] and index.verify(repair=False).ok
    assert index.store.list_ids() == set(index.collection.get()["ids"])  # NOTE: no entry without blobs, no orphan.
    with pytest.raises(InvalidRequestError, match="delete_collection"):
        store.delete()


def test_new_metadata_for_the_same_text_replaces_the_old_without_prefills(engine: FusionEngine, tmp_path: Path
                                                                            ) -> None:
    store = _store(engine, tmp_path)
    store.add_texts(TEXTS[:2], [{"a": 1, "old": "x"}, {"b": 2}], ids=["1", "2"])
    prefills = store.index.ingestor.prefills
    store.add_texts(TEXTS[:1], [{"a": 2}], ids=["1"])
    assert store.index.ingestor.prefills == prefills
    assert [d.metadata for d in store.get_by_ids(["1", "2"])] == [{"a": 2}, {"b": 2}]
    with pytest.raises(InvalidRequestError, match="reserved key 'doc_id'"):
        store.add_texts(["x y z"], [{"doc_id": "mine"}])


def test_documents_from_the_store_are_reused_by_chat_fusionrag(engine: FusionEngine, tmp_path: Path) -> None:
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    from fusionrag_integrations.langchain import ChatFusionRAG

    store = _store(engine, tmp_path)
    store.add_texts(TEXTS)
    prompt = ChatPromptTemplate.from_messages([("system", "Context:\n\n{context}"), ("human", "{question}")])
    chat = ChatFusionRAG(index=store.index, max_tokens=2)
    join = "\n\n".join
    chain = ({"context": store.as_retriever(search_kwargs={"k": 2}) | (lambda docs: join(d.page_content for d in docs)),
              "question": RunnablePassthrough()} | prompt | chat)
    message = chain.invoke("Who designed the Lumen lighthouse?")
    assert message.response_metadata["reused_tokens"] > 0 and message.response_metadata["cache_misses"] == 0
    assert isinstance((chain | StrOutputParser()).invoke("Who is Piet Orran?"), str)


def _scan(index: FusionIndex) -> Iterator[dict[str, Any]]:
    from fusionrag_core.ingest import chroma
    return chroma.scan(index.collection, ["metadatas"])


# ---- threads and servers --------------------------------------------------------------------------------
def test_threads_searching_one_store_get_their_own_results(table_store: FusionRAGVectorStore) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def search(i: int) -> list[str | None]:
        if i % 2:
            return [d.id for d in table_store.max_marginal_relevance_search("q", k=2, fetch_k=4)]
        return [d.id for d in table_store.similarity_search("q", k=1, filter={"kind": {"$ne": "lamp"}})]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(search, range(16)))
    assert results == [(["A", "C"] if i % 2 else ["C"]) for i in range(16)]


@pytest.mark.anyio
async def test_concurrent_async_adds_queue_for_the_corpus_writer_lock(engine: FusionEngine, tmp_path: Path) -> None:
    import asyncio

    store = _store(engine, tmp_path)
    ids = await asyncio.gather(*(store.aadd_texts([text], ids=[f"t{i}"]) for i, text in enumerate(TEXTS)))
    assert ids == [[f"t{i}"] for i in range(len(TEXTS))] and len(store.index) == len(TEXTS)
    assert store.index.verify(repair=False).ok
    impatient = _store(engine, tmp_path, writer_wait_s=0.0)
    with writing(impatient.index.store, "test"), pytest.raises(CorpusLockedError):
        impatient.add_texts(["One more text."])


@pytest.mark.servers
def test_chroma_server_through_host_and_port_or_client(engine: FusionEngine, tmp_path: Path) -> None:
    from urllib.parse import urlsplit

    from tests.servers import running_chroma_server

    with running_chroma_server(tmp_path / "server") as url:
        parts = urlsplit(url)
        store = FusionRAGVectorStore(collection_name="remote", embedding_function=DeterministicFakeEmbedding(size=8),
                                     host=parts.hostname, port=parts.port, engine=engine, config=CONFIG,
                                     data_dir=tmp_path / "data")
        store.add_texts(TEXTS[:2], ids=["a", "b"])
        assert Path(store.index.store.root) == kv_dir(tmp_path / "data", "remote")  # type: ignore[attr-defined]
        assert not (tmp_path / "data" / "chroma").exists()
        client = chromadb.HttpClient(host=str(parts.hostname), port=int(parts.port or 0),
                                     settings=Settings(anonymized_telemetry=False))
        again = FusionRAGVectorStore(collection_name="remote", embedding_function=DeterministicFakeEmbedding(size=8),
                                     client=client, engine=engine, kv_store=store.index.store)
        assert {d.id for d in again.similarity_search(TEXTS[1], k=2)} == {"a", "b"}
        again.delete(["a"])
        assert [d.id for d in store.get_by_ids(["a", "b"])] == ["b"]


def test_get_pages_entries_like_langchain_chroma(table_store: FusionRAGVectorStore) -> None:
    everything = table_store.get()
    assert sorted(everything["ids"]) == ["A", "B", "C", "D"] and set(everything) == {"ids", "documents", "metadatas"}
    assert {"kind": "chair", "n": 3} in everything["metadatas"]
    lamps = table_store.get(where={"kind": "lamp"}, include=["documents"])
    assert sorted(lamps["ids"]) == ["A", "B"] and set(lamps) == {"ids", "documents"}
    page = table_store.get(ids=["C", "A", "nope"], include=["embeddings"], where_document={"$contains": "blue"})
    assert page["ids"] == ["C"] and np.allclose(page["embeddings"][0], _unit(TABLE["C"]), atol=1e-6)
    assert len(table_store.get(limit=2, offset=1)["ids"]) == 2 and table_store.get(ids="nope") == {
        "ids": [], "documents": [], "metadatas": []}


def test_one_text_in_two_documents_is_one_chunk_until_its_last_owner_goes(engine: FusionEngine, tmp_path: Path) -> None:
    store = _store(engine, tmp_path)
    store.add_texts([TEXTS[0], TEXTS[0], TEXTS[1]], [{"who": "x"}, {"who": "y"}, {}], ids=["x", "y", "z"])
    assert len(store.index) == 2 and [d.id for d in store.similarity_search(TEXTS[0], k=3)][:1] == ["x"]
    assert [d.metadata for d in store.get_by_ids(["y"])] == [{"who": "x"}]  # NOTE: the first owner's metadata.
    chunk = store.index.document_chunks(["y"])["y"][0].chunk_id
    store.delete(["x"])
    assert _cached(store, chunk) == {"independent", "fused"} and [d.id for d in store.get_by_ids(["x", "y"])] == ["y"]
    store.delete(["y"])
    assert _cached(store, chunk) == set() and len(store.index) == 1
