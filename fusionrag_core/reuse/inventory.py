"""What learned caches a data directory holds, per model and scope; purging a tenant's; checking them.

Learned caches live under `<data_dir>/learned/<model>/` (the operator's scope, and every scope
when a server shares learning) and `<data_dir>/learned/<model>/scopes/<tenant>/<salt digest>/`
(`fusionrag_core.scope.Scope.learned_dir`). Nothing here loads a model: `fusionrag learned` and
`fusionrag verify` read the directories as they are.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fusionrag_core.errors import CacheCorruptError, CacheMismatchError, CacheNotFoundError, InvalidRequestError
from fusionrag_core.reuse.learned import open_learned
from fusionrag_core.runtime.kv import VARIANTS
from fusionrag_core.scope import SCOPES_DIR, Scope
from fusionrag_core.store.disk import DiskKVStore

LRU_FILE = "lru.sqlite"


@dataclass(frozen=True)
class LearnedScope:
    """One directory of learned caches.

    Attributes:
        model: the model's directory name (its fingerprint's head).
        tenant: the tenant ("" for the operator's scope, or caches every tenant shares).
        salt: the salt's directory ("-": no salt; a digest: the salt itself is never stored).
        path: the directory.
        caches: how many caches it holds.
        nbytes: their bytes.
    """

    model: str
    tenant: str
    salt: str
    path: Path
    caches: int
    nbytes: int


def learned_scopes(data_dir: str | Path) -> list[LearnedScope]:
    """Every directory of learned caches under `data_dir`, model by model."""
    return [_describe(model, tenant, salt, path) for model, tenant, salt, path in _directories(Path(data_dir))]


def purge_tenant(data_dir: str | Path, tenant: str) -> list[Path]:
    """Remove every learned cache of `tenant` (all its salts, every model); returns the folders removed.

    NOTE: run it while no server uses the directory: a server that has the tenant's caches open keeps
    writing through its open handles until it restarts (its learning is then skipped with a warning).

    Raises:
        InvalidRequestError: `tenant` is not a tenant name (the operator's caches are not purged here).
    """
    if not tenant:
        raise InvalidRequestError("name the tenant to purge (--tenant NAME); the operator's learned caches are "
                                  "removed by deleting <db>/learned")
    Scope(tenant)  # NOTE: the name check: a name never reaches outside its folder
    removed = []
    for model_dir in _model_dirs(Path(data_dir)):
        folder = model_dir / SCOPES_DIR / tenant
        if folder.is_dir():
            shutil.rmtree(folder)
            removed.append(folder)
    return removed


@dataclass(frozen=True)
class LearnedReport:
    """What `verify_learned` found in one directory (and removed, when it repaired)."""

    path: Path
    caches: int
    missing: list[str]
    corrupt: list[str]
    orphans: list[str]
    repaired: bool

    @property
    def ok(self) -> bool:
        return not (self.missing or self.corrupt or self.orphans)


def verify_learned(scope: LearnedScope, *, repair: bool) -> LearnedReport:
    """Check one directory: every cache row has its blobs, each blob reads back whole and is this
    model's, and every blob has its row. With `repair`, the bad entries and orphan blobs are removed.
    """
    store = DiskKVStore(scope.path / "kv")
    # NOTE: the model's directory is named for its fingerprint's head: a blob of any other model is corrupt here
    fingerprint = next((f for f in store.stored_fingerprints() if f.startswith(scope.model)), scope.model)
    rows = _rows(scope.path / LRU_FILE)
    blobs = store.list_ids()
    missing = [cid for cid in rows if cid not in blobs]
    corrupt = [cid for cid in rows if cid in blobs and not _reads(store, cid, fingerprint)]
    orphans = sorted(blobs - set(rows))
    if repair and (missing or corrupt or orphans):
        learned = open_learned(scope.path, fingerprint)
        for cid in [*missing, *corrupt]:
            learned.discard(cid)
        for cid in orphans:
            store.delete(cid)
    return LearnedReport(scope.path, len(rows), missing, corrupt, orphans, repair)


def _reads(store: DiskKVStore, chunk_id: str, fingerprint: str) -> bool:
    """Whether every stored variant of `chunk_id` decodes whole, as `fingerprint`'s."""
    for variant in VARIANTS:
        if not store.has(chunk_id, variant):
            continue
        try:
            store.get(chunk_id, variant, fingerprint=fingerprint)
        except (CacheCorruptError, CacheMismatchError, CacheNotFoundError):
            return False
    return True


def _rows(path: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return [str(r[0]) for r in db.execute("SELECT chunk_id FROM learned ORDER BY chunk_id")]


def _describe(model: str, tenant: str, salt: str, path: Path) -> LearnedScope:
    with contextlib.closing(sqlite3.connect(f"file:{path / LRU_FILE}?mode=ro", uri=True)) as db:
        count, nbytes = db.execute("SELECT count(*), coalesce(sum(nbytes), 0) FROM learned").fetchone()
    return LearnedScope(model, tenant, salt, path, int(count), int(nbytes))


def _model_dirs(data_dir: Path) -> list[Path]:
    root = data_dir.expanduser() / "learned"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _directories(data_dir: Path) -> Iterator[tuple[str, str, str, Path]]:
    """(model, tenant, salt, path) of each directory that holds a table of learned caches."""
    for model_dir in _model_dirs(data_dir):
        if (model_dir / LRU_FILE).is_file():
            yield model_dir.name, "", "-", model_dir
        scopes = model_dir / SCOPES_DIR
        for tenant_dir in sorted(scopes.iterdir()) if scopes.is_dir() else []:
            for salt_dir in sorted(tenant_dir.iterdir()) if tenant_dir.is_dir() else []:
                if (salt_dir / LRU_FILE).is_file():
                    yield model_dir.name, tenant_dir.name, salt_dir.name, salt_dir


__all__ = ["LRU_FILE", "LearnedReport", "LearnedScope", "learned_scopes", "purge_tenant", "verify_learned"]
