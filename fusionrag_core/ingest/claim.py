"""A process's claim on an embedded Chroma database: shared while it has the database open, sole
while it writes.

Embedded Chroma (a `PersistentClient` on a directory) keeps the vector index in the memory of the
process that opened it and does not read the files again while it runs. A process serving a
directory therefore never sees another process's writes there: a chunk deleted elsewhere is still
found (with no text), a chunk added elsewhere is counted but never found. So every process that
opens the directory claims it, and a write needs to be the only claim:

* `<dir>/.fusionrag-claim.lock`: a POSIX record lock (`fcntl`), shared by every process that has the
  directory open, exclusive while one of them writes. Record locks belong to the process, so the
  indexes one process opens on the directory never exclude each other; the upgrade to exclusive is
  atomic and fails, keeping the shared lock, while another process holds one; and the kernel drops
  the lock of a process that dies, SIGKILL included. (NOTE: the lock is host-local, like the
  corpus's writer lock; a directory shared by several hosts needs a Chroma server.)
* `<dir>/.fusionrag-holders/<host>-<pid>.json`: who holds a claim, for the error message; its holder
  keeps an `flock` on it while it lives, so a file left by a killed process is known to be stale.

A refused write fails before it changes anything, with `DatabaseInUseError`: several processes on
one corpus need a Chroma server (`chroma run --path DIR`, then `--chroma-url`), which serves every
client from one memory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from fusionrag_core.errors import DatabaseInUseError, FusionRAGError, ReadOnlyError
from fusionrag_core.ingest.lock import holder_info

CLAIM_FILE = ".fusionrag-claim.lock"
HOLDERS_DIR = ".fusionrag-holders"
_POLL_S = 0.2
# NOTE: how many other holders a refusal names (the rest are counted).
_NAMED = 3


class _Held:
    """This process's claim on one directory: one lock descriptor, however many `Claim`s share it.

    NOTE: a POSIX record lock is dropped when the process closes *any* descriptor of the file, so
    the lock file is opened exactly once per process and directory, here.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.guard = threading.Lock()
        self.count = 0
        self.sole = 0
        self.lock_fd = -1
        self.holder_fd = -1
        self.holder_file = path / HOLDERS_DIR / f"{socket.gethostname()}-{os.getpid()}.json"


_held: dict[Path, _Held] = {}
_held_guard = threading.Lock()


def claim(path: str | Path, *, wait_s: float = 0.0) -> Claim:
    """Claim the embedded database in `path` for this process (shared), until `Claim.release()`.

    Claims of one process never exclude each other; the first one takes the shared lock.

    Args:
        path: the embedded Chroma directory (created if missing).
        wait_s: how long to wait for another process's write to finish.

    Raises:
        DatabaseInUseError: another process is still writing to the database after `wait_s`.
        ReadOnlyError: this process cannot write the directory (embedded Chroma cannot open it either).
    """
    if not wait_s >= 0:
        raise FusionRAGError(f"wait_s must be >= 0 seconds, got {wait_s}")
    path = Path(path).expanduser().resolve()
    with _held_guard:
        held = _held.setdefault(path, _Held(path))
    with held.guard:
        if held.count == 0:
            _take_shared(held, wait_s)
        held.count += 1
    return Claim(held)


@contextlib.contextmanager
def alone(path: str | Path, action: str, *, wait_s: float = 0.0) -> Iterator[None]:
    """`with alone(path, "ingest"): ...`: no other process has the database open during the block.

    Raises:
        DatabaseInUseError: as `Claim.sole`.
    """
    with claim(path, wait_s=wait_s) as mine, mine.sole(action, wait_s=wait_s):
        yield


class Claim:
    """One shared claim on an embedded database (from `claim`); a context manager releasing it."""

    def __init__(self, held: _Held) -> None:
        self._held: _Held | None = held
        self.path = held.path

    @contextlib.contextmanager
    def sole(self, action: str, *, wait_s: float = 0.0) -> Iterator[None]:
        """Make this process the database's only user for the block (the claim stays shared after).

        Threads of this process may hold it at once (the corpus's writer lock orders their writes).

        Args:
            action: what the block does ("ingest", "delete", "repair"), quoted to other processes.
            wait_s: how long to wait for the other processes to close the database.

        Raises:
            DatabaseInUseError: another process still has it open after `wait_s`; nothing was done.
        """
        held = self._live()
        with held.guard:
            if held.sole == 0:
                _take_sole(held, action, wait_s)
            held.sole += 1
        try:
            yield
        finally:
            with held.guard:
                held.sole = max(0, held.sole - 1)  # NOTE: 0 already if the last claim was released inside.
                if held.sole == 0 and held.lock_fd >= 0:
                    _lockf(held.lock_fd, _SHARED)  # NOTE: a downgrade never waits.
                    _record(held, "open")

    def release(self) -> None:
        """Give the claim up (idempotent); the last claim of the process drops the lock."""
        held, self._held = self._held, None
        if held is None:
            return
        with held.guard:
            held.count -= 1
            if held.count == 0:
                _drop(held)

    def _live(self) -> _Held:
        if self._held is None:
            raise FusionRAGError(f"the claim on {self.path} was released; claim the database again")
        return self._held

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def holders(path: str | Path) -> list[dict[str, Any]]:
    """The other live processes holding a claim on the database in `path` (stale records removed)."""
    folder = Path(path).expanduser().resolve() / HOLDERS_DIR
    mine = f"{socket.gethostname()}-{os.getpid()}.json"
    found: list[dict[str, Any]] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in sorted(folder.iterdir()):
            if entry.name == mine or not entry.name.endswith(".json"):
                continue
            record = _live_record(entry)
            if record is not None:
                found.append(record)
    return found


