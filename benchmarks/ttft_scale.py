"""TTFT of cache reuse vs full attention on Llama-shaped models with random weights (speed only).

Quality needs trained weights; time to first token does not: it depends on the model's shape, the
prompt length and the work each method does. The packaged 135M model is too small for a GPU to
show the gain (its full prefill is a few milliseconds of kernel launches), so this script builds
random-weight models shaped like Llama-3.2-1B and Llama-3-8B and times, per prompt length:

* `full_attention`: a plain prefill of every prompt token;
* `full_reuse`: chunk caches stitched, only the question computed;
* `query_guided@r` (FusionRAG's query path; fused and independent caches cost the same here);
* `cacheblend@r` (KV deviation at an early layer);
* `query_guided@r (disk)`: the same, with the caches read from a `DiskKVStore` (bfloat16 blobs,
  checksums verified, in the OS page cache after the first read) instead of already in memory;
* `query_guided@r (disk int8)`: the same from int8 blobs (half the bytes, decoded on the device);
* `query_guided@r (host tier)`: from a `TieredKVStore`'s pinned host LRU (one host-to-device
  copy per chunk, no I/O, no checksum);
* `query_guided@r (GPU tier)`: from its device LRU (no copy at all; warm after the first run).

The issue-14 GPU run is one command that finishes in under 8 minutes on one H100/H200:

    python benchmarks/ttft_scale.py --tokenizer DIR --out OUT --shapes 8b --tokens 32768 --repeats 2 --budget-s 420

It first checks on the device that the planned sparse attention equals masked SDPA over every key
(`attention_check`: the CUDA kernels' path) and that ratio 1.0 equals full attention.

Methods are interleaved and each is timed `--repeats` times after one warm-up; the median is kept.
Before timing, each model checks on its shortest prompt that recomputing every chunk token over the
stitched caches reproduces full attention (first-token KL and logit difference are recorded).
Results go to `--out` as JSON and a Markdown table.

Usage (GPU machine, package importable):
    python benchmarks/ttft_scale.py --tokenizer DIR --out DIR [--shapes 1b,8b] [--tokens 4096,16384,32768]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.query.divergence import first_token_kl
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.runtime import attention
from fusionrag_core.runtime.kv import ChunkKV
from fusionrag_core.store import DiskKVStore
from fusionrag_core.store.tiered import TieredKVStore


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture model shape (head_dim = hidden / heads)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


SHAPES: dict[str, Shape] = {
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),  # the CPU self-test
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192),  # Llama-3.2-1B
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),  # Llama-3-8B
}


def build_engine(shape: Shape, tokenizer_dir: Path, max_tokens: int, device: str, dtype: torch.dtype) -> FusionEngine:
    """A random-weight Llama of `shape` behind the engine (the tokenizer gives the prompt layout)."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate, max_position_embeddings=max_tokens + 1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # NOTE: build in the target dtype: an 8B fp32 copy would be 32 GB
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return FusionEngine(model, tokenizer, name=f"random-llama({shape.hidden}x{shape.layers})")


