"""A request's phases, each a function of the `Request` (and of what every request shares).

    stitch ─► probe ─► select ─► recompute ─► start_decoding ─► decode_step... ─► keep

`stitch`, `select`, `start_decoding` and `keep` take one request; `probe`, `recompute` and
`decode_step` take several, whose rows run as one pass (`Decoder.probe_batch`, `prefill_batch`,
`decode_batch`): at a few dozen rows per request a pass is far from the cores' rate, so packing
requests is nearly free (`benchmarks/pass_packing.py`). Each phase moves its requests on
(`Request.enter`); the runner decides what to do when one fails (`batching.runner`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.batching.answer_heal import AnswerHeal
from fusionrag_core.batching.continuation import (
    continued_head,
    exact_head,
    exactly_continued,
    head_cache,
    kept_from,
    kept_layout,
    reopen,
    rest_of,
    settle,
)
from fusionrag_core.batching.heal import Healer, healed_head
from fusionrag_core.batching.prefix_cache import KeptPrefix, PrefixCache
from fusionrag_core.batching.request import Phase, Request
from fusionrag_core.batching.system_prefixes import SystemPrefixes
from fusionrag_core.query.decoding import Decoding
from fusionrag_core.query.probe import run_probes
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.recompute import run_passes, sparse_pass
from fusionrag_core.query.sampling import Sampler, TextAssembler
from fusionrag_core.query.select import probe_for
from fusionrag_core.query.stitch import CacheLookup, Stitched, prefetch, stitch
from fusionrag_core.runtime.decoder import Decoder
from fusionrag_core.scope import OPERATOR


@dataclass(frozen=True)
class Shared:
    """What every request's phases share: the model's passes and the engine's caches.

    Attributes:
        decoder: the model passes.
        tokenizer: detokenizes answers.
        fingerprint: the model's (stamped on kept prefixes).
        system_prefixes: the memo of computed system prefixes.
        prefix_cache: finished requests' K/V for later prompts (None: off).
        loader: threads that load a request's chunk caches concurrently.
        canonical_prefix: `[P]` the system prefix chunk caches are computed after.
        healer: heals kept requests while the engine is idle (None: off; `batching.heal`).
    """

    decoder: Decoder
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str
    system_prefixes: SystemPrefixes
    prefix_cache: PrefixCache | None
    loader: Executor
    canonical_prefix: torch.Tensor
    healer: Healer | None = None


# ---- stitch --------------------------------------------------------------------------------------------
def stitch_request(request: Request, shared: Shared) -> None:
    """Lay the request out in its buffer: a kept prefix continued, the system prefix, the chunk caches
    re-rotated after them; set its selection budget and the probe its selector reads."""
    plain = request.full_attention
    selection = request.selection
    # NOTE: a full recompute (and full attention) must equal a plain prefill, so it continues only exact
    # K/V: a kept turn's question and answer attended to the approximate chunk K/V of its time
    exact_only, chosen = plain or selection.recomputes_everything, (selection.name, selection.ratio)
    request.relayout(kept_layout(shared.prefix_cache, request.prompt, exact_only=exact_only,
                                 selection=chosen, scope=request.scope))
    # NOTE: a local: `request.lookup` stays the request's own (its loads and fallbacks are read at the end)
    lookup = request.lookup if plain else prefetch(
        request.prompt, request.lookup, shared.loader, inline=request.in_memory,
        after=exactly_continued(shared.prefix_cache, request.prompt, scope=request.scope))
    kept, n, repeat = continued_head(shared.prefix_cache, request.prompt, lookup, exact_only=exact_only,
                                     selection=chosen, scope=request.scope)
    if kept is not None:
        st, budget_base = _stitch_continued(request, shared, lookup, kept, n)
        request.continued = kept if n == kept.num_tokens else None
    elif not plain:
        st, budget_base = _stitch_fresh(request, shared, lookup)
    else:
        st, budget_base = _stitch_plain(request, shared)
    request.stitched = st
    request.forced_prefilled = not plain or kept is not None
    request.budget = 0 if repeat else min(selection.config.budget(budget_base), st.num_reused_tokens)
    request.probe = probe_for(selection.name, st, request.budget, selection.config)
    request.enter(Phase.STITCHED)


def _stitch_continued(request: Request, shared: Shared, lookup: CacheLookup, kept: KeptPrefix,
                      n: int) -> tuple[Stitched, int]:
    """Stitch after the first `n` tokens of a kept prefix; returns the buffer and the budget's base."""
    prompt = request.prompt
    request.continued_runs = tuple(dataclasses.replace(r, end=min(r.end, n)) for r in kept.runs if r.start < n)
    if request.full_attention:
        ids = prompt.token_ids()
        request.stitched_prompt = FusionPrompt(ids[:n], (), ids[n:])
    else:
        request.stitched_prompt = rest_of(prompt, n)
    st = stitch(shared.decoder, request.stitched_prompt, head_cache(kept, n), lookup,
                extra_capacity=request.sampling.max_new_tokens)
    reopened = reopen(st, kept, n)
    request.account.prefilled = int(request.stitched_prompt.question.shape[0])
    request.account.prefix_cached = n - reopened
    request.exact_base = min(n, kept.exact_tokens)
    request.healed_head = healed_head(kept, n)
    # NOTE: the new question gets the recompute budget a fresh request would: a share of every
    # reused chunk token (those of the exact head are no candidates)
    chunk_tokens = sum(r.end - r.start for r in request.continued_runs)
    return st, st.num_reused_tokens + max(0, chunk_tokens - reopened)


