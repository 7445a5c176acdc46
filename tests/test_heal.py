"""Healing kept requests (`EngineConfig.heal`, `fusionrag_core.batching.heal`).

What is proven: a kept FusionRAG turn's inexact K/V, healed while the engine is idle, become what
full attention computes, so a follow-up that continues it gets full attention's first-token logits
(within float tolerance) and greedy answer, on a tiny random Llama and on a tiny random Gemma 3
whose sliding window is far shorter than the prompt; healing runs in pieces, and a request that
arrives mid-heal waits for one piece at most (counted as a preemption), continues the head healed
so far and recomputes among the rest as a fresh request would; every Generation says how many of
its prompt tokens were exact, healed or approximate, and the engine's stats count the heals.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

import fusionrag_core.batching.heal as heal_module
from fusionrag_core.batching.heal import HealConfig
from fusionrag_core.batching.prefix_cache import KeptPrefix
from fusionrag_core.engine import EngineConfig, FusionEngine, Generation
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.runtime.kv import ChunkKV
from fusionrag_core.store.disk import DiskKVStore

DOCS = {
    "lumen": "The Lumen lighthouse on Gull Point was designed by the engineer Ada Vell in 1891. Its lamp is red.",
    "vell": "Ada Vell was born in the port town of Marrow, where her father repaired ship clocks for the fleet.",
    "marrow": "Marrow lies at the mouth of the river Tell and is known for its salt market and its pink salt.",
}
SAMPLING = SamplingConfig(max_new_tokens=8)
PIECE = 16
WAIT_S = 120.0


def _llama(tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(config).eval()


def _gemma(window: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                              max_position_embeddings=2048, layer_types=["sliding_attention", "full_attention"] * 2)
    return Gemma3ForCausalLM(config).eval()


def _engines(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> tuple[FusionEngine, FusionEngine]:
    """(an engine that keeps and heals finished requests, full attention's reference without a prefix cache)."""
    engine = FusionEngine(model, tokenizer, name="tiny", config=EngineConfig(heal=HealConfig(piece_tokens=PIECE)))
    fresh = engine.with_config(dataclasses.replace(engine.config, prefix_cache=None, heal=None))
    return engine, fresh


def _fused(engine: FusionEngine) -> dict[str, ChunkKV]:
    alone = {k: engine.chunk_cache(text) for k, text in DOCS.items()}
    return {k: engine.chunk_cache(text, [alone[o] for o in DOCS if o != k]) for k, text in DOCS.items()}


def _turns(engine: FusionEngine, first: Generation | None) -> tuple[FusionPrompt, FusionPrompt | None]:
    context = "\n\n".join(DOCS.values())
    messages = [{"role": "user", "content": f"Context:\n{context}\n\nWho designed the Lumen lighthouse?"}]
    one = engine.prompt_from_messages(messages, documents=dict(DOCS))
    if first is None:
        return one, None
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Where was she born?"}]
    return one, engine.prompt_from_messages(messages, documents=dict(DOCS))


def _kept(engine: FusionEngine) -> KeptPrefix:
    """The one entry of the engine's prefix cache."""
    assert engine.prefix_cache is not None
    entries = list(engine.prefix_cache._device.values())
    assert len(entries) == 1
    return entries[0]


def _check_healed_follow_up(engine: FusionEngine, fresh: FusionEngine) -> None:
    fused = _fused(engine)
    one, _ = _turns(engine, None)
    first = engine.generate(one, sampling=SAMPLING, caches=fused)
    assert first.approximate_tokens > 0 and first.healed_tokens == 0  # reused fused caches: inexact
    assert first.exact_tokens + first.healed_tokens + first.approximate_tokens == first.prompt_tokens
    assert engine.wait_for_heals(WAIT_S)
    healed = _kept(engine)
    assert healed.exact_tokens == healed.num_tokens and not bool(healed.inexact.any())
    assert healed.healed is not None and int(healed.healed.sum()) > 0
    _, two = _turns(engine, first)
    assert two is not None
    follow = engine.generate(two, sampling=SAMPLING, caches=fused)
    reference = fresh.full_attention(two, sampling=SAMPLING).collect()
    assert follow.healed_tokens == int(healed.healed.sum())
    assert follow.approximate_tokens == 0 and follow.recomputed_tokens == 0
    assert follow.stats()["continued_healed_cache"] is True
    torch.testing.assert_close(follow.first_token_logits, reference.first_token_logits, atol=1e-4, rtol=0)
    assert follow.token_ids == reference.token_ids
    stats = engine.stats()
    assert stats["heals"] >= 1 and stats["healed_tokens"] >= int(healed.healed.sum())
    assert stats["heal_pieces"] >= -(-int(healed.healed.sum()) // PIECE)


def test_a_healed_llama_follow_up_equals_full_attention(smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    _check_healed_follow_up(*_engines(_llama(smollm_tokenizer), smollm_tokenizer))


def test_a_healed_sliding_window_gemma_follow_up_equals_full_attention(
        smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    """A window of 8 tokens: every piece after the first sees only part of the healed head."""
    _check_healed_follow_up(*_engines(_gemma(8), smollm_tokenizer))


def test_a_healed_head_is_continued_after_its_chunks_are_re_fused(smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    """Every chunk's stored cache changed after the heal (another neighbour digest): the healed K/V
    are the tokens' own, so the follow-up still continues the whole healed head (a head with reused
    K/V would end where the first changed chunk starts) and equals full attention."""
    engine, fresh = _engines(_llama(smollm_tokenizer), smollm_tokenizer)
    fused = _fused(engine)
    one, _ = _turns(engine, None)
    first = engine.generate(one, sampling=SAMPLING, caches=fused)
    assert engine.wait_for_heals(WAIT_S)
    healed = _kept(engine)
    _, two = _turns(engine, first)
    assert two is not None
    refused = {k: dataclasses.replace(kv, fused_after="re-fused") for k, kv in fused.items()}
    follow = engine.generate(two, sampling=SAMPLING, caches=refused)
    reference = fresh.full_attention(two, sampling=SAMPLING).collect()
    assert follow.prefix_cached_tokens == healed.num_tokens
    assert follow.approximate_tokens == 0 and follow.healed_tokens == int(healed.healed.sum())
    torch.testing.assert_close(follow.first_token_logits, reference.first_token_logits, atol=1e-4, rtol=0)


def test_a_healed_follow_up_loads_no_chunk_cache(smollm_tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    """Every chunk lies in the healed head the follow-up continues: none of their caches is read from
    the store (before, all were loaded beside the follow-up's prefill and never used)."""
    engine, _ = _engines(_llama(smollm_tokenizer), smollm_tokenizer)
    store = DiskKVStore(tmp_path, storage_dtype="float32")
    for chunk_id, kv in _fused(engine).items():
        store.put(chunk_id, kv)
    one, _ = _turns(engine, None)
    first = engine.generate(one, sampling=SAMPLING, store=store)
    assert first.approximate_tokens > 0
    assert engine.wait_for_heals(WAIT_S)
    _, two = _turns(engine, first)
    assert two is not None
    read: list[str] = []
    get = store.get

    def counted(chunk_id: str, *args: Any, **kwargs: Any) -> ChunkKV:
        read.append(chunk_id)
        return get(chunk_id, *args, **kwargs)

    store.get = counted  # type: ignore[method-assign]
    follow = engine.generate(two, sampling=SAMPLING, store=store)
    assert follow.approximate_tokens == 0 and follow.prefix_cached_tokens == _kept_tokens(first)
    assert read == []


def _kept_tokens(first: Generation) -> int:
    """The tokens a finished turn keeps: its prompt and its answer but the last token."""
    return first.prompt_tokens + len(first.token_ids) - 1


def test_without_healing_the_follow_up_is_not_full_attention(smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    """The control: the same conversation without healing continues approximate K/V."""
    engine, fresh = _engines(_llama(smollm_tokenizer), smollm_tokenizer)
    plain = engine.with_config(dataclasses.replace(engine.config, heal=None))
    fused = _fused(plain)
    one, _ = _turns(plain, None)
    first = plain.generate(one, sampling=SAMPLING, caches=fused)
    _, two = _turns(plain, first)
    assert two is not None
    follow = plain.generate(two, sampling=SAMPLING, caches=fused)
    reference = fresh.full_attention(two, sampling=SAMPLING).collect()
    assert follow.approximate_tokens > 0 and follow.healed_tokens == 0
    assert not torch.allclose(follow.first_token_logits, reference.first_token_logits, atol=1e-4, rtol=0)
    assert "heals" not in plain.stats()


@pytest.fixture
def held_piece(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """(entered, go): the first heal piece signals `entered`, then waits for `go` before it runs."""
    entered, go = threading.Event(), threading.Event()
    heal_piece = heal_module.heal_piece

    def held(*args: object, **kwargs: object) -> KeptPrefix:
        if not entered.is_set():
            entered.set()
            assert go.wait(WAIT_S)
        return heal_piece(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(heal_module, "heal_piece", held)
    yield entered, go
    go.set()


def test_an_arrival_mid_heal_waits_one_piece_and_continues_the_healed_head(
        smollm_tokenizer: PreTrainedTokenizerBase, held_piece: tuple[threading.Event, threading.Event]) -> None:
    entered, go = held_piece
    engine, fresh = _engines(_llama(smollm_tokenizer), smollm_tokenizer)
    assert engine.scheduler is not None
    fused = _fused(engine)
    one, _ = _turns(engine, None)
    first = engine.generate(one, sampling=SAMPLING, caches=fused)
    assert entered.wait(WAIT_S)  # NOTE: the engine went idle: healing started, its first piece is held
    head = _kept(engine).exact_tokens
    _, two = _turns(engine, first)
    assert two is not None
    answers: list[Generation] = []
    arrival = threading.Thread(target=lambda: answers.append(engine.generate(two, sampling=SAMPLING, caches=fused)))
    arrival.start()
    while engine.scheduler.load["waiting"] == 0:  # NOTE: it waits for the lead the held piece has
        assert arrival.is_alive()
        threading.Event().wait(0.01)
    go.set()
    arrival.join(WAIT_S)
    (follow,) = answers
    assert follow.healed_tokens == PIECE  # the one piece healed before it ran
    assert follow.approximate_tokens > 0 and follow.recomputed_tokens > 0  # the rest: its own recompute
    assert follow.exact_tokens + follow.healed_tokens + follow.approximate_tokens == follow.prompt_tokens
    assert follow.exact_tokens >= head
    assert engine.stats()["heal_preempted"] == 1
    # NOTE: idle again, healing goes on, now over the follow-up's kept entry
    assert engine.wait_for_heals(WAIT_S)
    assert _kept(engine).exact_tokens == _kept(engine).num_tokens
    reference = fresh.full_attention(two, sampling=SAMPLING).collect()
    assert reference.exact_tokens == reference.prompt_tokens and reference.approximate_tokens == 0


def _healing_a_piece(tokenizer: PreTrainedTokenizerBase,
                     held_piece: tuple[threading.Event, threading.Event]) -> tuple[FusionEngine, threading.Event]:
    """An engine whose heal thread is inside its first piece, held there; (the engine, the event that lets it go)."""
    entered, go = held_piece
    engine, _ = _engines(_llama(tokenizer), tokenizer)
    one, _ = _turns(engine, None)
    engine.generate(one, sampling=SAMPLING, caches=_fused(engine))
    assert entered.wait(WAIT_S)
    return engine, go


def test_at_exit_healing_stops_after_the_piece_in_flight(
        smollm_tokenizer: PreTrainedTokenizerBase, held_piece: tuple[threading.Event, threading.Event]) -> None:
    """Defect: a program that ended while its engine healed aborted ("terminate called without an
    active exception", exit 134): the heal thread was inside torch when the interpreter finalized.
    At exit (`atexit`), `stop_healing` lets the piece in flight end and starts no other."""
    engine, go = _healing_a_piece(smollm_tokenizer, held_piece)
    assert engine.loop is not None
    assert not engine.loop.stop_healing(timeout_s=0.2)  # NOTE: the held piece is still running
    go.set()
    assert engine.loop.stop_healing(timeout_s=WAIT_S)
    threading.Event().wait(0.2)
    assert engine.stats()["heal_pieces"] == 1 and _kept(engine).exact_tokens < _kept(engine).num_tokens


def test_a_closed_engine_heals_no_more(
        smollm_tokenizer: PreTrainedTokenizerBase, held_piece: tuple[threading.Event, threading.Event]) -> None:
    """Defect: an engine dropped with kept requests to heal went on healing them in its daemon thread
    (a benchmark's next configuration ran beside it at half speed). `close` lets the piece in flight
    end; the heal thread exits and runs no other piece."""
    engine, go = _healing_a_piece(smollm_tokenizer, held_piece)
    assert engine.loop is not None
    healing = engine.loop._healing
    assert healing is not None and healing.is_alive()
    go.set()
    engine.close()
    healing.join(WAIT_S)
    assert not healing.is_alive()
    assert engine.stats()["heal_pieces"] == 1 and _kept(engine).exact_tokens < _kept(engine).num_tokens


EXITS_AFTER_HEALING = """
import sys
from transformers import AutoTokenizer
from tests.test_heal import _check_healed_follow_up, _engines, _llama
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
_check_healed_follow_up(*_engines(_llama(tokenizer), tokenizer))
"""


def test_a_program_whose_engine_healed_exits_cleanly(tokenizer_path: Path) -> None:
    """Defect: a heal thread woken to end at interpreter exit ended while the interpreter finalized,
    and the process aborted ("terminate called without an active exception", exit 134) after every
    test that healed. A real process: its exit status and stderr."""
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", EXITS_AFTER_HEALING, str(tokenizer_path)], cwd=repo,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]


def test_healing_needs_a_prefix_cache_and_a_scheduler() -> None:
    with pytest.raises(InvalidRequestError, match="prefix_cache"):
        EngineConfig(heal=HealConfig(), prefix_cache=None)
    with pytest.raises(InvalidRequestError, match="scheduler"):
        EngineConfig(heal=HealConfig(), scheduler=None)
    with pytest.raises(InvalidRequestError, match="piece_tokens"):
        HealConfig(piece_tokens=0)


def test_concurrent_conversations_healed_then_continued_equal_serial_full_attention(
        smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    """Four conversations' turns batched together: every kept turn is healed, and each batched
    follow-up equals that conversation's full attention run alone (greedy tokens, logits within
    the rounding of a packed pass)."""
    engine, fresh = _engines(_llama(smollm_tokenizer), smollm_tokenizer)
    fused = _fused(engine)
    orders = [list(DOCS), list(DOCS)[::-1], list(DOCS)[1:] + list(DOCS)[:1], list(DOCS)[2:] + list(DOCS)[:2]]

    def turns(order: list[str], first: Generation | None) -> FusionPrompt:
        messages = [{"role": "user", "content": "Context:\n" + "\n\n".join(DOCS[k] for k in order) + "\n\nWho?"}]
        if first is not None:
            messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
        return engine.prompt_from_messages(messages, documents={k: DOCS[k] for k in order})

    with ThreadPoolExecutor(len(orders)) as pool:
        firsts = list(pool.map(lambda o: engine.generate(turns(o, None), sampling=SAMPLING, caches=fused), orders))
        assert engine.wait_for_heals(WAIT_S)
        assert engine.stats()["heals"] == len(orders)
        follows = list(pool.map(lambda a: engine.generate(turns(a[0], a[1]), sampling=SAMPLING, caches=fused),
                                zip(orders, firsts, strict=True)))
    for order, first, follow in zip(orders, firsts, follows, strict=True):
        reference = fresh.full_attention(turns(order, first), sampling=SAMPLING).collect()
        assert follow.healed_tokens > 0 and follow.approximate_tokens == 0
        assert follow.token_ids == reference.token_ids
        torch.testing.assert_close(follow.first_token_logits, reference.first_token_logits, atol=1e-4, rtol=0)


def test_heal_totals_are_served_at_metrics(smollm_tokenizer: PreTrainedTokenizerBase) -> None:
    from fusionrag_integrations.openai_server.metrics import ENGINE_STATS, Metrics

    engine, _ = _engines(_llama(smollm_tokenizer), smollm_tokenizer)
    one, _ = _turns(engine, None)
    engine.generate(one, sampling=SAMPLING, caches=_fused(engine))
    assert engine.wait_for_heals(WAIT_S)
    stats = engine.stats()
    assert set(stats) <= set(ENGINE_STATS)
    body = Metrics(engine.stats).render(running=0, waiting=0).decode()
    assert f"fusionrag_heals_total {float(stats['heals'])}" in body and stats["heals"] == 1
    assert f"fusionrag_healed_tokens_total {float(stats['healed_tokens'])}" in body
