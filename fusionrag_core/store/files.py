"""File-system helpers shared by the disk store and the content index kept next to its caches."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Persist a rename: fsync the directory entry (POSIX only; a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # NOTE: some filesystems (and Windows) refuse fsync on directories; the data is synced.
    finally:
        os.close(fd)


__all__ = ["fsync_dir"]
