"""Whose traffic a cache holds: a request's scope, part of the key of every cache that traffic fills.

Caches that requests fill (the conversation cache of kept prefixes, the memo of computed system
prefixes, learned caches of retrieved documents and spans) reveal what filled them: a hit is faster
and is counted in `cached_tokens`. Each is keyed by the request's `Scope` as well as by its tokens
or text, so a request only ever hits what requests of its own scope filled. The operator's
ingested corpus is no traffic: it is shared by every scope.

A scope is a tenant (who the server says the caller is: one API key each) and, within it, an
optional `cache_salt` (vLLM's per-request field: a client partitions its own tenant further).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from fusionrag_core.errors import InvalidRequestError

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A tenant's name: a directory name on every file system (its learned caches live under it)."""

SCOPES_DIR = "scopes"
"""The folder, under the operator's learned caches, that holds every other scope's."""

MAX_SALT_CHARS = 1024
"""Longest `cache_salt`: a salt is a secret or an id, not a document."""


@dataclass(frozen=True)
class Scope:
    """Whose traffic may fill, and hit, a cache.

    Attributes:
        tenant: the caller as the server knows it (one API key each); "" for the operator's own,
            in-process traffic (and a server with one key or none).
        cache_salt: a partition of the tenant the caller chose ("" for none); only requests with
            the same salt share caches.

    Raises:
        InvalidRequestError: a tenant name that is not `TENANT_NAME`, or a salt that is too long.
    """

    tenant: str = ""
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if self.tenant and not TENANT_NAME.fullmatch(self.tenant):
            raise InvalidRequestError(
                f"tenant name {self.tenant!r} is not allowed: use 1 to 64 letters, digits, '_', '.' or '-', "
                "starting with a letter or digit")
        if len(self.cache_salt) > MAX_SALT_CHARS:
            raise InvalidRequestError(f"cache_salt has {len(self.cache_salt)} characters; at most {MAX_SALT_CHARS}")

    @property
    def digest(self) -> bytes:
        """16 bytes that differ for every (tenant, salt): what an in-memory cache key is seeded with."""
        return hashlib.blake2b(f"{self.tenant}\0{self.cache_salt}".encode(), digest_size=16).digest()

    @property
    def is_operator(self) -> bool:
        """The default scope: no tenant and no salt (in-process use, a server's shared learning)."""
        return not self.tenant and not self.cache_salt

    @property
    def salt_dir(self) -> str:
        """The directory name of the salt within its tenant's ("-" for none): a digest, so a
        client's salt never names a file."""
        if not self.cache_salt:
            return "-"
        return hashlib.blake2b(self.cache_salt.encode(), digest_size=16).hexdigest()

    def learned_dir(self, root: Path) -> Path:
        """Where this scope's learned caches live under `root`, the operator's: `root` itself for the
        operator's scope, else `root/scopes/<tenant or ->/<salt_dir>` (a tenant's are in one folder)."""
        if self.is_operator:
            return root
        return root / SCOPES_DIR / (self.tenant or "-") / self.salt_dir


OPERATOR = Scope()
"""The scope of in-process calls and of the operator's own traffic."""


__all__ = ["MAX_SALT_CHARS", "OPERATOR", "SCOPES_DIR", "TENANT_NAME", "Scope"]
