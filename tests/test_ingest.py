"""Ingest: chunking, offline fusion, updates, deletes, verify/repair and resume after SIGKILL.

A tiny random Llama (fp32, CPU) stands in for the model; the tokenizer and the embedding model
are the real ones, so chunk sizes and neighbours are those of real text.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.data import sample_corpus_dir
from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.chroma import all_ids
from fusionrag_core.ingest.chunking import Chunker, ChunkingConfig, chunk_id
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.records import NEIGHBOURS_KEY, OWNERS_KEY, PENDING_KEY
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.runtime.kv import ChunkKV
from fusionrag_core.store import DiskKVStore, StorageDType
from tests.ingest_worker import tiny_engine, tokenizer_dir

REPO_ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


@pytest.fixture(scope="module")
def docs() -> dict[str, str]:
    """The sample corpus, first paragraphs only (CPU time)."""
    out = {}
    for path in sorted(sample_corpus_dir().glob("*.md")):
        paragraphs = [p for p in path.read_text().split("\n\n") if p.strip() and not p.startswith("#")]
        out[path.stem] = "\n\n".join(paragraphs[:2])
    return out


class Opener:
    """Opens indexes in fresh directories under `root` and counts the engine's chunk prefills."""

    def __init__(self, engine: FusionEngine, root: Path) -> None:
        self.engine = engine
        self.root = root
        self.prefills = 0
        self._made = 0

    def __call__(self, storage_dtype: StorageDType = "float16", **config: Any) -> FusionIndex:
        self._made += 1
        settings = {"chunk_tokens": 40, "neighbours": 2, "batch_size": 4, **config}
        return FusionIndex.open(self.engine, self.root / f"index{self._made}", config=IngestConfig(**settings),
                                storage_dtype=storage_dtype)


@pytest.fixture
def make_index(engine: FusionEngine, tmp_path: Path) -> Iterator[Opener]:
    opener = Opener(engine, tmp_path)
    original = engine.chunk_cache
    original_many = engine.chunk_caches

    def counting(*args: Any, **kwargs: Any) -> ChunkKV:
        opener.prefills += 1
        return original(*args, **kwargs)

    def counting_many(token_ids: Any, neighbours: Any) -> list[ChunkKV]:
        if len(token_ids) > 1:  # NOTE: one chunk goes through chunk_cache, counted there.
            opener.prefills += len(token_ids)
        return original_many(token_ids, neighbours)

    engine.chunk_cache = counting  # type: ignore[method-assign]
    engine.chunk_caches = counting_many  # type: ignore[method-assign]
    yield opener
    del engine.chunk_cache
    del engine.chunk_caches


def _metadata(index: FusionIndex, ids: list[str] | None = None) -> dict[str, dict]:
    res = index.collection.get(ids=ids, include=["metadatas"])
    return {cid: dict(m or {}) for cid, m in zip(res["ids"], res["metadatas"] or [], strict=True)}


def _neighbours(index: FusionIndex) -> dict[str, list[str]]:
    return {cid: str(m.get(NEIGHBOURS_KEY, "")).split() for cid, m in _metadata(index).items()}


def _assert_consistent(index: FusionIndex) -> None:
    """Every Chroma id has both blobs, and the store holds nothing else."""
    chroma = all_ids(index.collection)
    assert index.store.list_ids("independent") == chroma
    assert index.store.list_ids("fused") == chroma
    assert index.verify(repair=False).ok


# ---- chunking ---------------------------------------------------------------------------------------
def test_chunks_fit_the_token_budget_and_keep_the_text(tokenizer: PreTrainedTokenizerBase,
                                                        docs: dict[str, str]) -> None:
    text = "\n\n".join(docs.values())
    chunker = Chunker(tokenizer, ChunkingConfig(chunk_tokens=48))
    chunks = chunker.split(text)
    assert len(chunks) > 5
    lengths = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in chunks]
    assert max(lengths) <= 48
    assert sum(lengths) > 0.5 * 48 * len(chunks), "chunks should be filled towards the budget"
    assert "".join("".join(chunks).split()) == "".join(text.split()), "chunks must keep all the text, in order"
    # sentence-aware: a chunk ends at a sentence end whenever the whole sentence fitted
    ends = sum(c.rstrip().endswith((".", "!", "?", '"')) for c in chunks)
    assert ends >= 0.6 * len(chunks)


