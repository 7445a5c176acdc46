#!/usr/bin/env bash
# one locked run: base (1ef83bd) batch 1 vs this branch batch 1/4/8/16, interleaved, 2 rounds
set -euo pipefail
PY=/work/main/.venv/bin/python
S=/work/wt/ingest-fast/scripts/ingest_scale.py
O=/tmp/prof/bench
mkdir -p $O
run() { # name libdir args...
  local name=$1 lib=$2; shift 2
  echo "== $name $(date -u +%T) $(uptime | sed 's/.*load/load/')" | tee -a $O/uptime.txt
  PYTHONPATH=$lib $PY $S --chunks 48 "$@" --out $O/$name 2>&1 | grep '^{' | tee -a $O/rows.jsonl
}
run base-r0 /work/wt/ingest-base --batches 1
run new-r0 /work/wt/ingest-fast --batches 1,4,8,16
run base-r1 /work/wt/ingest-base --batches 1
run new-r1 /work/wt/ingest-fast --batches 8,1
echo "== end $(date -u +%T) $(uptime | sed 's/.*load/load/')" | tee -a $O/uptime.txt
