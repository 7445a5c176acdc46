"""Where one request's caches come from, and why a request reused nothing.

`ReuseSources` is the store a request reads: the caches of an index (ingested, found by content
through the index's `ContentIndex`) first, then caches learned from traffic (`reuse/learned.py`).
`ReuseMonitor` belongs to one model instance: the first request whose prompt holds documents
(`documents_seen`) and reuses nothing logs one WARNING naming the likely cause and its fix, so reuse
is never lost in silence, and a prompt without documents (a chat turn, an agent's scaffolding)
never warns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.errors import CacheMismatchError, CacheNotFoundError, InvalidRequestError
from fusionrag_core.query.prompt import FusionPrompt
from fusionrag_core.query.tools import ToolRequest
from fusionrag_core.query.unicode import require_unicode
from fusionrag_core.recognise.content_index import Match
from fusionrag_core.reuse.learned import LearnedCaches, content_id
from fusionrag_core.reuse.spans import PARAGRAPH_BREAK, conversation_spans
from fusionrag_core.runtime.compat import tokenize_plain
from fusionrag_core.runtime.kv import ChunkKV, Variant
from fusionrag_core.scope import OPERATOR, Scope
from fusionrag_core.store.base import CacheSource, KVStore
from fusionrag_core.store.corpus_index import CorpusIndex

_Finder = Callable[[str], Sequence[Match]]

logger = logging.getLogger("fusionrag")

DOCUMENT_TOKENS = 128
"""A paragraph of prose at least this long, in no stored chunk, is taken for a document: about half an
ingest chunk (256 tokens by default). Chat turns, agent scaffolding and condense prompts stay below
it: the longest paragraph of prose in LlamaIndex's ReAct header has 76 tokens, and a chat log's
labelled lines ("user: ...") count one message at a time."""

PROSE_SHARE = 0.8
"""Text whose share of letters and white space is at least this reads as prose: passages score 0.9
and more, a tool's JSON schema about 0.65."""

_LABEL = re.compile(r"[\w ()'-]{1,30}:(?=\s|$)")  # NOTE: "user:", "Thought:", "Action Input:", "Tool Args:"


