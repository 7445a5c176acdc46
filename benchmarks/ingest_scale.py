"""Fused ingest throughput (chunks/min): packed prefills (batch 1 vs B) and Ray workers (1 vs N).

Every configuration ingests the same passages (MuSiQue dev, cut into `--chunk-tokens` chunks) into
a fresh index (embedded Chroma + disk store in a temp directory) with `--neighbours` neighbours, and
is timed around `add_texts` (chunking, independent caches, embeddings, neighbour graph, fused caches,
Chroma writes). Ray pools are started before the clock starts (model loading is not ingest work).

Before the first timed run, a two-passage ingest warms the process up (first calls of the LLM
and of the embedding model, allocator growth), so the first configuration does not pay for it.

Two clocks, because the machine this runs on may be shared:
* wall: chunks/min a user sees;
* cpu (local runs only): chunks per minute of this process's CPU time. With one torch thread it
  measures the work, not the contention: on a busy machine it is the figure to compare.

Usage:
    # CPU, packaged SmolLM2, 80-token chunks: packed batch 1 vs 8, Ray 1 vs 2 workers of 1 thread
    python benchmarks/ingest_scale.py --chunks 64 --batches 1,8 --ray-workers 1,2 --out bench-out/ingest
    # where the time goes: a cProfile of every local run, summed by ingest phase (slower runs)
    python benchmarks/ingest_scale.py --chunks 48 --batches 1,8 --profile --out bench-out/ingest-phases
    # GPU (prepared; not run here): random-weight Llama-3.2-1B shape, 512-token chunks; a fused pass
    # of 16 chunks holds 16 x (10 neighbours + 1) x 516 slots, hence --prefill-tokens
    python benchmarks/ingest_scale.py --shape 1b --tokenizer DIR --device cuda --dtype bfloat16 \
        --chunk-tokens 512 --chunks 256 --batches 1,4,8,16 --prefill-tokens 131072 --threads 0 \
        --out bench-out/ingest-gpu
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import multiprocessing
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.distributed import RayConfig, RayIngestor

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "datasets" / "musique_dev.jsonl"


def load_engine(model: str | None, shape: str | None, tokenizer: str | None, device: str, dtype: str,
                threads: int) -> FusionEngine:
    """The packaged model (or `model`), or a random-weight Llama of `shape` (speed only)."""
    if threads:
        torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    if shape is None:
        return FusionEngine.from_pretrained(model, device=device, dtype=torch_dtype)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from ttft_scale import SHAPES, build_engine  # NOTE: one definition of the random-weight shapes.

    if tokenizer is None:
        raise SystemExit("--shape needs --tokenizer DIR (a saved tokenizer, e.g. tests.ingest_worker.tokenizer_dir)")
    return build_engine(SHAPES[shape], Path(tokenizer), 16384, device, torch_dtype)


def passages(engine: FusionEngine, data: Path, chunks: int, chunk_tokens: int) -> list[str]:
    """Distinct passages whose chunks add up to about `chunks` chunks."""
    texts: list[str] = []
    seen: set[str] = set()
    tokens = 0
    with data.open() as f:
        for line in f:
            for p in json.loads(line)["passages"]:
                text = p["text"].strip()
                if text and text not in seen:
                    seen.add(text)
                    texts.append(text)
                    tokens += len(engine.layout.chunk_ids(text))
                    if tokens >= chunks * chunk_tokens:
                        return texts
    return texts


# NOTE: (phase, file name, function) whose cumulative cProfile time is the phase's; nested phases are
# indented. cProfile sees the ingest's own thread only: work on the blob writer's and the embedding
# thread shows as the time waited for it (and as nothing where it overlapped the prefills).
PHASES = (
    ("chunking", "ingest.py", "_cut"),
    ("independent caches (prefills, blob hand-over)", "ingest.py", "_independent_caches"),
    ("embeddings (on this thread)", "ingestor.py", "_embed"),
    ("waiting for the embedding thread", "_base.py", "result"),
    ("neighbour graph", "ingestor.py", "_find_neighbours"),
    ("existing chunks affected", "ingestor.py", "_affected_by"),
    ("fused caches + Chroma batches", "ingestor.py", "_add_new"),
    ("  of which: fused prefills", "fusion.py", "fused"),
    ("    of which: fusion drift (vs the independent cache)", "drift.py", "fusion_drift"),
    ("  of which: Chroma adds", "chroma.py", "add_chunks"),
    ("  of which: waiting for the blob writer", "writer.py", "flush"),
    ("all prefills (LLM forward passes)", "engine.py", "chunk_caches"),
    ("  of which: linear layers", "~", "<built-in method torch._C._nn.linear>"),
    ("  of which: neighbours re-rotated into the buffer", "stitch.py", "append_shifted"),
    ("blob writes on this thread (encode + fsync + rename)", "disk.py", "put"),
    ("re-fusion of existing chunks", "ingestor.py", "fuse_pending"),
    ("orphan sweep", "ingestor.py", "_sweep_orphans"),
)


def phase_seconds(stats: pstats.Stats) -> dict[str, float]:
    """Seconds per `PHASES` entry from a profile (a function's cumulative time, all its calls)."""
    table = stats.stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for name, file, function in PHASES:
        out[name] = round(sum(row[3] for (f, _, fn), row in table.items()
                              if fn == function and (file == "~" or f.endswith(file))), 2)
    return out


def run_one(engine: FusionEngine, texts: list[str], config: IngestConfig, ray: RayConfig | None,
            root: Path, profile: bool = False) -> dict[str, Any]:
    index = FusionIndex.open(engine, root, config=config)
    phases: dict[str, float] | None = None
    if ray is None:
        profiler = cProfile.Profile() if profile else None
        wall, cpu = time.perf_counter(), time.process_time()
        if profiler is not None:
            profiler.enable()
        report = index.add_texts(texts)
        if profiler is not None:
            profiler.disable()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if profiler is not None:
            phases = phase_seconds(pstats.Stats(profiler))
    else:
        with RayIngestor(engine, index.collection, index.store, index.config, index.ingestor.embedding_function,
                         ray) as ingestor:
            _ = ingestor.pool  # NOTE: workers start (and load the model) before the clock.
            wall = time.perf_counter()
            report = ingestor.add(texts)
            wall, cpu = time.perf_counter() - wall, float("nan")
    assert index.verify(repair=False).ok
    n = report.new_chunks
    row = {"chunks": n, "prefills": report.prefills, "wall_s": round(wall, 2),
           "chunks_per_min_wall": round(60 * n / wall, 1),
           "chunks_per_min_cpu": round(60 * n / cpu, 1) if cpu == cpu else None}
    return {**row, "phases_s": phases} if phases is not None else row


def warm_up(engine: FusionEngine, texts: list[str], config: IngestConfig, root: Path) -> None:
    """An untimed ingest of two passages: first calls of both models are not the first run's cost."""
    FusionIndex.open(engine, root, config=config).add_texts(texts[:2])


def prefill_rates(engine: FusionEngine, batches: list[int], chunk_tokens: int, neighbours: int,
                  chunks: int = 16) -> list[dict[str, Any]]:
    """Where packing can gain: CPU ms per chunk of the prefills alone (no store, no Chroma), per
    packed batch size, independent and fused (after `neighbours` caches), next to the fp32 GEMM rate
    of the model's MLP shape at the pass's row count (the linear layers are most of a prefill)."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(100, 20000, (chunk_tokens,), generator=g) for _ in range(chunks)]
    caches = [engine.chunk_cache(t) for t in ids[:neighbours]]
    rows: list[dict[str, Any]] = []
    for b in batches:
        row: dict[str, Any] = {"prefill_batch": b}
        for kind in ("independent", "fused"):
            context = caches if kind == "fused" else []
            cpu = time.process_time()
            for lo in range(0, chunks, b):
                group = ids[lo : lo + b]
                engine.chunk_caches(group, [context] * len(group))
            row[f"{kind}_ms_per_chunk"] = round(1000 * (time.process_time() - cpu) / chunks, 1)
        x, w = torch.randn(chunk_tokens * b, 576), torch.randn(1536, 576)
        cpu, n = time.process_time(), 0
        while time.process_time() - cpu < 1.0:
            torch.nn.functional.linear(x, w)
            n += 1
        row["gemm_gflops"] = round(2 * x.shape[0] * 576 * 1536 * n / (time.process_time() - cpu) / 1e9, 1)
        rows.append(row)
    return rows


def _gemm_rate(seconds: float, start: Any, out: Any) -> None:
    """One process, one torch thread: fp32 GEMMs of SmolLM2's MLP shape (80-token rows) for `seconds`."""
    torch.set_num_threads(1)
    x, w = torch.randn(80, 576), torch.randn(1536, 576)
    start.wait()
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < seconds:
        torch.nn.functional.linear(x, w)
        n += 1
    out.put(2 * 80 * 576 * 1536 * n / (time.perf_counter() - t) / 1e9)


def cpu_ceiling(counts: list[int], seconds: float = 5.0) -> dict[int, float]:
    """Aggregate fp32 GEMM GFLOP/s of 1, 2, ... single-thread processes running at once: what N
    one-thread workers can gain on this machine at best (cores that share an SMT core or a
    contended host give less than N x)."""
    ctx = multiprocessing.get_context("spawn")
    rates: dict[int, float] = {}
    for n in counts:
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_gemm_rate, args=(seconds, start, out)) for _ in range(n)]
        for p in procs:
            p.start()
        time.sleep(2.0)  # NOTE: every process has imported torch before the clock starts
        start.set()
        rates[n] = round(sum(out.get() for _ in procs), 1)
        for p in procs:
            p.join()
    return rates