def build_request(engine: FusionEngine, total: int, chunk_tokens: int) -> tuple[FusionPrompt, dict[str, ChunkKV]]:
    """A prompt of `total // chunk_tokens` chunks of random ordinary (non-special) token ids, and
    their independent caches. The same `total` gives the same chunks."""
    special = torch.tensor(sorted(engine.tokenizer.all_special_ids))
    g = torch.Generator().manual_seed(total)
    chunks = [torch.randint(1000, len(engine.tokenizer), (chunk_tokens,), generator=g)  # [T]
              for _ in range(max(1, total // chunk_tokens))]
    assert not any(bool(torch.isin(ids, special).any()) for ids in chunks)
    caches = {f"c{i:04d}": engine.chunk_cache(ids) for i, ids in enumerate(chunks)}
    prompt = engine.layout.build(list(zip(caches, chunks, strict=True)), "Which passage names the river?")
    return prompt, caches


def check_full_recompute(engine: FusionEngine, total: int, chunk_tokens: int) -> dict[str, float]:
    """Ratio 1.0 over stitched caches vs a plain prefill, on this device and dtype."""
    prompt, caches = build_request(engine, total, chunk_tokens)
    sampling = SamplingConfig(max_new_tokens=1)
    reference = engine.full_attention(prompt, sampling=sampling).collect().first_token_logits
    recomputed = engine.generate(prompt, sampling=sampling, selector="all", caches=caches).first_token_logits
    return {"kl": first_token_kl(reference, recomputed),
            "max_abs_logit_diff": float((reference - recomputed).abs().max()),
            "same_argmax": float(int(reference.argmax()) == int(recomputed.argmax()))}


def check_attention(engine: FusionEngine, total: int) -> dict[str, float]:
    """Planned sparse attention vs masked SDPA over every key, on a recompute-shaped pass of this
    model's head layout, on this device and dtype (the kernels the plan calls are device-specific)."""
    d = engine.decoder
    g = torch.Generator().manual_seed(0)
    n = max(8, total * 15 // 100)
    queries = torch.cat([torch.sort(torch.randperm(total - 16, generator=g)[:n]).values,
                         torch.arange(total - 16, total)]).to(engine.device)
    k_pos = torch.arange(total, device=engine.device)
    spec = attention.MaskSpec(queries, k_pos, torch.ones(total, dtype=torch.bool, device=engine.device))
    q = torch.randn(d.num_heads, int(queries.shape[0]), d.head_dim, generator=g).to(engine.device, d.dtype)
    k, v = (torch.randn(d.num_kv_heads, total, d.head_dim, generator=g).to(engine.device, d.dtype) for _ in "kv")
    plan = attention.plan(spec, group=d.num_heads // d.num_kv_heads, dtype=d.dtype)
    got = attention.attend(q, k, v, plan, scale=d.scaling).float()
    want = attention.reference(q, k, v, spec, scale=d.scaling).float()
    return {"max_abs_diff": float((got - want).abs().max()), "scores_vs_visible":
            plan.scores(int(queries.shape[0]), total) / float(spec.allowed().sum())}


def time_methods(engine: FusionEngine, total: int, chunk_tokens: int, ratio: float, repeats: int,
                 store_root: Path) -> dict[str, float]:
    """Median TTFT (s) of each method on one prompt of about `total` tokens."""
    prompt, caches = build_request(engine, total, chunk_tokens)
    store = DiskKVStore(store_root / f"t{total}", storage_dtype="bfloat16")
    int8 = DiskKVStore(store_root / f"t{total}-int8", storage_dtype="int8")
    for cid, kv in caches.items():
        store.put(cid, kv)
        int8.put(cid, kv)
    big = 1 << 40  # NOTE: every chunk fits; what is timed is where a hit is served from
    host = TieredKVStore(store, device=engine.device, dtype=engine.decoder.dtype, device_bytes=0, host_bytes=big)
    gpu = TieredKVStore(store, device=engine.device, dtype=engine.decoder.dtype, device_bytes=big, host_bytes=big)
    sampling = SamplingConfig(max_new_tokens=1)
    methods: dict[str, Callable[[], Generation]] = {
        "full_attention": lambda: engine.full_attention(prompt, sampling=sampling).collect(),
        "full_reuse": lambda: engine.generate(prompt, sampling=sampling, selector="none", caches=caches),
        f"query_guided@{ratio}": lambda: engine.generate(prompt, sampling=sampling, selector="query_guided",
                                                         ratio=ratio, caches=caches),
        f"cacheblend@{ratio}": lambda: engine.generate(prompt, sampling=sampling, selector="kv_deviation",
                                                       ratio=ratio, caches=caches),
        f"query_guided@{ratio} (disk)": lambda: engine.generate(prompt, sampling=sampling, selector="query_guided",
                                                                ratio=ratio, variant="independent", store=store),
        f"query_guided@{ratio} (disk int8)": lambda: engine.generate(
            prompt, sampling=sampling, selector="query_guided", ratio=ratio, variant="independent", store=int8),
        f"query_guided@{ratio} (host tier)": lambda: engine.generate(
            prompt, sampling=sampling, selector="query_guided", ratio=ratio, variant="independent", store=host),
        f"query_guided@{ratio} (GPU tier)": lambda: engine.generate(
            prompt, sampling=sampling, selector="query_guided", ratio=ratio, variant="independent", store=gpu),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for run in range(repeats + 1):  # NOTE: run 0 warms each method up (kernels, allocator, page cache)
        for name, method in methods.items():
            g = method()
            if g.cache_misses:
                raise RuntimeError(f"{name} missed caches: {g.cache_misses}")
            if run:
                times[name].append(g.ttft_s)
    return {name: statistics.median(t) for name, t in times.items()} | {"prompt_tokens": float(prompt.num_tokens)}


def run(shapes: list[str], lengths: list[int], tokenizer_dir: Path, out: Path, *, device: str, dtype: torch.dtype,
        chunk_tokens: int, ratio: float, repeats: int, budget_s: float) -> list[dict[str, object]]:
    """Time every (shape, length); results are written after each one, so a cut-short run keeps them."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="fusionrag-scale-") as tmp:
        for name in shapes:
            engine = build_engine(SHAPES[name], tokenizer_dir, max(lengths), device, dtype)
            check = check_full_recompute(engine, min(lengths), chunk_tokens)
            results.append({"shape": name, "ratio_1_check": check,
                            "attention_check": check_attention(engine, max(lengths))})
            print(json.dumps(results[-1]), flush=True)
            for total in lengths:
                if time.perf_counter() - start > budget_s:
                    print(f"budget of {budget_s:.0f} s spent: skipping {name} at {total} tokens", flush=True)
                    continue
                ttft = time_methods(engine, total, chunk_tokens, ratio, repeats, Path(tmp) / name)
                row = {"shape": name, **asdict(SHAPES[name]), "tokens": int(ttft.pop("prompt_tokens")),
                       "ttft_s": ttft, "speedup_vs_full_attention":
                       {k: ttft["full_attention"] / v for k, v in ttft.items()}}
                results.append(row)
                print(json.dumps(row), flush=True)
                write(results, out, device, dtype, ratio, chunk_tokens)
            del engine
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return results


def write(results: list[dict[str, object]], out: Path, device: str, dtype: torch.dtype, ratio: float,
          chunk_tokens: int) -> None:
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    meta = {"device": name, "dtype": str(dtype).removeprefix("torch."), "ratio": ratio, "chunk_tokens": chunk_tokens,
            "torch": torch.__version__, "command": sys.argv}
    (out / "ttft_scale.json").write_text(json.dumps({**meta, "results": results}, indent=1))
    timed = [r for r in results if "ttft_s" in r]
    methods = list(timed[0]["ttft_s"]) if timed else []  # type: ignore[call-overload]
    lines = [f"TTFT (ms, median) on {name}, {meta['dtype']}, random weights, chunks of {chunk_tokens} tokens",
             "", "| model | prompt tokens | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for r in timed:
        ttft: dict[str, float] = r["ttft_s"]  # type: ignore[assignment]
        fa = ttft["full_attention"]
        cells = [f"{1000 * ttft[m]:.1f}" + ("" if m == "full_attention" else f" ({fa / ttft[m]:.1f}×)")
                 for m in methods]
        lines.append(f"| {r['shape']} | {r['tokens']} | " + " | ".join(cells) + " |")
    for r in results:
        if "ratio_1_check" in r:
            c: dict[str, float] = r["ratio_1_check"]  # type: ignore[assignment]
            lines.append(f"\n{r['shape']}: ratio 1.0 vs full attention: first-token KL {c['kl']:.2e}, "
                         f"max |dlogit| {c['max_abs_logit_diff']:.3f}, same argmax {bool(c['same_argmax'])}")
            a: dict[str, float] = r["attention_check"]  # type: ignore[assignment]
            lines.append(f"{r['shape']}: planned sparse attention vs masked SDPA: max |diff| {a['max_abs_diff']:.2e}, "
                         f"scores computed / visible {a['scores_vs_visible']:.2f}")
    (out / "ttft_scale.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="a saved tokenizer directory (chat template)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", default="1b,8b", help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--tokens", default="4096,16384,32768", help="prompt lengths")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--budget-s", type=float, default=float("inf"), help="skip what would start after this")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    shapes = a.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {unknown}; choose from {sorted(SHAPES)}")
    run(shapes, [int(t) for t in a.tokens.split(",")], a.tokenizer, a.out, device=a.device, dtype=dtype,
        chunk_tokens=a.chunk_tokens, ratio=a.ratio, repeats=a.repeats, budget_s=a.budget_s)
    print((a.out / "ttft_scale.md").read_text())


if __name__ == "__main__":
    main()