class ReuseSources(KVStore):
    """What one request reads caches from: an index's store (ingested) first, then learned caches.

    A read view (`put` goes to the primary store) that also finds chunks by content in both
    content indexes. Either part may be None. One per request: it records what the request's prompt
    may learn (`pending`).

    Args:
        primary: the KV store ingest wrote (None: none attached), shared by every scope.
        learned: caches learned so far by requests of `scope` (None: learning off, or nothing
            learned yet).
        learning: whether retrieved documents are made learnable (default: `learned` is given).
        scope: whose request reads these sources (`fusionrag_core.scope`).
    """

    def __init__(self, primary: KVStore | None, learned: LearnedCaches | None, *,
                 learning: bool | None = None, scope: Scope = OPERATOR) -> None:
        super().__init__(primary.storage_dtype if primary is not None else "float16")
        self.primary = primary
        self.learned = learned
        self.learning = learned is not None if learning is None else learning
        self.primary_index = primary.content_index() if primary is not None else None
        self.scope = scope
        self.retrieved = 0  # NOTE: how many retrieved documents `prompt` was given (read by `diagnose`)
        self.pending: list[tuple[str, str]] = []  # NOTE: (content id, text) to learn once answered, in order

    def find(self, text: str) -> list[Match]:
        """Stored chunks found by content in `text`: the index's first, learned ones in the gaps."""
        found = self.primary_index.find(text) if self.primary_index is not None else []
        if self.learned is None:
            return found
        # NOTE: a learned row whose blobs are gone (set aside as corrupt, or evicted by another process)
        # is no chunk: its text stays learnable, and is learned again.
        learned = self.learned
        extra = [m for m in learned.index.find(text) if all(m.end <= f.start or m.start >= f.end for f in found)
                 and learned.store.has_any(m.chunk_id)]
        return sorted(found + extra, key=lambda m: m.start)

    def prompt(self, engine: FusionEngine, messages: Sequence[Mapping[str, Any]],
               documents: Sequence[str] = (), tools: ToolRequest | None = None) -> FusionPrompt:
        """`messages` as a FusionPrompt: chunks found by mark or content; if learning is on, the
        context around them is learnable where it occurs: `documents` (texts retrieved for this
        request), or, when none were retrieved, content-defined spans of the messages
        (`spans.conversation_spans`). Those with a cache become chunks; the others stay plain text
        (the prompt a plain prefill reads) and are recorded in `pending`, to be learned once the
        request has answered (`reuse.learning`). A mark whose id has no cache here is found by its text (see
        `PromptLayout.from_messages`). `tools` are rendered with the messages (the tool list is
        template text: never cut into spans)."""
        require_unicode(list(messages), "messages")  # NOTE: before the spans are hashed, not only at the layout
        contents = [str(m.get("content") or "") for m in messages]
        docs, cut = self._learnable(engine, contents, documents)
        prompt = engine.prompt_from_messages(messages, find=self.find, documents=docs, has_cache=self.has_any,
                                             spans=cut, tools=tools)
        self._keep_uncovered(prompt, contents)
        return self._with_unlearned(prompt, lambda find, has_cache: engine.prompt_from_messages(
            messages, find=find, documents=docs, has_cache=has_cache, tools=tools))

    def prompt_from_text(self, engine: FusionEngine, text: str, documents: Sequence[str] = ()) -> FusionPrompt:
        """A raw text prompt (a completion) as a FusionPrompt, chunks found and learned as in `prompt`."""
        require_unicode(text, "prompt")
        docs, cut = self._learnable(engine, [text], documents)
        prompt = engine.prompt_from_text(text, find=self.find, documents=docs, has_cache=self.has_any, spans=cut)
        self._keep_uncovered(prompt, [text])
        return self._with_unlearned(prompt, lambda find, has_cache: engine.prompt_from_text(
            text, find=find, documents=docs, has_cache=has_cache))

    def _with_unlearned(self, prompt: FusionPrompt, lay_out: Callable[[_Finder | None, Callable[[str], bool]],
                                                                     FusionPrompt]) -> FusionPrompt:
        """`prompt` with its layout without learned caches (`FusionPrompt.unlearned`: the corpus's
        chunks alone, as the request that learned them read it), when one of its segments is learned."""
        if self.learned is None or not any(
                seg.chunk_id and self.has_any(seg.chunk_id) and not self._ingested(seg.chunk_id)
                for seg in prompt.segments):
            return prompt
        find = self.primary_index.find if self.primary_index is not None else None
        return dataclasses.replace(prompt, unlearned=lay_out(find, self._ingested))

    def _ingested(self, chunk_id: str) -> bool:
        """Whether the primary store holds a cache variant of `chunk_id`."""
        return self.primary is not None and self.primary.has_any(chunk_id)

    def _keep_uncovered(self, prompt: FusionPrompt, contents: Sequence[str]) -> None:
        """`pending` less the pieces the prompt does not hold as written clear of every chunk found in
        it (a stored chunk is reused there: a piece that overlaps one is not learned, as the layout
        would not have placed it there)."""
        learnable = {cid for cid, _ in self.pending}
        found = [seg.text for seg in prompt.segments if seg.text and seg.chunk_id not in learnable]
        self.pending = [(cid, text) for cid, text in self.pending if _occurs_clear(text, contents, found)]

    def _learnable(self, engine: FusionEngine, contents: Sequence[str],
                   documents: Sequence[str]) -> tuple[dict[str, str], dict[str, str]]:
        """(documents, spans) by content id that have a cache here, for the layout to place; the
        learnable ones without a cache go to `pending` (nothing, if learning is off).

        NOTE: a piece without a cache is never cut out of its text: tokenized on its own, it would
        make a request that reuses nothing read other tokens than a plain prefill of its prompt."""
        docs: dict[str, str] = {}
        cut: dict[str, str] = {}
        self.retrieved = sum(1 for text in documents if text.strip())
        if self.learning:
            for text in documents:
                text = text.strip()
                if text:
                    docs[content_id(text, engine.fingerprint)] = text
            # NOTE: a retriever's documents say where documents start and end; only without them
            # does the text alone say it.
            for span in () if docs else conversation_spans(contents):
                cut.setdefault(content_id(span, engine.fingerprint), span)
        self.pending = [(cid, text) for cid, text in {**docs, **cut}.items() if not self.has_any(cid)]
        missing = {cid for cid, _ in self.pending}
        # NOTE: every document goes to the layout (stored chunks are found inside its text, a mark
        # without a cache falls back to it); one without a cache is never cut out of plain text there.
        return docs, {cid: t for cid, t in cut.items() if cid not in missing}

    def put(self, chunk_id: str, kv: ChunkKV) -> None:
        if self.primary is None:
            raise InvalidRequestError("no KV store to write to: this view only has learned caches")
        self.primary.put(chunk_id, kv)

    def get(self, chunk_id: str, variant: Variant, *, fingerprint: str, shape: tuple[int, int, int] | None = None,
            device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> ChunkKV:
        return self.get_with_source(chunk_id, variant, fingerprint=fingerprint, shape=shape, device=device,
                                    dtype=dtype)[0]

    def get_with_source(self, chunk_id: str, variant: Variant, *, fingerprint: str,
                        shape: tuple[int, int, int] | None = None, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> tuple[ChunkKV, CacheSource]:
        """`get`, and where the cache came from: the primary store's answer (a tier of a
        `TieredKVStore`, or "store"), else "learned"."""
        if self.primary is not None:
            with contextlib.suppress(CacheNotFoundError):
                return self.primary.get_with_source(chunk_id, variant, fingerprint=fingerprint, shape=shape,
                                                    device=device, dtype=dtype)
        if self.learned is not None:
            # NOTE: the learned caches' store is a blob store of their own: its answer ("store") would
            # hide that the cache was learned, not ingested.
            kv = self.learned.store.get(chunk_id, variant, fingerprint=fingerprint, shape=shape, device=device,
                                        dtype=dtype)
            self.learned.touch([chunk_id])
            return kv, "learned"
        raise CacheNotFoundError(f"no {variant} KV cache for chunk {chunk_id}: no store and no learned caches")

    def has(self, chunk_id: str, variant: Variant) -> bool:
        return any(part.has(chunk_id, variant) for part in self._parts())

    def delete(self, chunk_id: str, variant: Variant | None = None) -> None:
        if self.primary is not None:
            self.primary.delete(chunk_id, variant)

    def quarantine(self, chunk_id: str, variant: Variant) -> str | None:
        """Set the blob aside in the part `get` read it from: the primary store when it holds the
        entry, else the learned caches (see `KVStore.quarantine`; the part's errors propagate)."""
        for part in self._parts():
            if part.has(chunk_id, variant):
                return part.quarantine(chunk_id, variant)
        return None  # NOTE: neither holds it any more: another request set it aside first

    def content_index(self) -> CorpusIndex | None:
        """The primary store's (the corpus's); learned caches keep an index of their own
        (`LearnedCaches.index`), which `find` reads as well."""
        return self.primary_index

    def _parts(self) -> list[KVStore]:
        """The stores read, in `get`'s order: the primary (ingested) one, then the learned caches'."""
        return [part for part in (self.primary, self.learned.store if self.learned is not None else None)
                if part is not None]

    def list_ids(self, variant: Variant | None = None) -> set[str]:
        return self.primary.list_ids(variant) if self.primary is not None else set()

    def close(self) -> None:
        """Nothing to release: the parts belong to their owners."""


def _occurs_clear(piece: str, contents: Sequence[str], found: Sequence[str]) -> bool:
    """Whether `piece` occurs in one of `contents` where it overlaps no occurrence of a `found` text."""
    for content in contents:
        taken = [(at, at + len(f)) for f in found for at in _occurrences(content, f)]
        if any(all(at + len(piece) <= start or at >= end for start, end in taken)
               for at in _occurrences(content, piece)):
            return True
    return False


def _occurrences(text: str, piece: str) -> Iterator[int]:
    """Where `piece` (non-empty) starts in `text`, each non-overlapping occurrence."""
    at = text.find(piece) if piece else -1
    while at >= 0:
        yield at
        at = text.find(piece, at + len(piece))


def check_store_model(engine: FusionEngine, store: KVStore) -> None:
    """Refuse a KV store whose caches another model computed: not one of them could be reused.

    A store that cannot tell whose caches it holds (`KVStore.stored_fingerprints`) is accepted.

    Raises:
        CacheMismatchError: naming both models and the fix.
    """
    found = store.backend.stored_fingerprints()
    if found and engine.fingerprint not in found:
        raise CacheMismatchError(
            f"KV store {store.backend!r} holds caches computed by another model (fingerprint {min(found)[:12]}), "
            f"not by {engine.name!r} (fingerprint {engine.fingerprint[:12]}), so none could be reused; load the "
            "model it was built with, or pass another data_dir= / store= (one ingested with this model)"
        )


def learned_ids(prompt: FusionPrompt, generation: Generation, sources: ReuseSources) -> list[str]:
    """Content ids this request learns (or learned) caches for: its learnable pieces that had none."""
    if not sources.learning:
        return []
    return [cid for cid, _ in sources.pending]


class ReuseMonitor:
    """One per model instance: warns once when a request whose prompt holds documents reuses no chunk cache."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._warned = False
        self._lock = threading.Lock()

    def check(self, engine: FusionEngine, prompt: FusionPrompt, generation: Generation,
              sources: ReuseSources) -> str | None:
        """Log (once) and return why `generation` reused nothing although its prompt holds documents;
        None when it reused or learned something, or its prompt holds no document (`documents_seen`)."""
        if generation.reused_tokens or learned_ids(prompt, generation, sources):
            return None
        seen = documents_seen(engine, prompt, generation, sources)
        if seen is None:
            return None
        cause = diagnose(prompt, generation, sources)
        with self._lock:
            if self._warned:
                return cause
            self._warned = True
        logger.warning("FusionRAG model %s reused no KV cache for a prompt holding %s: %s "
                       "(this warning is shown once per model)", self.model_name, seen, cause)
        return cause


def documents_seen(engine: FusionEngine, prompt: FusionPrompt, generation: Generation,
                   sources: ReuseSources) -> str | None:
    """What says `prompt` holds documents, in words; None: nothing does (no reuse was expected).

    Documents were retrieved for this request; or chunks were found in it (by mark or content)
    without a usable cache; or its text outside stored chunks holds a paragraph of prose of at
    least `DOCUMENT_TOKENS` tokens.
    """
    if sources.retrieved:
        return f"{sources.retrieved} retrieved document(s)"
    if generation.cache_misses:
        return f"{len(generation.cache_misses)} chunk(s) found in it"
    longest = _longest_prose(engine, prompt)
    return f"a {longest}-token paragraph of document-like text" if longest >= DOCUMENT_TOKENS else None


def _longest_prose(engine: FusionEngine, prompt: FusionPrompt) -> int:
    """Tokens of the longest paragraph of prose (`PROSE_SHARE`) in the prompt outside its chunks."""
    plain = [prompt.prefix, *(s.token_ids for s in prompt.segments if s.kind != "chunk"), prompt.question]
    if sum(int(ids.shape[0]) for ids in plain) < DOCUMENT_TOKENS:
        return 0
    special = set(engine.tokenizer.all_special_ids)
    longest = 0
    for ids in plain:
        for run in _runs_between(ids.tolist(), special):  # NOTE: the chat template's own markup splits text
            text = engine.tokenizer.decode(run)
            assert isinstance(text, str)  # NOTE: one sequence of ids decodes to one string
            for paragraph in map(_without_markup, _paragraphs(text)):
                letters = sum(c.isalpha() or c.isspace() for c in paragraph)
                if paragraph.strip() and letters >= PROSE_SHARE * len(paragraph):
                    longest = max(longest, len(tokenize_plain(engine.tokenizer, paragraph)))
    return longest


def _without_markup(paragraph: str) -> str:
    """`paragraph` less its lines of JSON or markup (a tool list, a call, a tag): scaffolding, not prose."""
    return "\n".join(line for line in paragraph.splitlines() if not line.lstrip().startswith(("{", "[", "<")))


def _runs_between(ids: list[int], separators: set[int]) -> Iterator[list[int]]:
    """The runs of `ids` between separator ids."""
    run: list[int] = []
    for i in ids:
        if i in separators:
            yield run
            run = []
        else:
            run.append(i)
    yield run


def _paragraphs(text: str) -> Iterator[str]:
    """`text`'s paragraphs (blank-line separated); a labelled line ("user: ...", "Thought: ...")
    starts one of its own, without its label: a chat log or an agent's fields, one at a time."""
    for block in PARAGRAPH_BREAK.split(text):
        lines: list[str] = []
        for line in block.splitlines():
            label = _LABEL.match(line)
            if label:
                yield "\n".join(lines)
                lines = [line[label.end():]]
            else:
                lines.append(line)
        yield "\n".join(lines)


def diagnose(prompt: FusionPrompt, generation: Generation, sources: ReuseSources) -> str:
    """The likely cause of a request that reused nothing, and its fix."""
    reasons = " ".join(generation.cache_misses.values())
    if "model" in reasons or "fingerprint" in reasons:
        return ("the stored caches were built by another model; re-ingest with this model or load the model the "
                "store was built with")
    if generation.cache_misses:
        return ("chunks were found but their caches are missing or do not match (" + reasons[:200] + "); run "
                "`fusionrag verify` / ingest again for this store")
    if sources.primary_index is not None and sources.primary_index.problem is not None:
        return f"{sources.primary_index.problem}; {sources.primary_index.fix}"
    if sources.primary is None and not sources.learning:
        return ("no KV store is attached and learning is off; pass index= or store= (the store ingest wrote), "
                "or turn learning on")
    if sources.primary_index is None and not sources.learning:
        return ("this KV store cannot find chunks by content (it keeps no content index); mark "
                "chunks with format_docs / FusionChunkMarker, or use a disk or Redis store")
    if sources.learning and sources.retrieved:
        # NOTE: the retriever ran and its documents were learnable: they are not in the prompt as returned.
        return (f"the context matches no stored chunk verbatim, and none of the {sources.retrieved} documents "
                "retrieved for this request occurs in it as the retriever returned it (the prompt changed their "
                "text: reformatted, truncated, metadata added); put the retrieved texts into the prompt unchanged, "
                "or ingest the documents as the prompt shows them")
    ingest = "ingest the documents (FusionIndex.add_texts, FusionVectorStore, FusionKVTransform)"
    learn_from_retriever = ("retrieve them with a LangChain / LlamaIndex retriever so that learned caches pick them "
                            "up from the next request on")
    if sources.primary_index is not None and len(sources.primary_index) == 0:
        if sources.learning:  # NOTE: so no retriever ran (its documents would have been learned or named above)
            return (f"the store holds no indexed chunk text and no retriever ran for this request to learn its "
                    f"documents from; {ingest}, or {learn_from_retriever}")
        retrieved = (f"the {sources.retrieved} documents retrieved for this request are not stored: "
                     if sources.retrieved else "")
        return f"{retrieved}the store holds no indexed chunk text and learning is off; {ingest} or turn learning on"
    if not sources.learning and sources.retrieved:
        return (f"none of the {sources.retrieved} documents retrieved for this request matches a stored chunk "
                "verbatim (not ingested into this store, or changed since) and learning is off; ingest them as "
                "the retriever returns them, or turn learning on")
    if not sources.learning:
        return ("the context matches no stored chunk verbatim (documents changed or were split differently after "
                "ingest); ingest these documents, or turn learning on so that retrieved documents are learned")
    # NOTE: without a retriever, the context's spans are learned, except in the paragraphs that hold the
    # system prompt (the first message's opening one) and the question (the last message's closing one).
    return ("the context matches no stored chunk verbatim and no retriever ran for this request: its document-like "
            "text shares the system prompt's or the question's paragraph, where spans are not learned; put "
            f"documents in paragraphs of their own (a blank line around each), {ingest}, or {learn_from_retriever}")


__all__ = ["DOCUMENT_TOKENS", "PROSE_SHARE", "ReuseMonitor", "ReuseSources", "check_store_model", "diagnose",
           "documents_seen", "learned_ids"]
