"""Tests of fusionrag_core.store: blob format, DiskKVStore, RedisKVStore (real redis-server)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fusionrag_core.errors import (
    CacheCorruptError,
    CacheMismatchError,
    CacheNotFoundError,
    FusionRAGError,
    InvalidRequestError,
)
from fusionrag_core.runtime.kv import ChunkKV, Variant
from fusionrag_core.store import (
    DiskKVStore,
    KVStore,
    decode_blob,
    encode_blob,
    open_store,
)
from fusionrag_core.store import disk as disk_module
from tests.servers import running_redis_server

FP = "f" * 64
SHAPE = (2, 3, 8)  # (L, H, D)


def make_kv(
    n_tokens: int = 5,
    *,
    variant: Variant = "independent",
    seed: int = 0,
    fingerprint: str = FP,
    dtype: torch.dtype = torch.float32,
) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    L, H, D = SHAPE
    return ChunkKV(
        token_ids=torch.randint(0, 50_000, (n_tokens,), generator=g, dtype=torch.int64),
        keys=torch.randn(L, H, n_tokens, D, generator=g).to(dtype) * 3,  # [L, H, T, D]
        values=torch.randn(L, H, n_tokens, D, generator=g).to(dtype),  # [L, H, T, D]
        positions=torch.arange(10, 10 + n_tokens),
        fingerprint=fingerprint,
        variant=variant,
    )


def assert_same(a: ChunkKV, b: ChunkKV, *, atol: float = 0.0, rtol: float = 0.0) -> None:
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.positions, b.positions)
    assert a.fingerprint == b.fingerprint
    assert a.variant == b.variant
    torch.testing.assert_close(a.keys, b.keys, atol=atol, rtol=rtol)
    torch.testing.assert_close(a.values, b.values, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- blob format (backend-free)


def test_blob_round_trip_fp32_is_exact() -> None:
    kv = make_kv()
    out = decode_blob(encode_blob("ab12", kv, "float32"), source="t", chunk_id="ab12", variant="independent",
                      fingerprint=FP, shape=SHAPE)
    assert out.keys.dtype == torch.float32
    assert_same(out, kv)


def test_blob_rejects_overflowing_float16() -> None:
    kv = make_kv()
    big = ChunkKV(kv.token_ids, kv.keys * 1e5, kv.values, kv.positions, FP, "fused")
    with pytest.raises(InvalidRequestError, match="bfloat16"):
        encode_blob("ab12", big, "float16")
    just_in_range = ChunkKV(kv.token_ids, kv.keys.clamp(-1, 1) * 65504, kv.values, kv.positions, FP, "fused")
    encode_blob("ab12", just_in_range, "float16")
    # A cache that already holds inf is passed through, not misreported as an overflow.
    keys = kv.keys.clone()
    keys[0, 0, 0, 0] = float("inf")
    encode_blob("ab12", ChunkKV(kv.token_ids, keys, kv.values, kv.positions, FP, "fused"), "float16")
    # bfloat16 has float32's range, so the same cache is storable there.
    out = decode_blob(encode_blob("ab12", big, "bfloat16"), source="t", chunk_id="ab12", variant="fused",
                      fingerprint=FP)
    assert torch.isfinite(out.keys).all()


def test_blob_misplaced_under_other_id_is_corrupt() -> None:
    blob = encode_blob("ab12", make_kv(), "float16")
    with pytest.raises(CacheCorruptError, match="holds chunk 'ab12'"):
        decode_blob(blob, source="t", chunk_id="cd34", variant="independent", fingerprint=FP)


# ---------------------------------------------------------------- shared behaviour, both backends


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with running_redis_server() as url:
        yield url


def _disk(tmp_path: Path, storage_dtype: str) -> KVStore:
    return DiskKVStore(tmp_path / "kv", storage_dtype=storage_dtype)  # type: ignore[arg-type]


@pytest.fixture(params=["disk", pytest.param("redis", marks=pytest.mark.servers)])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[str], KVStore]]:
    """Factory of stores of the parametrized backend, closed at teardown."""
    opened: list[KVStore] = []
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        # NOTE: one namespace per test keeps tests independent on the shared module-scoped server.
        namespace = "t" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]

        def factory(storage_dtype: str = "float16") -> KVStore:
            s = open_store(url, storage_dtype=storage_dtype, namespace=namespace)  # type: ignore[arg-type]
            opened.append(s)
            return s
    else:

        def factory(storage_dtype: str = "float16") -> KVStore:
            s = _disk(tmp_path, storage_dtype)
            opened.append(s)
            return s

    yield factory
    for s in opened:
        s.close()


def test_round_trip_fp32_exact(make_store: Callable[[str], KVStore]) -> None:
    kv = make_kv(variant="fused")
    with make_store("float32") as store:
        store.put("ab12", kv)
        out = store.get("ab12", "fused", fingerprint=FP, shape=SHAPE)
    assert out.keys.dtype == torch.float32
    assert_same(out, kv)


@pytest.mark.parametrize("fmt", ["float32", "float16", "int8"])
def test_fusion_drift_round_trips_exactly_at_any_storage_dtype(make_store: Callable[[str], KVStore],
                                                               fmt: str) -> None:
    kv = replace(make_kv(variant="fused"), drift=torch.rand(5, generator=torch.Generator().manual_seed(1)))
    with make_store(fmt) as store:
        store.put("ab12", kv)
        out = store.get("ab12", "fused", fingerprint=FP, shape=SHAPE)
    # NOTE: one fp32 per token, never cast to the storage dtype
    assert out.drift is not None and out.drift.dtype == torch.float32 and torch.equal(out.drift, kv.drift)


def test_round_trip_fp16_within_tolerance(make_store: Callable[[str], KVStore]) -> None:
    kv = make_kv()
    store = make_store("float16")
    store.put("ab12", kv)
    out = store.get("ab12", "independent", fingerprint=FP)
    # dtype=None returns the dtype the cache was computed in; precision is float16's.
    assert out.keys.dtype == torch.float32
    assert not torch.equal(out.keys, kv.keys), "float16 storage should have rounded something"
    assert_same(out, kv, atol=1e-2, rtol=1e-3)
    as_half = store.get("ab12", "independent", fingerprint=FP, dtype=torch.float16)
    assert as_half.keys.dtype == torch.float16 and as_half.values.dtype == torch.float16


def test_bfloat16_storage(make_store: Callable[[str], KVStore]) -> None:
    kv = make_kv()
    store = make_store("bfloat16")
    store.put("ab12", kv)
    assert_same(store.get("ab12", "independent", fingerprint=FP), kv, atol=5e-2, rtol=1e-2)


def test_missing_raises_not_found(make_store: Callable[[str], KVStore]) -> None:
    store = make_store("float16")
    store.put("ab12", make_kv(variant="independent"))
    with pytest.raises(CacheNotFoundError, match="ingest"):
        store.get("ab12", "fused", fingerprint=FP)
    with pytest.raises(CacheNotFoundError):
        store.get("ffff", "independent", fingerprint=FP)
    with pytest.raises(KeyError):  # CacheNotFoundError is also a KeyError for dict-like callers
        store.get("ffff", "independent", fingerprint=FP)


def test_wrong_fingerprint_is_mismatch(make_store: Callable[[str], KVStore]) -> None:
    store = make_store("float16")
    store.put("ab12", make_kv())
    with pytest.raises(CacheMismatchError, match="re-ingest"):
        store.get("ab12", "independent", fingerprint="0" * 64)


def test_wrong_shape_is_mismatch(make_store: Callable[[str], KVStore]) -> None:
    store = make_store("float16")
    store.put("ab12", make_kv())
    with pytest.raises(CacheMismatchError, match=r"\(2, 3, 8\)"):
        store.get("ab12", "independent", fingerprint=FP, shape=(2, 4, 8))


def test_put_overwrites(make_store: Callable[[str], KVStore]) -> None:
    store = make_store("float32")
    store.put("ab12", make_kv(seed=1))
    newer = make_kv(seed=2, n_tokens=7)
    store.put("ab12", newer)
    assert_same(store.get("ab12", "independent", fingerprint=FP), newer)


def test_has_delete_list_ids(make_store: Callable[[str], KVStore]) -> None:
    store = make_store("float16")
    assert store.list_ids() == set()
    store.put("ab12", make_kv(variant="independent"))
    store.put("ab12", make_kv(variant="fused"))
    store.put("ab34", make_kv(variant="fused"))
    store.put("cd56", make_kv(variant="independent"))
    assert store.has("ab12", "independent") and store.has("ab12", "fused")
    assert not store.has("cd56", "fused")
    assert store.list_ids() == {"ab12", "ab34", "cd56"}
    assert store.list_ids("fused") == {"ab12", "ab34"}
    assert store.list_ids("independent") == {"ab12", "cd56"}

    store.delete("ab12")
    assert not store.has("ab12", "independent") and not store.has("ab12", "fused")
    assert store.list_ids() == {"ab34", "cd56"}
    store.delete("ab12")  # deleting again is fine
    store.delete("never-stored")
    with pytest.raises(CacheNotFoundError):
        store.get("ab12", "fused", fingerprint=FP)
    assert_same(store.get("ab34", "fused", fingerprint=FP), make_kv(variant="fused"), atol=1e-2, rtol=1e-3)


def test_quarantine_sets_one_variant_aside_once(make_store: Callable[[str], KVStore]) -> None:
    store = make_store("float16")
    store.put("ab12", make_kv(variant="independent"))
    store.put("ab12", make_kv(variant="fused"))
    where = store.quarantine("ab12", "fused")
    assert where is not None and "ab12" in where
    assert store.quarantine("ab12", "fused") is None, "the second caller finds nothing to move"
    assert not store.has("ab12", "fused") and store.has("ab12", "independent")
    assert store.list_ids("fused") == set() and store.list_ids() == {"ab12"}
    with pytest.raises(CacheNotFoundError):
        store.get("ab12", "fused", fingerprint=FP)


@pytest.mark.parametrize("bad", ["", "../etc", "a/b", "a.b", "a b", "x" * 129, "é"])
def test_bad_chunk_ids_are_refused(make_store: Callable[[str], KVStore], bad: str) -> None:
    store = make_store("float16")
    with pytest.raises(InvalidRequestError, match="chunk id"):
        store.put(bad, make_kv())
    with pytest.raises(InvalidRequestError):
        store.get(bad, "fused", fingerprint=FP)


def test_empty_chunk_round_trips(make_store: Callable[[str], KVStore]) -> None:
    store = make_store("float16")
    store.put("ab12", make_kv(n_tokens=0))
    out = store.get("ab12", "independent", fingerprint=FP, shape=SHAPE)
    assert out.num_tokens == 0 and out.keys.shape == (2, 3, 0, 8)


# ---------------------------------------------------------------- disk specifics


def test_disk_layout_and_no_temp_files(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, storage_dtype="float16")
    store.put("ab12", make_kv(variant="fused"))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "ab",
        "ab/ab12.fused.safetensors",
    ]


def test_disk_blob_is_plain_safetensors_with_metadata(tmp_path: Path) -> None:
    from safetensors import safe_open

    store = DiskKVStore(tmp_path, storage_dtype="float16")
    kv = make_kv()
    store.put("ab12", kv)
    with safe_open(str(store.path_for("ab12", "independent")), framework="pt") as f:
        meta = f.metadata()
        assert sorted(f.keys()) == ["keys", "positions", "token_ids", "values"]
        assert f.get_tensor("keys").dtype == torch.float16
    assert meta["fingerprint"] == FP and meta["variant"] == "independent"
    assert meta["storage_dtype"] == "float16" and meta["source_dtype"] == "float32"
    assert meta["checksum"].startswith("xxh3_128:") and meta["format_version"] == "1"
    assert meta["shape"] == "[2, 3, 5, 8]"


def test_put_failure_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskKVStore(tmp_path, storage_dtype="float32")
    old = make_kv(seed=1)
    store.put("ab12", old)
    path = store.path_for("ab12", "independent")
    old_bytes = path.read_bytes()

    def boom(fd: int) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(disk_module.os, "fsync", boom)
    with pytest.raises(OSError, match="disk on fire"):
        store.put("ab12", make_kv(seed=2))  # overwrite fails: old blob must survive intact
    with pytest.raises(OSError, match="disk on fire"):
        store.put("cd34", make_kv(seed=3))  # new entry fails: nothing may appear
    monkeypatch.undo()

    assert path.read_bytes() == old_bytes
    assert_same(store.get("ab12", "independent", fingerprint=FP), old)
    assert not store.path_for("cd34", "independent").exists()
    assert not store.has("cd34", "independent")
    leftovers = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers == ["ab12.independent.safetensors"], leftovers
    assert store.list_ids() == {"ab12"}


def test_truncated_file_is_corrupt(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path)
    store.put("ab12", make_kv())
    path = store.path_for("ab12", "independent")
    size = path.stat().st_size
    for keep in (size - 7, 100, 5, 0):
        with open(path, "r+b") as f:
            f.truncate(keep)
        with pytest.raises(CacheCorruptError) as e:
            store.get("ab12", "independent", fingerprint=FP)
        assert str(path) in str(e.value) and "re-run ingest" in str(e.value)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_8bit_storage_round_trips_within_its_precision(make_store: Callable[[str], KVStore], fmt: str) -> None:
    kv = make_kv(n_tokens=40)
    kv.keys[0, 1, :, 3] *= 50  # one outlier channel (a rotary dim): per-channel scales keep the rest precise
    store = make_store(fmt)
    store.put("ab12", kv)
    out = store.get("ab12", "independent", fingerprint=FP)
    assert out.keys.dtype == torch.float32
    for got, want in ((out.keys, kv.keys), (out.values, kv.values)):
        # NOTE: int8 rounds to 1/254 of a channel's range; e4m3 keeps ~2 significant bits relative
        rel = (got - want).abs() / want.abs().amax(dim=2, keepdim=True)
        assert float(rel.max()) < (0.5 / 127 + 1e-6 if fmt == "int8" else 0.07), fmt
    small = (out.keys[0, 1, :, 2] - kv.keys[0, 1, :, 2]).abs().max()
    assert float(small) < 0.1 * float(kv.keys[0, 1, :, 2].abs().max())  # the outlier did not swamp its neighbours
    as_half = store.get("ab12", "independent", fingerprint=FP, dtype=torch.float16)
    assert as_half.keys.dtype == torch.float16


def test_8bit_blob_is_half_of_float16_and_fully_checked(tmp_path: Path) -> None:
    kv = make_kv(n_tokens=64)
    sizes = {}
    for fmt in ("float16", "int8"):
        store = DiskKVStore(tmp_path / fmt, storage_dtype=fmt)  # type: ignore[arg-type]
        store.put("ab12", kv)
        sizes[fmt] = store.path_for("ab12", "independent").stat().st_size
    L, H, D = SHAPE
    kv_bytes = 2 * L * H * 64 * D
    assert sizes["int8"] - kv_bytes / 2 < sizes["float16"] - kv_bytes  # codes: one byte instead of two
    store = DiskKVStore(tmp_path / "int8", storage_dtype="int8")
    path = store.path_for("ab12", "independent")
    good = path.read_bytes()
    header_end = 8 + int.from_bytes(good[:8], "little")
    for offset in range(header_end, len(good), 5):  # codes and scales are covered by the checksum
        raw = bytearray(good)
        raw[offset] ^= 0x5A
        path.write_bytes(bytes(raw))
        with pytest.raises(CacheCorruptError):
            store.get("ab12", "independent", fingerprint=FP)


def test_flipped_data_byte_is_corrupt(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path)
    store.put("ab12", make_kv())
    path = store.path_for("ab12", "independent")
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 10] ^= 0x5A
    path.write_bytes(bytes(raw))
    with pytest.raises(CacheCorruptError, match="recompute") as e:
        store.get("ab12", "independent", fingerprint=FP)
    assert str(path) in str(e.value) and "checksum" in str(e.value)


def test_no_single_byte_flip_goes_unnoticed(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path)
    store.put("ab12", make_kv(n_tokens=2))
    path = store.path_for("ab12", "independent")
    good = path.read_bytes()
    header_end = 8 + int.from_bytes(good[:8], "little")
    # NOTE: safetensors writes metadata in hash-map order (varies per process), so sweep every
    # header byte rather than aim at one field; the tensor data is strided.
    offsets = [*range(header_end), *range(header_end, len(good), 7)]
    for offset in offsets:
        raw = bytearray(good)
        raw[offset] ^= 0x5A  # NOTE: never maps a digit to another digit, so never a "valid" version
        path.write_bytes(bytes(raw))
        with pytest.raises(CacheCorruptError):
            store.get("ab12", "independent", fingerprint=FP)
    raw = bytearray(good)
    raw[good.index(FP.encode())] ^= 0x01  # 'f' -> 'g': still valid JSON, but another "model"
    path.write_bytes(bytes(raw))
    with pytest.raises(CacheCorruptError, match="checksum"):
        store.get("ab12", "independent", fingerprint=FP)


def test_blob_with_earlier_sha256_checksum_still_reads(tmp_path: Path) -> None:
    from safetensors.torch import load, save

    from fusionrag_core.store import codec

    store = DiskKVStore(tmp_path, storage_dtype="float32")
    kv = make_kv()
    store.put("ab12", kv)
    path = store.path_for("ab12", "independent")
    raw = path.read_bytes()
    meta = dict(codec._read_header_metadata(raw, "test"))
    tensors = load(raw)
    meta["checksum"] = codec._checksum(tensors, meta, "sha256")  # what format 1 wrote before xxh3
    path.write_bytes(save(tensors, metadata=meta))
    assert torch.equal(store.get("ab12", "independent", fingerprint=FP).keys, kv.keys)

    meta["checksum"] = "md5:" + meta["checksum"].partition(":")[2]
    path.write_bytes(save(tensors, metadata=meta))
    with pytest.raises(CacheCorruptError, match="unknown checksum algorithm"):
        store.get("ab12", "independent", fingerprint=FP)


def test_newer_format_version_is_mismatch(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path)
    store.put("ab12", make_kv())
    path = store.path_for("ab12", "independent")
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"format_version":"1"', b'"format_version":"7"'))
    with pytest.raises(CacheMismatchError, match="format version '7'"):
        store.get("ab12", "independent", fingerprint=FP)


def test_unreadable_path_is_corrupt(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path)
    path = store.path_for("ab12", "fused")
    path.mkdir(parents=True)  # a directory where the file should be: read fails with an OSError
    with pytest.raises(CacheCorruptError, match=str(path)):
        store.get("ab12", "fused", fingerprint=FP)


def test_store_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(InvalidRequestError, match="directory"):
        DiskKVStore(f)


def test_relative_store_root_is_fixed_at_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = DiskKVStore("kv")
    monkeypatch.chdir(tmp_path.parent)  # a later chdir must not move the store
    assert store.root == (tmp_path / "kv").resolve()
    assert store.path_for("ab" * 16, "independent").is_relative_to(tmp_path.resolve())


def test_bad_storage_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="float16"):
        DiskKVStore(tmp_path, storage_dtype="int4")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        open_store(tmp_path / "kv", storage_dtype="fp8")  # type: ignore[arg-type]


def test_open_store_dispatch(tmp_path: Path) -> None:
    s = open_store(tmp_path / "kv", storage_dtype="bfloat16")
    assert isinstance(s, DiskKVStore) and s.storage_dtype == "bfloat16"
    s2 = open_store(str(tmp_path / "kv2"))
    assert isinstance(s2, DiskKVStore) and s2.root == tmp_path / "kv2" and s2.storage_dtype == "float16"
    assert (tmp_path / "kv2").is_dir()


def test_device_argument(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path)
    store.put("ab12", make_kv())
    out = store.get("ab12", "independent", fingerprint=FP, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert out.keys.device.type == "cpu" and out.keys.dtype == torch.bfloat16
    assert out.token_ids.dtype == torch.int64


# ---------------------------------------------------------------- redis specifics


@pytest.mark.servers
def test_redis_keys_and_index(redis_url: str) -> None:
    import redis

    from fusionrag_core.store.redis import RedisKVStore

    with RedisKVStore(redis_url, namespace="layout", storage_dtype="float16") as store:
        store.put("ab12", make_kv(variant="fused"))
        raw = redis.Redis.from_url(redis_url)
        assert raw.exists("layout:kv:fused:ab12") == 1
        assert raw.smembers("layout:ids:fused") == {b"ab12"}
        # Same bytes as the disk format: a blob written by one backend decodes with the shared code.
        out = decode_blob(raw.get("layout:kv:fused:ab12"), source="t", chunk_id="ab12",  # type: ignore[arg-type]
                          variant="fused", fingerprint=FP)
        assert_same(out, make_kv(variant="fused"), atol=1e-2, rtol=1e-3)

        raw.setrange("layout:kv:fused:ab12", 200, b"\x00garbage\x00")
        with pytest.raises(CacheCorruptError, match="layout:kv:fused:ab12"):
            store.get("ab12", "fused", fingerprint=FP)
        raw.set("layout:kv:fused:ab12", b"short")
        with pytest.raises(CacheCorruptError, match="recompute"):
            store.get("ab12", "fused", fingerprint=FP)
        store.delete("ab12")
        assert raw.exists("layout:kv:fused:ab12") == 0 and raw.scard("layout:ids:fused") == 0
        raw.close()


def test_redis_unreachable_says_how_to_fix() -> None:
    pytest.importorskip("redis")
    from tests.servers import free_port

    with pytest.raises(FusionRAGError, match="redis-server is running"):
        open_store(f"redis://127.0.0.1:{free_port()}/0")


def test_redis_url_password_is_redacted() -> None:
    pytest.importorskip("redis")
    from fusionrag_core.store.redis import _redact

    assert _redact("redis://user:s3cret@host:6379/0") == "redis://user:***@host:6379/0"
    assert _redact("redis://:s3cret@host:6379/0") == "redis://***@host:6379/0"
    assert _redact("redis://host:6379/0") == "redis://host:6379/0"