def _stitch_fresh(request: Request, shared: Shared, lookup: CacheLookup) -> tuple[Stitched, int]:
    """Stitch after the system prefix (memoised, or computed now)."""
    prompt = request.stitched_prompt = request.prompt
    canonical = torch.equal(prompt.prefix.cpu(), shared.canonical_prefix)
    # NOTE: the prefix chunk caches are computed after is the operator's, shared by every scope; any
    # other one a request brought is memoised for its own scope only
    prefix, memoised = shared.system_prefixes.get(prompt.prefix, OPERATOR if canonical else request.scope)
    P = int(prompt.prefix.shape[0])
    # NOTE: the prefix is either served from memory or computed now: in one count, never both
    request.account.system_prefix = P if memoised else 0
    request.account.prefilled = int(prompt.question.shape[0]) + P - request.account.system_prefix
    st = stitch(shared.decoder, prompt, prefix, lookup, extra_capacity=request.sampling.max_new_tokens,
                exact_prefix=canonical)
    request.exact_base = P
    if st.exact_slots.numel() and int(st.exact_slots[0]) == request.exact_base:
        request.exact_base += int(st.exact_slots.shape[0])
    return st, st.num_reused_tokens


def _stitch_plain(request: Request, shared: Shared) -> tuple[Stitched, int]:
    """Full attention: every token, the prefix included, is computed in one causal pass."""
    prompt = request.prompt
    request.stitched_prompt = FusionPrompt(prompt.prefix[:0], (), prompt.token_ids())
    st = stitch(shared.decoder, request.stitched_prompt, None, request.lookup,
                extra_capacity=request.sampling.max_new_tokens)
    request.account.prefilled = prompt.num_tokens
    return st, 0


# ---- probe, select, recompute ---------------------------------------------------------------------------
def probe(requests: Sequence[Request]) -> None:
    """Run the stitched requests' probes as one pass per set of probe layers (`run_probes`); their
    selectors read the masses it leaves."""
    run_probes([r.probe for r in requests if r.probe is not None])
    for r in requests:
        r.enter(Phase.PROBED)


def skip_probe(request: Request) -> None:
    """A request probed on its own: its selector runs its probe itself (`query.probe.masses`)."""
    request.enter(Phase.PROBED)


def select(request: Request) -> None:
    """Choose the chunk tokens to recompute and build the request's last pass (those tokens and the
    question)."""
    st = request.stitched_buffer()
    selection = request.selection
    selected = selection.fn(st, request.budget, selection.config)
    # NOTE: the new question's selection is a fresh request's; what an earlier one already
    # recomputed is continued as kept, and only the rest of it is computed now
    selected, settled = settle(st, selected)
    request.selected = selected  # [K]
    request.last_pass = sparse_pass(st, selected)
    num_selected = int(selected.shape[0])
    account = request.account
    if request.forced_prefilled:
        account.prefilled += request.last_pass.recomputed - num_selected  # NOTE: chunks without a cache
    account.prefix_cached += settled
    account.recomputed = num_selected
    account.reused = st.num_reused_tokens - num_selected
    request.enter(Phase.SELECTED)


def recompute(requests: Sequence[Request], decoder: Decoder) -> None:
    """Run the requests' last passes as one; each gets its first generated position's logits `[V]`."""
    passes = [r.last_pass for r in requests]
    assert all(p is not None for p in passes), "recompute before select"
    logits = run_passes(decoder, [p for p in passes if p is not None])  # [B, V]
    for r, first in zip(requests, logits, strict=True):
        r.first_logits = first
        r.enter(Phase.RECOMPUTED)


