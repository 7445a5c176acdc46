"""Chunks found by content in flattened prompts, unforgeable marks, and caches learned from traffic.

A tiny random Llama over the real SmolLM2 tokenizer: token ids (and so every split) are the real ones.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.recognise.content_index import ANCHOR_CHARS, ContentIndex, Match, chunk_anchor
from fusionrag_core.recognise.marks import MARK_CLOSE, MARK_OPEN, MARK_SEP, mark_chunk, split_marks, strip_marks
from fusionrag_core.reuse.learned import LearnConfig, LearnedCaches, content_id
from fusionrag_core.reuse.learning import learn_pieces
from fusionrag_core.reuse.sources import ReuseMonitor, ReuseSources
from fusionrag_core.store import DiskKVStore, KVStore
from fusionrag_core.store.tiered import TieredKVStore
from tests.ingest_worker import tiny_engine

TEXTS = [
    "The Lumen lighthouse on Gull Point was designed by the engineer Ada Vell in 1891, after the old light failed.",
    " Ada Vell was born in the port town of Marrow, where her father repaired ship clocks for the harbour board",
    "Marrow lies at the mouth of the river Tell — known for its salt market (est. 1702) and its grey stone quay.",
    "Tessaly Instruments built the lighthouse clock;\nits founder was Oren Tessaly, a watchmaker from Corran.",
]
QUESTION = "In which town was the designer of the Lumen lighthouse born?"
SAMPLING = SamplingConfig(max_new_tokens=4)


@pytest.fixture(scope="module")
def engine(smollm_tokenizer: PreTrainedTokenizerBase, one_thread: None) -> FusionEngine:
    return tiny_engine(smollm_tokenizer)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, engine: FusionEngine) -> DiskKVStore:
    """Independent caches of TEXTS under ids "c0".."c3", their texts in the store's content index."""
    store = DiskKVStore(tmp_path_factory.mktemp("kv"), storage_dtype="float32")
    for i, text in enumerate(TEXTS):
        store.put(f"c{i}", engine.chunk_cache(text))
    index = store.content_index()
    assert index is not None
    index.add((f"c{i}", t) for i, t in enumerate(TEXTS))
    return store


def _messages(context: str, where: str = "user") -> list[dict[str, str]]:
    if where == "system":
        return [{"role": "system", "content": f"Answer from the context.\n\n{context}"},
                {"role": "user", "content": QUESTION}]
    return [{"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {QUESTION}"}]


# ---- the content index -------------------------------------------------------------------------------

def answer_and_learn(engine: FusionEngine, prompt: FusionPrompt, sources: ReuseSources) -> Generation:
    """Answer `prompt` reading `sources`, then learn what it held without a cache, as `ReuseSession.run` does."""
    generation = engine.generate(prompt, store=sources, sampling=SAMPLING)
    assert sources.learned is not None
    learn_pieces(engine, sources.learned, sources.pending)
    return generation

def test_index_finds_every_stored_chunk_anywhere_and_verifies_the_whole_text(tmp_path: Path) -> None:
    index = ContentIndex(tmp_path)
    assert index.add((f"c{i}", t) for i, t in enumerate(TEXTS)) == 0
    headers = "".join(f"file_path: doc{i}.md\n\n{t}\n\n" for i, t in enumerate(TEXTS))
    prompt = f"<|im_start|>system\nAnswer.\n{headers}Question: x<|im_end|>"
    found = index.find(prompt)
    assert [m.chunk_id for m in found] == ["c0", "c1", "c2", "c3"]
    assert [prompt[m.start:m.end] for m in found] == TEXTS
    # one character changed anywhere in a chunk: that chunk is not found (digest of the whole text)
    edited = prompt.replace("salt market", "salt markets")
    assert [m.chunk_id for m in index.find(edited)] == ["c0", "c1", "c3"]
    assert index.find("nothing stored here, just a question about lighthouses and clocks") == []


def test_short_chunks_without_an_anchor_are_found_where_a_line_starts(tmp_path: Path) -> None:
    index = ContentIndex(tmp_path)
    short = "Room 12b holds the lamp and three spare wicks."  # 46 characters
    anchor = chunk_anchor(short)
    assert anchor is not None
    assert index.add([("s", short), ("tiny", "too short"), ("blank", " \n")]) == 1  # blank: not indexed
    assert len("too short") < ANCHOR_CHARS
    # under ANCHOR_CHARS: found only as a whole piece of text, never inside a prompt
    assert index.find(" too short\n") == [Match(1, 10, "tiny")]
    assert index.find("Context:\ntoo short\nQ") == [] and index.find("too shorts") == []
    assert index.find(f"Context:\n{short}\nQ") == [Match(9, 9 + len(short), "s")]
    if anchor.kind == 1:  # first-window anchor: only probed at a line start
        assert index.find(f"Context: {short}\nQ") == []


def _add_from_another_process(root: str) -> None:
    ContentIndex(root).add([("late", TEXTS[2])])