# ---- the locks ----------------------------------------------------------------------------------
_SHARED, _SOLE = "shared", "sole"


def _lockf(fd: int, kind: str) -> bool:
    """Set this process's record lock on `fd` without waiting: True when set, False when another
    process's lock conflicts (this process's own lock is kept then)."""
    import fcntl

    try:
        fcntl.lockf(fd, (fcntl.LOCK_SH if kind == _SHARED else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise
    return True


def _poll(try_once: Callable[[], bool], wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while not try_once():
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
    return True


def _take_shared(held: _Held, wait_s: float) -> None:
    try:
        held.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(held.path / CLAIM_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        raise ReadOnlyError(
            f"the Chroma database {held.path} is read-only for this process ({e.strerror}), and embedded Chroma "
            "writes to its directory even to read; make it writable, or serve a writable copy with a Chroma server "
            "(`chroma run --path COPY`) and connect to that (--chroma-url)"
        ) from e
    if not _poll(lambda: _lockf(fd, _SHARED), wait_s):
        os.close(fd)
        raise DatabaseInUseError(_busy_message(held.path, wait_s))
    held.lock_fd = fd
    try:
        _publish(held)
    except BaseException:
        _drop(held)
        raise


def _take_sole(held: _Held, action: str, wait_s: float) -> None:
    if not _poll(lambda: _lockf(held.lock_fd, _SOLE), wait_s):
        raise DatabaseInUseError(_shared_message(held.path, action, wait_s))
    _record(held, action, writing=True)


def _drop(held: _Held) -> None:
    """Unpublish and unlock (the caller holds `held.guard`)."""
    if held.holder_fd >= 0:
        with contextlib.suppress(FileNotFoundError):
            held.holder_file.unlink()
        os.close(held.holder_fd)  # NOTE: drops the flock that marks the record live.
        held.holder_fd = -1
    if held.lock_fd >= 0:
        os.close(held.lock_fd)  # NOTE: drops the record lock.
        held.lock_fd = -1
    held.sole = 0


# ---- who holds a claim --------------------------------------------------------------------------
def _publish(held: _Held) -> None:
    """Write this process's record, already flocked when it appears (written aside, then renamed)."""
    import fcntl

    folder = held.holder_file.parent
    folder.mkdir(exist_ok=True)
    staging = folder / f".{held.holder_file.stem}.tmp"
    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.holder_fd = fd
        _record(held, "open")
        os.replace(staging, held.holder_file)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            staging.unlink()
        raise


def _record(held: _Held, action: str, *, writing: bool = False) -> None:
    """Write what this process does into its record. Best-effort on a full disk: the record stays
    empty, and `_live_record` names its holder by the file's name."""
    if held.holder_fd < 0:
        return
    data = json.dumps({**holder_info(action), "writing": writing}).encode()
    os.ftruncate(held.holder_fd, 0)
    try:
        os.pwrite(held.holder_fd, data, 0)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise


def _live_record(entry: Path) -> dict[str, Any] | None:
    """The record in `entry` when its holder lives (it keeps the file flocked); a stale one is removed."""
    import fcntl

    try:
        fd = os.open(entry, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raw = os.pread(fd, 4096, 0)
            with contextlib.suppress(ValueError):
                record = json.loads(raw or b"null")
                if isinstance(record, dict):
                    return record
            return {"pid": entry.stem.rsplit("-", 1)[-1], "host": entry.stem.rsplit("-", 1)[0]}
        with contextlib.suppress(FileNotFoundError):
            entry.unlink()  # NOTE: nobody flocks it: its process died without releasing.
        return None
    finally:
        os.close(fd)


def _describe(records: list[dict[str, Any]]) -> str:
    if not records:
        return "another process"
    named = [f"pid {r.get('pid')} on {r.get('host')} ({r.get('action')}: {r.get('command')!r}, since {r.get('since')})"
             for r in records[:_NAMED]]
    more = f" and {len(records) - _NAMED} more" if len(records) > _NAMED else ""
    return ", ".join(named) + more


def _server_hint(path: Path) -> str:
    return (f"to share the corpus between processes, serve it with a Chroma server (`chroma run --path {path}`) and "
            "pass --chroma-url http://HOST:PORT (Python: FusionIndex.open(..., chroma_url=...), "
            "VectorDBConfig(url=...))")


def _shared_message(path: Path, action: str, wait_s: float) -> str:
    waited = f" after waiting {wait_s:g} s" if wait_s else ""
    reading = " (a verify without repair only reads: CLI verify --no-repair)" if action == "repair" else ""
    return (f"cannot {action}: the embedded Chroma database {path} is open in {_describe(holders(path))}{waited}; "
            "embedded Chroma serves one process (the others would go on serving what it held before the "
            f"{action}): stop that process and run this again{reading}, or, {_server_hint(path)}")


def _busy_message(path: Path, wait_s: float) -> str:
    writers = [r for r in holders(path) if r.get("writing")]
    waited = f" after waiting {wait_s:g} s" if wait_s else ""
    return (f"cannot open the embedded Chroma database {path}: {_describe(writers)} is writing to it{waited}; "
            f"let it finish, or wait for it (CLI: --wait SECONDS), or, {_server_hint(path)}")


def _forget_after_fork() -> None:
    """A forked child holds none of its parent's record locks: it starts without claims (its copies
    of the descriptors are closed, which leaves the parent's locks alone)."""
    global _held_guard
    _held_guard = threading.Lock()  # NOTE: another thread may have held it at the fork.
    for held in _held.values():
        for fd in (held.lock_fd, held.holder_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


__all__ = ["CLAIM_FILE", "HOLDERS_DIR", "Claim", "alone", "claim", "holders"]
