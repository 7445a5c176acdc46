"""One writer per corpus (issue #12, defect 3): the writer lock of disk and Redis stores excludes a
second writer (thread or process), says who holds it, waits when asked, and dies with its holder."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusionrag_core.errors import CorpusLockedError
from fusionrag_core.ingest.lock import WriterLock, writer_lock
from fusionrag_core.store import DiskKVStore, KVStore, open_store
from tests.servers import running_redis_server

HOLD = """
import sys, time
from fusionrag_core.ingest.lock import WriterLock, writer_lock
from fusionrag_core.store import open_store
lock = writer_lock(open_store(sys.argv[1], namespace=sys.argv[2]), "ingest", ttl_s=1.0)
lock.__enter__()
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with running_redis_server() as url:
        yield url


@pytest.fixture(params=["disk", pytest.param("redis", marks=pytest.mark.servers)])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """(store location, namespace) of the parametrized backend."""
    if request.param == "disk":
        return str(tmp_path / "kv"), "unused"
    return request.getfixturevalue("redis_url"), "lock" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]


def _store(location: tuple[str, str]) -> KVStore:
    return open_store(location[0], namespace=location[1])


def _lock(location: tuple[str, str], action: str = "ingest", wait_s: float = 0.0) -> WriterLock:
    # NOTE: a 1 s TTL: a dead holder's Redis key expires within the test's patience.
    return writer_lock(_store(location), action, wait_s=wait_s, ttl_s=1.0)


def test_a_second_writer_fails_naming_the_first(location: tuple[str, str]) -> None:
    with _lock(location, "ingest"):
        started = time.monotonic()
        with pytest.raises(CorpusLockedError) as e, _lock(location, "repair"):
            pass
        assert time.monotonic() - started < 1.0, "wait_s=0 fails at once"
        message = str(e.value)
        assert "cannot repair" in message and "(ingest:" in message and "--wait" in message, message
    with _lock(location):  # NOTE: released: free again
        pass


def test_a_second_writer_waits_for_the_first(location: tuple[str, str]) -> None:
    first = _lock(location)
    first.__enter__()
    releaser = threading.Timer(0.6, first.release)
    releaser.start()
    started = time.monotonic()
    with _lock(location, wait_s=10):
        waited = time.monotonic() - started
    releaser.join()
    assert 0.4 < waited < 5, waited


def test_the_lock_dies_with_its_process(location: tuple[str, str]) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, *location], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        time.sleep(1.5)  # NOTE: longer than a Redis TTL: the heartbeat keeps a live holder's lock
        with pytest.raises(CorpusLockedError, match=f"pid {holder.pid} "), _lock(location):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with _lock(location, wait_s=40):  # NOTE: kernel (file) or TTL (Redis) released it
        pass


def test_the_disk_lock_file_is_not_a_cache(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "kv")
    with writer_lock(store, "ingest"):
        assert store.list_ids() == set()
