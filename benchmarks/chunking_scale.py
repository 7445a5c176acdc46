"""How chunking time grows with a document's length, for text with and without line breaks.

The splitter re-segments the rest of the line a chunk starts in for every chunk, so on a long line
its time grows with the square of the line's length; the chunker hands such lines to it one window
at a time (`fusionrag_core/ingest/chunking.py`). This times `Chunker.split` on English-like text
of doubling sizes, once as one line and once in paragraphs, and prints seconds and characters per
second for each (best of `--repeats`). Linear growth shows as a flat chars/s column.

    python benchmarks/chunking_scale.py --sizes 250000 500000 1000000 2000000 --chunk-tokens 256
"""

from __future__ import annotations

import argparse
import json
import random
import time

from transformers import AutoTokenizer

from fusionrag_core.ingest.chunking import Chunker, ChunkingConfig
from fusionrag_core.runtime.loading import resolve_source

WORDS = ("the", "lighthouse", "keeper", "walked", "along", "northern", "cape", "while", "storms", "gathered",
         "over", "sea", "and", "nets")


def english(chars: int, *, paragraphs: bool, seed: int = 0) -> str:
    """Words and sentences; a blank line every ~600 characters when `paragraphs`, else none."""
    rng = random.Random(seed)
    out: list[str] = []
    size = since_break = 0
    while size < chars:
        word = rng.choice(WORDS) + ("." if rng.random() < 0.07 else "")
        if paragraphs and since_break > 600 and word.endswith("."):
            word, since_break = word + "\n\n", 0
        out.append(word)
        size += len(word) + 1
        since_break += len(word) + 1
    return " ".join(out)[:chars]


def best_of(chunker: Chunker, text: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        chunker.split(text)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[250_000, 500_000, 1_000_000, 2_000_000])
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default=None, help="tokenizer of this model (default: the packaged SmolLM2)")
    args = parser.parse_args()
    source = resolve_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source.path_or_id, gguf_file=source.gguf_file)
    chunker = Chunker(tokenizer, ChunkingConfig(args.chunk_tokens))
    rows = []
    for layout in ("one line", "paragraphs"):
        for size in args.sizes:
            seconds = best_of(chunker, english(size, paragraphs=layout == "paragraphs"), args.repeats)
            rows.append({"layout": layout, "chars": size, "seconds": round(seconds, 3),
                         "kchars_per_s": round(size / seconds / 1e3, 1)})
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
