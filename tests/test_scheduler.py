"""The engine's continuous-batching scheduler (`fusionrag_core.batching.scheduler`): answers served
together equal the serial engine's, each request keeps its own decoding state in a shared batch,
a consumer that stops reading frees its slot, limits refuse or queue as configured, and one
failing request fails alone.

The serial engine (`EngineConfig.scheduler=None`) over the same weights is the reference: greedy
answers must match it token for token and the first-token logits bit for bit (the prepare passes
are the same code; only decode steps are batched).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.prompts import ChatPromptTemplate

from fusionrag_core.batching.scheduler import SchedulerConfig
from fusionrag_core.engine import EngineConfig, FusionEngine, Generation
from fusionrag_core.errors import CacheMismatchError, InvalidRequestError, OverloadedError
from fusionrag_core.query.constrained import Grammar
from fusionrag_core.query.sampling import SamplingConfig
from fusionrag_core.runtime.kv import ChunkKV, KVBuffer
from fusionrag_core.store import DiskKVStore
from fusionrag_integrations.langchain import ChatFusionRAG, format_docs
from tests.scheduling import (
    BARRIER_S,
    Request,
    StepCounter,
    assert_same_answer,
    engine_like,
    idle,
    interleave,
    record_batches,
    reference_config,
    run_concurrently,
    use_scheduler,
)

CHUNKS = {
    "c0": "The Lumen lighthouse on Gull Point was designed by the engineer Ada Vell in 1891.",
    "c1": "Ada Vell was born in the port town of Marrow, where her father repaired ship clocks.",
    "c2": "Marrow lies at the mouth of the river Tell and is known for its salt market.",
    "c3": "Tessaly Instruments built the lighthouse clock; its founder was Oren Tessaly.",
    "c4": "The lamp room holds a brass lens ground in Harwick by Mina Ochre.",
    "c5": "Gull Point is reached by a causeway that floods twice a day.",
    "c6": "Oren Tessaly later moved his workshop to Harwick in 1903.",
    "c7": "The keeper's cottage was painted red after the storm of 1920.",
}
QUESTIONS = [
    "Who designed the Lumen lighthouse?",
    "Where was Ada Vell born?",
    "What is Marrow known for?",
    "Who founded Tessaly Instruments?",
    "Where was the brass lens ground?",
    "How do visitors reach Gull Point?",
    "When did Oren Tessaly move his workshop?",
    "What colour is the keeper's cottage?",
    "In which year was the lighthouse designed?",
    "What did Ada Vell's father repair?",
    "Which river flows past Marrow?",
    "Who built the lighthouse clock?",
    "Who ground the lens in the lamp room?",
    "How often does the causeway flood?",
    "Why was the cottage painted red?",
    "Name everyone mentioned in the passages.",
]
GREEDY = SamplingConfig(max_new_tokens=16)
JSON_SCHEMA = {
    "type": "object",
    "properties": {"designer": {"type": "string", "maxLength": 12}, "year": {"type": "integer"}},
    "required": ["designer", "year"],
    "additionalProperties": False,
}


def rag_requests(caches: Mapping[str, ChunkKV], sampling: SamplingConfig, n: int) -> list[Request]:
    """`n` distinct RAG requests: 2 or 3 distinct chunks each in varied order, the last chunk of
    every fourth one passed as plain text (no cache: prefilled), the others reused from `caches`."""
    ids = list(CHUNKS)
    requests = []
    for i in range(n):
        step = 1 + 2 * (i // len(ids) % 2)  # NOTE: coprime with 8: the picked chunks are distinct
        picked = [ids[(i + j * step) % len(ids)] for j in range(2 + i % 2)]
        if i % 3 == 0:
            picked.reverse()
        chunks: list[str | tuple[str, str]] = [(cid, CHUNKS[cid]) for cid in picked]
        if i % 4 == 3:
            chunks[-1] = CHUNKS[picked[-1]]
        requests.append(Request((QUESTIONS[i % len(QUESTIONS)], tuple(chunks)), sampling, caches))
    return requests


# ---- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_engine(default_engine: FusionEngine) -> FusionEngine:
    """The packaged SmolLM2 with the default scheduler (see `reference_config`)."""
    engine = engine_like(default_engine, SchedulerConfig())
    assert engine.scheduler is not None and engine.scheduler.config == SchedulerConfig()
    return engine


@pytest.fixture
def llama(llama_engine: FusionEngine, monkeypatch: pytest.MonkeyPatch) -> FusionEngine:
    """`llama_engine` with a fresh default scheduler for each test: a request one test leaves behind
    (say a failed test's stream, kept alive by its traceback) cannot run into the next test's counts."""
    use_scheduler(llama_engine, SchedulerConfig(), monkeypatch)
    return llama_engine


@pytest.fixture(scope="module")
def llama_serial(llama_engine: FusionEngine) -> FusionEngine:
    return engine_like(llama_engine, None)


@pytest.fixture(scope="module")
def llama_caches(llama_engine: FusionEngine) -> dict[str, ChunkKV]:
    return {cid: llama_engine.chunk_cache(text) for cid, text in CHUNKS.items()}


@pytest.fixture(scope="module")
def llama_requests(llama_caches: dict[str, ChunkKV]) -> list[Request]:
    return rag_requests(llama_caches, GREEDY, 16)


@pytest.fixture(scope="module")
def llama_references(llama_serial: FusionEngine, llama_requests: list[Request]) -> list[Generation]:
    """Each request's answer from the serial engine."""
    return [r.answer(llama_serial) for r in llama_requests]


# ---- 1. exactness under concurrency ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_llama_answers_under_concurrency_equal_the_serial_engine(
    llama: FusionEngine, llama_requests: list[Request], llama_references: list[Generation], concurrency: int
) -> None:
    assert len({r.prompt_args for r in llama_requests}) == len(llama_requests)  # distinct prompts
    assert len({tuple(g.token_ids) for g in llama_references}) > len(llama_references) // 2  # distinct answers
    counter = StepCounter(llama)
    answers = run_concurrently(lambda r: r.answer(llama), llama_requests, concurrency)
    for i, (got, want) in enumerate(zip(answers, llama_references, strict=True)):
        assert_same_answer(got, want, f"request {i} at concurrency {concurrency}", exact=concurrency == 1)
    assert sum(g.reused_tokens > 0 for g in answers) == len(answers)  # the chunk caches were stitched in
    assert counter.steps > 0
    if concurrency == 1:
        assert counter.rows == counter.steps  # one request at a time: every step has one row
        assert counter.mean_pack == 1.0
    if concurrency == 16:
        # NOTE: a scheduler that silently served one request at a time would give exactly 1.
        assert counter.mean_batch > 2, f"{counter.rows} rows in {counter.steps} steps"
        assert counter.mean_pack > 1.5, "arrivals of one round were not packed into one last pass"
    assert idle(llama)


