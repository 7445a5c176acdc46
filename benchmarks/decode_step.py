"""One decode step's cost at a long context on CPU: eager vs `compile_decode`, next to its floor.

The floor is one matrix-vector product per weight matrix (what any implementation must read).
The profile splits the eager step into matmuls, attention and the rest (Python, small ops).
`--batch B` times one batched step over B requests (`Decoder.decode_batch`, as the scheduler runs
it) with the packed oneDNN projections and head (`EngineConfig.packed_linears`) on and off, the two
alternating round by round so that a drift of the machine's speed reaches both alike.

    OMP_NUM_THREADS=1 python benchmarks/decode_step.py --context 4000 [--compile]
    python benchmarks/decode_step.py --context 950 --batch 1,16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from fusionrag_core.engine import EngineConfig, FusionEngine
from fusionrag_core.runtime.decoder import Decoder
from fusionrag_core.runtime.kv import KVBuffer


def median_step(decoder: Decoder, buf: KVBuffer, n: int) -> float:
    times = []
    for _ in range(n):
        slot = buf.reserve(torch.tensor([buf.length]), valid=True)
        t0 = time.perf_counter()
        decoder.decode_step(buf, 5, slot)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def filled(decoder: Decoder, context: int, steps: int) -> KVBuffer:
    buf = decoder.new_buffer(context + steps)
    slots = buf.reserve(torch.arange(context), valid=True)
    decoder.fill(buf, torch.randint(0, 1000, (context,), generator=torch.Generator().manual_seed(0)), slots)
    return buf


def batched_step(decoder: Decoder, bufs: Sequence[KVBuffer]) -> float:
    """Seconds of one `decode_batch` over `bufs` (each takes its next slot)."""
    slots = [b.reserve(torch.tensor([b.length]), valid=True) for b in bufs]
    t0 = time.perf_counter()
    decoder.decode_batch(bufs, torch.full((len(bufs),), 5), slots)
    return time.perf_counter() - t0


def packed_vs_mkl(engine: FusionEngine, batch: int, context: int, rounds: int) -> dict[str, float]:
    """Median batched-step seconds with packed projections and head, and with MKL's `F.linear`,
    alternating round by round over the same buffers; `ratio` is the median of the rounds' ratios."""
    mkl = Decoder(engine.model, packed_linears=False)
    bufs = [filled(engine.decoder, context, 2 * rounds + 4) for _ in range(batch)]
    for decoder in (engine.decoder, mkl):
        batched_step(decoder, bufs)
    packed, plain = [], []
    for _ in range(rounds):
        packed.append(batched_step(engine.decoder, bufs))
        plain.append(batched_step(mkl, bufs))
    return {"packed": statistics.median(packed), "mkl": statistics.median(plain),
            "ratio": statistics.median(a / b for a, b in zip(packed, plain, strict=True))}


def weights_floor(decoder: Decoder) -> float:
    """Median seconds of one row through every product a decode step runs (the layers' projections
    and the head, as the decoder holds them: packed or not), with no attention or elementwise work."""
    C = decoder.parts.embed_tokens.weight.shape[1]
    x = torch.randn(1, C, dtype=decoder.dtype)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        for lin in decoder.linears:
            q, _, _ = lin.qkv(x)
            lin.o(q)
            gate, _ = lin.gate_up(x)
            lin.down(gate)
        decoder.head(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=4000)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--model", default=None)
    p.add_argument("--compile", action="store_true", help="also time EngineConfig(compile_decode=True)")
    p.add_argument("--batch", default=None,
                   help="comma-separated request counts: time batched steps, packed projections on vs off")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = FusionEngine.from_pretrained(args.model, device="cpu", dtype=torch.float32)
    if args.batch:
        for batch in (int(b) for b in args.batch.split(",")):
            r = packed_vs_mkl(engine, batch, args.context, args.steps)
            print(f"batch {batch}, context {args.context}: packed {r['packed'] * 1e3:.1f} ms, MKL "
                  f"{r['mkl'] * 1e3:.1f} ms, packed / MKL {r['ratio']:.2f}x (median of {args.steps} rounds)")
        return
    buf = filled(engine.decoder, args.context, 3 * args.steps + 10)
    median_step(engine.decoder, buf, 3)
    eager = median_step(engine.decoder, buf, args.steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        median_step(engine.decoder, buf, 3)
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops) / 3e3
    mm = sum(e.self_cpu_time_total for e in ops
             if e.key in ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")) / 3e3
    att = sum(e.self_cpu_time_total for e in ops if "attention" in e.key) / 3e3
    print(f"eager step {eager * 1e3:.1f} ms ({1 / eager:.1f} tokens/s); weights floor "
          f"{weights_floor(engine.decoder) * 1e3:.1f} ms; profiled {total:.1f} ms = matmuls {mm:.1f} + attention "
          f"{att:.1f} + rest {total - mm - att:.1f} ms")
    if args.compile:
        compiled = FusionEngine(engine.model, engine.tokenizer, config=EngineConfig(compile_decode=True))
        t0 = time.perf_counter()
        median_step(compiled.decoder, buf, 2)
        warm = time.perf_counter() - t0
        step = median_step(compiled.decoder, buf, args.steps)
        print(f"compile_decode step {step * 1e3:.1f} ms ({1 / step:.1f} tokens/s); compiling took {warm:.1f} s")


if __name__ == "__main__":
    main()
