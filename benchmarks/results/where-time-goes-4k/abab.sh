#!/bin/bash
# Before/after, interleaved, in one hold of the benchmark lock:  flock /work/wt/bench.lock ./abab.sh
# "before" is main at 1ef83bd:  git archive 1ef83bd fusionrag_core | tar -x -C /tmp/before
# (the script itself is this branch's; it does not depend on attention internals)
cd "$(git rev-parse --show-toplevel)"
for round in 1 2; do
  for side in before after; do
    if [ $side = before ]; then pp=/tmp/before; else pp=$PWD; fi
    echo "== $side round $round $(date -u +%H:%M:%S) $(uptime)"
    OMP_NUM_THREADS=1 PYTHONPATH=$pp python scripts/where_time_goes.py --data ../shared/datasets/musique_dev.jsonl \
      --rows 1 --repeats 1 --max-passage-tokens 400 --out OUT/$side-$round.json
  done
done
echo "== end $(date -u +%H:%M:%S) $(uptime)"
