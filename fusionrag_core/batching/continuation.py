"""Continuing a prompt from a kept prefix (`prefix_cache`), and keeping a finished request's K/V.

A request whose prompt starts with `n` kept tokens is stitched as the prompt `rest_of(prompt, n)`:
those tokens are its prefix, their K/V copied from the kept entry at the positions they had, the
rest laid out as usual (chunk caches re-rotated after them). The kept chunk tokens outside its exact
head become reusable slots again (`reopen`), so the new question's selection ranks them exactly as
it would chunk tokens loaded from the store. Those an earlier question already recomputed are
settled: a partial recompute counts them in its selection but does not compute them again
(`settle`), so a follow-up recomputes only what its own question needs beyond what the
conversation already did.
"""

from __future__ import annotations

import torch

from fusionrag_core.batching.prefix_cache import KeptPrefix, PrefixCache, ReusedRun
from fusionrag_core.query.prompt import FusionPrompt, Segment
from fusionrag_core.query.stitch import CacheLookup, Stitched
from fusionrag_core.runtime.kv import ChunkKV
from fusionrag_core.scope import OPERATOR, Scope


def continued_head(cache: PrefixCache | None, prompt: FusionPrompt, lookup: CacheLookup, *, exact_only: bool,
                   selection: tuple[str, float | None], scope: Scope = OPERATOR) -> tuple[KeptPrefix | None, int, bool]:
    """The kept prefix `prompt` continues, how many of its tokens (all but the last at most;
    `exact_only`: within the entry's exact head), and whether the prompt repeats the entry's own;
    or (None, 0, False). Only an entry of the request's `scope` is continued.

    A later turn (the prompt holds the entry's whole prompt) continues all it shares. Any other
    prompt continues only with `PrefixCacheConfig.shared_documents`, and only an entry its own
    `selection` (selector, ratio) computed, so a method compared with another on one prompt never
    reads the other's K/V: the same prompt again is answered from the K/V as kept (that selection
    computed them for this very question, so nothing is selected anew: the first time's
    first-token logits); a prompt sharing the entry's documents, maybe part of its question,
    continues up to its own question, which its selection reads whole, as a fresh request's does.
    """
    if cache is None:
        return None, 0, False
    kept, n, repeat = _head(cache, prompt, lookup, exact_only=exact_only, selection=selection, scope=scope)
    cache.served(n)
    return kept, n, repeat


def exactly_continued(cache: PrefixCache | None, prompt: FusionPrompt, *, scope: Scope = OPERATOR) -> int:
    """How many leading tokens of `prompt` a kept entry would continue exactly (0: none): the chunks
    there need no cache (`verified_head` looks none of them up), so none is loaded for them."""
    if cache is None:
        return 0
    return _head(cache, prompt, None, exact_only=True, selection=("", None), scope=scope)[1]


def kept_layout(cache: PrefixCache | None, prompt: FusionPrompt, *, exact_only: bool,
                selection: tuple[str, float | None], scope: Scope = OPERATOR) -> FusionPrompt:
    """`prompt`, or its layout without learned caches (`FusionPrompt.unlearned`) where a kept entry
    continues that one further and leaves no more to compute than `prompt`'s question.

    NOTE: a learned piece is tokenized on its own, so a prompt that reads it parts at the piece from
    the K/V kept by the request that learned it (which read the piece as plain text). The same prompt
    asked again, or a later turn of its conversation, would otherwise continue the exact K/V kept
    only up to the piece and read approximate ones after it. The other layout never computes more
    tokens than `prompt`'s question, which a request continuing `prompt` computes anyway.
    """
    other = prompt.unlearned
    if cache is None or other is None:
        return prompt
    # NOTE: no cache is loaded to choose (no lookup): a kept run whose stored cache changed shortens
    # the head `continued_head` then continues, as it would have for either layout
    theirs, ours = (_head(cache, p, None, exact_only=exact_only, selection=selection, scope=scope)[1]
                    for p in (other, prompt))
    if theirs > ours and other.num_tokens - theirs <= int(prompt.question.shape[0]):
        return other
    return prompt


def _head(cache: PrefixCache, prompt: FusionPrompt, lookup: CacheLookup | None, *, exact_only: bool,
          selection: tuple[str, float | None], scope: Scope) -> tuple[KeptPrefix | None, int, bool]:
    """`continued_head`, counting nothing served; without `lookup`, the kept runs are not verified."""
    found = cache.match(prompt.token_ids(), prompt.num_tokens - 1, scope)
    kept, n = found if found is not None else (None, 0)
    repeat = False
    if kept is not None:
        if exact_only:
            n = min(n, kept.exact_tokens)
        elif lookup is not None:
            n = verified_head(prompt, kept, n, lookup)
        if n < kept.prompt_tokens:
            same = (cache.config.shared_documents and not exact_only
                    and (kept.selector, kept.ratio) == selection)
            repeat = same and n == prompt.num_tokens - 1 == kept.prompt_tokens - 1
            if not repeat:
                n = min(n, prompt.num_tokens - int(prompt.question.shape[0])) if same else 0
        # NOTE: a head within the system prefix is the memoised prefix's to serve (with the exact
        # first chunk after it); a kept entry is continued for shared documents or earlier turns
        if n < cache.config.min_tokens or (n <= int(prompt.prefix.shape[0]) and n < kept.prompt_tokens):
            kept, n, repeat = None, 0, False
    return kept, n, repeat


