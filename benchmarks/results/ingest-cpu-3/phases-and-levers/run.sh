#!/usr/bin/env bash
set -euo pipefail
PY=/work/main/.venv/bin/python
S=/work/wt/ingest-fast/scripts/ingest_scale.py
O=/tmp/prof/bench2
mkdir -p $O
run() {
  local name=$1 lib=$2; shift 2
  echo "== $name $(date -u +%T) $(uptime | sed 's/.*load/load/')" | tee -a $O/uptime.txt
  PYTHONPATH=$lib $PY $S --chunks 48 "$@" --out $O/$name 2>&1 | grep '^{' | tee -a $O/rows.jsonl
}
run base-profile /work/wt/ingest-base --batches 1 --profile
run new-profile /work/wt/ingest-fast --batches 1,8 --profile
run new-levers-fp32 /work/wt/ingest-fast --batches 8
run new-bf16 /work/wt/ingest-fast --batches 1,8 --dtype bfloat16
run new-2threads /work/wt/ingest-fast --batches 1,8 --threads 2
echo "== end $(date -u +%T) $(uptime | sed 's/.*load/load/')" | tee -a $O/uptime.txt
