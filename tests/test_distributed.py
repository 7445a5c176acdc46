"""A Ray ingest (2 workers on a local Ray cluster) builds the same corpus as a single-process ingest.

Same chunk ids, same neighbour lists, the same caches within fp tolerance, fused blobs that record
their neighbours, a collection that `verify` passes, one progress bar per phase, and resume: a Ray
ingest killed mid-way is finished by running it again, reusing the blobs it left behind. The
cluster listens on 127.0.0.1 only.
"""

from __future__ import annotations

import functools
import importlib.util
import ipaddress
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.data import sample_corpus_dir
from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import CacheMismatchError, InvalidRequestError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest import chroma
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.distributed import RayConfig, RayIngestor, start_local_cluster, store_spec
from fusionrag_core.ingest.ingestor import IngestReport
from fusionrag_core.ingest.records import NEIGHBOURS_KEY, RADIUS_KEY
from fusionrag_core.runtime.kv import neighbours_digest
from fusionrag_core.store.base import KVStore
from tests.ingest_worker import tiny_engine, tiny_engine_at

# NOTE: not importorskip: importing ray here, before the cluster starts, would put it in cluster
# mode (servers on every interface); `start_local_cluster` imports it in local-only mode.
if importlib.util.find_spec("ray") is None:
    pytest.skip("ray not installed (pip install 'fusionrag[ray]')", allow_module_level=True)
pytestmark = [pytest.mark.servers, pytest.mark.usefixtures("one_thread")]

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = IngestConfig(chunk_tokens=40, neighbours=2, batch_size=4, prefill_batch=3)


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """One local cluster for the module (the pools reuse an initialised Ray): 2 CPUs, loopback only."""
    # NOTE: the workers import `tests.ingest_worker` (the engine factory) from the repository.
    start_local_cluster(num_cpus=2, object_store_mb=100, runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    import ray

    yield "local"
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def tok_path(tokenizer_path: Path) -> str:
    return str(tokenizer_path)


@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    out = []
    for path in sorted(sample_corpus_dir().glob("*.md"))[:4]:
        paragraphs = [p for p in path.read_text().split("\n\n") if p.strip() and not p.startswith("#")]
        out.append("\n\n".join(paragraphs[:2]))
    return out


def _ray(address: str, tok_path: str, **kw: Any) -> RayConfig:
    # NOTE: the workers import `tests.ingest_worker` (the factory) from the repository.
    return RayConfig(functools.partial(tiny_engine_at, tok_path), address=address, workers=2,
                     runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}}, **kw)


def _corpus(index: FusionIndex) -> dict[str, dict[str, Any]]:
    res = index.collection.get(include=["metadatas"])
    return {cid: dict(m or {}) for cid, m in zip(res["ids"], res["metadatas"] or [], strict=True)}