def verified_head(prompt: FusionPrompt, kept: KeptPrefix, n: int, lookup: CacheLookup) -> int:
    """How many of the `n` matched tokens may be continued: up to the first chunk the kept K/V reused
    whose stored cache is not the one this prompt would reuse now (re-fused, deleted, or the chunk is
    no longer found there), so a corpus update never serves a stale prefix. A chunk within the
    entry's exact head is not looked up: its K/V were computed afresh (recomputed or healed), so
    they depend on the matched tokens alone, whatever cache they were first read from."""
    starts = _segment_starts(prompt)
    for run in kept.runs:
        if run.start >= n:
            break
        if run.end <= kept.exact_tokens:
            continue
        i = next((i for i, seg in enumerate(prompt.segments)
                  if seg.chunk_id == run.chunk_id and starts[i] == run.start), None)
        found = lookup(run.chunk_id, i == 0) if i is not None else None
        if not (isinstance(found, ChunkKV) and found.variant == run.variant and found.fused_after == run.fused_after):
            return run.start
    return n


def rest_of(prompt: FusionPrompt, n: int) -> FusionPrompt:
    """`prompt` with its first `n` tokens (fewer than all) as the prefix: the segments after them, the
    one they cut kept as plain text from the cut on, and the question's tokens after them.

    NOTE: a conversation's layout puts every turn after the last chunk in the question; a kept
    prefix covers the earlier turns, and the question left is the new turn: what the query-guided
    selection should read.
    """
    ids = prompt.token_ids()
    if not 0 <= n < prompt.num_tokens:
        raise ValueError(f"a kept head of {n} tokens must leave some of the {prompt.num_tokens} prompt tokens")
    starts = _segment_starts(prompt)
    segments: list[Segment] = []
    for seg, start in zip(prompt.segments, starts, strict=True):
        end = start + seg.num_tokens
        if end <= n:
            continue
        if start >= n:
            segments.append(seg)
        else:  # NOTE: the chunk's head is kept; its tail is computed like any text
            segments.append(Segment("text", seg.token_ids[n - start:]))
    P = int(prompt.prefix.shape[0])
    if n < P:  # NOTE: an earlier, shorter conversation ends inside this prompt's system prefix
        segments.insert(0, Segment("text", prompt.prefix[n:]))
    q_start = prompt.num_tokens - int(prompt.question.shape[0])
    return FusionPrompt(ids[:n], tuple(segments), prompt.question[max(0, n - q_start):], prompt.metadata)


def head_cache(kept: KeptPrefix, n: int) -> ChunkKV:
    """The kept K/V of the first `n` tokens as a prefix cache (positions `0..n-1`, as kept)."""
    return ChunkKV(token_ids=kept.token_ids[:n], keys=kept.keys[:, :, :n], values=kept.values[:, :, :n],
                   positions=torch.arange(n), fingerprint=kept.fingerprint, variant="independent")


def reopen(st: Stitched, kept: KeptPrefix, n: int) -> int:
    """Make the kept chunk tokens among the first `n`, past the entry's exact head, reusable slots of
    `st` (in slot order, before the chunks stitched after them); returns how many there are.

    Those an earlier request recomputed (chunk tokens no longer `inexact`) are also recorded in
    `st.settled_slots`: their K/V are what a fresh request's recompute would compute there, up to
    the approximate K/V they attended to.
    """
    in_runs = torch.zeros(n, dtype=torch.bool)
    for run in kept.runs:
        in_runs[max(run.start, kept.exact_tokens):min(run.end, n)] = True
    inexact = kept.inexact[:n]
    runs = _runs(in_runs | inexact)
    device = st.buf.keys.device
    slots = [torch.arange(a, b, device=device) for a, b in runs]
    drifts = [None if bool(torch.isnan(kept.drift[a:b]).any()) else kept.drift[a:b].to(device) for a, b in runs]
    st.chunk_slots[:0] = slots
    st.chunk_drift[:0] = drifts
    st.chunk_sources[:0] = [None] * len(runs)
    st.settled_slots = torch.nonzero(in_runs & ~inexact).flatten().to(device)  # [S]
    return sum(b - a for a, b in runs)


