"""A request as segments: system prefix, context (known chunks and plain text), question.

Each piece is tokenized on its own, so a chunk's token ids are the same at ingest and at query,
whatever surrounds it. The layout comes from the model's chat template: rendering it once with
sentinel strings shows where the instruction, the passages and the question go.

Chunks are also found inside a *flattened* prompt (what LangChain and LlamaIndex hand a model) by
`PromptLayout.from_messages`: by content (stored chunks whose text occurs verbatim, see
`recognise.ContentIndex`), as retrieved documents (whose K/V may be learned, see `learn.py`), or
by `mark_chunk` marks, the explicit fast path: private-use code points around the chunk's text
carrying its chunk id and a MAC under a per-process key, so only this process can make one. Marks
never reach the tokenizer; text where nothing is found is simply prefilled. A mark whose id has no
cache (a LangChain *document* id, say) falls back to finding its text by content; each chunk
segment records which route found it (`Segment.found_by`).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.compat import tokenize_plain, tokenize_template
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.recognise import ANCHOR_CHARS, Match

DEFAULT_INSTRUCTION = (
    "Answer the question using the passages. Reply with a short answer only: a name, place, date or short phrase."
)
CHUNK_SEPARATOR = "\n\n"
QUESTION_TEMPLATE = "Question: {question}"

# Private-use code points delimit a mark; they never reach the tokenizer as part of one.
MARK_OPEN, MARK_SEP, MARK_CLOSE = "\ue000", "\ue001", "\ue002"
MARK_CHARS = (MARK_OPEN, MARK_SEP, MARK_CLOSE)
_MARK_DELETE = str.maketrans(dict.fromkeys(MARK_CHARS))
# NOTE: a mark is OPEN id SEP mac SEP length SEP text CLOSE. The length says where the text ends, so
# a text holding mark characters is carried whole; the MAC (keyed BLAKE2b over id and text, under a
# key drawn per process) means only this process's `mark_chunk` makes marks: anything else that
# looks like one (in a question, a document, another process's output) is plain text.
_MARK_HEAD_RE = re.compile(
    f"{MARK_OPEN}([A-Za-z0-9_-]{{1,128}}){MARK_SEP}([0-9a-f]{{16}}){MARK_SEP}([0-9]{{1,9}}){MARK_SEP}")
_MARK_KEY = secrets.token_bytes(32)
_SENTINEL_CONTEXT, _SENTINEL_QUESTION = "\ue010CONTEXT\ue010", "\ue011QUESTION\ue011"
# NOTE: a special-token string inside a message's content (`<|im_start|>` typed by a user or held by
# a document) is replaced by GUARD_OPEN index GUARD_CLOSE before the chat template renders it, and a
# guard is tokenized as plain text: only the template's own special strings become control tokens.
# A guard a user writes is harmless: it too is tokenized as plain text.
_GUARD_OPEN, _GUARD_CLOSE = "\ue005", "\ue006"
_GUARD_RE = re.compile(f"{_GUARD_OPEN}([0-9]{{1,4}}){_GUARD_CLOSE}")


def _mac(chunk_id: str, text: str) -> str:
    data = chunk_id.encode() + b"\0" + text.encode()
    return hashlib.blake2b(data, key=_MARK_KEY, digest_size=8).hexdigest()


def mark_chunk(chunk_id: str, text: str) -> str:
    """Wrap a chunk's text so a FusionRAG model in this process finds it (and its cache) in a prompt.

    Raises:
        InvalidRequestError: `chunk_id` is not a storable chunk id (1-128 of `[A-Za-z0-9_-]`).
    """
    if re.fullmatch(r"[A-Za-z0-9_-]{1,128}", chunk_id) is None:
        raise InvalidRequestError(f"chunk id {chunk_id!r} cannot be marked: expected 1-128 of [A-Za-z0-9_-]")
    return f"{MARK_OPEN}{chunk_id}{MARK_SEP}{_mac(chunk_id, text)}{MARK_SEP}{len(text)}{MARK_SEP}{text}{MARK_CLOSE}"


@dataclass(frozen=True)
class MarkedChunk:
    """A chunk marked by `mark_chunk` in this process, as found in a prompt."""

    chunk_id: str
    text: str


def split_marks(text: str) -> list[str | MarkedChunk]:
    """`text` cut into plain text and genuine marks, in order (adjacent plain pieces joined).

    A mark whose MAC does not verify, or that is cut short, is not a mark: its characters stay text.
    """
    out: list[str | MarkedChunk] = []
    plain_from, at = 0, text.find(MARK_OPEN)
    while at >= 0:
        head = _MARK_HEAD_RE.match(text, at)
        if head is not None:
            start = head.end()
            end = start + int(head.group(3))
            body = text[start:end]
            if text[end : end + 1] == MARK_CLOSE and hmac.compare_digest(_mac(head.group(1), body), head.group(2)):
                if at > plain_from:
                    out.append(text[plain_from:at])
                out.append(MarkedChunk(head.group(1), body))
                plain_from = end + 1
                at = text.find(MARK_OPEN, plain_from)
                continue
        at = text.find(MARK_OPEN, at + 1)
    if plain_from < len(text) or not out:
        out.append(text[plain_from:])
    return out


def strip_marks(text: str) -> str:
    """The text a reader (or another model) should see: marks removed, chunk text kept."""
    return "".join(p if isinstance(p, str) else p.text for p in split_marks(text))


def clean_output(text: str) -> str:
    """`text` without mark characters.

    NOTE: marks never reach the tokenizer, so a model can only emit these code points on its own;
    they are removed anyway, because a later FusionRAG request would read them as chunk marks.
    """
    return text.translate(_MARK_DELETE)


FoundBy = Literal["given", "mark", "content", "document", "mark_then_content", "mark_then_document"]
"""How a chunk segment was found: named by id in a canonical prompt ("given"); by its `mark_chunk`
mark; by content (a stored chunk's text, `recognise.ContentIndex`); as a retrieved document's text;
or, for a mark whose id has no cache, by its marked text's content or as a retrieved document
("mark_then_content", "mark_then_document")."""

_AFTER_MARK: dict[str, FoundBy] = {"content": "mark_then_content", "document": "mark_then_document"}


@dataclass(frozen=True)
class Segment:
    """A piece of context. `chunk_id` set: a chunk whose cache may be reused; else plain text.

    Attributes:
        kind: "chunk" or "text".
        token_ids: `[T]` int64: the chunk's text, tokenized alone, then the passage separator when
            the prompt has one there (a cache with more tokens is then reused for its first `T`).
        chunk_id: the id its cache is looked up by.
        text: the chunk's text, when known (a chunk found in a flattened prompt).
        learn: whether the K/V computed for it, when it had no cache, may be kept as its cache
            (chunks found by content or retrieved documents: their id is their content's).
        found_by: how a chunk was found (see `FoundBy`); None for plain text.
    """

    kind: Literal["chunk", "text"]
    token_ids: torch.Tensor  # [T] int64
    chunk_id: str | None = None
    text: str | None = None
    learn: bool = False
    found_by: FoundBy | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class FusionPrompt:
    """prefix (computed exactly, memoised) + context segments + question (always computed fresh)."""

    prefix: torch.Tensor  # [P] int64
    segments: tuple[Segment, ...]
    question: torch.Tensor  # [Q] int64
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.question.numel() == 0:
            raise InvalidRequestError("the question is empty: pass a non-empty question")

    @property
    def num_tokens(self) -> int:
        return int(self.prefix.shape[0]) + sum(s.num_tokens for s in self.segments) + int(self.question.shape[0])

    def token_ids(self) -> torch.Tensor:
        """The whole prompt `[T]`, as a plain prefill would see it."""
        return torch.cat([self.prefix, *(s.token_ids for s in self.segments), self.question])


def _ids(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


class PromptLayout:
    """Where instruction, passages and question go for one tokenizer, derived from its chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self._separator = tokenize_plain(tokenizer, CHUNK_SEPARATOR)
        self._specials = _special_strings(tokenizer)
        self._special_index = {special: i for i, special in enumerate(self._specials)}
        self._special_re = re.compile("|".join(map(re.escape, self._specials))) if self._specials else None

    # ---- canonical layout: instruction + passages + question -------------------------------------
    def _render(self, instruction: str) -> tuple[str, str]:
        """(text before the passages, text after the question) for this instruction."""
        if not self.has_template:
            bos = self.tokenizer.bos_token or ""
            return f"{bos}{instruction}{CHUNK_SEPARATOR}", "\nAnswer:"
        user = f"{_SENTINEL_CONTEXT}{_SENTINEL_QUESTION}"
        try:
            text = self._apply([{"role": "system", "content": instruction}, {"role": "user", "content": user}])
        except Exception:  # templates without a system role (some raise): fold it into the user turn
            text = self._apply([{"role": "user", "content": f"{instruction}{CHUNK_SEPARATOR}{user}"}])
        before, _, rest = text.partition(_SENTINEL_CONTEXT)
        _, _, after = rest.partition(_SENTINEL_QUESTION)
        return before, after

    def _apply(self, messages: Sequence[Mapping[str, str]]) -> str:
        text = self.tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                                  add_generation_prompt=True)
        return str(text)

    def prefix_ids(self, instruction: str = DEFAULT_INSTRUCTION) -> torch.Tensor:
        """`[P]` ids of everything before the first passage."""
        return _ids(tokenize_template(self.tokenizer, self._render(instruction)[0]))

    def chunk_ids(self, text: str) -> torch.Tensor:
        """`[T]` ids of one passage as it is cached: its text, then the passage separator."""
        if not text.strip():
            raise InvalidRequestError("a chunk's text is empty")
        return _ids(tokenize_plain(self.tokenizer, text) + self._separator)

    def question_ids(self, question: str, instruction: str = DEFAULT_INSTRUCTION) -> torch.Tensor:
        """`[Q]` ids of the question line plus the template's closing (e.g. the assistant header)."""
        if not question.strip():
            raise InvalidRequestError("the question is empty: pass a non-empty question")
        closing = self._render(instruction)[1]
        return _ids(tokenize_plain(self.tokenizer, QUESTION_TEMPLATE.format(question=question.strip()))
                    + tokenize_template(self.tokenizer, closing))

    def build(
        self,
        chunks: Sequence[tuple[str | None, torch.Tensor]],
        question: str,
        instruction: str = DEFAULT_INSTRUCTION,
    ) -> FusionPrompt:
        """The canonical request: `chunks` are `(chunk_id or None, token ids)` pairs, in prompt order."""
        segments = tuple(
            Segment("chunk", ids, cid, found_by="given") if cid else Segment("text", ids) for cid, ids in chunks
        )
        return FusionPrompt(self.prefix_ids(instruction), segments, self.question_ids(question, instruction))

    def full_text(self, passages: Sequence[str], question: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
        """What `apply_chat_template` renders for the same request (for checks and plain baselines)."""
        before, after = self._render(instruction)
        context = "".join(p + CHUNK_SEPARATOR for p in passages)
        return f"{before}{context}{QUESTION_TEMPLATE.format(question=question.strip())}{after}"

    # ---- flattened prompts from frameworks -------------------------------------------------------
    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the model reads it (its chat template, or plain turns without one).

        Special-token strings inside message contents come out guarded (see `_GUARD_OPEN`): pass
        the result to `tokenize_rendered`, never to a tokenizer directly.
        """
        if not messages:
            raise InvalidRequestError("no messages: pass at least one user message")
        guarded = [{**m, "content": self.guard(m["content"])} for m in messages]
        if self.has_template:
            return str(self.tokenizer.apply_chat_template(
                guarded, tokenize=False, add_generation_prompt=add_generation_prompt))
        text = "\n\n".join(m["content"] for m in guarded) + ("\nAnswer:" if add_generation_prompt else "")
        return (self.tokenizer.bos_token or "") + text

    def guard(self, text: str) -> str:
        """User or document text with every special-token string replaced by a guard."""
        # NOTE: genuine marks pass unchanged (their MAC covers the text; it is tokenized as plain text).
        return "".join(self._guard_text(p) if isinstance(p, str) else mark_chunk(p.chunk_id, p.text)
                       for p in split_marks(text))

    def _guard_text(self, text: str) -> str:
        """`guard` for text read as plain context through and through (a mark's own text included)."""
        if self._special_re is None:
            return text
        index = self._special_index
        return self._special_re.sub(lambda m: f"{_GUARD_OPEN}{index[m.group(0)]}{_GUARD_CLOSE}", text)

    def unguard(self, text: str) -> str:
        """`guard`'s inverse: the text as the user or the document wrote it."""
        return _GUARD_RE.sub(lambda m: self._special_at(m.group(0), int(m.group(1))), text)

    def tokenize_rendered(self, text: str) -> list[int]:
        """Ids of rendered text: the template's special strings are specials, guarded ones plain text."""
        ids: list[int] = []
        parts = _GUARD_RE.split(text)  # [template text, guard index, template text, ...]
        for j, part in enumerate(parts):
            if j % 2:
                ids += tokenize_plain(self.tokenizer, self._special_at(f"{_GUARD_OPEN}{part}{_GUARD_CLOSE}", int(part)))
            elif part:
                ids += tokenize_template(self.tokenizer, part)
        return ids

    def _special_at(self, guard: str, i: int) -> str:
        # NOTE: a guard index out of range was written by a user, not by `guard`: it stays as written.
        return self._specials[i] if i < len(self._specials) else guard

    def from_messages(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        find: Callable[[str], Sequence[Match]] | None = None,
        documents: Mapping[str, str] | None = None,
        has_cache: Callable[[str], bool] | None = None,
    ) -> FusionPrompt:
        """Split a rendered conversation into a FusionPrompt at the chunks found in it.

        Chunks are found three ways: `mark_chunk` marks made in this process; stored chunks whose
        text occurs verbatim (`find`, e.g. `ContentIndex.find`); and `documents` (content id ->
        text of documents retrieved for this request), whose K/V may be learned as their cache.
        Each becomes a chunk segment (its cache is used only if the token ids match); text between
        chunks is plain context; text before the first is the prefix, after the last the question.

        With `has_cache` (is a cache stored under this id?), a mark whose id has none is read as
        context: its text is searched by content and for documents like any other text (a long
        document's text finds its several chunks, in order), and what is found there is reused
        with `found_by` "mark_then_content" / "mark_then_document". A mark whose text holds
        nothing found stays a chunk under its own id (a reported miss). Without `has_cache`
        every mark is taken at its id.
        """
        rendered = self.render(messages, add_generation_prompt=add_generation_prompt)
        docs = {cid: self.guard(doc) for cid, doc in (documents or {}).items()}
        pieces: list[str | _Found] = []
        for part in split_marks(rendered):
            if isinstance(part, str):
                pieces += _recognised(part, find, docs)
            elif has_cache is None or has_cache(part.chunk_id):
                pieces.append(_Found(part.chunk_id, part.text, "mark"))
            else:
                pieces += self._mark_fallback(part, find, docs)
        pieces = _joined(pieces)
        if not any(isinstance(p, _Found) for p in pieces):
            return FusionPrompt(_ids([]), (), _ids(self.tokenize_rendered("".join(map(str, pieces)))))
        first = next(i for i, p in enumerate(pieces) if isinstance(p, _Found))
        prefix = _ids(self.tokenize_rendered("".join(str(p) for p in pieces[:first])))
        segments: list[Segment] = []
        tail = ""
        for i in range(first, len(pieces)):
            piece = pieces[i]
            if isinstance(piece, str):
                tail = piece
                continue
            if tail:
                segments.append(Segment("text", _ids(self.tokenize_rendered(tail))))
            tail = ""
            segments.append(self._chunk_segment(piece, pieces, i))
        if not tail and segments[-1].learn:
            # NOTE: a prompt that ends with a found chunk's text: that text is the question.
            tail = segments.pop().text or ""
        question = _ids(self.tokenize_rendered(tail))
        if question.numel() == 0:
            raise InvalidRequestError("the prompt ends with a chunk: put the question after the context")
        return FusionPrompt(prefix, tuple(segments), question)

    def _mark_fallback(self, mark: MarkedChunk, find: Callable[[str], Sequence[Match]] | None,
                       documents: Mapping[str, str]) -> list[str | _Found]:
        """A mark whose id has no cache: the chunks found in its text, else the mark (a miss).

        NOTE: no text chooses a cache here either: content matches are verified by a digest of a
        stored chunk's whole text, and documents are this request's retrieved texts under their
        content id. The text is guarded like any context (its special-token strings stay plain).
        """
        pieces = _recognised(self._guard_text(mark.text), find, documents)
        if find is not None:
            # NOTE: a chunk too short for an anchor (often a long document's last) is found whole, in its gap.
            pieces = [q for p in pieces for q in (
                _recognised(p, find, {}) if isinstance(p, str) and 0 < len(p.strip()) < ANCHOR_CHARS else [p])]
        if not any(isinstance(p, _Found) for p in pieces):
            return [_Found(mark.chunk_id, mark.text, "mark")]
        routed = [replace(p, source=_AFTER_MARK[p.source]) if isinstance(p, _Found) else p for p in pieces]
        # NOTE: a mark stands for "text + separator": the separator stays, taken into a chunk that ends the text.
        return [*routed, CHUNK_SEPARATOR]

    def _chunk_segment(self, found: _Found, pieces: list[str | _Found], i: int) -> Segment:
        """A found chunk as a segment; a separator right after it in the prompt is taken into it.

        NOTE: a marked chunk always gets the separator (its mark stands for "text + separator").
        """
        following = pieces[i + 1] if i + 1 < len(pieces) else ""
        if found.source != "mark":  # found in guarded text: the chunk as its document wrote it
            found = replace(found, text=self.unguard(found.text))
        if found.source == "mark":
            ids = self.chunk_ids(found.text)
        elif isinstance(following, str) and following.startswith(CHUNK_SEPARATOR) and (
                len(following) > len(CHUNK_SEPARATOR) or i + 2 < len(pieces)):
            ids = self.chunk_ids(found.text)
            pieces[i + 1] = following[len(CHUNK_SEPARATOR):]
        else:
            ids = _ids(tokenize_plain(self.tokenizer, found.text))
        return Segment("chunk", ids, found.chunk_id, found.text, learn=found.source != "mark", found_by=found.source)


@dataclass(frozen=True)
class _Found:
    """A chunk found in a rendered prompt, and how."""

    chunk_id: str
    text: str
    source: FoundBy


def _recognised(text: str, find: Callable[[str], Sequence[Match]] | None,
                documents: Mapping[str, str]) -> list[str | _Found]:
    """Plain `text` as plain pieces and the chunks found in it, in order: content first, then documents."""
    spans = [(m.start, m.end, m.chunk_id, "content") for m in find(text)] if find is not None else []
    spans += _document_spans(text, documents, spans)
    out: list[str | _Found] = []
    at = 0
    for start, end, chunk_id, source in sorted(spans):
        out += [text[at:start], _Found(chunk_id, text[start:end], source)]  # type: ignore[arg-type]
        at = end
    return [*out, text[at:]]


def _joined(pieces: Sequence[str | _Found]) -> list[str | _Found]:
    """`pieces` with adjacent plain pieces joined and empty ones dropped."""
    out: list[str | _Found] = []
    for piece in pieces:
        if isinstance(piece, str) and out and isinstance(out[-1], str):
            out[-1] += piece
        elif piece != "":
            out.append(piece)
    return out


def _document_spans(text: str, documents: Mapping[str, str],
                    taken: Sequence[tuple[int, int, str, str]]) -> list[tuple[int, int, str, str]]:
    """Where the documents' texts occur in `text`, clear of `taken` spans and of each other."""
    spans = list(taken)
    found: list[tuple[int, int, str, str]] = []
    for chunk_id, doc in documents.items():
        if not doc.strip():
            continue
        at = text.find(doc)
        while at >= 0:
            end = at + len(doc)
            if all(end <= s or at >= e for s, e, _, _ in spans):
                spans.append((at, end, chunk_id, "document"))
                found.append(spans[-1])
            at = text.find(doc, end)
    return found


def _special_strings(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """Every special-token string of `tokenizer`, longest first (so a longer one wins a regex)."""
    specials = set(tokenizer.all_special_tokens)
    specials.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    return tuple(sorted((s for s in specials if s), key=len, reverse=True))

