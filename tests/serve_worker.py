"""`fusionrag serve` on the tiny engine, in this process: for tests that signal a real server.

    python -m tests.serve_worker --tokenizer DIR [--step-s S] [--stuck-at N] -- --db DIR serve --port 0 ...

The arguments after `--` are the `fusionrag` command line. The tiny engine never ends an answer by
itself (no end-of-sequence token: an answer runs its whole `max_tokens`), and its decode steps take
`--step-s` seconds each, standing for a large model's; with `--stuck-at N`, its N-th decode step
never returns (a step that cannot be interrupted: the issue's one long stop string, a huge prompt).

Once the command returns, the worker prints two JSON lines on stdout after `MARK` (uvicorn's access
log shares stdout): at once, the command's exit
code; then the engine's scheduler load (`running`, `waiting`, `kv_bytes`) once it has no work left,
or after `--settle-s` seconds (a step that never returns frees no slot).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

from fusionrag_core import cli
from fusionrag_core.batching.scheduler import SchedulerConfig
from fusionrag_core.cli import EngineSpec
from fusionrag_core.engine import FusionEngine
from tests.ingest_worker import tiny_engine_at

MARK = "serve_worker:"


def slowed_engine(tokenizer: str, step_s: float, stuck_at: int | None) -> FusionEngine:
    """The tiny engine with the default scheduler (what `serve` gives it unless told other limits),
    without an end-of-sequence token, each decode step `step_s` long, the `stuck_at`-th one never ending."""
    engine = tiny_engine_at(tokenizer).with_limits(SchedulerConfig())
    engine.eos_ids = set()
    decode_batch = engine.decoder.decode_batch
    steps = 0

    def slowed(*args: Any, **kwargs: Any) -> Any:
        nonlocal steps
        steps += 1
        if steps == stuck_at:
            threading.Event().wait()
        time.sleep(step_s)
        return decode_batch(*args, **kwargs)

    engine.decoder.decode_batch = slowed  # type: ignore[method-assign]
    return engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", required=True, help="directory from tests.ingest_worker.tokenizer_dir()")
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--stuck-at", type=int, default=None)
    parser.add_argument("--settle-s", type=float, default=10.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the fusionrag command line")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command

    engines: list[FusionEngine] = []

    def engine(spec: EngineSpec) -> FusionEngine:
        engines.append(slowed_engine(args.tokenizer, args.step_s, args.stuck_at))
        return engines[-1]

    code = cli.main(command, engine_factory=engine)
    print(MARK, json.dumps({"exit": code}), flush=True)
    scheduler = engines[0].scheduler if engines else None
    deadline = time.monotonic() + args.settle_s
    while scheduler is not None and scheduler.has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    print(MARK, json.dumps({"load": scheduler.load if scheduler is not None else None}), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
