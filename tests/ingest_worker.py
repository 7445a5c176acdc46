"""Test helpers for ingest: a tiny deterministic engine, and a worker that ingests then dies.

As a script (`python -m tests.ingest_worker ...`) it runs the `add_texts` calls of a JSON file
(a list of lists of texts) on a FusionIndex and SIGKILLs itself right after the store has received
`--die-after-fused` fused caches (new or re-fused): no `finally`, no flush, no cleanup runs,
exactly as if the machine had pulled the plug mid-ingest. The test then resumes the ingest and
checks what was and was not recomputed. With `--die-deleting DOC_ID` instead, the calls all finish,
then the worker deletes that document and SIGKILLs itself right after its Chroma entries are deleted,
before the chunks fused after them are re-fused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from chromadb.api.models.Collection import Collection
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest import chroma
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.runtime.kv import ChunkKV
from fusionrag_core.runtime.loading import resolve_source


def tokenizer_dir(cache_root: Path) -> Path:
    """The default model's tokenizer saved as plain files under `cache_root` (loads in < 1 s).

    NOTE: reading it from the .gguf parses the whole file (~25 s on a small CPU); pytest's cache
    directory keeps the saved copy across runs, keyed by the .gguf and the transformers version.
    """
    import transformers

    source = resolve_source(None)
    gguf = Path(source.path_or_id) / (source.gguf_file or "")
    key = f"{gguf.name}-{gguf.stat().st_size if gguf.is_file() else 0}-{transformers.__version__}"
    target = cache_root / key
    if not (target / "tokenizer_config.json").is_file():
        # NOTE: saved beside the target, then renamed: test processes running at once (pytest-xdist
        # workers, ingest workers) see the whole copy or none of it.
        tokenizer = AutoTokenizer.from_pretrained(source.path_or_id, gguf_file=source.gguf_file)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache_root))
        tokenizer.save_pretrained(str(staging))
        try:
            staging.rename(target)
        except OSError:  # another process published it first
            shutil.rmtree(staging, ignore_errors=True)
    return target


def tiny_engine(tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> FusionEngine:
    """A 2-layer random Llama in fp32 on CPU; the same seed gives the same weights (and fingerprint)
    in every process."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    torch.random.set_rng_state(generator_state)
    return FusionEngine(model, tokenizer, name=f"tiny-llama-seed{seed}")


def tiny_engine_at(tokenizer_path: str, seed: int = 0) -> FusionEngine:
    """`tiny_engine` with the tokenizer saved at `tokenizer_path` (for other processes: Ray workers)."""
    torch.set_num_threads(1)
    return tiny_engine(AutoTokenizer.from_pretrained(tokenizer_path), seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--tokenizer", required=True, help="directory from tokenizer_dir()")
    parser.add_argument("--texts", required=True, help="JSON file: list of add_texts calls, each a list of texts")
    parser.add_argument("--config", required=True, help="JSON object of IngestConfig fields")
    death = parser.add_mutually_exclusive_group(required=True)
    death.add_argument("--die-after-fused", type=int)
    death.add_argument("--die-deleting", metavar="DOC_ID")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # NOTE: as in the tests: tiny matrices, no gain from more threads.
    engine = tiny_engine(AutoTokenizer.from_pretrained(args.tokenizer))
    index = FusionIndex.open(engine, args.data_dir, config=IngestConfig(**json.loads(args.config)))
    put = index.store.put
    fused_puts = 0

    def put_then_maybe_die(chunk_id: str, kv: ChunkKV) -> None:
        nonlocal fused_puts
        put(chunk_id, kv)
        if kv.variant == "fused":
            fused_puts += 1
            if fused_puts >= args.die_after_fused:
                os.kill(os.getpid(), signal.SIGKILL)

    if args.die_after_fused is not None:
        index.store.put = put_then_maybe_die  # type: ignore[method-assign]
    for texts in json.loads(Path(args.texts).read_text()):
        index.add_texts(texts)
    if args.die_deleting is None:
        print("finished without dying: --die-after-fused is larger than the fused caches computed", file=sys.stderr)
        return 3
    delete_ids = chroma.delete_ids

    def delete_then_die(collection: Collection, ids: Iterable[str]) -> None:
        delete_ids(collection, ids)
        os.kill(os.getpid(), signal.SIGKILL)

    chroma.delete_ids = delete_then_die  # type: ignore[assignment]
    index.delete([args.die_deleting])
    print(f"finished without dying: deleting {args.die_deleting!r} deleted no Chroma entry", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
