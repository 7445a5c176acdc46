"""What 8-bit KV storage costs: bytes per token, load time and first-token KL vs float16 storage.

For each MuSiQue row (passages cut to `--max-passage-tokens`), every passage's independent cache is
stored in a `DiskKVStore` per storage dtype; FusionRAG's query path (query-guided, `--ratio`)
then answers from each store, and its first-token distribution is compared with the one from the
float16 store (KL(fp16 || dtype)) and with full attention. Load time is the median `get` of a
passage's cache (page cache warm; checksum and decode included).

    OMP_NUM_THREADS=1 python benchmarks/storage_dtype_study.py --data ../shared/datasets/musique_dev.jsonl \
        --rows 3 --max-passage-tokens 200 --out bench-out/storage.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fusionrag_core.bench.data import load_rows
from fusionrag_core.engine import FusionEngine
from fusionrag_core.query.divergence import first_token_kl
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.runtime.compat import tokenize_plain
from fusionrag_core.store import DiskKVStore

DTYPES = ("float16", "int8", "float8_e4m3fn")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--rows", type=int, default=3)
    p.add_argument("--max-passage-tokens", type=int, default=200)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    engine = FusionEngine.from_pretrained(args.model, device="cpu", dtype=torch.float32)
    one = SamplingConfig(max_new_tokens=1)
    per: dict[str, dict[str, list[float]]] = {d: {"kl_vs_fp16": [], "kl_vs_full": [], "load_ms": [],
                                                  "bytes_per_token": []} for d in DTYPES}
    with tempfile.TemporaryDirectory() as tmp:
        for i, row in enumerate(load_rows(args.data, args.rows)):
            tok = engine.tokenizer
            passages = [tok.decode(tokenize_plain(tok, x)[: args.max_passage_tokens]).strip()
                        for x in row.passage_texts()]
            caches = {f"r{i}p{j}": engine.chunk_cache(x) for j, x in enumerate(passages)}
            prompt = engine.prompt(row.question, chunks=list(zip(caches, passages, strict=True)))
            full = engine.full_attention(prompt, sampling=one).collect().first_token_logits
            logits = {}
            for d in DTYPES:
                store = DiskKVStore(Path(tmp) / d, storage_dtype=d)  # type: ignore[arg-type]
                for cid, kv in caches.items():
                    store.put(cid, kv)
                    size = store.path_for(cid, "independent").stat().st_size
                    per[d]["bytes_per_token"].append(size / kv.num_tokens)
                    t0 = time.perf_counter()
                    store.get(cid, "independent", fingerprint=engine.fingerprint)
                    per[d]["load_ms"].append(1000 * (time.perf_counter() - t0))
                g = engine.generate(prompt, store=store, selector="query_guided", ratio=args.ratio, sampling=one,
                                    variant="independent")
                assert not g.cache_misses, g.cache_misses
                logits[d] = g.first_token_logits
                per[d]["kl_vs_full"].append(first_token_kl(full, logits[d]))
            for d in DTYPES:
                per[d]["kl_vs_fp16"].append(first_token_kl(logits["float16"], logits[d]))
            print(f"row {i}: {prompt.num_tokens} tokens, " + ", ".join(
                f"{d}: KL vs fp16 {per[d]['kl_vs_fp16'][-1]:.2e}, vs full {per[d]['kl_vs_full'][-1]:.4f}"
                for d in DTYPES), flush=True)
    summary = {d: {k: statistics.mean(v) if k.startswith("kl") else statistics.median(v) for k, v in m.items()}
               for d, m in per.items()}
    for d, m in summary.items():
        print(d, ", ".join(f"{k} {v:.4g}" for k, v in m.items()))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "rows": args.rows, "ratio": args.ratio,
                                        "max_passage_tokens": args.max_passage_tokens}, indent=1))


if __name__ == "__main__":
    main()
