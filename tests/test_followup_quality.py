"""A prompt continued from a kept request is answered as well as a fresh request (issue 26):
first-token KL against full attention, over the shared-corpus rows of the benchmark dataset (every
row's passages in one fused index, as in a deployment). Two kinds: a conversation's follow-up, and
another question over the same documents (`PrefixCacheConfig.shared_documents`).

The prompt continues the kept K/V; its question gets a fresh request's query-guided selection, and
the tokens the kept request already recomputed are not computed again. Skipped when the dataset is
not next to the checkout (CI has it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusionrag_core.batching.prefix_cache import PrefixCacheConfig
from fusionrag_core.bench.data import load_rows
from fusionrag_core.bench.runner import row_passages
from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.index import FusionIndex
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.query.divergence import first_token_kl
from fusionrag_core.query.prompt import QUESTION_TEMPLATE
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.recognise.marks import mark_chunk
from fusionrag_core.runtime.compat import tokenize_plain

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "musique_dev.jsonl"
ROWS = 8
FOLLOW_UPS = ("Which passage supports that? Answer briefly.", "How sure are you? Answer briefly.",
              "Say that again as one short sentence.")  # the serving benchmark's
SAMPLING = SamplingConfig(max_new_tokens=32, stop=("\n",))  # the serving benchmark's
# NOTE: the compared requests are judged by their first token's logits and their token accounts,
# which the rest of their answer cannot change; only the kept first turns need whole answers
FIRST_TOKEN = SamplingConfig(max_new_tokens=1)

pytestmark = pytest.mark.skipif(not DATA.is_file(), reason=f"benchmark dataset not found at {DATA}")


@pytest.fixture(scope="module")
def corpus(default_engine: FusionEngine, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[FusionIndex, list[tuple[str, list[tuple[str, str]]]]]]:
    """The rows' passages (80 tokens at most, as the serving benchmark) in one fused index; per row,
    its question and its `(chunk id, text)` pairs."""
    rows = load_rows(DATA, ROWS)
    passages = [row_passages(row, default_engine, 80) for row in rows]
    texts = [p for ps in passages for p in ps]
    chunk_tokens = max(len(tokenize_plain(default_engine.tokenizer, t)) for t in texts)
    index = FusionIndex.open(default_engine, tmp_path_factory.mktemp("shared-corpus"),
                             config=IngestConfig(chunk_tokens=chunk_tokens, neighbours=10))
    report = index.add_texts(texts)
    ids = [c[0] for c in report.chunk_ids]
    by_row, at = [], 0
    for row, ps in zip(rows, passages, strict=True):
        by_row.append((row.question, list(zip(ids[at:at + len(ps)], ps, strict=True))))
        at += len(ps)
    yield index, by_row
    index.close()


def _messages(engine: FusionEngine, question: str, chunks: list[tuple[str, str]]) -> list[dict[str, str]]:
    context = "".join(mark_chunk(cid, text) for cid, text in chunks)
    return [{"role": "system", "content": engine.config.instruction},
            {"role": "user", "content": context + QUESTION_TEMPLATE.format(question=question)}]


def _ask(engine: FusionEngine, index: FusionIndex, messages: list[dict[str, str]],
         sampling: SamplingConfig = SAMPLING) -> Generation:
    return engine.generate(engine.prompt_from_messages(messages), sampling=sampling, store=index.store)


def test_a_follow_up_is_no_further_from_full_attention_than_a_fresh_request(
        default_engine: FusionEngine, corpus: tuple[FusionIndex, list[tuple[str, list[tuple[str, str]]]]]) -> None:
    index, rows = corpus
    kept = default_engine.with_config(dataclasses.replace(default_engine.config, scheduler=None))
    fresh = kept.with_config(dataclasses.replace(kept.config, prefix_cache=None))

    kl_kept, kl_fresh = [], []
    for i, (question, chunks) in enumerate(rows):
        messages = _messages(kept, question, chunks)
        first = _ask(kept, index, messages)
        messages += [{"role": "assistant", "content": first.text},
                     {"role": "user", "content": FOLLOW_UPS[i % len(FOLLOW_UPS)]}]
        continued, again = _ask(kept, index, messages, FIRST_TOKEN), _ask(fresh, index, messages, FIRST_TOKEN)
        reference = fresh.full_attention(fresh.prompt_from_messages(messages), sampling=FIRST_TOKEN).collect()
        assert continued.prefix_cached_tokens >= first.prompt_tokens - first.reused_tokens  # it continued
        assert 0 < continued.recomputed_tokens < again.recomputed_tokens  # its own, smaller, recompute
        continued.token_partition()
        kl_kept.append(first_token_kl(reference.first_token_logits, continued.first_token_logits))
        kl_fresh.append(first_token_kl(reference.first_token_logits, again.first_token_logits))
    # NOTE: per row either may win; over the rows, continuing is no worse
    assert sum(kl_kept) <= sum(kl_fresh), (kl_kept, kl_fresh)


def test_another_question_over_the_same_documents_is_no_further_from_full_attention(
        default_engine: FusionEngine, corpus: tuple[FusionIndex, list[tuple[str, list[tuple[str, str]]]]]) -> None:
    """Each row's documents asked the next row's question (no question repeats), with
    `PrefixCacheConfig.shared_documents`."""
    index, rows = corpus
    kept = default_engine.with_config(dataclasses.replace(
        default_engine.config, scheduler=None, prefix_cache=PrefixCacheConfig(shared_documents=True)))
    fresh = kept.with_config(dataclasses.replace(kept.config, prefix_cache=None))

    kl_kept, kl_fresh = [], []
    for i, (question, chunks) in enumerate(rows):
        _ask(kept, index, _messages(kept, question, chunks))
        messages = _messages(kept, rows[(i + 1) % len(rows)][0], chunks)
        continued, again = _ask(kept, index, messages, FIRST_TOKEN), _ask(fresh, index, messages, FIRST_TOKEN)
        reference = fresh.full_attention(fresh.prompt_from_messages(messages), sampling=FIRST_TOKEN).collect()
        assert continued.prefix_cached_tokens > again.prefix_cached_tokens  # the documents were continued
        assert 0 < continued.recomputed_tokens < again.recomputed_tokens
        continued.token_partition()
        kl_kept.append(first_token_kl(reference.first_token_logits, continued.first_token_logits))
        kl_fresh.append(first_token_kl(reference.first_token_logits, again.first_token_logits))
    assert sum(kl_kept) <= sum(kl_fresh), (kl_kept, kl_fresh)
