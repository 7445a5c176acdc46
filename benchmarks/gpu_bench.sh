#!/usr/bin/env bash
# GPU benchmark of FusionRAG, for a CUDA machine with the package installed (`make install`). Never run in CI.
#
#   1. ratio-1.0 equivalence on CUDA in bf16: recomputing every chunk token (selector "all", and
#      query_guided at ratio 1.0) over stitched chunk caches must match a plain prefill (full
#      attention): first-token logits close, same greedy tokens.
#   2. `fusionrag bench` at long contexts: SmolLM2-135M at ~4K tokens (10 passages x 400 tokens) and
#      Gemma-3-270M with whole passages (10 x up to 1600 tokens; MuSiQue passages are ~600 tokens,
#      so ~6K-token prompts).
#   3. fused ingest chunks/min (issue 15): random-weight Llama-3.2-1B shape, bf16, 512-token chunks,
#      10 neighbours, packed prefill batch 1 vs 4, 8, 16 (benchmarks/ingest_scale.py; ingest-1b/). A fused
#      pass of 16 chunks takes 16 x 11 x 516 KV slots: --prefill-tokens lifts the default 8192-slot
#      cap, which would run fused prefills of 512-token chunks one per pass at any batch size.
#
# Usage: benchmarks/gpu_bench.sh [--equivalence-only] [DATA.jsonl]
#   DATA defaults to ../shared/datasets/musique_dev.jsonl. Results go to $OUT if set, else
#   ./bench-out/gpu: equivalence.txt, smollm2-4k/ and gemma3-6k/ (results.json, results.md, plots).
# Needs no network (models ship in packages); takes ~5-8 minutes on one H100/H200.
set -euo pipefail

cd "$(dirname "$0")/.."
only_equivalence=0
if [[ "${1:-}" == "--equivalence-only" ]]; then
    only_equivalence=1
    shift
fi
data="${1:-../shared/datasets/musique_dev.jsonl}"
out="${OUT:-./bench-out/gpu}"
python="python3"
[[ -x .venv/bin/python ]] && python=.venv/bin/python
mkdir -p "$out"

"$python" - "$data" <<'PY' 2>&1 | tee "$out/equivalence.txt"
"""Ratio 1.0 equals full attention on CUDA in bf16 (the engine's exactness, at the dtype GPUs run)."""
import sys

import torch

# NOTE: the engine alone, no vector DB: this check needs only torch, transformers and the model.
from fusionrag_core.bench.data import load_rows
from fusionrag_core.query.divergence import first_token_kl
from fusionrag_core.runtime.compat import tokenize_plain
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.engine import FusionEngine

if not torch.cuda.is_available():
    sys.exit("no CUDA device: this check is for a GPU machine")
engine = FusionEngine.from_pretrained(device="cuda", dtype=torch.bfloat16)
sampling = SamplingConfig(max_new_tokens=32)
failures = 0
for i, row in enumerate(load_rows(sys.argv[1], 3)):
    # the benchmark's passages (runner.row_passages), cut to 400 tokens: ~4K-token prompts
    passages = [engine.tokenizer.decode(tokenize_plain(engine.tokenizer, p)[:400]).strip() for p in row.passage_texts()]
    caches = {f"p{j}": engine.chunk_cache(p) for j, p in enumerate(passages)}
    prompt = engine.prompt(row.question, chunks=list(zip(caches, passages)))
    reference = engine.full_attention(prompt, sampling=sampling).collect()
    for selector, ratio in (("all", None), ("query_guided", 1.0)):
        g = engine.generate(prompt, sampling=sampling, selector=selector, ratio=ratio, caches=caches)
        kl = first_token_kl(reference.first_token_logits, g.first_token_logits)
        diff = float((reference.first_token_logits - g.first_token_logits).abs().max())
        same = g.token_ids == reference.token_ids
        ok = same and kl < 1e-3 and g.recomputed_fraction == 1.0 and not g.cache_misses
        failures += not ok
        print(f"row {i} {selector:>12} ratio {ratio}: {prompt.num_tokens} tokens, KL {kl:.2e}, max |dlogit| {diff:.3f}, "
              f"same greedy tokens: {same} ({len(g.token_ids)} tokens), TTFT {1000 * g.ttft_s:.1f} ms vs full "
              f"attention {1000 * reference.ttft_s:.1f} ms -> {'ok' if ok else 'FAIL'}")
        if not same:
            print(f"    full attention: {reference.text!r}\n    {selector:>14}: {g.text!r}")
print("ratio-1.0 equivalence:", "PASS" if failures == 0 else f"FAIL ({failures} mismatches)")
sys.exit(1 if failures else 0)
PY

if [[ $only_equivalence == 1 ]]; then
    exit 0
fi

fusionrag="$python -m fusionrag_core.cli"
common=(--data "$data" --limit 20 --ratios 0.05,0.15,0.3 --storage-dtype bfloat16 --neighbours 9)
$fusionrag --device cuda --dtype bfloat16 bench "${common[@]}" --max-passage-tokens 400 --out "$out/smollm2-4k"
$fusionrag --device cuda --dtype bfloat16 --model gemma3-270m bench "${common[@]}" --max-passage-tokens 1600 \
    --out "$out/gemma3-6k"
tok=$("$python" -c "import sys; from pathlib import Path; from tests.ingest_worker import tokenizer_dir
print(tokenizer_dir(Path(sys.argv[1])))" "$out/tokenizer-cache" | tail -1)
"$python" benchmarks/ingest_scale.py --shape 1b --tokenizer "$tok" --device cuda --dtype bfloat16 --threads 0 \
    --chunk-tokens 512 --chunks 256 --batches 1,4,8,16 --prefill-tokens 131072 --data "$data" --out "$out/ingest-1b"
echo "done: $out"
