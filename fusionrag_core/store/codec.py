"""The blob format every `KVStore` backend writes and reads: encode, decode, validate.

A stored chunk cache is one safetensors blob per `(chunk_id, variant)`:

* tensors `token_ids` `[T]` int64, `keys` `[L, H, T, D]`, `values` `[L, H, T, D]` (both in the
  store's storage dtype) and `positions` `[T]` int64; 8-bit storage dtypes ("int8",
  "float8_e4m3fn") add `key_scales` and `value_scales` `[L, H, 1, D]` fp32 (`store/quant.py`); a
  fused cache with its fusion drift adds `drift` `[T]` fp32 (`fusionrag_core.query.drift`), and only such
  a blob is format version 2 (a version-1 reader refuses it as a newer format instead of
  quarantining it as corrupt; every other blob stays version 1, byte for byte);
* a string→string metadata header with the format name and version, the chunk id, the model
  fingerprint, the variant, the token-ids hash, the shape, the storage and source dtypes and a
  checksum over the header and the tensor bytes (`xxh3_128:<hex>`; blobs written with
  `sha256:<hex>` by earlier versions are read too).

The disk and Redis backends write byte-identical blobs (`encode_blob`) and validate every load the
same way (`decode_blob`); only where the bytes live differs.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, get_args

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fusionrag_core.errors import CacheCorruptError, CacheMismatchError, InvalidRequestError
from fusionrag_core.runtime.kv import VARIANTS, ChunkKV, Variant, hash_token_ids
from fusionrag_core.store.quant import QUANTIZED, dequantize, quantize

StorageDType = Literal["float32", "float16", "bfloat16", "int8", "float8_e4m3fn"]
STORAGE_DTYPES: tuple[StorageDType, ...] = get_args(StorageDType)

FORMAT_NAME = "fusionrag-kv"
FORMAT_VERSION = "2"
# NOTE: the versions this code reads; version 1 is version 2 without the optional `drift` tensor.
READ_VERSIONS = ("1", "2")
_NO_DRIFT_VERSION = "1"
# NOTE: the checksum detects bit rot and truncation, not tampering (anyone who can write a blob can
# write its checksum), so it need not be cryptographic; xxh3 hashes ~10x faster than sha256, which
# matters because every load verifies every byte before a single token is generated.
CHECKSUM_ALGO = "xxh3_128"
_HASHERS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    **QUANTIZED,
}
_TENSOR_NAMES = ("token_ids", "keys", "values", "positions")
# NOTE: 8-bit blobs also hold per-channel scales (`store/quant.py`); the checksum covers them too.
_SCALE_NAMES = ("key_scales", "value_scales")
# NOTE: ids are content hashes in practice; the charset excludes '.', '/', '\\' and anything else
# that could escape the store root or make `<chunk_id>.<variant>.safetensors` ambiguous.
_CHUNK_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# NOTE: a safetensors header larger than this is certainly garbage (ours are < 2 KiB).
_MAX_HEADER_BYTES = 1 << 20


def is_storable_chunk_id(chunk_id: object) -> bool:
    """Whether a KV store can hold `chunk_id` (see `validate_chunk_id`)."""
    return isinstance(chunk_id, str) and _CHUNK_ID_RE.fullmatch(chunk_id) is not None


def is_valid_namespace(namespace: str) -> bool:
    """Whether `namespace` can prefix a Redis store's keys: 1-64 characters of [A-Za-z0-9_.-]."""
    return _NAMESPACE_RE.fullmatch(namespace) is not None


def validate_chunk_id(chunk_id: str) -> str:
    """Return `chunk_id` if it is safe to use as a file name / key part.

    Raises:
        InvalidRequestError: if it is empty, too long, or holds characters other than
            `[A-Za-z0-9_-]` (path separators, dots, spaces...).
    """
    if not is_storable_chunk_id(chunk_id):
        raise InvalidRequestError(
            f"invalid chunk id {chunk_id!r}: expected 1-128 characters from [A-Za-z0-9_-] "
            "(chunk ids are hex content hashes; pass the id ingest produced, not a path or a text)"
        )
    return chunk_id