def test_chunk_ids_depend_on_text_model_and_chunking() -> None:
    config = ChunkingConfig(chunk_tokens=64)
    base = chunk_id("Ada Vell built the lamp.", "fp-a", config)
    assert base == chunk_id("Ada Vell built the lamp.", "fp-a", ChunkingConfig(chunk_tokens=64))
    assert len(base) == 32 and all(c in "0123456789abcdef" for c in base)
    assert base != chunk_id("Ada Vell built the lamp!", "fp-a", config)
    assert base != chunk_id("Ada Vell built the lamp.", "fp-b", config)
    assert base != chunk_id("Ada Vell built the lamp.", "fp-a", ChunkingConfig(chunk_tokens=65))
    with pytest.raises(InvalidRequestError, match="chunk_overlap"):
        ChunkingConfig(chunk_tokens=8, chunk_overlap=8)


# ---- ingest -----------------------------------------------------------------------------------------
def test_same_text_twice_is_no_work(
    make_index: Opener, docs: dict[str, str], capfd: pytest.CaptureFixture[str]
) -> None:
    index = make_index()
    texts = [docs["ada_vell"], docs["marrow"]]
    first = index.add_texts(texts, progress=True)
    bars = capfd.readouterr().err
    assert "independent caches" in bars and "fused caches" in bars and "chunk/s" in bars
    n = len({c for ids in first.chunk_ids for c in ids})
    assert first.new_chunks == n > 2
    assert make_index.prefills == first.prefills == 2 * n
    assert first.chunk_ids == [[chunk_id(c, index.engine.fingerprint, index.config.chunking)
                                for c in index.ingestor.chunker.split(t)] for t in texts]
    _assert_consistent(index)

    again = index.add_texts(texts)
    assert again.chunk_ids == first.chunk_ids and again.doc_ids == first.doc_ids
    assert (again.new_chunks, again.skipped_chunks, again.re_fused_chunks, again.prefills) == (0, n, 0, 0)
    assert make_index.prefills == 2 * n


def test_fused_cache_reproduces_a_full_prefill(make_index: Opener) -> None:
    index = make_index(storage_dtype="float32", neighbours=1, chunk_tokens=64)
    a = "The Lumen lighthouse on the northern cape was designed by the engineer Ada Vell in 1871."
    b = "Ada Vell was born in the fishing village of Marrow, where her father repaired nets."
    report = index.add_texts([a, b])
    (ida,), (idb,) = report.chunk_ids
    assert _neighbours(index) == {ida: [idb], idb: [ida]}
    engine, store = index.engine, index.store
    get = lambda cid, v: store.get(cid, v, fingerprint=engine.fingerprint, shape=engine.kv_shape)  # noqa: E731
    fused_b, independent_b = get(idb, "fused"), get(idb, "independent")
    # NOTE: last layer's values: they depend on attention to the neighbour, not just on position.
    assert (fused_b.values[-1] - independent_b.values[-1]).abs().max() > 1e-3, "fusion must change the cache"

    prompt = engine.prompt("Where was the designer of the Lumen lighthouse born?", chunks=[(ida, a), (idb, b)])
    sampling = SamplingConfig(max_new_tokens=1)
    reuse = engine.generate(prompt, selector="none", sampling=sampling,
                            caches={ida: get(ida, "independent"), idb: fused_b})
    full = engine.full_attention(prompt, sampling=sampling).collect()
    assert reuse.reused_tokens == prompt.num_tokens - prompt.prefix.numel() - prompt.question.numel()
    assert (reuse.first_token_logits - full.first_token_logits).abs().max() < 1e-3
    # the independent cache of b in the same place is measurably worse than the fused one
    independent = engine.generate(prompt, selector="none", sampling=sampling,
                                  caches={ida: get(ida, "independent"), idb: independent_b})
    assert (independent.first_token_logits - full.first_token_logits).abs().max() > 1e-3


def test_the_most_similar_neighbour_is_prefilled_last(make_index: Opener, docs: dict[str, str]) -> None:
    index = make_index(storage_dtype="float32", neighbours=3)
    index.add_texts([docs["lumen_lighthouse"], docs["ada_vell"]])
    engine, store = index.engine, index.store
    chunk, neighbours = next((c, n) for c, n in _neighbours(index).items() if len(n) == 3)
    nearest_first = [store.get(n, "independent", fingerprint=engine.fingerprint) for n in neighbours]
    placed = list(reversed(nearest_first))
    text = index.collection.get(ids=[chunk], include=["documents"])["documents"][0]  # type: ignore[index]
    expected = engine.chunk_cache(text, neighbours=placed)
    stored = store.get(chunk, "fused", fingerprint=engine.fingerprint)
    assert torch.allclose(stored.keys, expected.keys, atol=1e-5)
    assert torch.equal(stored.positions, expected.positions)


