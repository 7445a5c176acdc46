"""Answer quality of caches ingested in bf16 vs fp32 (packaged SmolLM2, CPU, served by the fp32 engine).

Both engines ingest the same corpus (the passages of the first ROWS MuSiQue dev rows, each cut to 80
tokens, one shared corpus, 10 neighbours) into two indexes; the fp32 engine then answers every
row's question from each index (k=10) and the first-token KL against full attention (ratio 1.0, the
exact prefill) is reported for full reuse of the fused caches (ratio 0) and the default recompute.
Run from the repo root: `python docs/bench/ingest-cpu-3/bf16_ingest_kl.py [ROWS]`.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from fusionrag_core.bench.data import load_rows
from fusionrag_core.query.divergence import first_token_kl
from fusionrag_core.compat import tokenize_plain
from fusionrag_core.decode import SamplingConfig
from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest import IngestConfig

ROWS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
DATA = Path(__file__).resolve().parents[3].parent / "shared" / "datasets" / "musique_dev.jsonl"
torch.set_num_threads(1)
fp32 = FusionEngine.from_pretrained(None, device="cpu", dtype=torch.float32)
bf16 = FusionEngine.from_pretrained(None, device="cpu", dtype=torch.bfloat16)
assert fp32.fingerprint == bf16.fingerprint
rows = load_rows(DATA, ROWS)
texts = list(dict.fromkeys(
    fp32.tokenizer.decode(tokenize_plain(fp32.tokenizer, p)[:80]).strip() for r in rows for p in r.passage_texts()))
config = IngestConfig(chunk_tokens=80, neighbors=10)
one = SamplingConfig(max_new_tokens=1)
out: dict[str, object] = {"rows": ROWS, "chunks": len(texts)}
with tempfile.TemporaryDirectory() as tmp:
    for name, engine in (("fp32", fp32), ("bf16", bf16)):
        start = time.perf_counter()
        FusionIndex.open(engine, Path(tmp) / name, config=config).add_texts(texts)
        out[f"ingest_s_{name}"] = round(time.perf_counter() - start, 1)
    indexes = {name: FusionIndex.open(fp32, Path(tmp) / name) for name in ("fp32", "bf16")}
    kls: dict[str, list[float]] = {}
    for row in rows:
        reference = indexes["fp32"].answer(row.question, k=10, sampling=one, ratio=1.0)[0]
        for name, index in indexes.items():
            for ratio in (0.0, 0.15):
                got = index.answer(row.question, k=10, sampling=one, ratio=ratio)[0]
                kls.setdefault(f"{name} caches, ratio {ratio}", []).append(
                    first_token_kl(reference.first_token_logits, got.first_token_logits))
    out["first_token_kl_mean"] = {k: round(sum(v) / len(v), 5) for k, v in kls.items()}
    out["first_token_kl"] = {k: [round(x, 5) for x in v] for k, v in kls.items()}
print(json.dumps(out))
