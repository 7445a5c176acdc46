"""Fusion drift: computed at ingest from the two caches of a chunk, stored in its fused blob
(validated like the rest), carried through stitching, and weighed into the `drift_aware` selector.
Tiny random Llama and Gemma 3 models, SmolLM2 tokenizer."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import CacheCorruptError, CacheMismatchError, InvalidRequestError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.query.drift import fusion_drift, prompt_drift
from fusionrag_core.query.probe import probe_layers, question_weights
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.query.select import SelectConfig, _inexact, get_selector, question_attention
from fusionrag_core.query.stitch import Stitched, stitch
from fusionrag_core.runtime.kv import ChunkKV
from fusionrag_core.runtime.rope import shift_keys
from fusionrag_core.store import DiskKVStore, TieredKVStore, decode_blob, encode_blob
from fusionrag_core.store.tiered import _pin as tiered_pin
from tests.test_engine import ARCHS, CHUNKS, prompt_for

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request: pytest.FixtureRequest, smollm_tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    torch.manual_seed(0)
    return FusionEngine(ARCHS[request.param]().eval(), smollm_tokenizer, name=request.param)


def _fused(engine: FusionEngine, i: int) -> ChunkKV:
    """Chunk `i` fused after the other chunks, with its drift from its independent cache."""
    others = [engine.chunk_cache(c) for j, c in enumerate(CHUNKS) if j != i]
    kv = replace(engine.chunk_cache(CHUNKS[i], others), variant="fused")
    return replace(kv, drift=fusion_drift(kv, engine.chunk_cache(CHUNKS[i]), engine.decoder.rope))


# ---- the drift itself ---------------------------------------------------------------------------------

def test_drift_is_zero_for_the_same_cache_at_other_positions(engine: FusionEngine) -> None:
    # RoPE must cancel: the independent cache re-rotated to far-away positions has not drifted
    alone = engine.chunk_cache(CHUNKS[0])
    delta = torch.tensor(37)
    moved = ChunkKV(alone.token_ids, shift_keys(alone.keys, delta, engine.decoder.rope), alone.values,
                    alone.positions + 37, alone.fingerprint, "fused")
    drift = fusion_drift(moved, alone, engine.decoder.rope)
    assert drift.shape == (alone.num_tokens,) and drift.dtype == torch.float32
    assert float(drift.abs().max()) < 1e-8


def test_drift_is_the_relative_kv_distance_per_layer_and_token(engine: FusionEngine) -> None:
    alone = engine.chunk_cache(CHUNKS[1])
    values = alone.values.clone()
    values[0, :, 2] *= 3.0  # token 2's values at layer 0 become 3x: |3v - v|^2 / |3v|^2 = 4/9 there
    changed = replace(alone, values=values, variant="fused")
    drift = fusion_drift(changed, alone, engine.decoder.rope)
    expected = torch.zeros(alone.num_tokens)
    expected[2] = (4 / 9) / engine.decoder.num_layers
    torch.testing.assert_close(drift, expected)


def test_fused_tokens_drift_and_the_drift_is_what_the_prompt_changes(engine: FusionEngine) -> None:
    kv = _fused(engine, 2)
    assert kv.drift is not None and bool((kv.drift > 0).all()), "fusion changes every token's K/V"


def test_drift_of_two_different_chunks_is_refused(engine: FusionEngine) -> None:
    a, b = engine.chunk_cache(CHUNKS[0]), engine.chunk_cache(CHUNKS[1])
    with pytest.raises(CacheMismatchError, match="two caches of one chunk"):
        fusion_drift(a, b, engine.decoder.rope)


def test_a_chunk_without_drift_counts_as_the_prompt_mean() -> None:
    values = prompt_drift([torch.tensor([1.0, 3.0]), None, torch.tensor([2.0])], [2, 3, 1])
    torch.testing.assert_close(values, torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0, 2.0]))
    torch.testing.assert_close(prompt_drift([None, None], [1, 2]), torch.ones(3))
    assert prompt_drift([], []).shape == (0,)


def test_chunkkv_refuses_a_drift_of_another_length(engine: FusionEngine) -> None:
    kv = engine.chunk_cache(CHUNKS[0])
    with pytest.raises(CacheMismatchError, match="drift must be a float32"):
        replace(kv, drift=torch.zeros(kv.num_tokens + 1))
    with pytest.raises(CacheMismatchError, match="drift must be a float32"):
        replace(kv, drift=torch.zeros(kv.num_tokens, dtype=torch.float16))
    head = replace(kv, drift=torch.arange(kv.num_tokens, dtype=torch.float32)).head(3)
    assert head.drift is not None and head.drift.tolist() == [0.0, 1.0, 2.0]


# ---- the blob -------------------------------------------------------------------------------------------

def _decode(blob: bytes, kv: ChunkKV) -> ChunkKV:
    return decode_blob(blob, source="test", chunk_id="c1", variant=kv.variant, fingerprint=kv.fingerprint)


def test_drift_round_trips_and_only_blobs_with_drift_are_version_2(engine: FusionEngine) -> None:
    kv = _fused(engine, 0)
    blob = encode_blob("c1", kv, "float16")
    assert st_load(blob)["drift"].dtype == torch.float32
    back = _decode(blob, kv)
    assert back.drift is not None and torch.equal(back.drift, kv.drift)
    without = replace(kv, drift=None)
    plain = encode_blob("c1", without, "float16")
    assert b'"format_version":"1"' in plain and b'"format_version":"2"' in blob
    assert "drift" not in st_load(plain) and _decode(plain, without).drift is None


def test_tampered_missing_or_negative_drift_is_corrupt(engine: FusionEngine) -> None:
    kv = _fused(engine, 0)
    assert kv.drift is not None
    blob = bytearray(encode_blob("c1", kv, "float32"))
    at = blob.rfind(kv.drift.numpy().tobytes())  # the drift tensor's bytes
    assert at > 0
    blob[at] ^= 0x01
    with pytest.raises(CacheCorruptError, match="checksum"):
        _decode(bytes(blob), kv)
    # a version-2 header whose drift tensor was dropped: the tensor set is wrong
    full = encode_blob("c1", kv, "float32")
    tensors = {k: v for k, v in st_load(full).items() if k != "drift"}
    with pytest.raises(CacheCorruptError, match="expected tensors"):
        _decode(st_save(tensors, metadata=_header(full)), kv)
    negative = replace(kv, drift=-kv.drift - 1.0)
    with pytest.raises(CacheCorruptError, match="drift must be finite non-negative"):
        _decode(encode_blob("c1", negative, "float32"), negative)


def _header(blob: bytes) -> dict[str, str]:
    (n,) = struct.unpack("<Q", blob[:8])
    return dict(json.loads(blob[8 : 8 + n])["__metadata__"])


def test_an_unknown_newer_version_is_a_mismatch_not_corruption(engine: FusionEngine) -> None:
    kv = _fused(engine, 0)
    blob = encode_blob("c1", kv, "float16").replace(b'"format_version":"2"', b'"format_version":"3"')
    with pytest.raises(CacheMismatchError, match="reads versions 1, 2"):
        _decode(blob, kv)


# ---- ingest ---------------------------------------------------------------------------------------------

def test_ingest_stores_each_fused_cache_with_its_drift(engine: FusionEngine, tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path / "index", config=IngestConfig(chunk_tokens=64, neighbours=2),
                             storage_dtype="float32")
    ids = [cid for (cid,) in index.add_texts(CHUNKS).chunk_ids]
    get = lambda cid, v: index.store.get(cid, v, fingerprint=engine.fingerprint)  # noqa: E731
    for cid in ids:
        fused, alone = get(cid, "fused"), get(cid, "independent")
        assert fused.drift is not None
        torch.testing.assert_close(fused.drift, fusion_drift(fused, alone, engine.decoder.rope), atol=1e-6, rtol=1e-5)
        assert alone.drift is None


def test_a_chunk_alone_in_its_corpus_has_no_drift(engine: FusionEngine, tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path / "index", config=IngestConfig(chunk_tokens=64, neighbours=2))
    ((cid,),) = index.add_texts(CHUNKS[:1]).chunk_ids
    assert index.store.get(cid, "fused", fingerprint=engine.fingerprint).drift is None


# ---- selection ------------------------------------------------------------------------------------------

def _stitched(engine: FusionEngine, caches: dict[str, ChunkKV]) -> Stitched:
    prompt = prompt_for(engine, CHUNKS)
    return stitch(engine.decoder, prompt, engine.system_prefix(prompt.prefix), lambda cid, _first: caches.get(cid),
                  extra_capacity=1)


def _caches(engine: FusionEngine) -> dict[str, ChunkKV]:
    return {f"c{i}": _fused(engine, i) for i in range(len(CHUNKS))}


def test_stitching_carries_each_chunks_drift_in_prompt_order(engine: FusionEngine) -> None:
    caches = _caches(engine)
    st = _stitched(engine, caches)
    assert st.chunks_without_drift == 0
    expected = torch.cat([caches[f"c{i}"].drift for i in range(len(CHUNKS))])  # type: ignore[misc]
    torch.testing.assert_close(st.drift(), expected[: st.num_reused_tokens])
    caches["c1"] = replace(caches["c1"], drift=None)
    assert _stitched(engine, caches).chunks_without_drift == 1


def test_drift_aware_ranks_by_attention_times_drift(engine: FusionEngine) -> None:
    caches = _caches(engine)
    config = SelectConfig(ratio=0.2)
    st = _stitched(engine, caches)
    picked = get_selector("drift_aware")(st, config.budget(st.num_reused_tokens), config)
    st = _stitched(engine, caches)
    attention = question_attention(st, (0.75,), last_share=config.last_token_share)
    slots, attention = _inexact(st, st.reusable_slots, attention)
    score = attention * st.drift()[torch.isin(st.reusable_slots, slots)]
    expected = torch.sort(slots[torch.sort(-score, stable=True).indices[: picked.numel()]]).values
    assert picked.numel() == config.budget(st.num_reused_tokens)
    assert torch.equal(picked, expected)


def test_a_chunk_that_did_not_drift_is_never_recomputed(engine: FusionEngine) -> None:
    caches = _caches(engine)
    still = caches["c1"]
    caches["c1"] = replace(still, drift=torch.zeros_like(still.drift))  # type: ignore[arg-type]
    config = SelectConfig(ratio=0.3)
    st = _stitched(engine, caches)
    picked = get_selector("drift_aware")(st, config.budget(st.num_reused_tokens), config)
    assert not bool(torch.isin(picked, st.chunk_slots[1]).any())


def test_without_any_drift_or_last_token_share_drift_aware_ranks_by_attention_alone(engine: FusionEngine) -> None:
    caches = {cid: replace(kv, drift=None) for cid, kv in _caches(engine).items()}
    config = SelectConfig(ratio=0.25, last_token_share=None)
    st = _stitched(engine, caches)
    picked = get_selector("drift_aware")(st, config.budget(st.num_reused_tokens), config)
    st = _stitched(engine, caches)
    slots, attention = _inexact(st, st.reusable_slots, question_attention(st, (0.75,)))
    expected = torch.sort(slots[torch.sort(-attention, stable=True).indices[: config.budget(st.num_reused_tokens)]])
    assert torch.equal(picked, expected.values)


def test_question_weights_give_the_last_token_its_share() -> None:
    weights = question_weights(5, 0.5, torch.device("cpu"))
    assert weights is not None
    torch.testing.assert_close(weights, torch.tensor([0.125, 0.125, 0.125, 0.125, 0.5]))
    assert question_weights(5, None, torch.device("cpu")) is None
    assert torch.equal(question_weights(1, 0.2, torch.device("cpu")), torch.ones(1))  # type: ignore[arg-type]
    for bad in (-0.1, 1.5):
        with pytest.raises(InvalidRequestError, match="last_token_share"):
            SelectConfig(last_token_share=bad)


def test_a_last_token_share_of_one_reads_only_the_last_token(engine: FusionEngine) -> None:
    st = _stitched(engine, _caches(engine))
    got = question_attention(st, (0.75,), last_share=1.0)
    layer = probe_layers(engine.decoder.windows, (0.75,))[0]
    last = torch.zeros(st.question_ids.numel())
    last[-1] = 1.0  # the last token's queries alone
    mass = engine.decoder.probe(st.buf, st.question_ids, st.question_slots, layers=(layer,), weights=last)[layer]
    want = mass[st.reusable_slots] / mass[st.reusable_slots].sum()
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, question_attention(st, (0.75,)), atol=1e-4)


def test_the_engine_reports_chunks_without_drift(engine: FusionEngine) -> None:
    caches = _caches(engine)
    caches["c0"] = replace(caches["c0"], drift=None)
    prompt = prompt_for(engine, CHUNKS)
    gen = engine.generate(prompt, selector="drift_aware", ratio=0.2, caches=caches,
                          sampling=SamplingConfig(max_new_tokens=1))
    assert gen.chunks_without_drift == 1 and gen.stats()["chunks_without_drift"] == 1
    assert gen.recomputed_tokens == SelectConfig(ratio=0.2).budget(gen.reused_tokens + gen.recomputed_tokens)


def test_drift_survives_the_tiered_store_and_pinning(engine: FusionEngine, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    kv = replace(_fused(engine, 1), fused_after="0123456789abcdef")
    inner = DiskKVStore(tmp_path / "kv", storage_dtype="float32")
    inner.put("c1", kv)
    store = TieredKVStore(inner, device="cpu", dtype=torch.float32, device_bytes=1 << 24, host_bytes=1 << 24)
    for _ in range(3):  # the store, then the device tier, then again
        got = store.get("c1", "fused", fingerprint=kv.fingerprint)
        assert got.drift is not None and torch.equal(got.drift, kv.drift)
    # with CUDA present the host tier pins the K/V; every other field must survive the copy
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    pinned = tiered_pin(kv)
    assert pinned.drift is not None and torch.equal(pinned.drift, kv.drift) and pinned.fused_after == kv.fused_after


def test_verify_gives_old_fused_caches_their_drift_without_a_prefill(engine: FusionEngine, tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path / "index", config=IngestConfig(chunk_tokens=64, neighbours=2),
                             storage_dtype="float32")
    ids = [cid for (cid,) in index.add_texts(CHUNKS).chunk_ids]
    get = lambda cid, v: index.store.get(cid, v, fingerprint=engine.fingerprint)  # noqa: E731
    before = {cid: get(cid, "fused") for cid in ids}
    for cid in ids[:2]:  # as an earlier version wrote them
        index.store.put(cid, replace(before[cid], drift=None))
    prefills = index.ingestor.prefills
    checked = index.verify(repair=False)
    assert checked.ok and checked.without_drift == 2 and checked.drift_added == 0
    assert get(ids[0], "fused").drift is None, "a check without repair writes nothing"
    report = index.verify(repair=True)
    assert report.ok and report.without_drift == 2 and report.drift_added == 2
    assert index.ingestor.prefills == prefills, "drift comes from the stored caches, not a prefill"
    for cid in ids:
        got = get(cid, "fused")
        assert got.drift is not None and torch.equal(got.keys, before[cid].keys)
        torch.testing.assert_close(got.drift, before[cid].drift, atol=1e-6, rtol=1e-5)
    assert index.verify(repair=True).without_drift == 0


def test_a_query_over_an_ingested_corpus_has_drift_for_every_inexact_chunk(engine: FusionEngine,
                                                                            tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path / "index", config=IngestConfig(chunk_tokens=64, neighbours=2))
    index.add_texts(CHUNKS)
    gen, _ = index.answer("Where was the designer of the Lumen lighthouse born?", k=3,
                          sampling=SamplingConfig(max_new_tokens=1))
    assert gen.selector == "drift_aware"
    # the first chunk reuses its exact independent cache (no drift, never recomputed): not counted
    assert gen.cache_variants == {"independent": 1, "fused": 2}
    assert gen.chunks_without_drift == 0
