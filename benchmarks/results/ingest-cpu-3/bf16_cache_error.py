"""Caches computed in bf16 vs fp32 (packaged SmolLM2, CPU): relative K/V error, vs the fp16 storage error.

Run from the repo root: `python docs/bench/ingest-cpu-3/bf16_cache_error.py` (prints one JSON line).
"""

import json
import sys

import torch

sys.path.insert(0, "scripts")
import ingest_scale

from fusionrag_core.engine import FusionEngine
from fusionrag_core.kv import ChunkKV

torch.set_num_threads(1)
fp32 = FusionEngine.from_pretrained(None, device="cpu", dtype=torch.float32)
bf16 = FusionEngine.from_pretrained(None, device="cpu", dtype=torch.bfloat16)
texts = ingest_scale.passages(fp32, ingest_scale.DATA, 200, 80)
ids = [fp32.layout.chunk_ids(t)[:80] for t in texts][:11]


def caches(engine: FusionEngine) -> tuple[list[ChunkKV], ChunkKV]:
    independent = [engine.chunk_cache(i) for i in ids[:10]]
    return independent, engine.chunk_cache(ids[10], independent)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


i32, f32 = caches(fp32)
i16, f16 = caches(bf16)
print(json.dumps({
    "independent_keys_rel_err_bf16": sum(rel(a.keys, b.keys) for a, b in zip(i16, i32, strict=True)) / 10,
    "independent_values_rel_err_bf16": sum(rel(a.values, b.values) for a, b in zip(i16, i32, strict=True)) / 10,
    "fused_keys_rel_err_bf16": rel(f16.keys, f32.keys),
    "fused_values_rel_err_bf16": rel(f16.values, f32.values),
    "fused_keys_rel_err_fp16_storage": rel(f32.keys.half(), f32.keys),
    "fused_values_rel_err_fp16_storage": rel(f32.values.half(), f32.values),
}))