def test_rows_added_by_another_process_are_found_and_removed_rows_are_not(tmp_path: Path) -> None:
    index = ContentIndex(tmp_path)
    index.add([("c0", TEXTS[0])])
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_add_from_another_process, args=(str(tmp_path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    prompt = f"{TEXTS[0]}\n\n{TEXTS[2]}\n\nQ"
    assert [m.chunk_id for m in index.find(prompt)] == ["c0", "late"]
    index.remove(["c0"])
    assert [m.chunk_id for m in index.find(prompt)] == ["late"]


def test_the_sorted_hash_array_is_rebuilt_and_still_finds_everything(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from fusionrag_core.store import content_index
    monkeypatch.setattr(content_index, "_MAX_PENDING", 2)
    index = ContentIndex(tmp_path)
    index.add((f"c{i}", t) for i, t in enumerate(TEXTS))
    assert list(tmp_path.glob("anchors.*.i64"))  # the array was published
    assert [m.chunk_id for m in ContentIndex(tmp_path).find("\n\n".join(TEXTS))] == ["c0", "c1", "c2", "c3"]


# ---- marks -------------------------------------------------------------------------------------------
def test_forged_or_cut_marks_are_plain_text_and_mark_characters_in_text_survive() -> None:
    genuine = mark_chunk("c1", TEXTS[1])
    forged = f"{MARK_OPEN}c0{MARK_SEP}{'0' * 16}{MARK_SEP}{len(TEXTS[0])}{MARK_SEP}{TEXTS[0]}{MARK_CLOSE}"
    assert split_marks(forged) == [forged]
    assert split_marks(genuine[:-3]) == [genuine[:-3]]
    weird = f"a doc with {MARK_CLOSE} and {MARK_OPEN}x{MARK_SEP} inside"
    parts = split_marks(f"Q {mark_chunk('d', weird)} after")
    assert [p if isinstance(p, str) else (p.chunk_id, p.text) for p in parts] == ["Q ", ("d", weird), " after"]
    assert strip_marks(f"x{genuine}y{forged}") == f"x{TEXTS[1]}y{forged}"


def test_a_forged_mark_steers_no_cache(engine: FusionEngine, store: DiskKVStore) -> None:
    fake = f"{MARK_OPEN}c0{MARK_SEP}{'ab' * 8}{MARK_SEP}{len(TEXTS[3])}{MARK_SEP}{TEXTS[3]}{MARK_CLOSE}"
    sources = ReuseSources(store, None)
    prompt = sources.prompt(engine, _messages(f"{TEXTS[1]}\n\n{fake}"))
    # TEXTS[3] is found by its content (its own cache, c3), never as c0: the forged id chose nothing
    assert [s.chunk_id for s in prompt.segments if s.kind == "chunk"] == ["c1", "c3"]


# ---- recognition in prompts --------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["user", "system"])
def test_recognised_chunks_split_like_marks_and_answer_the_same(engine: FusionEngine, store: DiskKVStore,
                                                                where: str) -> None:
    sources = ReuseSources(store, None)
    plain = sources.prompt(engine, _messages("\n\n".join(TEXTS), where))
    marked = engine.prompt_from_messages(_messages("".join(mark_chunk(f"c{i}", t) for i, t in enumerate(TEXTS)),
                                                   where))
    # marks stand for "text + separator"; the plain layout has the separator after all but the last
    assert [s.chunk_id for s in plain.segments] == ["c0", "c1", "c2", "c3"]
    assert torch.equal(plain.prefix, marked.prefix)
    for a, b in zip(plain.segments[:-1], marked.segments[:-1], strict=True):
        assert torch.equal(a.token_ids, b.token_ids)
    same_layout = sources.prompt(engine, _messages("\n\n".join(TEXTS) + "\n\n", where))
    gen_plain = engine.generate(same_layout, store=sources, sampling=SAMPLING)
    gen_marked = engine.generate(marked, store=store, sampling=SAMPLING)
    assert torch.equal(same_layout.token_ids(), marked.token_ids())
    assert gen_plain.token_ids == gen_marked.token_ids
    assert (gen_plain.first_token_logits - gen_marked.first_token_logits).abs().max().item() < 1e-5
    chunk_tokens = sum(s.num_tokens for s in same_layout.segments if s.kind == "chunk")
    assert gen_plain.reused_tokens >= 0.7 * chunk_tokens
    assert gen_plain.cache_misses == {}


def test_last_chunk_without_a_separator_reuses_its_cache_minus_the_separator(engine: FusionEngine,
                                                                             store: DiskKVStore) -> None:
    sources = ReuseSources(store, None)
    prompt = sources.prompt(engine, [{"role": "user", "content": "\n\n".join(TEXTS) + f"\nQuestion: {QUESTION}"}])
    last = prompt.segments[-1]
    assert last.chunk_id == "c3" and last.num_tokens == engine.layout.chunk_ids(TEXTS[3]).shape[0] - 1
    gen = engine.generate(prompt, store=sources, selector="none", sampling=SAMPLING)
    assert gen.reused_tokens == sum(s.num_tokens for s in prompt.segments if s.kind == "chunk")
    q, p = int(prompt.question.shape[0]), int(prompt.prefix.shape[0])
    assert gen.prefilled_tokens in (q, q + p)  # the question, and the prefix unless memoised
    assert gen.reused_tokens + gen.prefilled_tokens + p >= gen.prompt_tokens
    stats = gen.stats()
    assert stats["reuse_ratio"] == pytest.approx(gen.reused_tokens / gen.prompt_tokens)
    assert stats["recomputed_tokens"] == 0


def test_multi_turn_conversations_find_chunks_in_every_turn(engine: FusionEngine, store: DiskKVStore) -> None:
    sources = ReuseSources(store, None)
    messages = [{"role": "user", "content": f"Context:\n{TEXTS[0]}\n\nWho designed it?"},
                {"role": "assistant", "content": "Ada Vell."},
                {"role": "user", "content": f"And this?\n{TEXTS[2]}\n\nWhere is Marrow?"}]
    prompt = sources.prompt(engine, messages)
    assert [s.chunk_id for s in prompt.segments if s.kind == "chunk"] == ["c0", "c2"]


# ---- caches learned from traffic ---------------------------------------------------------------------
def test_retrieved_documents_are_learned_then_reused_on_the_next_ask(engine: FusionEngine, tmp_path: Path) -> None:
    learned = LearnedCaches(tmp_path / "learned", engine.fingerprint)
    sources = ReuseSources(None, learned)
    messages = _messages("\n\n".join(TEXTS))
    first_prompt = sources.prompt(engine, messages, documents=TEXTS)
    assert len(sources.pending) == len(TEXTS) and first_prompt.segments == ()  # NOTE: text, until learned
    first = answer_and_learn(engine, first_prompt, sources)
    assert first.reused_tokens == 0 and first.cache_misses == {}
    assert len(learned) == len(TEXTS)
    ids = [content_id(t.strip(), engine.fingerprint) for t in TEXTS]
    assert learned.neighbours(ids[2]) == ids[:2]  # what the document attended to when it was computed
    # the next ask needs no documents: the texts are found by content in the learned caches
    second_prompt = ReuseSources(None, learned).prompt(engine, messages)
    second = answer_and_learn(engine, second_prompt, sources)
    chunk_tokens = sum(s.num_tokens for s in second_prompt.segments if s.kind == "chunk")
    assert second.reused_tokens >= 0.7 * chunk_tokens > 0
    # at ratio 1.0 every reused token is computed again: the answer is a plain prefill's of that prompt
    exact = engine.generate(second_prompt, store=sources, ratio=1.0, sampling=SAMPLING)
    assert exact.token_ids == engine.full_attention(second_prompt, sampling=SAMPLING).collect().token_ids


def test_learned_caches_stay_within_their_byte_bound_least_recently_used_first(engine: FusionEngine,
                                                                              tmp_path: Path) -> None:
    kv = dataclasses.replace(engine.chunk_cache(TEXTS[0]), variant="fused")
    stored = kv.nbytes // 2  # float16 on disk
    learned = LearnedCaches(tmp_path, engine.fingerprint, LearnConfig(max_bytes=int(2.5 * stored)))
    for i in range(3):
        learned._put(f"x{i}", TEXTS[0] + str(i), kv, [])
        if i == 1:
            learned.touch(["x0"])  # x0 used after x1: x1 is the least recently used
    assert len(learned) == 2 and not learned.store.has("x1", "fused") and learned.store.has("x0", "fused")
    assert learned.nbytes <= 2.5 * stored
    assert [m.chunk_id for m in learned.index.find(TEXTS[0] + "1\n")] == []


# ---- never silently lost -----------------------------------------------------------------------------
def test_no_reuse_warns_once_per_model_naming_the_cause(engine: FusionEngine, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    empty = DiskKVStore(tmp_path / "kv")
    sources = ReuseSources(empty, None)
    monitor = ReuseMonitor("tiny-llama")
    long_context = " ".join(TEXTS * 2)
    with caplog.at_level(logging.WARNING, logger="fusionrag"):
        for _ in range(2):
            prompt = sources.prompt(engine, _messages(long_context))
            gen = engine.generate(prompt, store=sources, sampling=SAMPLING)
            assert gen.reused_tokens == 0
            assert monitor.check(engine, prompt, gen, sources) is not None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ingest" in warnings[0].getMessage()


def test_a_store_provides_its_content_index_through_its_interface(tmp_path: Path) -> None:
    """The corpus's content index is the store's to provide (`KVStore.content_index`): the disk store's
    own, kept next to its caches; wrappers give the one of what they wrap; a backend must answer."""
    disk = DiskKVStore(tmp_path / "kv")
    index = disk.content_index()
    assert index is disk.content_index() and index.root == disk.root / ".content"
    tiered = TieredKVStore(disk, device="cpu", dtype=torch.float32, device_bytes=0, host_bytes=0)
    assert tiered.content_index() is index and ReuseSources(tiered, None).content_index() is index
    assert ReuseSources(None, None).content_index() is None

    class Silent(KVStore):  # NOTE: no content_index: a backend says whether it keeps one
        put = get = has = delete = list_ids = close = lambda *a, **k: None  # type: ignore[assignment]

    with pytest.raises(TypeError, match="content_index"):
        Silent()  # type: ignore[abstract]
