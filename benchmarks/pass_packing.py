"""Would packing arriving requests' prepare passes into one pass pay? The products, measured.

The scheduler (`fusionrag_core/batching/scheduler.py`) runs each arriving request's prepare — its
probe (the question's rows through most layers) and its recompute pass (the selected chunk tokens
and the question) — as passes of its own between decode steps. Packing `k` of them into one pass
would share what their products read (the weights) and nothing else: attention stays per request,
over its own buffer. So the most packing can save is the difference between `k` passes of `n` rows
through every layer's projections and MLP and one pass of `k * n` rows. This script times both on
the model's own layer products (`Decoder.linears`, as a pass runs them) for the row counts prepares
have, and prints the ratio: near 1, the products are compute-bound at that size and packing gains
nothing; well below 1, they are bound by reading the weights and packing would pay.

    python benchmarks/pass_packing.py --rows 1,4,8,16,32,64,128 --packs 2,4 --out pack.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fusionrag_core.engine import FusionEngine
from fusionrag_core.runtime.decoder import Decoder


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="smollm2-135m (default), gemma3-270m, or a path")
    p.add_argument("--rows", default="1,4,8,16,32,64,128", help="comma-separated rows of one request's pass")
    p.add_argument("--packs", default="2,4", help="comma-separated requests packed into one pass")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats (median)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    engine = FusionEngine.from_pretrained(args.model, device="cpu", dtype=torch.float32)
    rows = [int(r) for r in args.rows.split(",")]
    packs = [int(k) for k in args.packs.split(",")]
    table = [measure(engine.decoder, n, k, args.repeats) for n in rows for k in packs]
    report = {"model": engine.name, "threads": torch.get_num_threads(), "load": os.getloadavg(),
              "rows": table}
    for r in table:
        print(f"{r['rows']:4d} rows x {r['packs']} requests: serial {r['serial_ms']:7.1f} ms, packed "
              f"{r['packed_ms']:7.1f} ms, packed / serial {r['packed_over_serial']:.2f} "
              f"({r['serial_ms'] / (r['rows'] * r['packs']):.2f} ms per row serial)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


def measure(decoder: Decoder, n: int, k: int, repeats: int) -> dict[str, Any]:
    """The products of `k` passes of `n` rows against one pass of `k * n` rows, median ms of each."""
    width = int(decoder.parts.embed_tokens.weight.shape[1])
    x = torch.randn(1, n * k, width, generator=torch.Generator().manual_seed(n * 100 + k))  # [1, kn, C]
    serial = timed(lambda: [products(decoder, x[:, j * n:(j + 1) * n]) for j in range(k)], repeats)
    packed = timed(lambda: products(decoder, x), repeats)
    return {"rows": n, "packs": k, "serial_ms": serial * 1e3, "packed_ms": packed * 1e3,
            "packed_over_serial": packed / serial}


@torch.inference_mode()
def products(decoder: Decoder, x: torch.Tensor) -> torch.Tensor:
    """Every layer's projections and MLP over `x` `[1, N, C]` (attention left out: it is per request)."""
    for i, lin in enumerate(decoder.linears):
        q, _, _ = lin.qkv(decoder.parts.layers[i].input_layernorm(x))
        x = x + lin.o(q)[0]
        x = x + lin.mlp(decoder.parts.layers[i].post_attention_layernorm(x))
    return x


def timed(run: Any, repeats: int) -> float:
    run()  # NOTE: warm-up: oneDNN's first call per shape builds its primitive
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


if __name__ == "__main__":
    main()
