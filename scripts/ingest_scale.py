"""Fused ingest throughput (chunks/min): packed prefills (batch 1 vs B) and Ray workers (1 vs N).

Every configuration ingests the same passages (MuSiQue dev, cut into `--chunk-tokens` chunks) into
a fresh index (embedded Chroma + disk store in a temp directory) with `--neighbors` neighbours, and
is timed around `add_texts` (chunking, independent caches, embeddings, neighbour graph, fused caches,
Chroma writes). Ray pools are started before the clock starts (model loading is not ingest work).

Two clocks, because the machine this runs on may be shared:
* wall: chunks/min a user sees;
* cpu (local runs only): chunks per minute of this process's CPU time. With one torch thread it
  measures the work, not the contention: on a busy machine it is the figure to compare.

Usage:
    # CPU, packaged SmolLM2, 80-token chunks: packed batch 1 vs 8, Ray 1 vs 2 workers of 1 thread
    python scripts/ingest_scale.py --chunks 64 --batches 1,8 --ray-workers 1,2 --out bench-out/ingest
    # GPU (prepared; not run here): random-weight Llama-3.2-1B shape, 512-token chunks
    python scripts/ingest_scale.py --shape 1b --tokenizer DIR --device cuda --dtype bfloat16 \
        --chunk-tokens 512 --chunks 256 --batches 1,4,8,16 --threads 0 --out bench-out/ingest-gpu
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fusionrag_core.distributed import RayConfig, RayIngestor
from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest import IngestConfig

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
    sys.path.insert(0, str(REPO / "scripts"))
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


def run_one(engine: FusionEngine, texts: list[str], config: IngestConfig, ray: RayConfig | None,
            root: Path) -> dict[str, Any]:
    index = FusionIndex.open(engine, root, config=config)
    if ray is None:
        wall, cpu = time.perf_counter(), time.process_time()
        report = index.add_texts(texts)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    else:
        with RayIngestor(engine, index.collection, index.store, index.config, index.ingestor.embedding_function,
                         ray) as ingestor:
            _ = ingestor.pool  # NOTE: workers start (and load the model) before the clock.
            wall = time.perf_counter()
            report = ingestor.add(texts)
            wall, cpu = time.perf_counter() - wall, float("nan")
    assert index.verify(repair=False).ok
    n = report.new_chunks
    return {"chunks": n, "prefills": report.prefills, "wall_s": round(wall, 2),
            "chunks_per_min_wall": round(60 * n / wall, 1),
            "chunks_per_min_cpu": round(60 * n / cpu, 1) if cpu == cpu else None}


def prefill_rates(engine: FusionEngine, batches: list[int], chunk_tokens: int, neighbors: int,
                  chunks: int = 16) -> list[dict[str, Any]]:
    """Where packing can gain: CPU ms per chunk of the prefills alone (no store, no Chroma), per
    packed batch size, independent and fused (after `neighbors` caches), next to the fp32 GEMM rate
    of the model's MLP shape at the pass's row count (the linear layers are most of a prefill)."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(100, 20000, (chunk_tokens,), generator=g) for _ in range(chunks)]
    caches = [engine.chunk_cache(t) for t in ids[:neighbors]]
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
    ap.add_argument("--neighbors", type=int, default=10)
    ap.add_argument("--batches", default="1,8", help="packed prefill batch sizes, local runs")
    ap.add_argument("--ray-workers", default="", help="Ray worker counts (local cluster, 1 thread each), e.g. 1,2")
    ap.add_argument("--ray-batch", type=int, default=8, help="prefill_batch of the Ray runs")
    ap.add_argument("--repeats", type=int, default=1, help="rounds; configurations are interleaved within each")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prefills", action="store_true",
                    help="also time the prefills alone per --batches (CPU ms per chunk) and the GEMM rate")
    ap.add_argument("--ceiling", action="store_true",
                    help="also measure aggregate GEMM GFLOP/s of 1 vs --ray-workers single-thread processes")
    args = ap.parse_args(argv)

    factory = functools.partial(load_engine, args.model, args.shape, args.tokenizer, args.device, args.dtype,
                                args.threads or 1)
    engine = factory()
    texts = passages(engine, args.data, args.chunks, args.chunk_tokens)
    runs: list[tuple[str, IngestConfig, RayConfig | None]] = []
    for b in [int(x) for x in args.batches.split(",") if x]:
        runs.append((f"local batch {b}", IngestConfig(chunk_tokens=args.chunk_tokens, neighbors=args.neighbors,
                                                       prefill_batch=b), None))
    for w in [int(x) for x in args.ray_workers.split(",") if x]:
        config = IngestConfig(chunk_tokens=args.chunk_tokens, neighbors=args.neighbors, prefill_batch=args.ray_batch)
        runs.append((f"ray {w} worker(s) x 1 thread, batch {args.ray_batch}", config,
                     RayConfig(factory, address="local", workers=w, threads_per_worker=1)))
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fusionrag-ingest-scale-") as tmp:
        for r in range(args.repeats):
            for i, (name, config, ray) in enumerate(runs):
                row = {"run": name, "round": r, **run_one(engine, texts, config, ray, Path(tmp) / f"{r}-{i}")}
                print(json.dumps(row), flush=True)
                results.append(row)
    prefill: list[dict[str, Any]] = []
    if args.prefills:
        prefill = prefill_rates(engine, [int(x) for x in args.batches.split(",") if x], args.chunk_tokens,
                                args.neighbors)
        for row in prefill:
            print(json.dumps(row), flush=True)
    ceiling: dict[int, float] = {}
    if args.ceiling:
        ceiling = cpu_ceiling(sorted({1, *(int(x) for x in args.ray_workers.split(",") if x)}))
        print(json.dumps({"gemm_gflops_by_processes": ceiling}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": args.device, "dtype": args.dtype, "model": args.shape or args.model or "packaged SmolLM2-135M",
            "chunk_tokens": args.chunk_tokens, "neighbors": args.neighbors, "torch": torch.__version__,
            "cpus": platform.processor() or platform.machine(), "argv": sys.argv[1:],
            "gemm_gflops_by_processes": ceiling, "prefills": prefill}
    (args.out / "ingest_scale.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = ["| run | chunks | wall s | chunks/min (wall) | chunks/min (CPU time) |", "|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['chunks']} | {r['wall_s']} | {r['chunks_per_min_wall']} | "
              f"{r['chunks_per_min_cpu'] if r['chunks_per_min_cpu'] is not None else '-'} |" for r in results]
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