def test_update_re_fuses_exactly_the_chunks_whose_neighbours_changed(
    make_index: Opener, docs: dict[str, str]
) -> None:
    index = make_index()
    index.add_texts([docs["lumen_lighthouse"], docs["marrow"], docs["night_of_lanterns"]])
    before = _neighbours(index)
    fused_before = {c: index.store.get(c, "fused", fingerprint=index.engine.fingerprint) for c in before}
    prefills_before = make_index.prefills

    report = index.add_texts([docs["oren_tessaly"], docs["tessaly_instruments"]])
    after = _neighbours(index)
    changed = {c for c in before if set(after[c]) != set(before[c])}
    assert 0 < len(changed) < len(before), "the test corpus should move some neighbour sets, not all"
    assert report.re_fused_chunks == len(changed)
    assert report.prefills == make_index.prefills - prefills_before == 2 * report.new_chunks + len(changed)
    new_ids = set(after) - set(before)
    assert all(new_ids & set(after[c]) for c in changed)
    for c in set(before) - changed:  # untouched chunks keep their cache bit for bit
        assert torch.equal(index.store.get(c, "fused", fingerprint=index.engine.fingerprint).keys,
                           fused_before[c].keys)
    assert not any(m[PENDING_KEY] for m in _metadata(index).values())
    _assert_consistent(index)


def test_delete_and_replace_leave_nothing_behind(make_index: Opener, docs: dict[str, str]) -> None:
    index = make_index(chunk_tokens=48)
    # NOTE: long enough to fill a chunk alone, so it is cut out the same in both documents.
    shared = ("Every keeper of the Lumen lighthouse signed the logbook at dawn and at dusk, noting the wind, "
              "the state of the sea, the ships that passed and the oil burnt by the great lamp overnight.")
    texts = {"ada": shared + "\n\n" + docs["ada_vell"], "marrow": docs["marrow"], "lamp": docs["lumen_lighthouse"],
             "also": shared}
    report = index.add_texts(list(texts.values()), doc_ids=list(texts), metadatas=[{"topic": k} for k in texts])
    chunks = dict(zip(report.doc_ids, report.chunk_ids, strict=True))
    shared_id = chunks["also"][0]
    assert shared_id == chunks["ada"][0] and len(chunks["also"]) == 1
    assert json.loads(_metadata(index, [shared_id])[shared_id][OWNERS_KEY]) == ["ada", "also"]

    ada_only = set(chunks["ada"]) - {shared_id}
    removed = index.delete(["ada"])
    assert removed == len(ada_only)
    remaining = all_ids(index.collection)
    assert not ada_only & remaining and shared_id in remaining
    for c in ada_only:
        assert not index.store.has(c, "independent") and not index.store.has(c, "fused")
    assert not any(ada_only & set(n) for n in _neighbours(index).values()), "dependants must be re-fused"
    assert _metadata(index, [shared_id])[shared_id]["doc_id"] == "also"
    _assert_consistent(index)

    # replacing a document's text drops the chunks it no longer has
    update = index.add_texts([docs["corran_institute"]], doc_ids=["marrow"])
    assert update.removed_chunks == len(set(chunks["marrow"]) - set(update.chunk_ids[0])) > 0
    assert not set(chunks["marrow"]) & all_ids(index.collection)
    assert index.delete(["marrow", "lamp", "also"]) == len(set(update.chunk_ids[0]) | set(chunks["lamp"])) + 1
    assert all_ids(index.collection) == set() and index.store.list_ids() == set()

    with pytest.raises(InvalidRequestError, match="reserved key"):
        index.add_texts(["Some text."], metadatas=[{"doc_id": "x"}])
    with pytest.raises(InvalidRequestError, match="list of texts"):
        index.add_texts("Some text.")


def test_verify_finds_and_repairs_every_kind_of_damage(make_index: Opener,
                                                        docs: dict[str, str]) -> None:
    index = make_index()
    index.add_texts([docs["ada_vell"], docs["marrow"]])
    store = index.store
    assert isinstance(store, DiskKVStore)
    engine = index.engine
    ids = sorted(all_ids(index.collection))
    corrupt, wrong_model, missing = ids[:3]
    blob = store.path_for(corrupt, "fused")
    data = bytearray(blob.read_bytes())
    data[-5] ^= 0xFF
    blob.write_bytes(bytes(data))
    other = store.get(wrong_model, "independent", fingerprint=engine.fingerprint)
    store.put(wrong_model, replace(other, fingerprint="0" * 32))
    store.path_for(missing, "independent").unlink()
    store.put("0" * 32, other)  # an orphan: a blob no Chroma entry refers to

    found = index.verify(repair=False)
    assert (found.corrupt, found.mismatched, found.missing, found.orphans) == (1, 1, 1, 1)
    assert not found.ok and not found.repaired
    prefills_before = make_index.prefills

    fixed = index.verify(repair=True)
    assert fixed.repaired and fixed.recomputed == make_index.prefills - prefills_before == 3
    assert store.get(wrong_model, "independent", fingerprint=engine.fingerprint).fingerprint == engine.fingerprint
    _assert_consistent(index)