# ---- fork ------------------------------------------------------------------------------------------------
def fork(request: Request, parent: Request, shared: Shared) -> None:
    """Give a fork its parent's computed prompt: a copy of the buffer (each choice appends its own
    tokens), the same accounting and first logits; it then decodes with its own sampling."""
    request.relayout(parent.prompt)  # NOTE: the layout the parent chose (`kept_layout`)
    st = parent.stitched_buffer()
    assert parent.phase is Phase.RECOMPUTED and parent.first_logits is not None, "fork before the parent's recompute"
    buf = shared.decoder.new_buffer(st.buf.capacity)
    st.buf.copy_to(buf)
    request.stitched = dataclasses.replace(st, buf=buf, missed=[])
    request.stitched_prompt = parent.stitched_prompt
    request.account = dataclasses.replace(parent.account)
    request.selected = parent.selected
    request.first_logits = parent.first_logits
    request.enter(Phase.FORKED)


# ---- decode ----------------------------------------------------------------------------------------------
def start_decoding(request: Request, shared: Shared) -> None:
    """Pick the first token; the request decodes on, or has finished already."""
    prompt, st, first = request.prompt, request.stitched_buffer(), request.first_logits
    assert first is not None, "start_decoding before recompute"
    eos_ids = set(request.eos_ids)
    sampler = Sampler(request.sampling, prompt.token_ids(), tokenizer=shared.tokenizer, eos_ids=eos_ids)
    request.decoding = Decoding(st.buf, prompt.num_tokens, sampler,
                                TextAssembler(shared.tokenizer, request.sampling.stop),
                                request.sampling.max_new_tokens, eos_ids)
    request.output.put(request.decoding.start(first))
    request.enter(Phase.FINISHED if request.decoding.finished else Phase.DECODING)
    if request.heal_answer and shared.healer is not None and request.selected is not None:
        exact = exact_head(st, request.selected, request.exact_base)
        if exact < st.buf.length:
            request.answer_heal = AnswerHeal(exact, exact, shared.healer.config.piece_tokens)


def decode_step(requests: Sequence[Request], decoder: Decoder) -> torch.Tensor:
    """Feed each decoding request its last token in one batched step; returns the logits `[B, V]`
    (each request picks from its own row: `advance`)."""
    decodings = [r.decoding for r in requests]
    assert all(d is not None for d in decodings), "decode_step on a request that is not decoding"
    inputs = [d.next_input() for d in decodings if d is not None]
    tokens = torch.tensor([tok for tok, _ in inputs], device=decoder.device)  # [B]
    return decoder.decode_batch([d.buf for d in decodings if d is not None], tokens,
                                [slot for _, slot in inputs])  # [B, V]


def advance(request: Request, logits: torch.Tensor) -> None:
    """Pick the request's next token from its `[V]` logits and stream its text."""
    assert request.decoding is not None
    request.output.put(request.decoding.advance(logits))
    if request.decoding.finished:
        request.enter(Phase.FINISHED)


# ---- keep ------------------------------------------------------------------------------------------------
def keep(request: Request, shared: Shared) -> None:
    """After the answer: learn the chunks that had no cache (when asked), and keep the request's K/V
    for later prompts (when the engine keeps them). Runs on the consumer's side, never delaying a step."""
    if request.forked:
        return  # NOTE: its parent, the same prompt, is kept and learned from
    st, decoding = request.stitched_buffer(), request.decoding
    assert decoding is not None and request.selected is not None and request.stitched_prompt is not None
    if request.learn is not None and st.missed:
        request.learn(request.stitched_prompt, st)
    if shared.prefix_cache is not None:
        exact_base, healed = request.exact_base, request.healed_head
        if request.answer_heal is not None:  # NOTE: its own healing grew the exact head
            exact_base = max(exact_base, request.answer_heal.exact)
            healed = request.answer_heal.healed_slots(st.buf.length, healed)
        kept = kept_from(st, request.selected, decoding.ids, shared.fingerprint, request.continued_runs,
                         exact_base, (request.selection.name, request.selection.ratio), healed, request.scope)
        shared.prefix_cache.keep(kept, replaces=request.continued)
        request.enter(Phase.KEPT)


__all__ = ["Shared", "advance", "decode_step", "fork", "keep", "probe", "recompute", "select", "skip_probe",
           "start_decoding", "stitch_request"]