def _assert_same_caches(a: KVStore, b: KVStore, ids: list[str], engine: FusionEngine) -> None:
    for cid in ids:
        for variant in ("independent", "fused"):
            x = a.get(cid, variant, fingerprint=engine.fingerprint, shape=engine.kv_shape)  # type: ignore[arg-type]
            y = b.get(cid, variant, fingerprint=engine.fingerprint, shape=engine.kv_shape)  # type: ignore[arg-type]
            assert torch.equal(x.token_ids, y.token_ids) and torch.equal(x.positions, y.positions)
            # NOTE: fp16 storage; packing differs between the runs, so the last bits may too.
            torch.testing.assert_close(y.keys.float(), x.keys.float(), rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(y.values.float(), x.values.float(), rtol=2e-3, atol=2e-3)
            assert (x.drift is None) == (y.drift is None) == (variant == "independent")
            if x.drift is not None and y.drift is not None:  # NOTE: a relative distance: looser
                torch.testing.assert_close(y.drift, x.drift, rtol=2e-2, atol=1e-4)


@pytest.fixture(scope="module")
def local_index(engine: FusionEngine, docs: list[str],
                tmp_path_factory: pytest.TempPathFactory) -> tuple[FusionIndex, IngestReport]:
    """The single-process ingest every Ray ingest is compared with."""
    local = FusionIndex.open(engine, tmp_path_factory.mktemp("local"), config=CONFIG)
    return local, local.add_texts(docs, doc_ids=[f"d{i}" for i in range(len(docs))])


def test_ray_ingest_equals_local_ingest(engine: FusionEngine, docs: list[str], ray_address: str, tok_path: str,
                                        tmp_path: Path, local_index: tuple[FusionIndex, IngestReport],
                                        capfd: pytest.CaptureFixture[str]) -> None:
    local, local_report = local_index
    remote = FusionIndex.open(engine, tmp_path / "ray", config=CONFIG)
    ingestor = RayIngestor(engine, remote.collection, remote.store, remote.config,
                           remote.ingestor.embedding_function, _ray(ray_address, tok_path))
    with ingestor:  # NOTE: one pool for both calls (FusionIndex.add_texts(ray=...) starts one per call).
        capfd.readouterr()
        remote_report = ingestor.add(docs, doc_ids=[f"d{i}" for i in range(len(docs))], progress=True)
        _check_progress(capfd.readouterr().err, remote_report.new_chunks)
        import ray

        assert ray.get([a.torch_threads.remote() for a in ingestor.pool.actors]) == [1, 1]  # 1 thread each
        _check_same_corpus(engine, local, remote, local_report, remote_report)
        _check_resume(remote, ingestor, docs)


def test_local_cluster_listens_on_loopback_only(ray_address: str) -> None:
    import psutil
    import ray

    assert ray.is_initialized() and ipaddress.ip_address(ray.util.get_node_ip_address()).is_loopback
    listening = [(p.name(), c.laddr.ip) for p in psutil.Process().children(recursive=True)
                 for c in _connections(p) if c.status == psutil.CONN_LISTEN]
    assert len(listening) >= 2  # NOTE: the GCS and the raylet at least: the check is not vacuous.
    for name, ip in listening:
        assert ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback, (name, ip)


def _connections(process: Any) -> list[Any]:
    import psutil

    try:
        return list(process.net_connections(kind="inet"))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _check_progress(err: str, chunks: int) -> None:
    """One bar per phase, each counting every chunk of the ingest (tqdm: `desc: 100%|...| n/n [...chunk/s]`)."""
    for phase in ("independent caches", "embeddings", "neighbour graph", "fused caches"):
        assert f"{phase}: 100%" in err and f"{chunks}/{chunks}" in err.split(f"{phase}: 100%")[1][:60], phase
    assert "chunk/s" in err


def test_killed_ray_ingest_resumes(engine: FusionEngine, docs: list[str], ray_address: str, tok_path: str,
                                   tmp_path: Path, local_index: tuple[FusionIndex, IngestReport],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray ingest that dies after its first Chroma batch (blobs of later batches stored, their entries
    not) is INCOMPLETE for verify; running it again reuses every stored blob and yields the corpus of
    a local ingest, which verify passes."""
    local, local_report = local_index
    index = FusionIndex.open(engine, tmp_path / "killed", config=CONFIG)
    doc_ids = [f"d{i}" for i in range(len(docs))]
    add_chunks = chroma.add_chunks
    calls = 0

    def dies_on_second_batch(*args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt("killed")
        add_chunks(*args, **kwargs)

    monkeypatch.setattr(chroma, "add_chunks", dies_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        index.add_texts(docs, doc_ids=doc_ids, ray=_ray(ray_address, tok_path))
    monkeypatch.setattr(chroma, "add_chunks", add_chunks)
    assert len(index) == CONFIG.batch_size
    assert index.verify(repair=False).incomplete
    stored_fused = sum(index.store.has(cid, "fused") for ids in local_report.chunk_ids for cid in set(ids))
    assert CONFIG.batch_size < stored_fused

    again = index.add_texts(docs, doc_ids=doc_ids, ray=_ray(ray_address, tok_path))
    total = local_report.new_chunks
    assert again.new_chunks == total - CONFIG.batch_size
    assert again.prefills == total - stored_fused  # NOTE: only the fused caches the killed run had not stored
    _check_same_corpus(engine, local, index, local_report, None)




def _check_same_corpus(engine: FusionEngine, local: FusionIndex, remote: FusionIndex, local_report: IngestReport,
                       remote_report: IngestReport | None) -> None:
    if remote_report is not None:
        assert remote_report.chunk_ids == local_report.chunk_ids
        assert remote_report.new_chunks == local_report.new_chunks >= 8
        assert remote_report.prefills == local_report.prefills == 2 * local_report.new_chunks
    a, b = _corpus(local), _corpus(remote)
    assert set(a) == set(b)
    assert {cid: m[NEIGHBOURS_KEY] for cid, m in a.items()} == {cid: m[NEIGHBOURS_KEY] for cid, m in b.items()}
    assert all(len(m[NEIGHBOURS_KEY].split()) == 2 for m in b.values())
    _assert_same_caches(local.store, remote.store, sorted(a), engine)
    for cid, meta in b.items():
        # NOTE: every fused blob says which neighbours it was built on, so verify can check it.
        fused = remote.store.get(cid, "fused", fingerprint=engine.fingerprint, shape=engine.kv_shape)
        assert fused.fused_after == neighbours_digest(meta[NEIGHBOURS_KEY].split()), cid
    assert remote.verify(repair=False).ok
    # NOTE: and prompts holding a chunk's text find its cache (the content index), as after a local ingest.
    local_content, remote_content = local.store.content_index(), remote.store.content_index()
    assert local_content is not None and remote_content is not None
    assert len(remote_content) == len(local_content) > 0


def _check_resume(remote: FusionIndex, ingestor: RayIngestor, docs: list[str]) -> None:
    """A run killed after its blobs but before its Chroma entries leaves blobs without entries; the
    next Ray ingest reuses them (no prefill) and ends with a consistent collection."""
    b = _corpus(remote)
    last = max(b, key=lambda cid: b[cid]["chunk_index"])
    remote.collection.delete(ids=[last])
    again = ingestor.add(docs, doc_ids=[f"d{i}" for i in range(len(docs))])
    assert (again.new_chunks, again.prefills) == (1, 0)
    resumed = _corpus(remote)
    assert set(resumed) == set(b)
    for cid, meta in resumed.items():
        # NOTE: the re-added chunk's radius now comes from Chroma's distances (last bits differ).
        assert meta.pop(RADIUS_KEY) == pytest.approx(b[cid][RADIUS_KEY], abs=1e-5)
        assert meta == {k: v for k, v in b[cid].items() if k != RADIUS_KEY}, cid
    assert remote.verify(repair=False).ok


def test_ray_workers_must_build_the_drivers_model(engine: FusionEngine, docs: list[str], ray_address: str,
                                                  tok_path: str, tmp_path: Path) -> None:
    index = FusionIndex.open(engine, tmp_path / "other", config=CONFIG)
    other = RayConfig(functools.partial(tiny_engine_at, tok_path, 1), address=ray_address, workers=1,
                      runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    with pytest.raises(CacheMismatchError, match="fingerprint"):
        index.add_texts(docs[:1], ray=other)
    assert len(index) == 0 and not index.store.list_ids()


def test_ray_needs_a_shared_store() -> None:
    class Memory:
        pass

    with pytest.raises(InvalidRequestError, match="every worker reaches"):
        store_spec(Memory())  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="workers"):
        RayConfig(lambda: None, workers=0)  # type: ignore[arg-type, return-value]


def test_cli_ingest_on_a_local_ray_cluster(engine: FusionEngine, docs: list[str], tok_path: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from fusionrag_core.cli import main

    # NOTE: the cluster `--ray local` starts has its workers import from the driver's working
    # directory, and they import `tests.ingest_worker` (the engine factory).
    monkeypatch.chdir(REPO_ROOT)

    if ray.is_initialized():
        ray.shutdown()  # NOTE: `--ray local` starts (and stops) its own cluster.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(docs[:2]):
        (corpus / f"doc{i}.md").write_text(text)
    db = ["--db", str(tmp_path / "db")]
    argv = [*db, "ingest", str(corpus), "--chunk-tokens", "40", "--neighbours", "2", "--quiet",
            "--ray", "local", "--workers", "2"]
    assert main(argv, engine_factory=functools.partial(_cli_engine, tok_path)) == 0
    assert "new chunk(s)" in capsys.readouterr().out
    assert not ray.is_initialized()  # NOTE: the cluster it started is gone.
    assert main([*db, "verify", "--no-repair"], engine_factory=functools.partial(_cli_engine, tok_path)) == 0


def _cli_engine(tok_path: str, spec: Any) -> FusionEngine:
    return tiny_engine_at(tok_path)


def test_local_cluster_refuses_a_ray_imported_in_cluster_mode(tmp_path: Path) -> None:
    """A process that imported `ray` before (cluster mode: servers on every interface) gets an error
    that says how to fix it, not a cluster open to the network."""
    code = ("import ray\nfrom fusionrag_core.ingest.distributed import start_local_cluster\n"
            "try:\n    start_local_cluster(1, 80)\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
            "print('initialised', ray.is_initialized())\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT),
           "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=180).stdout
    assert "InvalidRequestError" in out and "every interface" in out and "initialised False" in out, out