def validate_variant(variant: str) -> Variant:
    """Return `variant` if it is one of `VARIANTS`.

    Raises:
        InvalidRequestError: naming the accepted variants.
    """
    if variant not in VARIANTS:
        raise InvalidRequestError(f"unknown cache variant {variant!r}; use one of {VARIANTS}")
    return variant


def storage_torch_dtype(storage_dtype: str) -> torch.dtype:
    """Map a storage dtype name to its torch dtype.

    Raises:
        InvalidRequestError: for names other than "float32", "float16", "bfloat16".
    """
    try:
        return _TORCH_DTYPES[storage_dtype]
    except KeyError:
        raise InvalidRequestError(
            f"unsupported storage dtype {storage_dtype!r}; use one of {STORAGE_DTYPES}"
        ) from None


def as_stored(kv: ChunkKV, storage_dtype: StorageDType) -> ChunkKV:
    """`kv` on the CPU at the precision a store of `storage_dtype` gives it back: cast to a float
    format, or quantised and decoded to fp32 for an 8-bit one (exactly what `decode_blob` returns).

    A copy kept in memory at this precision computes the same as one read back from the store.
    """
    if storage_dtype not in QUANTIZED:
        return kv.to("cpu", storage_torch_dtype(storage_dtype))
    keys, values = (dequantize(*quantize(t, storage_dtype), torch.float32, "cpu") for t in (kv.keys, kv.values))
    return replace(kv.to("cpu"), keys=keys, values=values)


def memory_torch_dtype(storage_dtype: StorageDType) -> torch.dtype:
    """The dtype `as_stored` gives: the storage dtype, or fp32 for an 8-bit one."""
    return torch.float32 if storage_dtype in QUANTIZED else storage_torch_dtype(storage_dtype)


def _tensor_names(storage_dtype: str, version: str) -> tuple[str, ...]:
    names = _TENSOR_NAMES + _SCALE_NAMES if storage_dtype in QUANTIZED else _TENSOR_NAMES
    return names if version == _NO_DRIFT_VERSION else (*names, "drift")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str], algo: str = CHECKSUM_ALGO) -> str:
    """`algo` hash over the header fields (except the checksum itself) and each tensor's name,
    dtype, shape and raw bytes, in a fixed order.

    NOTE: covering the header means a flipped byte in, e.g., the fingerprint reads as corruption
    instead of as a (misleading) cache of another model.
    """
    h = _HASHERS[algo]()
    fields = {k: v for k, v in metadata.items() if k != "checksum"}
    h.update(json.dumps(fields, sort_keys=True).encode())
    for name in _tensor_names(metadata.get("storage_dtype", ""), metadata.get("format_version", "")):
        t = tensors[name].contiguous()
        h.update(f"|{name}|{_dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        # NOTE: viewing as uint8 works for every dtype (bfloat16 has no numpy equivalent) and hands
        # hashlib the tensor's own buffer without a copy.
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return f"{algo}:{h.hexdigest()}"


_HALF_MAX = torch.finfo(torch.float16).max


def _overflows_half(*tensors: torch.Tensor) -> bool:
    """Whether casting to float16 would turn a finite value into inf.

    NOTE: only float16 needs this: bfloat16 and float32 share float32's range. One aminmax pass is
    ~10x cheaper than isfinite on the cast copy; the exact check runs only when it flags something,
    so caches that already hold inf/nan (a caller bug we pass through) are not misreported.
    """
    for t in tensors:
        if t.numel() == 0:
            continue
        lo, hi = torch.aminmax(t.detach())
        if float(hi) > _HALF_MAX or float(lo) < -_HALF_MAX:
            finite = torch.isfinite(t)
            if bool((t[finite].abs() > _HALF_MAX).any()):
                return True
    return False


def encode_blob(chunk_id: str, kv: ChunkKV, storage_dtype: StorageDType) -> bytes:
    """Serialise `kv` to the safetensors blob format described in the module docstring.

    Args:
        chunk_id: the chunk's id (recorded in the header so a misplaced blob is detected).
        kv: the cache to store; may live on any device, in any float dtype.
        storage_dtype: dtype keys/values are cast to before writing.

    Returns:
        The blob bytes.

    Raises:
        InvalidRequestError: if `chunk_id` is malformed, or if casting to `storage_dtype` would turn
            finite values into inf (float16 tops out at 65504).
    """
    validate_chunk_id(chunk_id)
    target = storage_torch_dtype(storage_dtype)
    scales: dict[str, torch.Tensor] = {}
    if storage_dtype in QUANTIZED:
        keys, scales["key_scales"] = (t.to("cpu").contiguous() for t in quantize(kv.keys, storage_dtype))
        values, scales["value_scales"] = (t.to("cpu").contiguous() for t in quantize(kv.values, storage_dtype))
    else:
        keys = kv.keys.detach().to("cpu", target).contiguous()  # [L, H, T, D]
        values = kv.values.detach().to("cpu", target).contiguous()  # [L, H, T, D]
    if target == torch.float16 and kv.keys.dtype != torch.float16 and _overflows_half(kv.keys, kv.values):
        raise InvalidRequestError(
            f"chunk {chunk_id}: K/V values overflow {storage_dtype} (|x| > its max); "
            "open the store with storage_dtype='bfloat16' or 'float32' for this model"
        )
    tensors = {
        "token_ids": kv.token_ids.detach().to("cpu", torch.int64).contiguous(),  # [T]
        "keys": keys,
        "values": values,
        "positions": kv.positions.detach().to("cpu", torch.int64).contiguous(),  # [T]
        **scales,  # [L, H, 1, D] fp32 each, 8-bit formats only
    }
    if kv.drift is not None:
        tensors["drift"] = kv.drift.detach().to("cpu", torch.float32).contiguous()  # [T]
    L, H, T, D = keys.shape
    metadata = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION if kv.drift is not None else _NO_DRIFT_VERSION,
        "chunk_id": chunk_id,
        "fingerprint": kv.fingerprint,
        "variant": kv.variant,
        "token_ids_hash": hash_token_ids(tensors["token_ids"]),
        "shape": json.dumps([L, H, T, D]),
        "storage_dtype": storage_dtype,
        "source_dtype": _dtype_name(kv.keys.dtype),
    }
    if kv.fused_after:
        metadata["fused_after"] = kv.fused_after  # NOTE: optional: blobs without it stay byte-identical.
    metadata["checksum"] = _checksum(tensors, metadata)
    return st_save(tensors, metadata=metadata)