# ---- 2. Gemma 3: sliding-window layers ---------------------------------------------------------------
LOG = " ".join(f"Entry {k}: the keeper logged a {d} wind at force {k % 9 + 1} and {k * 3} litres of lamp oil."
               for k, d in zip(range(30), ["north", "west", "south", "east", "calm"] * 6, strict=True))


@pytest.fixture(scope="module")
def gemma() -> FusionEngine:
    config = reference_config(EngineConfig(), SchedulerConfig())
    return FusionEngine.from_pretrained("gemma3-270m", device="cpu", dtype=torch.float32, config=config)


@pytest.fixture(scope="module")
def gemma_window(gemma: FusionEngine) -> int:
    """The sliding window of Gemma 3's local layers (its global layers have none)."""
    windows = {w for w in gemma.decoder.windows if w is not None}
    assert len(windows) == 1 and None in gemma.decoder.windows  # local and global layers
    return windows.pop()


@pytest.fixture(scope="module")
def gemma_cases(gemma: FusionEngine, gemma_window: int) -> tuple[list[Request], list[Generation]]:
    """Gemma requests (the first longer than its window) and their serial answers."""
    sampling = SamplingConfig(max_new_tokens=12)
    caches = {cid: gemma.chunk_cache(CHUNKS[cid]) for cid in ("c0", "c1", "c3")}
    half = len(LOG) // 2
    long = Request(("How much lamp oil was logged in entry 7?", (("log-a", LOG[:half]), LOG[half:])), sampling,
                   {"log-a": gemma.chunk_cache(LOG[:half])})
    requests = [long, *rag_requests(caches, sampling, 16)[:5]]
    # NOTE: `rag_requests` passes every chunk id; those without a cache here are prefilled (misses).
    assert gemma.prompt(*long.prompt_args).num_tokens > gemma_window
    serial = engine_like(gemma, None)
    return requests, [r.answer(serial) for r in requests]


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_gemma_sliding_window_answers_under_concurrency_equal_the_serial_engine(
    gemma: FusionEngine, gemma_window: int, gemma_cases: tuple[list[Request], list[Generation]], concurrency: int
) -> None:
    requests, references = gemma_cases
    # NOTE: 16 requests from 6 distinct prompts: duplicates in one batch must not share state either.
    order = [i % len(requests) for i in range(16 if concurrency == 16 else len(requests))]
    counter = StepCounter(gemma)
    answers = run_concurrently(lambda i: requests[i].answer(gemma), order, concurrency)
    for i, got in zip(order, answers, strict=True):
        assert_same_answer(got, references[i], f"gemma request {i} at concurrency {concurrency}",
                           exact=concurrency == 1)
    assert answers[0].prompt_tokens > gemma_window and answers[0].reused_tokens > 0
    if concurrency == 16:
        assert counter.mean_batch > 2, f"{counter.rows} rows in {counter.steps} steps"
        assert counter.mean_pack > 1.5, "arrivals of one round were not packed into one last pass"
    assert idle(gemma)


