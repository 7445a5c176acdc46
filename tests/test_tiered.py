"""The cache tiers in front of a KV store: LRU by bytes, promotion on hit, per-request statistics."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import CacheMismatchError, CacheNotFoundError
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.store import DiskKVStore
from fusionrag_core.store.tiered import TieredKVStore
from tests.test_store import FP, make_kv

NBYTES = make_kv(n_tokens=5).nbytes


def _tiered(tmp_path: Path, device_entries: float, host_entries: float) -> TieredKVStore:
    inner = DiskKVStore(tmp_path / "kv", storage_dtype="float32")
    for i in range(4):
        inner.put(f"c{i}", make_kv(n_tokens=5, seed=i))
    return TieredKVStore(inner, device="cpu", dtype=torch.float32, device_bytes=int(device_entries * NBYTES),
                         host_bytes=int(host_entries * NBYTES))


def _tier(store: TieredKVStore, cid: str) -> str:
    return store.get_with_source(cid, "independent", fingerprint=FP)[1]


def test_hits_promote_and_lru_evicts_by_bytes(tmp_path: Path) -> None:
    store = _tiered(tmp_path, device_entries=2, host_entries=3)
    assert [_tier(store, c) for c in ("c0", "c1", "c0")] == ["store", "store", "device"]
    assert _tier(store, "c2") == "store"  # device tier now holds c0, c2: c1 was least recently used
    assert _tier(store, "c1") == "host"  # ...but the host tier still has it: promoted back
    assert _tier(store, "c1") == "device"
    assert _tier(store, "c3") == "store"  # host tier (3 entries) drops c0, its least recently used
    assert _tier(store, "c0") == "store"
    stats = store.stats()
    assert stats["device_hits"] == 2 and stats["host_hits"] == 1 and stats["store_hits"] == 5
    assert stats["device_used_bytes"] == 2 * NBYTES and stats["host_used_bytes"] == 3 * NBYTES
    torch.testing.assert_close(store.get("c1", "independent", fingerprint=FP).keys, make_kv(5, seed=1).keys)


def test_drop_copies_empties_the_tiers_and_keeps_the_blobs(tmp_path: Path) -> None:
    store = _tiered(tmp_path, device_entries=4, host_entries=4)
    assert [_tier(store, "c0") for _ in range(2)] == ["store", "device"]
    store.inner.put("c0", newer := make_kv(n_tokens=5, seed=9))  # NOTE: a write around the tiers (Ray workers')
    store.drop_copies()
    assert store.stats()["device_used_bytes"] == store.stats()["host_used_bytes"] == 0
    kv, tier = store.get_with_source("c0", "independent", fingerprint=FP)
    assert tier == "store" and torch.equal(kv.keys, newer.keys)


def test_tiers_off_and_oversized_entries_bypass(tmp_path: Path) -> None:
    store = _tiered(tmp_path, device_entries=0, host_entries=0.5)
    assert [_tier(store, "c0") for _ in range(3)] == ["store"] * 3
    assert store.stats()["host_used_bytes"] == 0


def test_writes_invalidate_and_tier_hits_are_validated(tmp_path: Path) -> None:
    store = _tiered(tmp_path, device_entries=4, host_entries=4)
    _tier(store, "c0")
    newer = make_kv(n_tokens=5, seed=9)
    store.put("c0", newer)
    kv, tier = store.get_with_source("c0", "independent", fingerprint=FP)
    assert tier == "store" and torch.equal(kv.keys, newer.keys)
    with pytest.raises(CacheMismatchError):
        store.get("c0", "independent", fingerprint="0" * 64)  # a tier hit of another model's cache
    store.delete("c0")
    with pytest.raises(CacheNotFoundError):
        store.get("c0", "independent", fingerprint=FP)


def test_threads_share_one_tiered_store(tmp_path: Path) -> None:
    store = _tiered(tmp_path, device_entries=2, host_entries=4)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for j in range(20):
                cid = f"c{(seed + j) % 4}"
                kv = store.get(cid, "independent", fingerprint=FP)
                assert torch.equal(kv.keys, make_kv(5, seed=int(cid[1])).keys)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = store.stats()
    assert sum(stats[f"{t}_hits"] for t in ("device", "host", "store")) == 80
    assert stats["device_used_bytes"] <= 2 * NBYTES


def test_generation_reports_its_own_tier_hits(tmp_path: Path, default_engine: FusionEngine) -> None:
    engine = default_engine
    chunks = ["The lighthouse was designed by Ada Vell.", "Ada Vell was born in Marrow."]
    inner = DiskKVStore(tmp_path / "kv", storage_dtype="float32")
    for i, text in enumerate(chunks):
        inner.put(f"t{i}", engine.chunk_cache(text))
    store = TieredKVStore(inner, device=engine.device, dtype=engine.decoder.dtype, device_bytes=1 << 30,
                          host_bytes=1 << 30)
    prompt = engine.prompt("Where was the designer born?", chunks=[(f"t{i}", c) for i, c in enumerate(chunks)])
    one = SamplingConfig(max_new_tokens=1)
    cold = engine.generate(prompt, store=store, variant="independent", sampling=one)
    warm = engine.generate(prompt, store=store, variant="independent", sampling=one)
    plain = engine.generate(prompt, store=inner, variant="independent", sampling=one)
    assert cold.stats()["kv_store_hits"] == 2 and cold.stats()["kv_device_hits"] == 0
    assert warm.stats()["kv_device_hits"] == 2 and warm.stats()["kv_store_hits"] == 0
    assert warm.stats()["kv_device_bytes"] == warm.kv_bytes_loaded
    assert plain.stats()["kv_store_hits"] == 2
    torch.testing.assert_close(warm.first_token_logits, plain.first_token_logits)
