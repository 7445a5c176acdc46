"""Uploaded files (`/v1/files`): what a vector store ingests, kept under `<data_dir>/files/`.

A file is its bytes (`<id>`) and its record (`<id>.json`: OpenAI's `file` object and the tenant that
uploaded it), each written to a temporary name and renamed into place, bytes first: a file whose
record exists is whole. A file is its tenant's (`tenants`): another tenant's id is no file (404), as
OpenAI's files are their organization's; a record written before tenants is the operator's (""). Only text
files are taken (UTF-8, as `fusionrag ingest` reads them); anything else is refused with a 400 that
says so, at upload. The body limit is the server's (`ServerConfig.max_body_bytes`).
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

from fusionrag_core.errors import InvalidRequestError
from fusionrag_integrations.openai_server.responses_protocol import new_id, now

PURPOSES = ("assistants", "user_data")
"""The purposes a file may be uploaded for (both mean: to be added to a vector store)."""
_ID = re.compile(r"file_[0-9a-f]{32}")
_TENANT = "fusionrag_tenant"
"""The record's key naming the tenant a file is (never sent: `FileStore.get` drops it)."""


class NoSuchObjectError(LookupError):
    """An id that names no file, vector store or response here (answered 404)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class FileStore:
    """The uploaded files of one server; thread-safe (each file is written once, then only read).

    Args:
        root: the directory the files live in (created on first upload).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()

    def add(self, filename: str, data: bytes, purpose: str, tenant: str) -> dict[str, Any]:
        """Keep a file `tenant` uploaded; its `file` object.

        Raises:
            InvalidRequestError: an unknown purpose, an empty file, or one that is not UTF-8 text.
        """
        if purpose not in PURPOSES:
            raise InvalidRequestError(f"purpose {purpose!r} is not supported; use one of {list(PURPOSES)}")
        if not data:
            raise InvalidRequestError(f"file {filename!r} is empty")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequestError(
                f"file {filename!r} is not UTF-8 text ({e.reason} at byte {e.start}): this server ingests text files "
                "only (convert PDFs and documents to text first)") from None
        record: dict[str, Any] = {"id": new_id("file"), "object": "file", "bytes": len(data), "created_at": now(),
                  "filename": Path(filename).name or "upload.txt", "purpose": purpose, "status": "processed",
                  "expires_at": None, "status_details": None}
        self.root.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.root / record["id"], data)
        _write_atomic(self.root / f"{record['id']}.json", json.dumps({**record, _TENANT: tenant}).encode())
        return record

    def get(self, file_id: str, tenant: str) -> dict[str, Any]:
        """The `file` object of `file_id`, a file of `tenant`.

        Raises:
            NoSuchObjectError: no such file of `tenant`'s.
        """
        path = self._record_path(file_id)
        try:
            record: dict[str, Any] = json.loads(path.read_text())
        except FileNotFoundError:
            record = {}
        if not record or record.pop(_TENANT, "") != tenant:
            raise NoSuchObjectError(f"No file with id {file_id!r} found")
        return record

    def text(self, file_id: str, tenant: str) -> str:
        """The file's text (checked as UTF-8 at upload).

        Raises:
            NoSuchObjectError: no such file of `tenant`'s.
        """
        self.get(file_id, tenant)
        return (self.root / file_id).read_bytes().decode("utf-8")

    def content(self, file_id: str, tenant: str) -> bytes:
        self.get(file_id, tenant)
        return (self.root / file_id).read_bytes()

    def list_files(self, tenant: str) -> list[dict[str, Any]]:
        """Every file object of `tenant`'s, newest first."""
        if not self.root.is_dir():
            return []
        records = []
        for p in self.root.glob("file_*.json"):
            if _ID.fullmatch(p.stem):
                try:
                    records.append(self.get(p.stem, tenant))
                except NoSuchObjectError:
                    continue  # NOTE: another tenant's, or deleted meanwhile
        return sorted(records, key=lambda r: (r["created_at"], r["id"]), reverse=True)

    def delete(self, file_id: str, tenant: str) -> dict[str, Any]:
        """Remove a file (its record first, so a half-removed file is no file).

        Raises:
            NoSuchObjectError: no such file of `tenant`'s.
        """
        with self._lock:
            self.get(file_id, tenant)
            self._record_path(file_id).unlink(missing_ok=True)
            (self.root / file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def _record_path(self, file_id: str) -> Path:
        if not _ID.fullmatch(file_id):
            raise NoSuchObjectError(f"No file with id {file_id!r} found (file ids look like 'file_<32 hex digits>')")
        return self.root / f"{file_id}.json"


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all (a temporary file, synced, renamed into place)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


__all__ = ["PURPOSES", "FileStore", "NoSuchObjectError"]