# ---- 3. asyncio ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_asyncio_gather_of_threads_equals_the_serial_engine(
    llama: FusionEngine, llama_requests: list[Request], llama_references: list[Generation]
) -> None:
    picked = [0, 5, 10, 15]

    async def ask_all() -> list[Generation]:
        return await asyncio.gather(*(asyncio.to_thread(llama_requests[i].answer, llama) for i in picked))

    counter = StepCounter(llama)
    answers = asyncio.run(ask_all())
    for i, got in zip(picked, answers, strict=True):
        assert_same_answer(got, llama_references[i], f"request {i}")
    assert counter.rows > counter.steps  # the threads' requests shared decode steps
    assert idle(llama)


@pytest.mark.slow
def test_langchain_abatch_equals_its_sync_path_on_the_serial_engine(
    llama: FusionEngine, llama_serial: FusionEngine, llama_caches: dict[str, ChunkKV], tmp_path: Path
) -> None:
    store = DiskKVStore(tmp_path / "kv", storage_dtype="float32")
    for cid, kv in llama_caches.items():
        store.put(cid, kv)
    template = ChatPromptTemplate.from_messages([("human", "Context:{context}Question: {question}")])
    docs = [Document(id=cid, page_content=text) for cid, text in CHUNKS.items()]
    inputs = [{"context": format_docs(docs[i:i + 3]), "question": QUESTIONS[i]} for i in range(4)]

    def chain(engine: FusionEngine) -> Any:
        return template | ChatFusionRAG(engine=engine, store=store, max_tokens=12, learn=False)

    async def batched() -> list[BaseMessage]:
        return await chain(llama).abatch(inputs)

    got = asyncio.run(batched())
    want = [chain(llama_serial).invoke(x) for x in inputs]
    for g, w in zip(got, want, strict=True):
        assert g.content == w.content and str(g.content).strip()
        assert g.response_metadata["completion_tokens"] == w.response_metadata["completion_tokens"]
        assert g.response_metadata["reused_tokens"] == w.response_metadata["reused_tokens"] > 0
    assert idle(llama)


