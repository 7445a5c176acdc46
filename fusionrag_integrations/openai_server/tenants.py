"""Who calls the server: each API key is a tenant, and a tenant's caches are its own.

`fusionrag serve --api-key KEY` takes one key (its callers are one tenant, the operator's scope);
`--api-key-file FILE` takes one line per key, `TENANT KEY` (blank lines and `#` comments are
skipped; a tenant may have several keys, a key belongs to one tenant). The file is read again
whenever it changes (its size, mtime or inode), at the next request: keys are added, rotated and
revoked without a restart. A file that cannot be read or parsed keeps the keys read before, and
the server logs an error naming the line until it is fixed.

A request's cache scope is its tenant plus the `cache_salt` it sends (`fusionrag_core.scope`): it
only hits caches that requests of the same scope filled.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.scope import Scope

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Key:
    secret: bytes
    tenant: str


class TenantKeys:
    """The API keys a server accepts and the tenant each one names.

    Args:
        api_key: one key whose callers are the operator's tenant (""), or None.
        key_file: a file of `TENANT KEY` lines, or None.

    Raises:
        InvalidRequestError: the key file cannot be read or holds a malformed line (at start, a
            bad file is refused: the server would otherwise run with keys nobody meant).
    """

    def __init__(self, api_key: str | None, key_file: str | Path | None) -> None:
        self.api_key = api_key
        self.key_file = Path(key_file).expanduser() if key_file else None
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._keys: tuple[_Key, ...] = ()
        if self.key_file is not None:
            self._stamp, self._keys = _stamp(self.key_file), read_key_file(self.key_file)

    @property
    def required(self) -> bool:
        """Whether a request must send a key (any key is configured)."""
        return self.api_key is not None or self.key_file is not None

    def tenant_of(self, given: str) -> str | None:
        """The tenant whose key `given` is ("" for `api_key`), or None when it is no key here.

        Every key is compared, in constant time each, whichever matches.
        """
        found: str | None = None
        if self.api_key is not None and hmac.compare_digest(given.encode(), self.api_key.encode()):
            found = ""
        for key in self._current():
            if hmac.compare_digest(given.encode(), key.secret) and found is None:
                found = key.tenant
        return found

    def _current(self) -> tuple[_Key, ...]:
        """The key file's keys, read again when the file changed since it was last read."""
        if self.key_file is None:
            return ()
        with self._lock:
            try:
                stamp = _stamp(self.key_file)
                if stamp != self._stamp:
                    self._keys, self._stamp = read_key_file(self.key_file), stamp
                    logger.info("API key file %s read again: %d key(s)", self.key_file, len(self._keys))
            except (OSError, InvalidRequestError) as e:
                logger.error("API key file %s could not be read again (%s); the %d key(s) read before stay in use "
                             "until it is fixed", self.key_file, e, len(self._keys))
            return self._keys


def read_key_file(path: Path) -> tuple[_Key, ...]:
    """The keys of a `TENANT KEY` file.

    Raises:
        OSError: the file cannot be read.
        InvalidRequestError: a line that is not `TENANT KEY`, a bad tenant name, or a key twice.
    """
    keys: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.split()
        if len(parts) != 2:
            raise InvalidRequestError(f"{path}, line {number}: expected 'TENANT KEY' (two words), got "
                                      f"{len(parts)} word(s)")
        tenant, key = parts
        Scope(tenant)  # NOTE: the tenant names a directory of learned caches: the core's check and its message
        if key in keys:
            raise InvalidRequestError(f"{path}, line {number}: this key is already given to tenant {keys[key]!r}; "
                                      "give each tenant keys of its own")
        keys[key] = tenant
    return tuple(_Key(key.encode(), tenant) for key, tenant in keys.items())


def _stamp(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


__all__ = ["TenantKeys", "read_key_file"]
