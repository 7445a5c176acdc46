"""Exact prefix reuse across requests (`EngineConfig.prefix_cache`): a conversation's follow-up
continues from the K/V its earlier turn computed.

What is proven: the cache finds the longest kept head by token blocks and never trusts a hash
alone; it stays within its byte budget; with `shared_documents`, a repeated prompt is answered
from its kept K/V with the first ask's first-token logits and a new question over the same
documents continues them; full attention continued from a kept exact head equals a
fresh full attention (logits within fp tolerance, greedy tokens equal), on Llama and on a
sliding-window Gemma 3; a FusionRAG follow-up continued from its first turn recomputes only chunk
tokens its first turn left as reused (how well it answers: tests/test_followup_quality.py); a full
recompute (ratio 1.0) continued equals full attention; every prompt token is still counted once; a
chunk whose stored cache changed since ends the continued head before it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerBase

import fusionrag_core.engine as engine_module
from fusionrag_core.batching.prefix_cache import KeptPrefix, PrefixCache, PrefixCacheConfig
from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.runtime.kv import KEEP_IN_PLACE_SHARE, ChunkKV, storage_bytes

DOCS = {
    "lumen": "The Lumen lighthouse on Gull Point was designed by the engineer Ada Vell in 1891. Its lamp is red.",
    "vell": "Ada Vell was born in the port town of Marrow, where her father repaired ship clocks for the fleet.",
    "marrow": "Marrow lies at the mouth of the river Tell and is known for its salt market and its pink salt.",
    "tell": "The river Tell froze twice in the nineteenth century, in 1830 and in 1891, closing the harbour.",
}
CONVERSATIONS = [
    (["lumen", "vell", "marrow"], "Who designed the Lumen lighthouse?", "Where was that person born?"),
    (["marrow", "tell", "lumen"], "What is Marrow known for?", "Which river flows there?"),
    (["tell", "lumen", "vell"], "When did the river Tell freeze?", "What else happened in 1891?"),
    (["vell", "marrow", "tell"], "What did Ada Vell's father repair?", "In which town did he work?"),
    (["marrow", "vell", "lumen"], "Who designed the Lumen lighthouse?", "Say more about it."),
    (["lumen", "tell", "marrow"], "What is Marrow known for?", "Say more about it."),
    (["vell", "lumen", "tell"], "When did the river Tell freeze?", "Say more about it."),
    (["tell", "marrow", "vell"], "What did Ada Vell's father repair?", "Say more about it."),
]
SAMPLING = SamplingConfig(max_new_tokens=12)


# ---- the cache itself ----------------------------------------------------------------------------
def _entry(ids: list[int], nbytes_per_token: int = 8, prompt: int = 4) -> KeptPrefix:
    T = len(ids)
    kv = torch.zeros(1, 1, T, nbytes_per_token // 8)  # fp32: 4 bytes, keys + values
    return KeptPrefix(token_ids=torch.tensor(ids), keys=kv, values=kv.clone(), inexact=torch.zeros(T, dtype=torch.bool),
                      drift=torch.zeros(T), runs=(), fingerprint="fp", prompt_tokens=prompt, exact_tokens=T,
                      selector="drift_aware", ratio=0.15)


def test_match_finds_the_longest_kept_head_and_compares_tokens() -> None:
    cache = PrefixCache(PrefixCacheConfig(block_tokens=4, min_tokens=4), "fp")
    cache.keep(_entry(list(range(20))))
    cache.keep(_entry(list(range(10)) + [99] * 10))
    found = cache.match(torch.tensor([*list(range(14)), 7, 7]), limit=15)
    assert found is not None and found[1] == 14  # past the last full block, within the first entry
    found = cache.match(torch.tensor([*list(range(10)), 99, 99, 5]), limit=12)
    assert found is not None and found[1] == 12  # the limit caps the head
    assert cache.match(torch.tensor([1, 2, 3, 4, 5]), limit=5) is None  # the first block differs
    cache.keep(_entry([9] * 16, prompt=12))
    found = cache.match(torch.tensor([9] * 11 + [1]), limit=12)  # inside the kept prompt: the shared head
    assert found is not None and found[1] == 11
    assert cache.match(torch.tensor([9] * 3 + [1]), limit=4) is None  # shorter than min_tokens
    assert cache.stats()["prefix_hits"] == cache.stats()["prefix_misses"] == 0  # the caller counts
    cache.served(11)
    cache.served(0)
    assert cache.stats()["prefix_hits"] == cache.stats()["prefix_misses"] == 1
    assert cache.stats()["prefix_hit_tokens"] == 11


def test_a_hash_never_decides_alone() -> None:
    """An entry whose block hashes point at it but whose tokens differ (a forged index) gives no match."""
    cache = PrefixCache(PrefixCacheConfig(block_tokens=4, min_tokens=4), "fp")
    cache.keep(_entry(list(range(8))))
    ((key, entry),) = cache._device.items()
    cache._device[key] = dataclasses.replace(entry, token_ids=torch.tensor([50] * 8))
    assert cache.match(torch.tensor(list(range(8))), limit=8) is None


def test_lru_eviction_keeps_the_budget_and_replaced_entries_go() -> None:
    one = _entry(list(range(16)), nbytes_per_token=64).nbytes
    room = one + one // 4  # a 16-token entry and a 20-token one, not three entries
    cache = PrefixCache(PrefixCacheConfig(max_bytes=2 * room, block_tokens=4, min_tokens=4), "fp")
    a, b, c = (_entry([k] * 4 + list(range(12)), 64) for k in (100, 200, 300))
    cache.keep(a)
    cache.keep(b)
    assert cache.match(a.token_ids, limit=16) is not None  # a is now the most recently used
    cache.keep(c)
    stats = cache.stats()
    assert stats["prefix_entries"] == 2 and stats["prefix_bytes"] <= 2 * room and stats["prefix_evictions"] == 1
    assert cache.match(b.token_ids, limit=16) is None and cache.match(a.token_ids, limit=16) is not None
    longer = _entry([*a.token_ids.tolist(), 5, 6, 7, 8], 64)
    cache.keep(longer, replaces=a)
    assert cache.stats()["prefix_entries"] == 2  # c and the continuation of a; a itself is gone
    with pytest.raises(InvalidRequestError, match="another model"):
        cache.keep(dataclasses.replace(longer, fingerprint="other"))


def test_the_device_tier_evicts_to_the_host_tier_and_a_match_brings_an_entry_back() -> None:
    one = _entry(list(range(16)), nbytes_per_token=64).nbytes
    cache = PrefixCache(PrefixCacheConfig(max_bytes=one, host_bytes=one, block_tokens=4, min_tokens=4), "fp")
    a, b, c = (_entry([k] * 4 + list(range(12)), 64) for k in (100, 200, 300))
    cache.keep(a)
    cache.keep(b)  # a moves to the host tier
    stats = cache.stats()
    assert (stats["prefix_entries"], stats["prefix_host_entries"], stats["prefix_demotions"]) == (1, 1, 1)
    cache.keep(c)  # b moves to the host tier, a is dropped
    assert cache.match(a.token_ids, limit=16) is None
    found = cache.match(b.token_ids, limit=16)  # back to the device tier; c goes to the host tier
    assert found is not None and found[1] == 16 and torch.equal(found[0].keys, b.keys)
    stats = cache.stats()
    assert (stats["prefix_promotions"], stats["prefix_demotions"], stats["prefix_evictions"]) == (1, 3, 1)
    assert stats["prefix_bytes"] <= one and stats["prefix_host_bytes"] <= one
    assert cache.match(c.token_ids, limit=16) is not None  # served from the host tier in its turn
    big = _entry([7] * 32, 64)  # larger than the device tier: kept on the host only, served from there
    roomy = PrefixCache(PrefixCacheConfig(max_bytes=one, host_bytes=4 * one, block_tokens=4, min_tokens=4), "fp")
    roomy.keep(a)
    roomy.keep(big)
    assert roomy.match(big.token_ids, limit=32) is not None and roomy.match(a.token_ids, limit=16) is not None
    stats = roomy.stats()
    assert (stats["prefix_entries"], stats["prefix_host_entries"], stats["prefix_evictions"]) == (1, 1, 0)
    assert stats["prefix_demotions"] == 1  # put on the host once; a match leaves it there, not moved again
    roomy.keep(_entry([8] * 96, 64))  # larger than both tiers: not kept
    assert roomy.stats()["prefix_evictions"] == 0 and roomy.match(torch.tensor([8] * 96), limit=96) is None


def test_a_kept_entry_counts_the_memory_it_holds_in_each_tier() -> None:
    """An entry that views a larger buffer (a finished request's, kept without a copy) counts that
    buffer; the host tier counts what the entry it holds holds (a compact copy from a GPU; on a CPU
    the entry itself), so the tiers' bytes add up."""
    buf = torch.zeros(1, 1, 20, 8)  # [L, H, S, D]: 16 tokens used of 20 slots
    view = dataclasses.replace(_entry(list(range(16)), 64), keys=buf[:, :, :16], values=buf.clone()[:, :, :16])
    assert view.nbytes == 2 * buf.nbytes
    assert view.to(torch.device("cpu"), pin=False) is view  # NOTE: already on the cpu: no copy
    cache = PrefixCache(PrefixCacheConfig(max_bytes=view.nbytes, host_bytes=4 * view.nbytes, block_tokens=4,
                                          min_tokens=4), "fp")
    cache.keep(view)
    cache.keep(_entry([5] * 16, 64))  # the view moves to the host tier
    stats = cache.stats()
    held = {tier: sum(e.nbytes for e in entries.values())
            for tier, entries in (("device", cache._device), ("host", cache._host))}
    assert (stats["prefix_bytes"], stats["prefix_host_bytes"]) == (held["device"], held["host"])


# ---- continuing requests -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(default_engine: FusionEngine) -> tuple[FusionEngine, FusionEngine]:
    """(an engine with a prefix cache of its own, one without), on the packaged SmolLM2."""
    kept = default_engine.with_config(dataclasses.replace(default_engine.config, prefix_cache=PrefixCacheConfig()))
    fresh = default_engine.with_config(dataclasses.replace(default_engine.config, prefix_cache=None))
    return kept, fresh


@pytest.fixture(scope="module")
def sharing(default_engine: FusionEngine) -> FusionEngine:
    """An engine whose prefix cache also continues shared documents and repeats (`shared_documents`)."""
    return default_engine.with_config(dataclasses.replace(
        default_engine.config, prefix_cache=PrefixCacheConfig(shared_documents=True)))


@pytest.fixture(scope="module")
def fused(default_engine: FusionEngine) -> dict[str, ChunkKV]:
    """Each document's cache fused after the others' independent caches."""
    alone = {k: default_engine.chunk_cache(text) for k, text in DOCS.items()}
    return {k: default_engine.chunk_cache(text, [alone[o] for o in DOCS if o != k]) for k, text in DOCS.items()}


def _turns(engine: FusionEngine, conversation: tuple[list[str], str, str],
           first: Generation | None) -> tuple[FusionPrompt, FusionPrompt | None]:
    names, question, follow_up = conversation
    context = "\n\n".join(DOCS[n] for n in names)
    messages = [{"role": "user", "content": f"Context:\n{context}\n\n{question}"}]
    documents = {n: DOCS[n] for n in names}
    one = engine.prompt_from_messages(messages, documents=documents)
    if first is None:
        return one, None
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": follow_up}]
    return one, engine.prompt_from_messages(messages, documents=documents)


def _first_turn(kept: FusionEngine, conversation: tuple[list[str], str, str],
                fused: dict[str, ChunkKV]) -> tuple[FusionPrompt, Generation, FusionPrompt]:
    """On an emptied prefix cache: the first turn's prompt, its FusionRAG answer, the follow-up's prompt."""
    kept.kept_prefixes.clear()  # type: ignore[union-attr]
    one, _ = _turns(kept, conversation, None)
    first = kept.generate(one, sampling=SAMPLING, caches=fused)
    _, two = _turns(kept, conversation, first)
    assert two is not None
    return one, first, two


def test_full_attention_continued_equals_full_attention(engines: tuple[FusionEngine, FusionEngine]) -> None:
    kept, fresh = engines
    kept.kept_prefixes.clear()  # type: ignore[union-attr]
    for conversation in CONVERSATIONS[:2]:
        one, _ = _turns(kept, conversation, None)
        first = kept.full_attention(one, sampling=SAMPLING).collect()
        _, two = _turns(kept, conversation, first)
        assert two is not None
        continued = kept.full_attention(two, sampling=SAMPLING).collect()
        reference = fresh.full_attention(two, sampling=SAMPLING).collect()
        assert continued.prefix_cached_tokens >= one.num_tokens  # the whole first turn, and its answer's head
        assert continued.token_ids == reference.token_ids
        torch.testing.assert_close(continued.first_token_logits, reference.first_token_logits, atol=1e-3, rtol=0)
        continued.token_partition()


def test_a_fusionrag_follow_up_continues_and_recomputes_less_than_a_fresh_one(
        engines: tuple[FusionEngine, FusionEngine], fused: dict[str, ChunkKV]) -> None:
    """How it is answered; how well (first-token KL against full attention, no worse than a fresh
    request's) is measured on the benchmark's shared-corpus rows: tests/test_followup_quality.py."""
    kept, fresh = engines
    kept.kept_prefixes.clear()  # type: ignore[union-attr]
    for conversation in CONVERSATIONS:
        one, _ = _turns(kept, conversation, None)
        first = kept.generate(one, sampling=SAMPLING, caches=fused)
        _, two = _turns(kept, conversation, first)
        assert two is not None
        continued = kept.generate(two, sampling=SAMPLING, caches=fused)
        again = fresh.generate(two, sampling=SAMPLING, caches=fused)
        assert continued.prefix_cached_tokens > again.prefix_cached_tokens  # it did continue the first turn
        assert continued.recomputed_tokens > 0  # the new question recomputed some kept chunk tokens
        # NOTE: its selection is a fresh request's budget; what the first turn recomputed is not again
        assert continued.recomputed_tokens < again.recomputed_tokens
        assert continued.prefilled_tokens < again.prefilled_tokens
        continued.token_partition()
    assert kept.stats()["prefix_hits"] >= len(CONVERSATIONS)


def test_a_finished_request_is_kept_in_its_own_buffer_unless_it_used_little_of_it(
        engines: tuple[FusionEngine, FusionEngine], fused: dict[str, ChunkKV]) -> None:
    """A finished request's K/V become its kept entry without a copy when they fill most of its
    memory; else (a generation budget it mostly did not use, a larger piece of reused memory) they
    are copied compact, so an entry never holds much more than its tokens."""
    kept, _ = engines
    cache = kept.kept_prefixes
    assert cache is not None
    for sampling in (SAMPLING, SamplingConfig(max_new_tokens=4096, stop=("\n",))):
        cache.clear()
        one, _ = _turns(kept, CONVERSATIONS[0], None)
        first = kept.generate(one, sampling=sampling, caches=fused)
        ((entry),) = cache._device.values()
        T = entry.num_tokens
        assert one.num_tokens < T <= one.num_tokens + len(first.token_ids)
        held = storage_bytes(entry.keys, entry.values)
        tokens = entry.keys.nbytes + entry.values.nbytes
        # NOTE: kept in place only when its tokens fill KEEP_IN_PLACE_SHARE of the memory; a compact
        # copy may round up to `KVMemory`'s granule (64 tokens of keys and values)
        granule = engine_memory_granule(kept)
        assert tokens <= held <= max(tokens / KEEP_IN_PLACE_SHARE, 1.25 * tokens + granule), (held, tokens)
        assert entry.nbytes == held and cache.stats()["prefix_bytes"] == entry.nbytes


def engine_memory_granule(engine: FusionEngine) -> int:
    memory = engine.decoder.memory
    assert memory is not None
    return memory.granule * 4  # NOTE: fp32 elements


def test_a_follow_up_recomputes_only_what_its_first_turn_did_not(
        engines: tuple[FusionEngine, FusionEngine], fused: dict[str, ChunkKV], monkeypatch: pytest.MonkeyPatch) -> None:
    """The follow-up's selection is ranked over every kept chunk token past the exact head; the
    tokens the first turn already recomputed count in it but are not computed again, and every
    token it recomputes was one the first turn left as reused."""
    kept, _ = engines
    one, _, two = _first_turn(kept, CONVERSATIONS[0], fused)
    found = kept.kept_prefixes.match(two.token_ids(), two.num_tokens - 1)  # type: ignore[union-attr]
    assert found is not None
    seen: list[torch.Tensor] = []
    sparse_pass = engine_module.sparse_pass
    monkeypatch.setattr(engine_module, "sparse_pass",
                        lambda st, selected: (seen.append(selected.cpu()), sparse_pass(st, selected))[1])
    continued = kept.generate(two, sampling=SAMPLING, caches=fused)
    (selected,) = seen
    assert selected.numel() == continued.recomputed_tokens > 0
    assert bool(found[0].inexact[selected].all())  # never a token the first turn recomputed
    budget = round(0.15 * sum(seg.num_tokens for seg in one.segments if seg.chunk_id))
    assert continued.recomputed_tokens < budget  # the first turn's share of the selection was skipped
    continued.token_partition()


def test_a_full_recompute_follow_up_equals_full_attention(
        engines: tuple[FusionEngine, FusionEngine], fused: dict[str, ChunkKV]) -> None:
    """Ratio 1.0 continues only the exact head (the kept question and answer attended to approximate
    chunk K/V), so it still equals a plain prefill."""
    kept, fresh = engines
    _, _, two = _first_turn(kept, CONVERSATIONS[1], fused)
    full = kept.generate(two, sampling=SAMPLING, caches=fused, ratio=1.0)
    reference = fresh.full_attention(two, sampling=SAMPLING).collect()
    assert full.token_ids == reference.token_ids
    torch.testing.assert_close(full.first_token_logits, reference.first_token_logits, atol=1e-3, rtol=0)
    full.token_partition()


def test_a_follow_up_from_the_host_tier_equals_one_from_the_device_tier(
        engines: tuple[FusionEngine, FusionEngine], fused: dict[str, ChunkKV], default_engine: FusionEngine) -> None:
    """An engine whose device tier holds nothing keeps every request in the host tier, and continues
    a follow-up from there exactly as from the device tier."""
    kept, _ = engines
    host = default_engine.with_config(dataclasses.replace(
        default_engine.config, prefix_cache=PrefixCacheConfig(max_bytes=0, host_bytes=1 << 30)))
    answers = []
    for engine in (kept, host):
        _, _, two = _first_turn(engine, CONVERSATIONS[0], fused)
        answers.append(engine.generate(two, sampling=SAMPLING, caches=fused))
    on_device, on_host = answers
    assert on_host.prefix_cached_tokens == on_device.prefix_cached_tokens > 0
    assert on_host.token_ids == on_device.token_ids
    torch.testing.assert_close(on_host.first_token_logits, on_device.first_token_logits, atol=1e-5, rtol=0)
    stats = host.stats()
    assert stats["prefix_promotions"] >= 1 and stats["prefix_entries"] == 0 and stats["prefix_host_entries"] >= 1
    on_host.token_partition()


def test_the_same_prompt_again_is_answered_from_its_kept_k_v(
        engines: tuple[FusionEngine, FusionEngine], sharing: FusionEngine, fused: dict[str, ChunkKV]) -> None:
    """A repeat with the same selection selects nothing anew: only its last token is computed, over
    the K/V its first ask left, so its first-token logits are the first ask's. Another ratio, or full
    attention, never reads that entry: each is answered as afresh; so is the repeat without
    `shared_documents`."""
    default, _ = engines
    default.kept_prefixes.clear()  # type: ignore[union-attr]
    one, _ = _turns(default, CONVERSATIONS[2], None)
    default.generate(one, sampling=SAMPLING, caches=fused)
    afresh = default.generate(one, sampling=SAMPLING, caches=fused)
    assert afresh.prefix_cached_tokens <= int(one.prefix.shape[0]) and afresh.recomputed_tokens > 0
    kept = sharing
    kept.kept_prefixes.clear()  # type: ignore[union-attr]
    first = kept.generate(one, sampling=SAMPLING, caches=fused)
    again = kept.generate(one, sampling=SAMPLING, caches=fused)
    assert (again.recomputed_tokens, again.prefilled_tokens) == (0, 1)
    assert again.prefix_cached_tokens + again.reused_tokens == one.num_tokens - 1
    assert again.token_ids == first.token_ids
    torch.testing.assert_close(again.first_token_logits, first.first_token_logits, atol=1e-4, rtol=0)
    again.token_partition()
    other = kept.generate(one, sampling=SAMPLING, caches=fused, ratio=0.3)
    full = kept.full_attention(one, sampling=SAMPLING).collect()
    for g in (other, full):
        assert g.prefix_cached_tokens <= int(one.prefix.shape[0])  # at most the memoised system prefix
        g.token_partition()
    assert full.prefilled_tokens + full.prefix_cached_tokens == one.num_tokens


def test_another_question_over_the_same_documents_continues_them(
        engines: tuple[FusionEngine, FusionEngine], sharing: FusionEngine, fused: dict[str, ChunkKV]) -> None:
    """The same system prompt and documents with a new question (`shared_documents`): the documents'
    K/V are continued (the first question's recompute settled), the new question is prefilled and
    selects its own."""
    _, fresh = engines
    kept = sharing
    kept.kept_prefixes.clear()  # type: ignore[union-attr]
    names, question, follow_up = CONVERSATIONS[0]
    one, _ = _turns(kept, (names, question, follow_up), None)
    kept.generate(one, sampling=SAMPLING, caches=fused)
    two, _ = _turns(kept, (names, follow_up, question), None)
    continued = kept.generate(two, sampling=SAMPLING, caches=fused)
    again = fresh.generate(two, sampling=SAMPLING, caches=fused)
    assert continued.prefix_cached_tokens > again.prefix_cached_tokens
    assert continued.prefilled_tokens == int(two.question.shape[0])
    assert 0 < continued.recomputed_tokens < again.recomputed_tokens
    continued.token_partition()


def test_a_changed_chunk_cache_ends_the_continued_head(
        engines: tuple[FusionEngine, FusionEngine], fused: dict[str, ChunkKV]) -> None:
    """The second document was re-fused (another neighbour digest) after the first turn: the
    follow-up continues only up to where that chunk starts, and reuses the new cache."""
    kept, _ = engines
    one, _, two = _first_turn(kept, CONVERSATIONS[0], fused)
    refused = dict(fused, vell=dataclasses.replace(fused["vell"], fused_after="re-fused"))
    continued = kept.generate(two, sampling=SAMPLING, caches=refused)
    start = int(one.prefix.shape[0]) + one.segments[0].num_tokens  # where the "vell" chunk starts
    assert one.segments[1].chunk_id == "vell"
    assert continued.prefix_cached_tokens + continued.reused_tokens + continued.recomputed_tokens > 0
    assert continued.prefix_cached_tokens <= start
    assert continued.cache_variants.get("fused", 0) >= 2  # "vell" and what follows came from the caches
    continued.token_partition()


@pytest.mark.parametrize("window", [8])
def test_sliding_window_model_continues_exactly(smollm_tokenizer: PreTrainedTokenizerBase, window: int) -> None:
    """Gemma 3 with a window far shorter than the prompt: full attention continued equals a fresh one."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                              max_position_embeddings=2048,
                              layer_types=["sliding_attention", "full_attention"] * 2)
    engine = FusionEngine(Gemma3ForCausalLM(config).eval(), smollm_tokenizer, name="tiny-gemma3")
    fresh = engine.with_config(dataclasses.replace(engine.config, prefix_cache=None))
    first = engine.prompt("What is kept?", chunks=list(DOCS.values())[:2])
    answer = engine.full_attention(first, sampling=SAMPLING).collect()
    follow = FusionPrompt(first.prefix, first.segments,
                          torch.cat([first.question, torch.tensor(answer.token_ids), first.question]))
    continued = engine.full_attention(follow, sampling=SAMPLING).collect()
    reference = fresh.full_attention(follow, sampling=SAMPLING).collect()
    assert continued.prefix_cached_tokens >= first.num_tokens
    assert continued.token_ids == reference.token_ids
    torch.testing.assert_close(continued.first_token_logits, reference.first_token_logits, atol=1e-4, rtol=0)


# ---- through the integrations --------------------------------------------------------------------
def test_a_chat_follow_up_continues_its_first_turn_in_both_frameworks(
        engines: tuple[FusionEngine, FusionEngine]) -> None:
    """LangChain's and LlamaIndex's chat models send the whole conversation each turn; the second
    turn continues the first's K/V (reported as cached prompt tokens) without any option."""
    from langchain_core.messages import AIMessage, HumanMessage
    from llama_index.core.llms import ChatMessage

    from fusionrag_integrations.langchain import ChatFusionRAG
    from fusionrag_integrations.llama_index import FusionRAGLLM

    kept, _ = engines
    kept.kept_prefixes.clear()  # type: ignore[union-attr]
    context = "\n\n".join(DOCS.values())
    first_question = f"Context:\n{context}\n\nWho designed the Lumen lighthouse?"
    chat = ChatFusionRAG(engine=kept, max_tokens=8, learn=False)
    first = chat.invoke([HumanMessage(first_question)])
    second = chat.invoke([HumanMessage(first_question), AIMessage(str(first.content)),
                          HumanMessage("Where was that person born?")])
    assert first.usage_metadata is not None and second.usage_metadata is not None
    first_prompt = first.usage_metadata["input_tokens"]
    assert second.response_metadata["prefix_cached_tokens"] >= first_prompt
    llm = FusionRAGLLM(engine=kept, max_new_tokens=8, learn=False)
    one = llm.chat([ChatMessage(role="user", content=first_question + " Answer briefly.")])
    two = llm.chat([ChatMessage(role="user", content=first_question + " Answer briefly."),
                    ChatMessage(role="assistant", content=str(one.message.content)),
                    ChatMessage(role="user", content="Where was that person born?")])
    assert two.raw["prefix_cached_tokens"] >= one.raw["prompt_tokens"]
