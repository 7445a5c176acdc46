"""The benchmark runner: every method on the same rows, through the real ingest path.

One row, top to bottom:

    passages (title + text, cut to `max_passage_tokens` model tokens)
    -> ingested twice into throwaway FusionIndexes (embedded Chroma + disk KV store):
       "independent" (fuse=False: what CacheBlend / EPIC precompute) and "fused" (FusionRAG's ingest,
       every passage fused after its top-n most similar passages of the corpus)
    -> one canonical prompt (each passage tagged with its chunk id), then the question
    -> every (method, ratio), greedy, in an order rotated from row to row
    -> per-row results scored against full attention on the same prompt

The corpus (`BenchConfig.corpus`):
    "row"    : each row's passages are a corpus of their own, so a fused cache's neighbours are exactly
               the other passages of its prompt (the most favourable case; kept for ablations).
    "shared" : every selected row's passages are ingested into ONE corpus, as in a deployment, so
               neighbours are found corpus-wide and are often other questions' passages.
The prompt's passages (`BenchConfig.context`, shared corpus only for "retrieved"):
    "gold"      : the row's own passages in dataset order.
    "retrieved" : the top-`k` chunks the fused index retrieves for the question, best first.
results.json records both, and the share of each prompt chunk's fused neighbours that are
passages of the same prompt (`corpus.same_prompt_neighbour_share`).

then `metrics.summarize` aggregates the rows and `report.write_report` writes results.json,
results.md and the plots.

TTFT is the engine's own `Generation.ttft_s`: it starts before the chunk caches are read from the
KV store (the engine looks them up by chunk id while stitching), so the store load of the row's
caches, stitching, selection and the recompute pass are all inside it; full attention's TTFT is
its plain prefill of the whole prompt. Methods run interleaved within each row, so machine drift
hits all of them alike, after one untimed warm-up query.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from tqdm.auto import tqdm

from fusionrag_core.bench.data import BenchRow, load_rows, passage_text
from fusionrag_core.bench.methods import DEFAULT_METHODS, DEFAULT_RATIOS, FULL_ATTENTION, METHODS, Method
from fusionrag_core.bench.metrics import RowResult, summarize
from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.errors import CacheNotFoundError, ContextLengthError, InvalidRequestError
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest import chroma
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.records import NEIGHBOURS_KEY
from fusionrag_core.query.divergence import first_token_agree, first_token_kl
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.query.select import SelectConfig
from fusionrag_core.runtime.compat import tokenize_plain
from fusionrag_core.runtime.kv import Variant
from fusionrag_core.store import StorageDType

#: Stop at the end of the first line: the benchmark scores short answers.
ANSWER_STOP = ("\n",)

CorpusMode = Literal["row", "shared"]
ContextMode = Literal["gold", "retrieved"]


@dataclass(frozen=True)
class BenchConfig:
    """What to run.

    Attributes:
        data: the JSONL dataset (see `bench.data`).
        methods: method names from `METHODS`; full attention, the reference of every quality and
            speed ratio, is always run (added first if missing).
        ratios: recompute ratios of the methods that recompute.
        limit: rows of the dataset to run, after `skip` (None = all).
        skip: leading rows of the dataset to leave out (a held-out slice: `skip=10, limit=5` runs
            rows 10-14).
        neighbours: n of fused ingest, capped at (passages in the row - 1).
        max_passage_tokens: cut each passage to its first N model tokens (None = keep whole).
        max_new_tokens: answer length limit (greedy; answers also stop at a newline).
        storage_dtype: dtype of the KV store's blobs (see `fusionrag_core.store.KVStore`).
        warmup: run one untimed query before the first timed one.
        corpus: "row" (each row's passages are their own corpus) or "shared" (all selected rows'
            passages in one corpus; neighbours are found corpus-wide).
        context: "gold" (the row's own passages) or "retrieved" (top-`k` from the shared corpus).
        k: chunks retrieved per question with `context="retrieved"`.
    """

    data: Path
    methods: tuple[str, ...] = DEFAULT_METHODS
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    limit: int | None = None
    skip: int = 0
    neighbours: int = 10
    max_passage_tokens: int | None = None
    max_new_tokens: int = 32
    storage_dtype: StorageDType = "float16"
    warmup: bool = True
    corpus: CorpusMode = "row"
    context: ContextMode = "gold"
    k: int = 4

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise InvalidRequestError(
                f"unknown method(s) {unknown or '(none given)'}; choose from {', '.join(METHODS)}"
            )
        if any(METHODS[m].recomputes for m in self.methods) and not self.ratios:
            raise InvalidRequestError("no recompute ratio given; pass ratios such as 0.05,0.15,0.3")
        for ratio in self.ratios:
            SelectConfig(ratio=ratio)  # NOTE: the engine's own range check and message.
        if len(set(self.ratios)) != len(self.ratios):
            raise InvalidRequestError(f"recompute ratios repeat: {list(self.ratios)}; list each once")
        if self.limit is not None and self.limit < 1:
            raise InvalidRequestError(f"limit must be >= 1 row, got {self.limit}")
        if self.skip < 0:
            raise InvalidRequestError(f"skip must be >= 0 rows, got {self.skip}")
        if self.max_passage_tokens is not None and self.max_passage_tokens < 1:
            raise InvalidRequestError(f"max_passage_tokens must be >= 1, got {self.max_passage_tokens}")
        IngestConfig(neighbours=self.neighbours)  # NOTE: IngestConfig's own check and message.
        SamplingConfig(max_new_tokens=self.max_new_tokens)
        if self.corpus not in get_args(CorpusMode):
            raise InvalidRequestError(
                f"unknown corpus mode {self.corpus!r}; use one of {', '.join(get_args(CorpusMode))}")
        if self.context not in get_args(ContextMode):
            raise InvalidRequestError(
                f"unknown context mode {self.context!r}; use one of {', '.join(get_args(ContextMode))}")
        if self.context == "retrieved" and self.corpus != "shared":
            raise InvalidRequestError("context 'retrieved' retrieves from the shared corpus; add corpus='shared' "
                                      "(--corpus shared)")
        if self.k < 1:
            raise InvalidRequestError(f"k must be >= 1 retrieved chunk, got {self.k}")
        if self.storage_dtype not in get_args(StorageDType):
            raise InvalidRequestError(
                f"unknown storage dtype {self.storage_dtype!r}; use one of {', '.join(get_args(StorageDType))}"
            )

    def plan(self) -> list[tuple[Method, float | None]]:
        """Every (method, ratio) to run on each row, full attention first."""
        names = [FULL_ATTENTION, *(m for m in self.methods if m != FULL_ATTENTION)]
        return [
            (METHODS[name], ratio)
            for name in names
            for ratio in (self.ratios if METHODS[name].recomputes else (None,))
        ]


def label(method: str, ratio: float | None) -> str:
    """`fusionrag@0.15`, or the bare name of a baseline."""
    return method if ratio is None else f"{method}@{ratio:g}"


@dataclass
class _IngestTotals:
    """Chunks and seconds of each ingest kind, over all rows."""

    chunks: dict[str, int] = field(default_factory=lambda: {"independent": 0, "fused": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"independent": 0.0, "fused": 0.0})

    def summary(self) -> dict[str, float | int | None]:
        def per_min(kind: str) -> float | None:
            return 60.0 * self.chunks[kind] / self.seconds[kind] if self.seconds[kind] > 0 else None

        return {
            "independent_chunks_per_min": per_min("independent"),
            "fused_chunks_per_min": per_min("fused"),
            "independent_chunks": self.chunks["independent"],
            "fused_chunks": self.chunks["fused"],
            "independent_seconds": self.seconds["independent"],
            "fused_seconds": self.seconds["fused"],
        }


@dataclass
class _Corpus:
    """Ingested passages: `(chunk_id, text)` per passage in ingest order, each kind's index, and
    each chunk's fused neighbours (chunk ids, nearest first)."""

    chunks: list[tuple[str, str]]
    indexes: dict[Variant, FusionIndex]
    neighbours: dict[str, list[str]]


def run_benchmark(
    config: BenchConfig,
    engine: FusionEngine,
    *,
    embedding_function: chroma.EmbeddingFn | None = None,
    progress: bool = True,
    command: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run every method on the dataset's rows; returns the results.json document.

    Args:
        config: what to run.
        engine: the model (any FusionEngine: the packaged default, another model, a test model);
            each query passes its row's KV store, so the engine is left as it was; the methods run
            on a copy without a prefix cache (`with_config`), so none continues another's K/V.
        embedding_function: for the Chroma collections (default: the offline MiniLM).
        progress: show a tqdm bar (one step per ingest and per query).
        command: the command line, recorded in the results.

    Returns:
        `{"model", "dataset", "rows", "results": [per (method, ratio) summary], "ingest", "corpus",
        "config", "command", "ttft", "per_row"}` (see `metrics.summarize` for the summary keys).

    Raises:
        DatasetFormatError: the dataset is missing or malformed.
        ContextLengthError: a row's prompt does not fit the model (lower `max_passage_tokens`).
        CacheNotFoundError: a query had to prefill a chunk whose cache ingest should have stored.
    """
    rows = load_rows(config.data, None if config.limit is None else config.skip + config.limit)[config.skip:]
    if not rows:
        raise InvalidRequestError(f"{config.data} holds no rows after skipping {config.skip}; pass a dataset with "
                                  "at least one row there (or a smaller --skip)")
    ef = embedding_function if embedding_function is not None else chroma.default_embedding_function()
    sampling = SamplingConfig(max_new_tokens=config.max_new_tokens, stop=ANSWER_STOP)
    plan = config.plan()
    if engine.prefix_cache is not None:
        # NOTE: every method answers the same prompt: a request must not continue another's K/V
        engine = engine.with_config(dataclasses.replace(engine.config, prefix_cache=None))
    passages = [row_passages(row, engine, config.max_passage_tokens) for row in rows]
    if config.context == "gold":
        for i, (row, ps) in enumerate(zip(rows, passages, strict=True)):
            _check_fits(engine, row, ps, sampling, i)
    totals = _IngestTotals()
    results: list[RowResult] = []
    per_row: list[dict[str, Any]] = []
    ingests = 1 if config.corpus == "shared" else len(rows)
    # NOTE: one step per ingest and per query, so a slow row still shows progress.
    bar = tqdm(total=ingests + len(rows) * len(plan), desc="bench", unit="step", disable=not progress)
    with bar, tempfile.TemporaryDirectory(prefix="fusionrag-bench-") as tmp:
        root = Path(tmp)
        shared: _Corpus | None = None
        if config.corpus == "shared":
            bar.set_postfix_str(f"ingest {sum(map(len, passages))} passages")
            shared = _ingest(engine, [p for ps in passages for p in ps], _doc_ids(passages), "shared", root,
                             config, ef, totals)
            bar.update(1)
        try:
            offset = 0
            for i, row in enumerate(rows):
                corpus = shared
                if corpus is None:
                    bar.set_postfix_str(f"row {i + 1}: ingest")
                    corpus = _ingest(engine, passages[i], [f"passage-{j}" for j in range(len(passages[i]))],
                                     f"row{i}", root, config, ef, totals)
                    bar.update(1)
                own = corpus.chunks[offset:offset + len(passages[i])] if shared is not None else corpus.chunks
                offset += len(passages[i])
                try:
                    row_results, outputs = _run_row(engine, row, i, own, corpus, config, sampling, bar)
                finally:
                    if shared is None:
                        _drop(corpus, root)
                results.extend(row_results)
                per_row.append(outputs)
        finally:
            if shared is not None:
                _drop(shared, root)
    shares = [r["same_prompt_neighbour_share"] for r in per_row if r["same_prompt_neighbour_share"] is not None]
    return {
        "model": engine.name,
        "model_fingerprint": engine.fingerprint,
        "device": str(engine.device),
        "dtype": str(engine.decoder.dtype).removeprefix("torch."),
        "dataset": str(config.data),
        "rows": len(rows),
        "first_row": config.skip,
        "command": list(command) if command is not None else None,
        "config": {**asdict(config), "data": str(config.data)},
        "corpus": {
            "mode": config.corpus,
            "context": config.context,
            "k": config.k if config.context == "retrieved" else None,
            "passages": sum(map(len, passages)),
            "same_prompt_neighbour_share": sum(shares) / len(shares) if shares else None,
            "gold_passage_recall": (sum(r["gold_passage_recall"] for r in per_row) / len(per_row)
                                    if config.context == "retrieved" else None),
        },
        "results": summarize(results),
        "ingest": totals.summary(),
        "ttft": "engine time to first token; for reuse methods it includes loading the row's chunk caches "
                "from the KV store, stitching, selection and the recompute pass",
        "per_row": per_row,
    }


def _doc_ids(passages: Sequence[Sequence[str]]) -> list[str]:
    """Document ids of every row's passages in the shared corpus: `row{i}-passage-{j}`."""
    return [f"row{i}-passage-{j}" for i, ps in enumerate(passages) for j in range(len(ps))]


def _run_row(
    engine: FusionEngine,
    row: BenchRow,
    i: int,
    own: Sequence[tuple[str, str]],
    corpus: _Corpus,
    config: BenchConfig,
    sampling: SamplingConfig,
    bar: tqdm[Any],
) -> tuple[list[RowResult], dict[str, Any]]:
    """Answer one row with every (method, ratio) and score it; returns its results and outputs.

    `own` are the row's passages as ingested; the prompt holds them ("gold") or the top-k
    retrieved from `corpus` ("retrieved").
    """
    plan = config.plan()
    chunks = list(own)
    if config.context == "retrieved":
        hits = corpus.indexes["fused"].search(row.question, config.k)
        chunks = [(h.chunk_id, h.text) for h in hits]
    prompt = engine.prompt(row.question, chunks=chunks)
    if i == 0 and config.warmup:
        _warm_up(engine, prompt, corpus)
    # NOTE: rotated so no method always runs right after the same other one.
    shift = i % len(plan)
    generations: dict[tuple[str, float | None], Generation] = {}
    for method, ratio in plan[shift:] + plan[:shift]:
        bar.set_postfix_str(f"row {i + 1}: {label(method.name, ratio)}")
        generations[(method.name, ratio)] = _answer(engine, prompt, method, ratio, corpus, sampling)
        bar.update(1)
    row_results = _score(row, plan, generations)
    prompt_ids = [cid for cid, _ in chunks]
    own_ids = {cid for cid, _ in own}
    outputs = {
        "question": row.question,
        "answers": list(row.answers),
        "prompt_tokens": prompt.num_tokens,
        "prompt_chunks": len(chunks),
        "same_prompt_neighbour_share": same_prompt_neighbour_share(prompt_ids, corpus.neighbours),
        "gold_passage_recall": len(own_ids.intersection(prompt_ids)) / len(own_ids),
        "outputs": {label(r.method, r.ratio): r.answer for r in row_results},
        "kl_first_token": {label(r.method, r.ratio): r.kl_first_token for r in row_results},
        "recomputed_fraction": {label(r.method, r.ratio): r.recomputed_fraction for r in row_results},
    }
    return row_results, outputs


def same_prompt_neighbour_share(prompt_ids: Sequence[str], neighbours: dict[str, list[str]]) -> float | None:
    """Mean over the prompt's chunks of the share of their fused neighbours that are other chunks of
    the same prompt (1.0: every neighbour it was fused after is in the prompt); None when no chunk
    of the prompt has neighbours."""
    present = set(prompt_ids)
    shares = [
        sum(n in present and n != cid for n in neighbours[cid]) / len(neighbours[cid])
        for cid in dict.fromkeys(prompt_ids)
        if neighbours.get(cid)
    ]
    return sum(shares) / len(shares) if shares else None


def row_passages(row: BenchRow, engine: FusionEngine, max_tokens: int | None) -> list[str]:
    """The row's passages as chunk texts: `passage_text(title, text)`, cut to the first
    `max_tokens` model tokens (decoded back to text), whitespace-trimmed as the chunker trims."""
    out: list[str] = []
    for title, text in row.passages:
        passage = passage_text(title, text)
        if max_tokens is not None:
            ids = tokenize_plain(engine.tokenizer, passage)
            if len(ids) > max_tokens:
                passage = str(engine.tokenizer.decode(ids[:max_tokens], skip_special_tokens=True))
        out.append(passage.strip())
    return out


def _check_fits(engine: FusionEngine, row: BenchRow, passages: Sequence[str], sampling: SamplingConfig,
                index: int) -> None:
    """Fail before any ingest work if the row's prompt cannot fit the model."""
    need = engine.prompt(row.question, chunks=list(passages)).num_tokens + sampling.max_new_tokens
    if need > engine.context_window:
        raise ContextLengthError(
            f"row {index}: {len(passages)} passages + question + {sampling.max_new_tokens} answer tokens need {need} "
            f"positions, more than {engine.name}'s context window of {engine.context_window}; cut passages with "
            f"max_passage_tokens (--max-passage-tokens) "
            f"{max(1, (engine.context_window - 256) // max(1, len(passages)))} or less"
        )


def _ingest(
    engine: FusionEngine,
    passages: Sequence[str],
    doc_ids: Sequence[str],
    name: str,
    root: Path,
    config: BenchConfig,
    ef: chroma.EmbeddingFn,
    totals: _IngestTotals,
) -> _Corpus:
    """Ingest `passages` (one document each) into an independent and a fused index named `name`."""
    # NOTE: one chunk per passage: the chunk budget is the longest passage, so no passage is split.
    chunk_tokens = max(len(tokenize_plain(engine.tokenizer, p)) for p in passages)
    settings: dict[Variant, IngestConfig] = {
        "independent": IngestConfig(chunk_tokens=chunk_tokens, neighbours=0, fuse=False),
        "fused": IngestConfig(chunk_tokens=chunk_tokens, neighbours=min(config.neighbours, len(passages) - 1)),
    }
    indexes: dict[Variant, FusionIndex] = {}
    chunk_ids: list[str] = []
    for kind, ingest_config in settings.items():
        index = FusionIndex.open(engine, root, collection_name=f"{name}-{kind}", config=ingest_config,
                                 embedding_function=ef, storage_dtype=config.storage_dtype)
        indexes[kind] = index
        report = index.add_texts(list(passages), doc_ids=list(doc_ids))
        ids = [chunks[0] for chunks in report.chunk_ids]
        if any(len(chunks) != 1 for chunks in report.chunk_ids):
            raise InvalidRequestError(
                f"{name}: a passage was cut into several chunks ({[len(c) for c in report.chunk_ids]}); "
                "the benchmark needs one chunk per passage (this is a bug in the chunk budget)"
            )
        if chunk_ids and ids != chunk_ids:
            raise InvalidRequestError(f"{name}: the {kind} ingest named the passages' chunks differently")
        chunk_ids = ids
        totals.chunks[kind] += report.new_chunks
        totals.seconds[kind] += report.seconds
    _check_caches(indexes, chunk_ids, name)
    texts, neighbours = _chunk_records(indexes["fused"], chunk_ids)
    return _Corpus([(cid, texts[cid]) for cid in chunk_ids], indexes, neighbours)


def _check_caches(indexes: dict[Variant, FusionIndex], chunk_ids: Sequence[str], name: str) -> None:
    # NOTE: the engine falls back from a missing fused cache to the independent one without a
    # miss; a benchmark must not silently measure the wrong cache.
    for kind, index in indexes.items():
        missing = sorted(set(chunk_ids) - index.store.list_ids(kind))
        if missing:
            raise CacheNotFoundError(
                f"{name}: the {kind} ingest stored no {kind} cache for chunk(s) {missing}; "
                "the benchmark cannot measure that method (check the ingest log)"
            )


def _chunk_records(index: FusionIndex, chunk_ids: Sequence[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Chunk texts as the collection holds them (what a retriever would hand the prompt), and each
    chunk's fused neighbours as ingest recorded them."""
    res = index.collection.get(ids=list(dict.fromkeys(chunk_ids)), include=["documents", "metadatas"])
    documents, metadatas = res["documents"] or [], res["metadatas"] or []
    texts = {cid: str(doc) for cid, doc in zip(res["ids"], documents, strict=True)}
    neighbours = {cid: str((meta or {}).get(NEIGHBOURS_KEY) or "").split()
                  for cid, meta in zip(res["ids"], metadatas, strict=True)}
    return texts, neighbours


def _warm_up(engine: FusionEngine, prompt: Any, corpus: _Corpus) -> None:
    """One untimed query of each kind (plain prefill, cache reuse): first calls pay one-time costs."""
    short = SamplingConfig(max_new_tokens=2)
    engine.full_attention(prompt, sampling=short).collect()
    engine.generate(prompt, sampling=short, selector="query_guided", variant="fused",
                    store=corpus.indexes["fused"].store)


def _answer(
    engine: FusionEngine,
    prompt: Any,
    method: Method,
    ratio: float | None,
    corpus: _Corpus,
    sampling: SamplingConfig,
) -> Generation:
    """One method's answer; caches are read from the store of the method's ingest kind."""
    if method.selector is None:
        return engine.full_attention(prompt, sampling=sampling).collect()
    assert method.variant is not None  # NOTE: every reuse method names its cache variant.
    generation = engine.generate(prompt, sampling=sampling, selector=method.selector, ratio=ratio,
                                 variant=method.variant, store=corpus.indexes[method.variant].store)
    if generation.cache_misses:
        raise CacheNotFoundError(
            f"{label(method.name, ratio)} prefilled chunks instead of reusing their caches: {generation.cache_misses}"
        )
    return generation


def _score(
    row: BenchRow, plan: Sequence[tuple[Method, float | None]], generations: dict[tuple[str, float | None], Generation]
) -> list[RowResult]:
    """Per-method results of one row, against full attention on the same prompt (in plan order)."""
    reference = generations[(FULL_ATTENTION, None)]
    out = []
    for method, ratio in plan:
        g = generations[(method.name, ratio)]
        out.append(RowResult(
            method=method.name,
            ratio=ratio,
            answer=g.text.strip(),
            golds=list(row.answers),
            reference_answer=reference.text.strip(),
            kl_first_token=first_token_kl(reference.first_token_logits, g.first_token_logits),
            first_token_agree=first_token_agree(reference.first_token_logits, g.first_token_logits),
            ttft_s=g.ttft_s,
            recomputed_fraction=g.recomputed_fraction,
            kv_bytes_loaded=g.kv_bytes_loaded,
        ))
    return out


def _drop(corpus: _Corpus, root: Path) -> None:
    """Delete the row's collections and KV stores (a full run would otherwise keep gigabytes)."""
    for index in corpus.indexes.values():
        name = index.collection.name
        index.store.close()
        client = chroma.open_client(chroma.VectorDBConfig(path=str(root / "chroma"), collection=name))
        client.delete_collection(name)
        shutil.rmtree(root / "kv" / name, ignore_errors=True)


__all__ = [
    "DEFAULT_METHODS",
    "DEFAULT_RATIOS",
    "METHODS",
    "BenchConfig",
    "Method",
    "label",
    "row_passages",
    "run_benchmark",
]
