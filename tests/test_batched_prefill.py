"""Packed chunk prefills (several chunks per forward pass) equal one-at-a-time prefills."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.fusion import CacheBuilder
from fusionrag_core.query.prefill import prefill_chunk, prefill_chunks
from fusionrag_core.store import DiskKVStore
from tests.ingest_worker import tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    return tiny_engine(tokenizer)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(100, 2000, (n,), generator=torch.Generator().manual_seed(seed))


def test_packed_prefill_equals_one_at_a_time(engine: FusionEngine) -> None:
    chunks = [_ids(n, seed) for seed, n in enumerate((7, 12, 5, 9, 1))]
    independent = [engine.chunk_cache(c) for c in chunks]
    prefix = engine.system_prefix(engine.layout.prefix_ids(engine.config.instruction))
    # NOTE: mixed lengths and neighbour counts, a chunk without neighbours among fused ones, and a
    # neighbour shared by several chunks: each packed chunk must see only its own context.
    neighbours = [[independent[1], independent[2]], [], [independent[0]], independent[:4][::-1], [independent[3]]]
    one = [prefill_chunk(engine.decoder, prefix, c, engine.fingerprint, n)
           for c, n in zip(chunks, neighbours, strict=True)]
    many = prefill_chunks(engine.decoder, prefix, chunks, engine.fingerprint, neighbours)
    assert len(many) == len(one)
    for a, b in zip(one, many, strict=True):
        assert (a.variant, a.fingerprint) == (b.variant, b.fingerprint)
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.positions, b.positions)
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.values, a.values, rtol=1e-5, atol=1e-5)
    # NOTE: the packing is not a no-op: the fused caches differ from the chunks' independent ones.
    assert not torch.allclose(many[0].keys, engine.chunk_cache(chunks[0]).keys, atol=1e-4)


@pytest.mark.parametrize(("batch", "tokens", "passes"), [(1, 10**6, 6), (4, 10**6, 2), (8, 10**6, 1), (8, 1, 6)])
def test_builder_packs_by_chunks_and_tokens(engine: FusionEngine, tmp_path, batch: int, tokens: int,  # type: ignore[no-untyped-def]
                                            passes: int) -> None:
    config = IngestConfig(chunk_tokens=40, neighbours=2, prefill_batch=batch, prefill_tokens=tokens)
    builder = CacheBuilder(engine, DiskKVStore(tmp_path), config)
    calls: list[int] = []
    original = engine.chunk_caches

    def spy(token_ids, neighbours):  # type: ignore[no-untyped-def]
        calls.append(len(token_ids))
        return original(token_ids, neighbours)

    engine.chunk_caches = spy  # type: ignore[method-assign]
    try:
        builder.independent([(f"{i:032x}", f"Chunk number {i} talks about lighthouses.") for i in range(6)])
    finally:
        del engine.chunk_caches
    assert len(calls) == passes and sum(calls) == 6 == builder.prefills
    assert all(builder.store.has(f"{i:032x}", "independent") for i in range(6))


def test_config_rejects_bad_batch() -> None:
    with pytest.raises(Exception, match="prefill_batch"):
        IngestConfig(prefill_batch=0)