def settle(st: Stitched, selected: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`selected` without the settled slots, which stop being reusable slots of `st` (their K/V stay
    as kept); returns it and how many settled slots there were.

    NOTE: a full recompute (ratio 1.0) continues only a kept entry's exact head, which has no
    settled slots, so it stays equal to a plain prefill.
    """
    settled = st.settled_slots
    if settled.numel() == 0:
        return selected, 0
    slots: list[torch.Tensor] = []
    drifts: list[torch.Tensor | None] = []
    sources: list[tuple[str, str, str] | None] = []
    for s, d, source in zip(st.chunk_slots, st.chunk_drift, st.chunk_sources, strict=True):
        keep = ~torch.isin(s, settled)
        if bool(keep.any()):  # NOTE: a run left with no slot is no reused chunk any more
            slots.append(s[keep])
            drifts.append(None if d is None else d[keep])
            sources.append(source)
    st.chunk_slots, st.chunk_drift, st.chunk_sources = slots, drifts, sources
    st.settled_slots = settled[:0]
    return selected[~torch.isin(selected, settled.to(selected.device))], int(settled.shape[0])


def kept_from(st: Stitched, selected: torch.Tensor, answer_ids: list[int], fingerprint: str,
              kept_runs: tuple[ReusedRun, ...], exact_base: int, selection: tuple[str, float | None],
              healed: torch.Tensor | None = None, scope: Scope = OPERATOR) -> KeptPrefix:
    """The finished request's K/V as a prefix entry: every computed slot (prompt, then the answer tokens
    fed back), which of them are reused chunk tokens never recomputed, and where those came from.

    Args:
        st: the request's buffer after decoding (slot == position for every slot in use); the
            entry takes its K/V over (`KVBuffer.keep_head`): nothing may write it afterwards.
        selected: `[K]` slots its selector recomputed.
        answer_ids: the generated tokens (those fed back hold the slots after the prompt).
        fingerprint: the model's.
        kept_runs: the runs of the kept prefix it continued (they stay valid: verified at its start).
        exact_base: how many leading slots held exact K/V before its passes ran (the prefix, an exact
            first chunk, a continued entry's exact head, or its own answer healing's).
        selection: its selector and ratio.
        healed: `[n]` bool: which tokens healing made exact (of the kept head it continued, or its
            own answer healing's; None: none).
        scope: its request's (only requests of that scope continue the entry).
    """
    T = st.buf.length
    inexact = torch.zeros(T, dtype=torch.bool)
    drift = torch.zeros(T, dtype=torch.float32)
    reusable = st.reusable_slots.cpu()
    if reusable.numel():
        inexact[reusable] = True
        drift[reusable] = st.drift().float().cpu()
        for slots, d in zip(st.chunk_slots, st.chunk_drift, strict=True):
            if d is None:
                drift[slots.cpu()] = float("nan")
    inexact[selected.cpu()] = False
    inexact[st.exact_slots.cpu()] = False
    runs = list(kept_runs)
    for slots, source in zip(st.chunk_slots, st.chunk_sources, strict=True):
        if source is not None:
            runs.append(ReusedRun(int(slots[0]), int(slots[-1]) + 1, *source))
    exact = exact_head(st, selected, exact_base)
    # NOTE: the exact head may hold reused slots healing made exact (`batching.answer_heal`)
    inexact[:exact] = False
    drift[:exact] = 0.0
    fed = T - int(st.slot_tokens.shape[0])
    assert 0 <= fed <= len(answer_ids), f"{fed} slots after the prompt, {len(answer_ids)} answer tokens"
    token_ids = torch.cat([st.slot_tokens.cpu(), torch.tensor(answer_ids[:fed], dtype=torch.int64)])  # [T]
    keys, values = st.buf.keep_head(T)  # [L, H, T, D] each: the request is finished
    return KeptPrefix(
        token_ids=token_ids,
        keys=keys, values=values, inexact=inexact, drift=drift,
        runs=tuple(sorted(runs, key=lambda r: r.start)), fingerprint=fingerprint,
        prompt_tokens=int(st.slot_tokens.shape[0]), exact_tokens=exact, selector=selection[0], ratio=selection[1],
        healed=None if healed is None else torch.cat([healed, torch.zeros(T - int(healed.shape[0]), dtype=torch.bool)]),
        scope=scope,
    )


def exact_head(st: Stitched, selected: torch.Tensor, exact_base: int) -> int:
    """How many leading slots of a request's buffer hold what full attention computes, once its passes
    ran: `exact_base`, extended by the slots its recompute pass and decode steps computed."""
    # NOTE: slots its recompute pass and decode steps computed attend to every slot before them, so
    # they extend the exact head as long as they follow it without a gap
    T = st.buf.length
    computed = torch.zeros(T, dtype=torch.bool)
    for slots in (selected, st.forced_slots, st.question_slots):
        computed[slots.cpu()] = True
    computed[int(st.slot_tokens.shape[0]):] = True
    exact = exact_base
    while exact < T and computed[exact]:
        exact += 1
    return exact


def _segment_starts(prompt: FusionPrompt) -> list[int]:
    starts, at = [], int(prompt.prefix.shape[0])
    for seg in prompt.segments:
        starts.append(at)
        at += seg.num_tokens
    return starts


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """`[a, b)` ranges where `mask` `[T]` is True."""
    padded = torch.cat([torch.zeros(1, dtype=torch.int8), mask.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    edges = torch.nonzero(padded[1:] - padded[:-1]).flatten().tolist()
    return list(zip(edges[0::2], edges[1::2], strict=True))


__all__ = ["continued_head", "exact_head", "exactly_continued", "head_cache", "kept_from", "reopen", "rest_of",
           "settle", "verified_head"]