# ---- 4. per-request decoding state in one batch ------------------------------------------------------
@pytest.mark.slow
def test_requests_with_different_sampling_in_one_batch_equal_their_serial_runs(
    llama: FusionEngine, llama_serial: FusionEngine, llama_requests: list[Request],
    llama_references: list[Generation], monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy = dataclasses.replace(llama_requests[0], sampling=SamplingConfig(max_new_tokens=24))
    sampled = dataclasses.replace(llama_requests[1], sampling=SamplingConfig(max_new_tokens=24, temperature=0.9,
                                                                             top_p=0.95, seed=11))
    # NOTE: the stop string is a word of the request's own greedy answer, so it does stop it
    stop_word = llama_references[2].text.split()[2]
    stop = dataclasses.replace(llama_requests[2], sampling=SamplingConfig(max_new_tokens=24, stop=(stop_word,)))
    grammar = dataclasses.replace(llama_requests[0], sampling=SamplingConfig(
        max_new_tokens=24, grammar=Grammar.json_schema(JSON_SCHEMA)))
    # NOTE: two requests sampling with one seed: a random state shared in the batch would split its draws
    # NOTE: the stop request ends after a few tokens: admitted last, it still shares a step with all
    requests = [greedy, sampled, grammar, sampled, stop]
    references = [r.answer(llama_serial) for r in requests]
    n = min(len(references[1].token_ids), len(llama_references[1].token_ids))
    assert references[1].token_ids[:n] != llama_references[1].token_ids[:n]  # it did sample (not the argmax)
    assert references[4].finish_reason == "stop" and stop_word not in references[4].text
    assert references[2].text.startswith("{") and references[2].text != references[0].text

    batches = record_batches(llama, monkeypatch)
    answers = interleave([r.stream(llama) for r in requests])
    labels = ("greedy", "sampled", "grammar", "sampled again", "stop")
    for label, got, want in zip(labels, answers, references, strict=True):
        assert_same_answer(got, want, label)
    assert max(batches.rows) == len(requests)  # all decoded in the same steps
    assert idle(llama)


# ---- 5. a consumer that stops reading ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("how", ["close", "del"])
def test_a_stream_closed_early_leaves_the_batch_and_the_others_finish(
    llama: FusionEngine, llama_serial: FusionEngine, llama_requests: list[Request], how: str
) -> None:
    assert llama.scheduler is not None
    quitter = dataclasses.replace(llama_requests[3], sampling=SamplingConfig(max_new_tokens=64))
    stayer = llama_requests[4]
    want = stayer.answer(llama_serial)
    stayer_bytes = llama.decoder.kv_bytes(llama.prompt(*stayer.prompt_args).num_tokens + stayer.sampling.max_new_tokens)

    abandoned = quitter.stream(llama)
    reader = iter(abandoned)
    assert isinstance(reader, Generator) and next(reader)
    kept = stayer.stream(llama)
    kept_reader = iter(kept)
    assert next(kept_reader)
    assert llama.scheduler.load["running"] == 2
    if how == "close":
        reader.close()  # NOTE: the stream object itself stays referenced, as after `for ...: break`
    else:
        del reader, abandoned
    # NOTE: the lead was free, so the closing consumer's hand-over dropped its request at once.
    assert llama.scheduler.load == {"running": 1, "waiting": 0, "kv_bytes": stayer_bytes}
    counter = StepCounter(llama)
    for _ in kept_reader:
        pass
    assert kept.result is not None
    assert_same_answer(kept.result, want, "the request that kept reading")
    assert counter.rows == counter.steps  # the abandoned request was never decoded again
    assert idle(llama)


def test_readers_hand_their_openmp_pools_back_between_rounds_only_when_another_may_lead(
    llama: FusionEngine, llama_requests: list[Request], pool_releases: list[str]
) -> None:
    llama_requests[0].answer(llama)
    # NOTE: alone, its caller leads every round and keeps its pool until it stops reading
    assert pool_releases == [threading.current_thread().name]
    pool_releases.clear()
    run_concurrently(lambda r: r.answer(llama), llama_requests[:4], 4)
    # NOTE: one pool per reader that ever led would put every parallel op to sleep
    assert len(pool_releases) > 4, "no leader handed its pool back between rounds"
    assert idle(llama)


# ---- 6. limits -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_request_over_the_kv_budget_alone_is_refused_and_one_that_fits_exactly_runs(
    llama: FusionEngine, llama_serial: FusionEngine, llama_requests: list[Request], monkeypatch: pytest.MonkeyPatch
) -> None:
    request = llama_requests[0]
    need = llama.decoder.kv_bytes(llama.prompt(*request.prompt_args).num_tokens + request.sampling.max_new_tokens)
    use_scheduler(llama, SchedulerConfig(kv_budget_bytes=need - 1), monkeypatch)
    stream = request.stream(llama)  # NOTE: lazy: the limit is checked when the stream is first read
    with pytest.raises(OverloadedError, match="kv_budget_bytes"):
        next(iter(stream))
    assert idle(llama)
    use_scheduler(llama, SchedulerConfig(kv_budget_bytes=need), monkeypatch)
    assert_same_answer(request.answer(llama), request.answer(llama_serial), "a request that fits exactly")
    assert idle(llama)


