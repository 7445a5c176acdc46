"""`DiskKVStore`: one safetensors file per `(chunk_id, variant)` under a root directory.

Layout: `root/<chunk_id[:2]>/<chunk_id>.<variant>.safetensors`. The two-character shard keeps
directories small for large corpora. Writes go to a hidden temp file in the same directory, are
fsynced and `os.replace`d over the final name, so readers see either the old or the new blob,
never a partial one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from fusionrag_core.errors import CacheNotFoundError, InvalidRequestError, ReadOnlyError
from fusionrag_core.runtime.kv import VARIANTS, ChunkKV, Variant
from fusionrag_core.store.base import KVStore
from fusionrag_core.store.codec import (
    StorageDType,
    decode_file,
    encode_blob,
    recorded_fingerprint,
    validate_chunk_id,
    validate_variant,
)
from fusionrag_core.store.content_index import REBUILD_HINT, ContentIndex
from fusionrag_core.store.files import fsync_dir

_SUFFIX = ".safetensors"
CONTENT_DIR = ".content"
"""Where the content index of the chunk texts is kept under the root (its leading dot hides it from `list_ids`)."""
QUARANTINE_DIR = ".quarantine"
"""Where blobs that failed validation are moved (`quarantine`); its leading dot hides it from `list_ids`."""
# NOTE: what writing a directory this process may not change raises (a read-only mount, file modes).
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class DiskKVStore(KVStore):
    """KV caches as safetensors files in a directory (the default store).

    Thread- and process-safe for concurrent readers and writers of distinct or equal keys (the
    last `put` wins). A crash mid-`put` can leave a hidden `.*.tmp` file in a shard directory;
    it is never read and may be deleted.

    Args:
        root: directory holding the caches; created if missing.
        storage_dtype: dtype keys/values are stored in (see `KVStore` for the trade-off).
    """

    def __init__(self, root: Path | str, storage_dtype: StorageDType = "float16") -> None:
        super().__init__(storage_dtype)
        # NOTE: resolved once, so a later chdir does not move the store under a running process.
        self.root = Path(root).expanduser().resolve()
        if self.root.exists() and not self.root.is_dir():
            raise InvalidRequestError(
                f"KV store path {self.root} is a file; pass a directory (it is created if missing)"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        self._content: ContentIndex | None = None  # NOTE: opened on first use: a store read by id needs none
        self._content_lock = threading.Lock()

    def path_for(self, chunk_id: str, variant: Variant) -> Path:
        """The file that holds `(chunk_id, variant)` (whether or not it exists)."""
        validate_chunk_id(chunk_id)
        validate_variant(variant)
        return self.root / chunk_id[:2] / f"{chunk_id}.{variant}{_SUFFIX}"

    def put(self, chunk_id: str, kv: ChunkKV) -> None:
        path = self.path_for(chunk_id, kv.variant)
        blob = encode_blob(chunk_id, kv, self.storage_dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            # NOTE: mkstemp creates 0600 files; caches hold no secrets and may be read by another user
            # serving the same corpus, so publish them world-readable like ordinary files.
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, path)
        except BaseException:
            # NOTE: the final name is only ever produced by os.replace, so on any failure before it
            # the previous blob (if any) is untouched; only the temp file needs cleaning up.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
            raise
        fsync_dir(path.parent)

    def get(
        self,
        chunk_id: str,
        variant: Variant,
        *,
        fingerprint: str,
        shape: tuple[int, int, int] | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> ChunkKV:
        path = self.path_for(chunk_id, variant)
        try:
            return decode_file(path, chunk_id=chunk_id, variant=variant, fingerprint=fingerprint, shape=shape,
                               device=device, dtype=dtype)
        except FileNotFoundError:
            raise CacheNotFoundError(
                f"no {variant} KV cache for chunk {chunk_id} in {self.root} (expected {path}); "
                "run ingest for its document, or check the store path"
            ) from None

    def has(self, chunk_id: str, variant: Variant) -> bool:
        return self.path_for(chunk_id, variant).is_file()

    def delete(self, chunk_id: str, variant: Variant | None = None) -> None:
        for v in VARIANTS if variant is None else (validate_variant(variant),):
            with contextlib.suppress(FileNotFoundError):
                self.path_for(chunk_id, v).unlink()

    def quarantine(self, chunk_id: str, variant: Variant) -> str | None:
        """Move the blob to `root/.quarantine/` (never listed, never read), keeping its bytes.

        Raises:
            ReadOnlyError: this process cannot write the store's directory; the blob stays.
        """
        path = self.path_for(chunk_id, variant)
        target = self.root / QUARANTINE_DIR / f"{path.stem}.{time.time_ns()}{_SUFFIX}"
        try:
            target.parent.mkdir(exist_ok=True)
            try:
                os.rename(path, target)  # NOTE: atomic: of two threads setting it aside, one moves it.
            except FileNotFoundError:
                return None
        except OSError as e:
            if e.errno not in _NOT_WRITABLE:
                raise
            raise ReadOnlyError(f"the KV store {self.root} is read-only for this process ({e.strerror})") from e
        return str(target)

    def free_bytes(self) -> int | None:
        """Free space of the filesystem holding the store."""
        return shutil.disk_usage(self.root).free

    def list_ids(self, variant: Variant | None = None) -> set[str]:
        wanted = VARIANTS if variant is None else (validate_variant(variant),)
        return {chunk_id for _, chunk_id, stored in self._blobs() if stored in wanted}

    def stored_fingerprints(self, sample: int = 3) -> set[str]:
        """The fingerprints recorded in the headers of the first `sample` blobs found (no tensor is read)."""
        found: set[str] = set()
        for i, (path, _, _) in enumerate(self._blobs()):
            if i == sample:
                break
            fingerprint = recorded_fingerprint(Path(path))
            if fingerprint is not None:
                found.add(fingerprint)
        return found

    def _blobs(self) -> Iterator[tuple[str, str, str]]:
        """`(path, chunk id, variant)` of every blob file, in directory order (lazily: stop any time)."""
        with os.scandir(self.root) as shards:
            for shard in shards:
                if not shard.is_dir() or shard.name.startswith("."):
                    continue
                with os.scandir(shard.path) as entries:
                    for entry in entries:
                        # NOTE: temp files start with '.'; `<id>.<variant>.safetensors` has exactly
                        # two dots because ids cannot contain one.
                        name = entry.name
                        if name.startswith(".") or not name.endswith(_SUFFIX):
                            continue
                        parts = name[: -len(_SUFFIX)].split(".")
                        if len(parts) == 2:
                            yield entry.path, parts[0], parts[1]

    def content_index(self) -> ContentIndex:
        """The on-disk index of the chunk texts (`<root>/.content`), opened on first use.

        Several processes (and store objects) may share one directory's index: its rows are read
        back through SQLite, so each sees the others' writes.
        """
        with self._content_lock:
            if self._content is None:
                self._content = ContentIndex(self.root / CONTENT_DIR, fix=REBUILD_HINT)
            return self._content

    def __getstate__(self) -> dict[str, object]:
        # NOTE: a copy in another process (pickled) opens its own content index: a lock and an SQLite
        # connection cannot travel, and the directory's index is shared through its files anyway.
        return {k: v for k, v in self.__dict__.items() if k not in ("_content", "_content_lock")}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._content = None
        self._content_lock = threading.Lock()

    def close(self) -> None:
        """Close the content index's connection (its next use opens it again); blob files are opened per call."""
        with self._content_lock:
            if self._content is not None:
                self._content.close()

    def __repr__(self) -> str:
        return f"DiskKVStore(root={str(self.root)!r}, storage_dtype={self.storage_dtype!r})"


