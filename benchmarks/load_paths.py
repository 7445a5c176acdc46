"""A request's chunk loads from a disk store: one after another vs prefetched on a thread pool.

One MuSiQue row's caches (passages cut to `--max-passage-tokens`) are stored per storage dtype;
the script times the loads alone both ways, and TTFT from the store next to TTFT from memory.
The OS page cache is warm (the blobs were just written): this is the store's decode path, not a
cold disk.

    OMP_NUM_THREADS=1 python benchmarks/load_paths.py --data ../shared/datasets/musique_dev.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fusionrag_core.bench.data import load_rows
from fusionrag_core.engine import FusionEngine
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.runtime.compat import tokenize_plain
from fusionrag_core.store import DiskKVStore


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--max-passage-tokens", type=int, default=400)
    p.add_argument("--dtypes", nargs="+", default=["float16", "int8"])
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    engine = FusionEngine.from_pretrained(None, device="cpu", dtype=torch.float32)
    row = next(iter(load_rows(args.data, 1)))
    tok = engine.tokenizer
    passages = [str(tok.decode(tokenize_plain(tok, t)[: args.max_passage_tokens])).strip() for t in row.passage_texts()]
    caches = {f"p{j}": engine.chunk_cache(t) for j, t in enumerate(passages)}
    prompt = engine.prompt(row.question, chunks=list(zip(caches, passages, strict=True)))
    one = SamplingConfig(max_new_tokens=1)
    pool = ThreadPoolExecutor(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            store = DiskKVStore(Path(tmp) / dtype, storage_dtype=dtype)
            for cid, kv in caches.items():
                store.put(cid, kv)

            def get(cid: str, store: DiskKVStore = store) -> object:
                return store.get(cid, "independent", fingerprint=engine.fingerprint, dtype=torch.float32)

            sequential = median_s(lambda: [get(c) for c in caches], args.repeats)
            prefetched = median_s(lambda: list(pool.map(get, caches)), args.repeats)
            from_store = statistics.median(
                engine.generate(prompt, store=store, variant="independent", sampling=one).ttft_s
                for _ in range(args.repeats))
            from_memory = statistics.median(
                engine.generate(prompt, caches=caches, sampling=one).ttft_s for _ in range(args.repeats))
            size = sum(f.stat().st_size for f in (Path(tmp) / dtype).rglob("*") if f.is_file())
            print(f"{dtype}: {size / 1e6:.1f} MB; loads one after another {sequential * 1e3:.0f} ms, prefetched on "
                  f"{args.threads} threads {prefetched * 1e3:.0f} ms; TTFT from the store {from_store:.2f} s, "
                  f"from memory {from_memory:.2f} s")


if __name__ == "__main__":
    main()
