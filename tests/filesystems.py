"""Test helpers for real small filesystems: a tmpfs of a few megabytes, mounted by the test, filled.

A full disk hits code at points an injected ENOSPC does not choose: SQLite's journal and shared
memory files, directory entries, the bytes a blob needs before its fsync. Mounting needs root
(CAP_SYS_ADMIN); without it the test is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

FILLER = "filler"
"""The name of the file `fill` writes at the filesystem's root."""


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "2m") -> Iterator[Path]:
    """A tmpfs of `size` mounted at `where` (made if missing) for the block; unmounted after it,
    lazily when the code under test still holds a file open there.

    Skips the test when not root or when the mount fails (a container without CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a real full disk) needs root")
    where.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)  # NOTE: files still open under it


def fill(root: Path) -> Path:
    """Write `root/FILLER` until the filesystem has no byte left; returns the file (delete it to free
    the space)."""
    filler = root / FILLER
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    return filler


def files_under(root: Path, *, but: tuple[str, ...] = (FILLER,)) -> list[Path]:
    """Every file under `root` (relative), except those named in `but`."""
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file() and p.name not in but)