def _read_header_metadata(blob: bytes, source: str) -> dict[str, str]:
    """Parse the safetensors header (`u64 little-endian length` + JSON) and return `__metadata__`."""
    if len(blob) < 8:
        raise _corrupt(source, f"only {len(blob)} bytes, smaller than a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > _MAX_HEADER_BYTES or 8 + n > len(blob):
        raise _corrupt(source, f"header claims {n} bytes but the blob has {len(blob)} (truncated?)")
    try:
        header = json.loads(blob[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(source, f"unparsable header ({e})") from e
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _corrupt(source, "header has no fusionrag metadata")
    return meta


def _corrupt(source: str, reason: str) -> CacheCorruptError:
    return CacheCorruptError(
        f"KV cache {source} is corrupt: {reason}. Delete it and re-run ingest (or verify) to recompute it"
    )


def decode_blob(
    blob: bytes,
    *,
    source: str,
    chunk_id: str,
    variant: Variant,
    fingerprint: str,
    shape: tuple[int, int, int] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> ChunkKV:
    """Parse and fully validate a blob written by `encode_blob`.

    Args:
        blob: the raw bytes.
        source: where the bytes came from (file path or Redis key), quoted in errors.
        chunk_id: the id the caller asked for; must match the header.
        variant: the variant the caller asked for; must match the header.
        fingerprint: the loaded model's fingerprint; must match the header.
        shape: the model's `(layers, kv_heads, head_dim)`, checked when given.
        device: where to put the returned tensors.
        dtype: dtype of the returned keys/values; `None` means the dtype the cache was computed in
            (recorded at `put`), so a round trip returns the caller's dtype.

    Returns:
        The validated cache.

    Raises:
        CacheCorruptError: truncated/unparsable blob, missing or inconsistent header fields,
            checksum or token-hash failure, or a blob stored under another id/variant.
        CacheMismatchError: another model's cache (fingerprint), wrong `(L, H, D)`, or a format
            version this code does not read.
    """
    meta = _read_header_metadata(blob, source)
    _check_format(meta, source)
    try:
        tensors = st_load(blob)
    except Exception as e:  # NOTE: safetensors raises its own SafetensorError (and others) on bad data.
        raise _corrupt(source, f"unreadable tensors ({e})") from e
    return _validated(meta, tensors, source=source, chunk_id=chunk_id, variant=variant, fingerprint=fingerprint,
                      shape=shape, device=device, dtype=dtype)


def decode_file(
    path: Path,
    *,
    chunk_id: str,
    variant: Variant,
    fingerprint: str,
    shape: tuple[int, int, int] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> ChunkKV:
    """`decode_blob` for a blob in a file, memory-mapped instead of read.

    NOTE: reading the file and then parsing it copies every byte twice before the checksum reads
    them a third time; mapped, the checksum's read pages the bytes in and the move to the caller's
    device/dtype is the only copy. Blobs are replaced by rename, never rewritten in place, so a
    mapping always sees one complete file.

    Raises:
        FileNotFoundError: no such file.
        CacheCorruptError / CacheMismatchError: as `decode_blob`.
    """
    source = f"file {path}"
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not iterable)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CacheCorruptError(
            f"KV cache file {path} cannot be read ({e}); fix its permissions, or delete it and re-run "
            "ingest (or verify) to recompute it"
        ) from e
    except Exception as e:  # NOTE: SafetensorError (and others) on a truncated or garbled file.
        raise _corrupt(source, f"unreadable ({e})") from e
    if not isinstance(meta, dict):
        raise _corrupt(source, "header has no fusionrag metadata")
    _check_format(meta, source)
    return _validated(meta, tensors, source=source, chunk_id=chunk_id, variant=variant, fingerprint=fingerprint,
                      shape=shape, device=device, dtype=dtype)


def recorded_fingerprint(path: Path) -> str | None:
    """The model fingerprint a blob file's header records, read without its tensors.

    Unchecked (the checksum is not verified): a hint of whose caches a store holds, not a load.
    None when the file is no readable fusionrag blob; `decode_file` judges such a file when it is loaded.
    """
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
    except Exception:  # NOTE: SafetensorError (and OSError) on a missing, truncated or garbled file.
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        return None
    return meta.get("fingerprint") or None


def header_bytes(first: bytes) -> int | None:
    """How many leading bytes of a blob hold its safetensors header, from its first 8 (None: no
    plausible header): for a store that can read part of a blob (`recorded_fingerprint_in`)."""
    if len(first) < 8:
        return None
    (n,) = struct.unpack("<Q", first[:8])
    return 8 + n if n <= _MAX_HEADER_BYTES else None


def recorded_fingerprint_in(head: bytes) -> str | None:
    """`recorded_fingerprint` of a blob from its leading bytes (its header: `header_bytes`), unchecked;
    None when they hold no fusionrag blob's header."""
    try:
        meta = _read_header_metadata(head, "a blob's header")
    except CacheCorruptError:
        return None
    if meta.get("format") != FORMAT_NAME:
        return None
    return meta.get("fingerprint") or None


def _check_format(meta: dict[str, str], source: str) -> None:
    if meta.get("format") != FORMAT_NAME:
        raise _corrupt(source, f"not a fusionrag KV blob (format={meta.get('format')!r})")
    version = meta.get("format_version", "")
    if not (version.isascii() and version.isdigit()):
        raise _corrupt(source, f"bad format version {version!r}")
    # NOTE: checked before the checksum, whose scheme a future version may change.
    if version not in READ_VERSIONS:
        raise CacheMismatchError(
            f"KV cache {source} has format version {meta.get('format_version')!r}, this fusionrag reads "
            f"versions {', '.join(READ_VERSIONS)}; re-ingest with this version (or upgrade fusionrag)"
        )


def _validated(
    meta: dict[str, str],
    tensors: dict[str, torch.Tensor],
    *,
    source: str,
    chunk_id: str,
    variant: Variant,
    fingerprint: str,
    shape: tuple[int, int, int] | None,
    device: torch.device | str,
    dtype: torch.dtype | None,
) -> ChunkKV:
    """The cache in a parsed blob, after every check `decode_blob` documents."""
    names = _tensor_names(meta.get("storage_dtype", ""), meta.get("format_version", ""))
    if set(tensors) != set(names):
        raise _corrupt(source, f"expected tensors {sorted(names)}, found {sorted(tensors)}")
    # NOTE: checksum first: past this point every field is what the writer wrote, so the checks
    # below catch writer bugs and misplaced blobs, not bit rot.
    algo = meta.get("checksum", "").partition(":")[0]
    if algo not in _HASHERS:
        raise _corrupt(source, f"unknown checksum algorithm {algo!r}")
    if _checksum(tensors, meta, algo) != meta.get("checksum"):
        raise _corrupt(source, "checksum mismatch (the bytes changed after they were written)")

    if meta.get("chunk_id") != chunk_id or meta.get("variant") != variant:
        raise _corrupt(
            source,
            f"it holds chunk {meta.get('chunk_id')!r} ({meta.get('variant')!r}), not {chunk_id!r} ({variant!r})",
        )
    storage_name = meta.get("storage_dtype", "")
    source_name = meta.get("source_dtype", "")
    if storage_name not in _TORCH_DTYPES:
        raise CacheMismatchError(
            f"KV cache {source} is stored as {storage_name!r}, which this fusionrag does not read; re-ingest"
        )
    try:
        source_dtype = getattr(torch, source_name)
        if not isinstance(source_dtype, torch.dtype) or not source_dtype.is_floating_point:
            raise AttributeError(source_name)
        declared_shape = json.loads(meta["shape"])
    except (AttributeError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise _corrupt(source, f"bad header field ({e!r})") from e
    keys, values = tensors["keys"], tensors["values"]  # [L, H, T, D]
    if keys.dtype != _TORCH_DTYPES[storage_name] or values.dtype != keys.dtype:
        raise _corrupt(source, f"keys/values are {keys.dtype}/{values.dtype}, header says {storage_name}")
    if list(keys.shape) != declared_shape:
        raise _corrupt(source, f"keys have shape {list(keys.shape)}, header says {declared_shape}")
    if tensors["token_ids"].dtype != torch.int64 or tensors["positions"].dtype != torch.int64:
        raise _corrupt(source, "token_ids/positions are not int64")
    if hash_token_ids(tensors["token_ids"]) != meta.get("token_ids_hash"):
        raise _corrupt(source, "token-ids hash mismatch")
    drift = tensors.get("drift")  # [T]
    if drift is not None and (drift.dtype != torch.float32 or drift.shape != tensors["token_ids"].shape
                              or not bool(torch.isfinite(drift).all()) or bool((drift < 0).any())):
        raise _corrupt(source, f"drift must be finite non-negative float32 [T], got {drift.dtype} {list(drift.shape)}")
    target = dtype or source_dtype
    if storage_name in QUANTIZED:
        L, H, _, D = keys.shape
        for name in _SCALE_NAMES:
            sc = tensors[name]
            if sc.dtype != torch.float32 or list(sc.shape) != [L, H, 1, D] or not bool(torch.isfinite(sc).all()):
                raise _corrupt(source, f"{name} must be finite float32 [{L}, {H}, 1, {D}], got {sc.dtype} "
                                       f"{list(sc.shape)}")
        # NOTE: decoded on the target device: the codes cross the bus at one byte per value.
        keys = dequantize(keys, tensors["key_scales"], target, device)
        values = dequantize(values, tensors["value_scales"], target, device)

    try:
        kv = ChunkKV(
            token_ids=tensors["token_ids"],
            keys=keys,
            values=values,
            positions=tensors["positions"],
            fingerprint=meta.get("fingerprint", ""),
            variant=variant,
            fused_after=meta.get("fused_after", ""),
            drift=drift,
        )
    except CacheMismatchError as e:
        # NOTE: the checksum matched, so an inconsistent cache was written that way: still unusable.
        raise _corrupt(source, str(e)) from e
    try:
        kv.validate(fingerprint=fingerprint, shape=shape)
    except CacheMismatchError as e:
        raise CacheMismatchError(f"KV cache {source}: {e}") from e
    return kv.to(device, target)
