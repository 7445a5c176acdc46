"""Prompt-building time per route a chunk is found by: chunk-id marks, document-id marks, plain text.

Not a test: it prints one line per route. MuSiQue dev passages are ingested into a
`FusionRAGVectorStore` (tiny random Llama over the SmolLM2 tokenizer, 256-token chunks); the
Documents of `--docs` of them (document ids, several chunks each) are put in a system message three
ways: marked with their chunk ids (resolved directly), through `format_docs` (document ids: no
cache under them, so each marked text is found by content), and joined as plain text. It times
`ChatFusionRAG.reuse_prompt` (render, find, tokenize; no model pass) and checks that every route
finds every chunk, with the same prompt tokens for both kinds of marks.

    PYTHONPATH=$PWD python benchmarks/mark_routes_bench.py --docs 8 --repeats 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from langchain_core.embeddings import DeterministicFakeEmbedding
from transformers import AutoTokenizer

from fusionrag_core.index import IngestConfig
from fusionrag_core.recognise.marks import mark_chunk
from fusionrag_integrations.langchain import ChatFusionRAG, FusionRAGVectorStore, format_docs
from tests.ingest_worker import tiny_engine, tokenizer_dir

DATASET = Path(__file__).resolve().parents[1] / ".." / "shared" / "datasets" / "musique_dev.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = tiny_engine(AutoTokenizer.from_pretrained(tokenizer_dir(Path(".pytest_cache/d/fusionrag-tokenizer"))))
    with DATASET.open() as f:
        rows = [json.loads(line) for _, line in zip(range(2), f, strict=False)]
    texts = [p["text"] for r in rows for p in r["passages"]][:20]
    with tempfile.TemporaryDirectory() as directory:
        store = FusionRAGVectorStore(collection_name="bench", embedding_function=DeterministicFakeEmbedding(size=8),
                                     persist_directory=directory, engine=engine,
                                     config=IngestConfig(chunk_tokens=256, neighbours=2))
        store.add_texts(texts, ids=[f"d{i}" for i in range(len(texts))])
        docs = store.get_by_ids([f"d{i}" for i in range(args.docs)])
        got = store.index.collection.get(include=["documents"])
        chunk_of = dict(zip(got["documents"] or [], got["ids"], strict=True))
        chat = ChatFusionRAG(index=store.index, learn=False)
        contexts = {
            "chunk-id marks": "".join(mark_chunk(chunk_of[d.page_content], d.page_content) for d in docs),
            "document-id marks (fallback)": format_docs(docs),
            "plain join (content)": "\n\n".join(d.page_content for d in docs),
        }
        for name, context in contexts.items():
            messages = [{"role": "system", "content": "Context:\n\n" + context}, {"role": "user", "content": "Q?"}]
            prompt = chat.reuse_prompt(messages, None)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                chat.reuse_prompt(messages, None)
                times.append(time.perf_counter() - start)
            found = sum(s.kind == "chunk" for s in prompt.segments)
            print(f"{name:30s} median {statistics.median(times) * 1e3:6.2f} ms  chunks found {found}/{len(docs)}  "
                  f"prompt tokens {prompt.num_tokens}")


if __name__ == "__main__":
    main()
