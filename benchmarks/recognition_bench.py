"""Recognition time of a long prompt against content indexes of 10^4..10^6 stored chunks (CPU).

Not a test: it prints a table. The prompt holds `--chunks` real chunks (random words, ~4 characters
a token) joined as LangChain's `format_docs` joins them, inside a chat-template-like frame; the
index holds those chunks plus synthetic rows (random anchor hashes) up to each corpus size, which
is what a lookup touches: the sorted hash array and the rows of the hashes that hit.

With `--redis-url`, the same rows go to a Redis store's content index (`RedisContentIndex`, a
namespace of its own, deleted after): "open" is then a new process's first lookup (it loads the rows
into its mirror), "find" a lookup that follows the change log (one round trip) and searches the mirror.

    PYTHONPATH=$PWD python benchmarks/recognition_bench.py --prompt-tokens 32768 --sizes 10000 100000 1000000
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import string
import tempfile
import time
from collections.abc import Iterator

from fusionrag_core.recognise.content_index import ContentIndex, chunk_anchor, text_digest
from fusionrag_core.store.corpus_index import CorpusIndex
from fusionrag_core.store.redis import RedisKVStore


def _chunk(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))))
    return " ".join(words).capitalize() + "."


@contextlib.contextmanager
def _redis_store(url: str | None) -> Iterator[RedisKVStore | None]:
    """A Redis store in a namespace of its own (its keys deleted on exit), or None without a URL."""
    if url is None:
        yield None
        return
    with RedisKVStore(url, f"bench.{random.getrandbits(32):08x}") as store:
        try:
            yield store
        finally:
            keys = list(store.client.scan_iter(f"{store.namespace}:*"))
            if keys:
                store.client.delete(*keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--redis-url", default=None, help="measure a Redis store's content index instead")
    args = parser.parse_args()
    rng = random.Random(0)
    chars_per_token = 4
    n_chunks = args.prompt_tokens // args.chunk_tokens
    chunks = [_chunk(rng, args.chunk_tokens * chars_per_token) for _ in range(n_chunks)]
    prompt = "<|im_start|>system\nAnswer using the context.<|im_end|>\n<|im_start|>user\n"
    prompt += "\n\n".join(chunks) + "\n\nQuestion: who?<|im_end|>\n<|im_start|>assistant\n"
    print(f"prompt: {len(prompt)} characters (~{args.prompt_tokens} tokens), {n_chunks} stored chunks in it")
    print("| stored chunks | build s | open ms | find ms (median) | find ms (p90) | found |")
    print("|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp, _redis_store(args.redis_url) as store:
        def fresh_index() -> CorpusIndex:
            return ContentIndex(tmp) if store is None else RedisKVStore(store.url, store.namespace).content_index()

        index = fresh_index()
        index.add((f"real{i}", c) for i, c in enumerate(chunks))
        done = n_chunks
        for size in sorted(args.sizes):
            t0 = time.perf_counter()
            while done < size:
                step = min(100_000, size - done)
                rows = [(rng.getrandbits(63) - (1 << 62), f"syn{done + j}", 7, 1000, rng.getrandbits(62), 0)
                        for j in range(step)]
                index.insert_rows(rows)  # type: ignore[attr-defined]
                done += step
            build = time.perf_counter() - t0
            t0 = time.perf_counter()
            fresh = fresh_index()
            fresh.find("warm up the memory map and the row reader")
            opened = (time.perf_counter() - t0) * 1e3
            times, found = [], 0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                found = len(fresh.find(prompt))
                times.append((time.perf_counter() - t0) * 1e3)
            times.sort()
            print(f"| {size:,} | {build:.1f} | {opened:.1f} | {statistics.median(times):.2f} | "
                  f"{times[int(0.9 * (len(times) - 1))]:.2f} | {found}/{n_chunks} |")
    assert chunk_anchor(chunks[0]) is not None and text_digest(chunks[0]) > 0


if __name__ == "__main__":
    main()