@pytest.mark.slow
def test_a_budget_for_one_request_serves_concurrent_requests_one_at_a_time(
    llama: FusionEngine, llama_serial: FusionEngine, llama_requests: list[Request], monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = llama_requests[4:8]
    sizes = [llama.decoder.kv_bytes(llama.prompt(*r.prompt_args).num_tokens + r.sampling.max_new_tokens)
             for r in requests]
    assert 2 * min(sizes) > max(sizes)  # the budget below fits any one of them, never two
    use_scheduler(llama, SchedulerConfig(kv_budget_bytes=max(sizes)), monkeypatch)
    batches = record_batches(llama, monkeypatch)
    answers = run_concurrently(lambda r: r.answer(llama), requests, len(requests))
    for i, (r, got) in enumerate(zip(requests, answers, strict=True)):
        assert_same_answer(got, r.answer(llama_serial), f"request {i}")
    assert batches.rows and set(batches.rows) == {1}
    assert max(batches.waiting) > 0  # the others did wait for the budget
    assert idle(llama)


@pytest.mark.slow
def test_max_running_caps_the_batch(
    llama: FusionEngine, llama_requests: list[Request], llama_references: list[Generation],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    use_scheduler(llama, SchedulerConfig(max_running=2), monkeypatch)
    batches = record_batches(llama, monkeypatch)
    answers = interleave([r.stream(llama) for r in llama_requests[8:12]])
    for i, got in enumerate(answers):
        assert_same_answer(got, llama_references[8 + i], f"request {8 + i}")
    assert max(batches.rows) == 2 and max(batches.waiting) > 0


class FirstLookupCaches(dict[str, ChunkKV]):
    """Chunk caches that call `on_first_lookup` at their first lookup, which the loop makes while
    preparing the request they belong to (its consumer, or another, leads the loop then)."""

    def __init__(self, caches: Mapping[str, ChunkKV], on_first_lookup: Callable[[], None]) -> None:
        super().__init__(caches)
        self._on_first_lookup: Callable[[], None] | None = on_first_lookup

    def __contains__(self, key: object) -> bool:
        if self._on_first_lookup is not None:
            call, self._on_first_lookup = self._on_first_lookup, None
            call()
        return super().__contains__(key)


@pytest.mark.slow
def test_a_prefill_budget_of_one_token_prepares_one_request_between_two_decode_steps(
    llama: FusionEngine, llama_requests: list[Request], llama_references: list[Generation],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prefill_tokens_per_step`: "prompt tokens prepared between two decode steps (at least one
    request)": with 1, a burst of arrivals is prepared one request per decode step, so the running
    requests' next token waits for at most one prefill."""
    use_scheduler(llama, SchedulerConfig(prefill_tokens_per_step=1), monkeypatch)
    events: list[str] = []  # NOTE: appended by the leading thread only: prepares and steps in order
    decode_batch = llama.decoder.decode_batch

    def logged_step(bufs: Sequence[KVBuffer], token_ids: torch.Tensor, slots: Sequence[torch.Tensor]) -> torch.Tensor:
        events.append(f"step of {len(bufs)}")
        return decode_batch(bufs, token_ids, slots)

    monkeypatch.setattr(llama.decoder, "decode_batch", logged_step)
    burst = [dataclasses.replace(r, caches=FirstLookupCaches(r.caches or {}, lambda: events.append("prepare")))
             for r in llama_requests[12:16]]
    answers = run_concurrently(lambda r: r.answer(llama), burst, len(burst))
    for i, got in enumerate(answers):
        assert_same_answer(got, llama_references[12 + i], f"request {12 + i}")
    assert events.count("prepare") == len(burst) and "step of 4" in events  # all four did run together
    # NOTE: on an idle engine the first admission's round ends without a step (its first token
    # waits for none), so the second request is prepared before the first step
    between = [e for e in " ".join(events).split("step of ") if "prepare" in e]
    assert between[0].count("prepare") <= 2 and all(e.count("prepare") == 1 for e in between[1:]), events


@pytest.mark.slow
def test_a_full_waiting_queue_refuses_one_more_and_serves_the_queued_ones(
    llama: FusionEngine, llama_requests: list[Request], llama_references: list[Generation],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = use_scheduler(llama, SchedulerConfig(max_waiting=2), monkeypatch)
    answers: dict[int, Generation] = {}
    refused: list[Exception] = []
    threads = [threading.Thread(target=lambda i=i: answers.update({i: llama_requests[i].answer(llama)}))
               for i in (1, 2)]
    submitted = threading.Semaphore(0)  # NOTE: released once by each of `threads` when its request is queued
    add = scheduler.add

    def counted_add(*args: Any, **kwargs: Any) -> Any:
        added = add(*args, **kwargs)
        if threading.current_thread() in threads:
            submitted.release()
        return added

    monkeypatch.setattr(scheduler, "add", counted_add)

    def fill_the_queue() -> None:
        """Runs while the leader prepares its own request: two requests queue, a third is refused."""
        for t in threads:
            t.start()
        for _ in threads:
            assert submitted.acquire(timeout=BARRIER_S)
        assert scheduler.load["waiting"] == 2
        with pytest.raises(OverloadedError, match="max_waiting") as refusal:
            llama_requests[3].answer(llama)  # NOTE: refused at submit, before it could wait for the lead
        refused.append(refusal.value)

    lead = llama_requests[0]
    holding = dataclasses.replace(lead, caches=FirstLookupCaches(lead.caches or {}, fill_the_queue))
    assert_same_answer(holding.answer(llama), llama_references[0], "the leader's request")
    assert len(refused) == 1
    for t in threads:
        t.join(BARRIER_S)
    for i in (1, 2):
        assert_same_answer(answers[i], llama_references[i], f"queued request {i}")
    assert idle(llama)


# ---- 7. failure isolation ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_request_failing_in_preparation_fails_alone(
    llama: FusionEngine, llama_serial: FusionEngine, llama_requests: list[Request],
    llama_references: list[Generation], llama_caches: dict[str, ChunkKV]
) -> None:
    good = llama_caches["c0"]
    alien = dataclasses.replace(good, fingerprint="0" * 32)  # computed by another model
    one_head = ChunkKV(good.token_ids, good.keys[:, :1].clone(), good.values[:, :1].clone(), good.positions,
                       good.fingerprint, good.variant)  # another model's shape
    assert "c0" in {c[0] for c in llama_requests[0].prompt_args[1] if isinstance(c, tuple)}
    bad = [(dataclasses.replace(llama_requests[0], caches={**llama_caches, "c0": alien}), "computed by model"),
           (dataclasses.replace(llama_requests[0], caches={**llama_caches, "c0": one_head}), "kv_heads")]
    for request, why in bad:  # NOTE: what the serial engine raises for them
        with pytest.raises(CacheMismatchError, match=why):
            request.answer(llama_serial)
    mixed = [llama_requests[5], bad[0][0], llama_requests[6], bad[1][0], llama_requests[7]]

    def outcome(r: Request) -> Generation | Exception:
        try:
            return r.answer(llama)
        except Exception as e:
            return e

    outcomes = run_concurrently(outcome, mixed, len(mixed))
    for i, out in zip((5, 6, 7), outcomes[0::2], strict=True):
        assert isinstance(out, Generation), out
        assert_same_answer(out, llama_references[i], f"good request {i}")
    for out, (_, why) in zip(outcomes[1::2], bad, strict=True):
        assert isinstance(out, CacheMismatchError) and why in str(out), out
    assert idle(llama)
    assert_same_answer(llama_requests[8].answer(llama), llama_references[8], "a request after the failures")


@pytest.mark.slow
def test_packed_passes_that_fail_fall_back_to_one_request_at_a_time(
    llama: FusionEngine, llama_requests: list[Request], llama_references: list[Generation],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A packed probe or last pass that fails (say out of memory) is reported, and its requests
    run their passes alone: every answer still equals the serial one."""
    probe_batch, prefill_batch = llama.decoder.probe_batch, llama.decoder.prefill_batch
    packed: list[str] = []

    def refuse_probes(bufs: Sequence[KVBuffer], *args: Any, **kwargs: Any) -> Any:
        if len(bufs) > 1:
            packed.append("probe")
            raise RuntimeError("out of memory (test)")
        return probe_batch(bufs, *args, **kwargs)

    def refuse_passes(bufs: Sequence[KVBuffer], *args: Any, **kwargs: Any) -> Any:
        if len(bufs) > 1:
            packed.append("pass")
            raise RuntimeError("out of memory (test)")
        return prefill_batch(bufs, *args, **kwargs)

    monkeypatch.setattr(llama.decoder, "probe_batch", refuse_probes)
    monkeypatch.setattr(llama.decoder, "prefill_batch", refuse_passes)
    answers = run_concurrently(lambda r: r.answer(llama), llama_requests[:8], 8)
    for i, got in enumerate(answers):
        assert_same_answer(got, llama_references[i], f"request {i}", exact=True)  # NOTE: every pass ran alone
    assert {"probe", "pass"} <= set(packed), "the requests were never packed: nothing was tested"
    assert "they probe one at a time" in caplog.text and "they run one at a time" in caplog.text
    assert idle(llama)


# ---- 8. configuration -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [
    ("max_running", 0), ("max_running", -1), ("max_waiting", -1), ("kv_budget_bytes", 0),
    ("kv_budget_bytes", -5), ("prefill_tokens_per_step", 0),
])
def test_invalid_scheduler_limits_are_refused(field: str, value: int) -> None:
    with pytest.raises(InvalidRequestError, match=f"SchedulerConfig.{field} must be >="):
        SchedulerConfig(**{field: value})


def test_valid_scheduler_limits_are_kept() -> None:
    config = SchedulerConfig(max_running=1, max_waiting=1, kv_budget_bytes=1, prefill_tokens_per_step=1)
    assert (config.max_running, config.max_waiting, config.kv_budget_bytes, config.prefill_tokens_per_step) == (
        1, 1, 1, 1)
    assert SchedulerConfig().kv_budget_bytes is None  # resolved from free memory by the engine


@pytest.mark.slow
def test_no_waiting_room_is_refused_or_still_serves_an_idle_engine(
    llama: FusionEngine, llama_requests: list[Request], llama_references: list[Generation],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """`max_waiting=0` is either refused as a limit, or means no queue behind the running requests
    (an idle engine still serves); never an engine that refuses every request."""
    try:
        config = SchedulerConfig(max_waiting=0)
    except InvalidRequestError:
        return  # NOTE: refused where it is configured: also a correct reading of the limit
    use_scheduler(llama, config, monkeypatch)
    assert idle(llama)
    assert_same_answer(llama_requests[0].answer(llama), llama_references[0], "max_waiting=0 on an idle engine")