def _ingest_then_die(calls: list[list[str]], config: dict[str, Any], die_after_fused: int, tmp_path: Path,
                     request: pytest.FixtureRequest) -> Path:
    """Run the `add_texts` calls in a subprocess that SIGKILLs itself after `die_after_fused` fused
    caches were stored; returns its data dir."""
    (tmp_path / "calls.json").write_text(json.dumps(calls))
    data_dir = tmp_path / "killed"
    worker = subprocess.run(
        [sys.executable, "-m", "tests.ingest_worker", "--data-dir", str(data_dir),
         "--tokenizer", str(tokenizer_dir(request.config.cache.mkdir("fusionrag-tokenizer"))),
         "--texts", str(tmp_path / "calls.json"), "--config", json.dumps(config),
         "--die-after-fused", str(die_after_fused)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert worker.returncode == -signal.SIGKILL, worker.stderr[-3000:]
    return data_dir


def _assert_same_corpus(index: FusionIndex, reference: FusionIndex) -> None:
    _assert_consistent(index)
    assert _neighbours(index) == _neighbours(reference)
    fingerprint = index.engine.fingerprint
    for cid in all_ids(index.collection):
        got = index.store.get(cid, "fused", fingerprint=fingerprint)
        want = reference.store.get(cid, "fused", fingerprint=fingerprint)
        assert torch.allclose(got.keys, want.keys, atol=1e-2, rtol=1e-2)


KILL_CONFIG: dict[str, Any] = {"chunk_tokens": 40, "neighbours": 2, "batch_size": 4}


def test_ingest_killed_mid_fusion_resumes_without_recomputing(
    make_index: Opener, docs: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    texts = [docs["lumen_lighthouse"], docs["tessaly_instruments"], docs["oren_tessaly"]]
    die_after = 6  # NOTE: batches of 4: chunks 1-4 reach Chroma, 5-6 have both blobs but no entry.
    data_dir = _ingest_then_die([texts], KILL_CONFIG, die_after, tmp_path, request)

    reference = make_index(**KILL_CONFIG)  # the same ingest, uninterrupted
    clean = reference.add_texts(texts)
    n = clean.new_chunks
    assert n > die_after + KILL_CONFIG["batch_size"]

    index = FusionIndex.open(reference.engine, data_dir)
    assert index.config.identity() == IngestConfig(**KILL_CONFIG).identity(), "settings come from the collection"
    assert len(all_ids(index.collection)) == 4, "the killed run added one batch of 4 to Chroma"
    assert len(index.store.list_ids("independent")) == n and len(index.store.list_ids("fused")) == die_after
    prefills_before = make_index.prefills

    resumed = index.add_texts(texts)
    assert resumed.chunk_ids == clean.chunk_ids
    assert resumed.prefills == make_index.prefills - prefills_before == n - die_after, "only missing fused caches"
    assert (resumed.skipped_chunks, resumed.new_chunks, resumed.re_fused_chunks) == (4, n - 4, 0)
    _assert_same_corpus(index, reference)


def test_update_killed_mid_re_fusion_is_finished_by_the_next_run(
    make_index: Opener, docs: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    first = [docs["lumen_lighthouse"], docs["marrow"], docs["night_of_lanterns"]]
    second = [docs["oren_tessaly"], docs["tessaly_instruments"]]
    reference = make_index(**KILL_CONFIG)
    one, two = reference.add_texts(first), reference.add_texts(second)
    assert two.re_fused_chunks >= 2
    # NOTE: dies right after the first re-fused blob is stored, before its entry is updated.
    data_dir = _ingest_then_die([first, second], KILL_CONFIG, one.new_chunks + two.new_chunks + 1, tmp_path, request)

    index = FusionIndex.open(reference.engine, data_dir)
    pending = [c for c, m in _metadata(index).items() if m[PENDING_KEY]]
    assert len(pending) == two.re_fused_chunks, "every chunk to re-fuse stays marked until its entry is updated"
    prefills_before = make_index.prefills

    resumed = index.add_texts(second)
    assert resumed.prefills == make_index.prefills - prefills_before == two.re_fused_chunks
    assert (resumed.new_chunks, resumed.skipped_chunks, resumed.re_fused_chunks) == (0, two.new_chunks,
                                                                                    two.re_fused_chunks)
    _assert_same_corpus(index, reference)
