"""The one definition of fusion (fusionrag_core.ingest.fusion): neighbour ranking and the context
check, shared by FusionIndex ingest and the LlamaIndex FusionKVTransform."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.errors import ContextLengthError
from fusionrag_core.ingest.config import IngestConfig
from fusionrag_core.ingest.fusion import CacheBuilder, batch_neighbours, check_fusion_fits, rank_neighbours
from fusionrag_core.store import DiskKVStore, StorageDType

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rank_neighbours_nearest_first_ties_by_id() -> None:
    hits = {"c": 0.2, "a": 0.2, "b": 0.1, "d": 0.9}
    assert rank_neighbours(hits, 3) == [("b", 0.1), ("a", 0.2), ("c", 0.2)]
    assert rank_neighbours(hits, 0) == [] and len(rank_neighbours(hits, 10)) == 4


def test_batch_neighbours_skip_self_and_cap_at_the_batch() -> None:
    emb = np.asarray([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]], dtype=np.float32)
    ids = ["x", "y", "z"]
    near = batch_neighbours(emb, ids, [0, 2], 1)
    assert list(near[0]) == ["y"] and list(near[1]) == ["y"]
    everyone = batch_neighbours(emb, ids, [1], 5)[0]
    assert set(everyone) == {"x", "z"} and everyone["x"] == pytest.approx(0.2, abs=1e-6)
    assert batch_neighbours(emb, ids, [0], 0) == [{}]


@pytest.fixture(scope="module")
def short_engine(smollm_tokenizer: PreTrainedTokenizerBase) -> FusionEngine:
    """A tiny random Llama with a 96-position context window."""
    config = LlamaConfig(vocab_size=len(smollm_tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=96)
    torch.manual_seed(0)
    return FusionEngine(LlamaForCausalLM(config).eval(), smollm_tokenizer, name="short")


def test_fusion_that_cannot_fit_is_refused_up_front_and_exactly(short_engine: FusionEngine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ContextLengthError, match="neighbours"):
        check_fusion_fits(short_engine, neighbours=3, chunk_tokens=64)
    builder = CacheBuilder(short_engine, DiskKVStore(tmp_path), IngestConfig(neighbours=1, chunk_tokens=16))
    long_text = " ".join(["lighthouse keeper"] * 20)
    builder.independent([("a", long_text), ("c", long_text + " again"), ("b", "A short chunk.")])
    assert builder.fused([("b", "A short chunk.", [])])[0].variant == "fused"  # no neighbour: the independent one
    with pytest.raises(ContextLengthError, match="chunk b fused after 2 neighbours needs"):
        builder.fused([("b", "A short chunk.", [("a", 0.1), ("c", 0.2)])])


@pytest.mark.parametrize("storage_dtype", ["float16", "bfloat16", "int8", "float8_e4m3fn"])
def test_a_fused_cache_is_the_same_with_neighbours_from_memory_or_from_the_store(
        short_engine: FusionEngine, tmp_path, storage_dtype: StorageDType) -> None:  # type: ignore[no-untyped-def]
    texts = [("a", "The keeper lit the lamp."), ("b", "Ada Vell drew the lens."), ("c", "The clock struck nine.")]
    fused = []
    for memory_mb in (64, 0):  # 0: no memory copy, every neighbour is read back from the store
        store = DiskKVStore(tmp_path / f"{storage_dtype}-{memory_mb}", storage_dtype=storage_dtype)
        builder = CacheBuilder(short_engine, store, IngestConfig(neighbours=2, chunk_tokens=16,
                                                                 neighbour_cache_mb=memory_mb))
        builder.independent(texts)
        fused.append(builder.fused([("c", texts[2][1], [("a", 0.1), ("b", 0.2)])])[0])
    assert fused[0].variant == fused[1].variant == "fused"
    assert torch.equal(fused[0].keys, fused[1].keys) and torch.equal(fused[0].values, fused[1].values)
