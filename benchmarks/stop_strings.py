"""What a stop string costs per generated token: `TextAssembler.add` (decode, find the stop, hold
back a possible prefix of it) against the stop's length.

The scheduler runs every request's `add` inside its shared round, so this time is added to every
running request's step. The answer is English-like text through the packaged model's tokenizer;
the stops never occur in it, but each ends with a prefix of what was generated so far, so text is
held back as it would be for a near miss. Prints the median microseconds per token for each stop
length (a flat column: the cost does not grow with the stop).

    python benchmarks/stop_strings.py --lengths 10 1000 100000 1000000 --tokens 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from fusionrag_core.query.sampling import TextAssembler
from fusionrag_core.runtime.loading import resolve_source

ANSWER = ("The lighthouse keeper walked along the northern cape while storms gathered over the sea, "
          "and the fishermen pulled their nets ashore before the tide turned. ")


def per_token_us(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: str) -> float:
    """Median microseconds of one `add` over the whole answer."""
    assembler = TextAssembler(tokenizer, [stop])
    times = []
    for token in ids:
        start = time.perf_counter()
        assembler.add(token)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def near_miss(length: int, answer: str) -> str:
    """A stop of `length` characters that starts like the answer (so text is held back) and never
    occurs in it."""
    return (answer * (length // len(answer) + 1))[: length - 1] + "\x00"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 1_000, 100_000, 1_000_000])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--model", default=None, help="tokenizer of this model (default: the packaged SmolLM2)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    source = resolve_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source.path_or_id, gguf_file=source.gguf_file)
    text = ANSWER * (args.tokens // 20 + 1)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens]
    rows = []
    print(f"{'stop chars':>12} {'us/token':>10}")
    for length in args.lengths:
        us = per_token_us(tokenizer, ids, near_miss(length, text))
        rows.append({"stop_chars": length, "tokens": len(ids), "us_per_token": round(us, 1)})
        print(f"{length:>12} {us:>10.1f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
