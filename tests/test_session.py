"""The reuse session and the request options both integrations share (fusionrag_integrations.session, .request).

One rule for where learned caches live, one validation of a request's options, and one session
shared by many threads with no request's values kept on it. A 1-layer random Llama over the real
SmolLM2 tokenizer: the plumbing is under test, not the answers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.paths import DEFAULT_DATA_DIR, learned_dir
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.query.select import SELECTORS
from fusionrag_core.recognise.marks import mark_chunk
from fusionrag_core.store import DiskKVStore, KVStore
from fusionrag_integrations import request as request_module
from fusionrag_integrations.langchain import ChatFusionRAG
from fusionrag_integrations.langchain import FusionRAGLLM as LangChainLLM
from fusionrag_integrations.llama_index import FusionRAGLLM as LlamaIndexLLM
from fusionrag_integrations.request import OPTION_NAMES, RESPONSE_FORMAT, TOOL_OPTIONS, RequestOptions
from fusionrag_integrations.session import ReuseConfig, ReuseSession
from tests.lighthouse import QUESTION, TEXTS

FRAMEWORKS = [ChatFusionRAG, LangChainLLM, LlamaIndexLLM]
Ask = Callable[[str], tuple[str, Any]]


@pytest.fixture(scope="module")
def store(one_layer_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory) -> KVStore:
    store = DiskKVStore(tmp_path_factory.mktemp("kv"))
    first = one_layer_engine.chunk_cache(TEXTS[0])
    store.put("c0", first)
    store.put("c1", one_layer_engine.chunk_cache(TEXTS[1]))
    store.put("c1", one_layer_engine.chunk_cache(TEXTS[1], [first]))  # NOTE: c1 has both variants
    return store


# ---- where learned caches live: one rule --------------------------------------------------------
@pytest.mark.parametrize("cls", FRAMEWORKS)
@pytest.mark.parametrize(("given", "where"), [
    ({}, lambda tmp, fp: learned_dir(DEFAULT_DATA_DIR, fp)),
    ({"data_dir": "DATA"}, lambda tmp, fp: learned_dir(tmp / "DATA", fp)),
    ({"learned_dir": "OWN"}, lambda tmp, fp: tmp / "OWN"),
    ({"data_dir": "DATA", "learned_dir": "OWN"}, lambda tmp, fp: tmp / "OWN"),
], ids=["default", "data_dir", "learned_dir", "both"])
def test_learned_caches_live_where_one_rule_says_in_both_frameworks(
        cls: type, given: dict[str, str], where: Callable[[Path, str], Path], one_layer_engine: FusionEngine,
        tmp_path: Path) -> None:
    paths = {name: str(tmp_path / value) for name, value in given.items()}
    model = cls(engine=one_layer_engine, **paths)
    expected = where(tmp_path, one_layer_engine.fingerprint)
    assert model.reuse_session().learned_root == expected
    assert ReuseConfig(**paths).root(one_layer_engine.fingerprint) == expected


@pytest.mark.parametrize("cls", [ChatFusionRAG, LangChainLLM])
def test_a_model_bound_to_an_index_learns_under_the_index_data_dir(cls: type, one_layer_engine: FusionEngine,
                                                                     tmp_path: Path) -> None:
    from fusionrag_core.index import FusionIndex
    from fusionrag_core.ingest.config import IngestConfig

    index = FusionIndex.open(one_layer_engine, tmp_path / "corpus", config=IngestConfig(neighbours=1, chunk_tokens=64))
    fingerprint = one_layer_engine.fingerprint
    assert cls(index=index).reuse_session().learned_root == learned_dir(tmp_path / "corpus", fingerprint)
    explicit = cls(index=index, data_dir=str(tmp_path / "elsewhere")).reuse_session().learned_root
    assert explicit == learned_dir(tmp_path / "elsewhere", fingerprint)  # data_dir given: it wins


def test_a_learning_request_writes_its_caches_there_in_both_frameworks(one_layer_engine: FusionEngine,
                                                                        tmp_path: Path) -> None:
    # NOTE: a prompt holding a retrieved text is learned whichever framework answers it; here the
    # session is asked directly for the retrieved text, as each framework's observer supplies it.
    for cls in (ChatFusionRAG, LlamaIndexLLM):
        data_dir = tmp_path / cls.__module__.split(".")[1]
        session = cls(engine=one_layer_engine, data_dir=str(data_dir), max_new_tokens=2).reuse_session()
        options = RequestOptions(SamplingConfig(max_new_tokens=2))
        pieces = list(session.answer([{"role": "user", "content": f"{TEXTS[2]}\n{QUESTION}"}], options, [TEXTS[2]]))
        assert isinstance(pieces[-1], Generation) and pieces[-1].reused_tokens == 0  # learned, not reused
        learned = session.learned()
        assert learned is not None and len(learned) == 1
        assert (learned_dir(data_dir, one_layer_engine.fingerprint) / "lru.sqlite").exists()


# ---- options: one declaration, one validation per request ------------------------------------------
@pytest.mark.parametrize("cls", FRAMEWORKS)
def test_every_option_is_a_field_and_a_per_call_argument(cls: type, one_layer_engine: FusionEngine) -> None:
    fields = cls.option_fields()
    assert sorted(fields.values()) == sorted(OPTION_NAMES)
    assert set(fields) <= set(cls.model_fields)
    assert cls.call_options() == {*fields, *OPTION_NAMES, RESPONSE_FORMAT, *TOOL_OPTIONS}
    description = cls.model_fields["selector"].description
    assert all(name in description for name in SELECTORS)
    defaults = cls(engine=one_layer_engine).request_options({})
    assert defaults.sampling.temperature == SamplingConfig().temperature and defaults.selector is None


def test_options_are_validated_once_per_request(one_layer_engine: FusionEngine, store: KVStore,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    chat = ChatFusionRAG(engine=one_layer_engine, store=store, max_tokens=2, learn=False)
    llm = LlamaIndexLLM(engine=one_layer_engine, kv_store=store, max_new_tokens=2, learn=False)
    built: list[RequestOptions] = []
    selectors: list[str] = []
    post_init, get_selector = RequestOptions.__post_init__, request_module.get_selector

    def counted(self: RequestOptions) -> None:
        built.append(self)
        post_init(self)

    def counted_selector(name: str) -> Any:
        selectors.append(name)
        return get_selector(name)

    monkeypatch.setattr(RequestOptions, "__post_init__", counted)
    monkeypatch.setattr(request_module, "get_selector", counted_selector)
    calls: list[Callable[[], Any]] = [
        lambda: chat.invoke("Hello", selector="first_k", ratio=0.5),
        lambda: list(chat.stream("Hello", selector="first_k")),
        lambda: llm.complete("Hello", selector="first_k", ratio=0.5),
        lambda: list(llm.stream_complete("Hello", selector="first_k")),
    ]
    for call in calls:
        built.clear()
        selectors.clear()
        call()
        assert len(built) == 1 and built[0].selector == "first_k"
        assert selectors == ["first_k"]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"selector": "best"}, "unknown selector"),
    ({"ratio": 1.5}, "recompute ratio"),
    ({"variant": "warm"}, "unknown cache variant"),
    ({"top_p": 0.0}, "top_p"),
    ({"caches": {}}, "unsupported call option"),
    ({"max_new_tokens": 2, "temperature": 0.5, "max_tokens": 3}, "pass one"),
])
def test_a_bad_call_option_is_refused_alike_in_both_frameworks(overrides: dict[str, Any], message: str,
                                                                one_layer_engine: FusionEngine) -> None:
    models: list[Any] = [ChatFusionRAG(engine=one_layer_engine), LlamaIndexLLM(engine=one_layer_engine)]
    if "max_tokens" in overrides:
        models = models[:1]  # NOTE: only LangChain names a field max_tokens
    for model in models:
        with pytest.raises(InvalidRequestError, match=message):
            model.request_options(overrides)


def test_full_attention_and_variant_are_per_call_options_in_both_frameworks(one_layer_engine: FusionEngine,
                                                                          store: KVStore) -> None:
    prompt = f"{mark_chunk('c0', TEXTS[0])}\n{mark_chunk('c1', TEXTS[1])}\n{QUESTION}"
    chat = ChatFusionRAG(engine=one_layer_engine, store=store, max_tokens=2, learn=False)
    llm = LlamaIndexLLM(engine=one_layer_engine, kv_store=store, max_new_tokens=2, learn=False)
    for stats in (lambda **o: chat.invoke(prompt, **o).response_metadata,
                  lambda **o: llm.complete(prompt, **o).additional_kwargs):
        assert stats()["fused_chunks"] == 1
        assert (stats(variant="independent")["fused_chunks"], stats(variant="independent")["independent_chunks"]) == (
            0, 2)
        assert stats()["reused_tokens"] > 0 and stats(full_attention=True)["reused_tokens"] == 0


# ---- many threads, one session --------------------------------------------------------------------
REQUESTS = {
    "a": (f"{mark_chunk('c0', TEXTS[0])}\n{QUESTION}", {"max_new_tokens": 5, "selector": "none"}),
    "b": (f"{mark_chunk('c1', TEXTS[1])}\nWho repaired clocks?", {"max_new_tokens": 3, "selector": "all"}),
}


def _session_ask(engine: FusionEngine, store: KVStore) -> Ask:
    session = ReuseSession(engine, store, ReuseConfig(learn=False))

    def ask(name: str) -> tuple[str, Any]:
        text, options = REQUESTS[name]
        pieces = list(session.answer([{"role": "user", "content": text}], RequestOptions.from_values(options)))
        generation = pieces[-1]
        assert isinstance(generation, Generation)
        return "".join(str(p) for p in pieces[:-1]), (generation.token_ids, generation.selector,
                                                      sorted(generation.found_by))
    return ask


def _langchain_ask(engine: FusionEngine, store: KVStore) -> Ask:
    chat = ChatFusionRAG(engine=engine, store=store, learn=False)

    def ask(name: str) -> tuple[str, Any]:
        text, options = REQUESTS[name]
        meta = (message := chat.invoke(text, **options)).response_metadata
        return str(message.content), (meta["completion_tokens"], meta["selector"], meta["chunk_found_by"])
    return ask


def _llama_index_ask(engine: FusionEngine, store: KVStore) -> Ask:
    llm = LlamaIndexLLM(engine=engine, kv_store=store, learn=False)

    def ask(name: str) -> tuple[str, Any]:
        text, options = REQUESTS[name]
        response = llm.complete(text, **options)
        meta = response.additional_kwargs
        return response.text, (meta["completion_tokens"], meta["selector"], meta["chunk_found_by"])
    return ask


@pytest.mark.parametrize("make", [_session_ask, _langchain_ask, _llama_index_ask],
                         ids=["session", "langchain", "llama_index"])
def test_two_threads_sharing_one_session_get_their_own_results(
        make: Callable[[FusionEngine, KVStore], Ask], one_layer_engine: FusionEngine, store: KVStore,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both requests are held inside `engine.stream` until the other has reached it, so any
    request value kept on the shared model or session would be the other request's."""
    ask = make(one_layer_engine, store)
    serial = {name: ask(name) for name in REQUESTS}
    assert serial["a"] != serial["b"]
    barrier = threading.Barrier(2, timeout=30)
    stream = one_layer_engine.stream
    held_requests: list[int] = []

    def held(*args: Any, **kwargs: Any) -> Any:
        held_requests.append(barrier.wait())
        return stream(*args, **kwargs)

    monkeypatch.setattr(one_layer_engine, "stream", held)
    answers: dict[str, tuple[str, Any]] = {}
    threads = [threading.Thread(target=lambda n=name: answers.__setitem__(n, ask(n))) for name in REQUESTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(held_requests) == [0, 1] and answers == serial