def git_describe() -> str:
    """The commit of the fusionrag_core measured (its checkout may not be this script's)."""
    import fusionrag_core

    root = Path(fusionrag_core.__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10)
    except OSError:
        return "unknown"
    return f"{out.stdout.strip() or 'unknown'} ({root})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model for FusionEngine.from_pretrained (default: packaged)")
    ap.add_argument("--shape", choices=("tiny", "1b", "8b"), help="random-weight Llama shape instead of --model")
    ap.add_argument("--tokenizer", help="tokenizer directory for --shape")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the driver (0: leave as is)")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--chunks", type=int, default=64, help="about this many chunks per run")
    ap.add_argument("--chunk-tokens", type=int, default=80)
    ap.add_argument("--neighbours", type=int, default=10)
    ap.add_argument("--batches", default="1,8", help="packed prefill batch sizes, local runs")
    ap.add_argument("--prefill-tokens", type=int, default=IngestConfig.prefill_tokens,
                    help="most KV slots of one packed pass (IngestConfig.prefill_tokens); a fused 512-token "
                         "chunk with 10 neighbours takes ~5.7K")
    ap.add_argument("--ray-workers", default="", help="Ray worker counts (local cluster, 1 thread each), e.g. 1,2")
    ap.add_argument("--ray-batch", type=int, default=8, help="prefill_batch of the Ray runs")
    ap.add_argument("--repeats", type=int, default=1, help="rounds; configurations are interleaved within each")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prefills", action="store_true",
                    help="also time the prefills alone per --batches (CPU ms per chunk) and the GEMM rate")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile every local run and report seconds per ingest phase (the profiler slows it)")
    ap.add_argument("--ceiling", action="store_true",
                    help="also measure aggregate GEMM GFLOP/s of 1 vs --ray-workers single-thread processes")
    args = ap.parse_args(argv)

    factory = functools.partial(load_engine, args.model, args.shape, args.tokenizer, args.device, args.dtype,
                                args.threads)
    engine = factory()
    texts = passages(engine, args.data, args.chunks, args.chunk_tokens)
    runs: list[tuple[str, IngestConfig, RayConfig | None]] = []
    for b in [int(x) for x in args.batches.split(",") if x]:
        runs.append((f"local batch {b}", IngestConfig(chunk_tokens=args.chunk_tokens, neighbours=args.neighbours,
                                                       prefill_batch=b, prefill_tokens=args.prefill_tokens), None))
    for w in [int(x) for x in args.ray_workers.split(",") if x]:
        config = IngestConfig(chunk_tokens=args.chunk_tokens, neighbours=args.neighbours, prefill_batch=args.ray_batch,
                              prefill_tokens=args.prefill_tokens)
        runs.append((f"ray {w} worker(s) x 1 thread, batch {args.ray_batch}", config,
                     RayConfig(factory, address="local", workers=w, threads_per_worker=1)))
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fusionrag-ingest-scale-") as tmp:
        if runs:
            warm_up(engine, texts, runs[0][1], Path(tmp) / "warm-up")
        for r in range(args.repeats):
            for i, (name, config, ray) in enumerate(runs):
                row = {"run": name, "round": r,
                       **run_one(engine, texts, config, ray, Path(tmp) / f"{r}-{i}", args.profile and ray is None)}
                print(json.dumps(row), flush=True)
                results.append(row)
    prefill: list[dict[str, Any]] = []
    if args.prefills:
        prefill = prefill_rates(engine, [int(x) for x in args.batches.split(",") if x], args.chunk_tokens,
                                args.neighbours)
        for row in prefill:
            print(json.dumps(row), flush=True)
    ceiling: dict[int, float] = {}
    if args.ceiling:
        ceiling = cpu_ceiling(sorted({1, *(int(x) for x in args.ray_workers.split(",") if x)}))
        print(json.dumps({"gemm_gflops_by_processes": ceiling}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": args.device, "dtype": args.dtype, "model": args.shape or args.model or "packaged SmolLM2-135M",
            "chunk_tokens": args.chunk_tokens, "neighbours": args.neighbours, "torch": torch.__version__,
            "cpus": platform.processor() or platform.machine(), "argv": sys.argv[1:],
            "gemm_gflops_by_processes": ceiling, "prefills": prefill, "profiled": args.profile,
            "torch_threads": torch.get_num_threads(), "git": git_describe()}
    (args.out / "ingest_scale.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = ["| run | chunks | wall s | chunks/min (wall) | chunks/min (CPU time) |", "|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['chunks']} | {r['wall_s']} | {r['chunks_per_min_wall']} | "
              f"{r['chunks_per_min_cpu'] if r['chunks_per_min_cpu'] is not None else '-'} |" for r in results]
    profiled = [r for r in results if r.get("phases_s")]
    if profiled:
        lines += ["", "| phase (s, cProfile of the ingest's thread) | "
                  + " | ".join(f"{r['run']} (round {r['round']})" for r in profiled) + " |",
                  "|---" * (len(profiled) + 1) + "|"]
        for name, _, _ in PHASES:
            lines.append(f"| {name} | " + " | ".join(str(r["phases_s"][name]) for r in profiled) + " |")
    if prefill:
        lines += ["", "| prefill_batch | independent CPU ms/chunk | fused CPU ms/chunk | GEMM GFLOP/s at its rows |",
                  "|---|---|---|---|"]
        lines += [f"| {r['prefill_batch']} | {r['independent_ms_per_chunk']} | {r['fused_ms_per_chunk']} | "
                  f"{r['gemm_gflops']} |" for r in prefill]
    if ceiling:
        lines += ["", "| single-thread GEMM processes at once | aggregate GFLOP/s | vs 1 |", "|---|---|---|"]
        lines += [f"| {n} | {g} | {g / ceiling[1]:.2f}x |" for n, g in ceiling.items()]
    (args.out / "ingest_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
