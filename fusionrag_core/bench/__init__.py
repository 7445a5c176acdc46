"""Benchmark support: the multi-hop QA dataset loader (`data`), the methods compared (`methods`), the
answer/speed metrics (`metrics`), the runner (`runner`) and the report (`report`).

The benchmark compares full attention, full KV reuse and selective-recompute methods on the same
rows; `metrics.summarize` turns per-row `metrics.RowResult`s into the per-method dicts of
results.json.
"""
