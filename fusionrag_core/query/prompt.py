"""A request as segments: system prefix, context (known chunks and plain text), question.

Each piece is tokenized on its own, so a chunk's token ids are the same at ingest and at query,
whatever surrounds it. The layout comes from the model's chat template: rendering it once with
sentinel strings shows where the instruction, the passages and the question go.

Chunks are also found inside a *flattened* prompt (what LangChain and LlamaIndex hand a model) by
`PromptLayout.from_messages`: by content (stored chunks whose text occurs verbatim, see
`recognise.ContentIndex`), as retrieved documents (whose K/V may be learned, see `reuse/learned.py`), or
by `mark_chunk` marks, the explicit fast path: private-use code points around the chunk's text
carrying its chunk id and a MAC under a per-process key, so only this process can make one. Marks
never reach the tokenizer; text where nothing is found is simply prefilled. A mark whose id has no
cache (a LangChain *document* id, say) falls back to finding its text by content; each chunk
segment records which route found it (`Segment.found_by`).
"""

from __future__ import annotations

import bisect
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.errors import ContextLengthError, InvalidRequestError
from fusionrag_core.query.tools import ChatTools, ToolRequest
from fusionrag_core.query.unicode import require_unicode
from fusionrag_core.recognise.content_index import ANCHOR_CHARS, Match
from fusionrag_core.recognise.marks import MarkedChunk, mark_chunk, split_marks
from fusionrag_core.runtime.compat import tokenize_plain, tokenize_template

DEFAULT_INSTRUCTION = (
    "Answer the question using the passages. Reply with a short answer only: a name, place, date or short phrase."
)
CHUNK_SEPARATOR = "\n\n"
QUESTION_TEMPLATE = "Question: {question}"

_SENTINEL_CONTEXT, _SENTINEL_QUESTION = "\ue010CONTEXT\ue010", "\ue011QUESTION\ue011"
# NOTE: a special-token string inside a message's content (`<|im_start|>` typed by a user or held by
# a document) is replaced by ESCAPE_OPEN nonce index ESCAPE_CLOSE before the chat template renders it,
# and the escape is tokenized as plain text: only the template's own special strings become control
# tokens. The nonce is drawn per process, so no text can write an escape: text holding these code
# points, or anything that looks like an escape, is left as written and read as written (unescaping
# it would turn a document's own characters into a special-token string).
_ESCAPE_OPEN, _ESCAPE_CLOSE = "\ue005", "\ue006"
_ESCAPE_NONCE = secrets.token_hex(8)
_ESCAPE_RE = re.compile(f"{_ESCAPE_OPEN}{_ESCAPE_NONCE}([0-9]{{1,4}}){_ESCAPE_CLOSE}")


FoundBy = Literal["given", "mark", "content", "document", "span", "mark_then_content", "mark_then_document"]
"""How a chunk segment was found: named by id in a canonical prompt ("given"); by its `mark_chunk`
mark; by content (a stored chunk's text, `recognise.ContentIndex`); as a retrieved document's text;
as a span of context the caller cut by content (learnable like a document, where no retrieved
document says where documents are); or, for a mark whose id has no cache, by its marked text's
content or as a retrieved document ("mark_then_content", "mark_then_document")."""

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
    """prefix (computed exactly, memoised) + context segments + question (always computed fresh).

    `unlearned`: the same text laid out without learned caches, as the request that learned them
    read it (set by `reuse.sources.ReuseSources` when a segment is a learned cache): a learned piece
    is tokenized on its own, so this layout's tokens part from the kept K/V of that request at the
    piece, and a kept entry may continue the other one exactly (`batching.continuation.kept_layout`).
    """

    prefix: torch.Tensor  # [P] int64
    segments: tuple[Segment, ...]
    question: torch.Tensor  # [Q] int64
    metadata: Mapping[str, str] = field(default_factory=dict)
    unlearned: FusionPrompt | None = None

    def __post_init__(self) -> None:
        if self.question.numel() == 0:
            raise InvalidRequestError("the question is empty: pass a non-empty question")

    @property
    def num_tokens(self) -> int:
        return int(self.prefix.shape[0]) + sum(s.num_tokens for s in self.segments) + int(self.question.shape[0])

    def token_ids(self) -> torch.Tensor:
        """The whole prompt `[T]`, as a plain prefill would see it."""
        return torch.cat([self.prefix, *(s.token_ids for s in self.segments), self.question])

    def check_fits(self, max_new_tokens: int, context_window: int) -> None:
        """Raises ContextLengthError unless the prompt and `max_new_tokens` fit in `context_window`."""
        if self.num_tokens + max_new_tokens > context_window:
            raise ContextLengthError(
                f"prompt of {self.num_tokens} tokens + {max_new_tokens} new tokens exceeds the model's context "
                f"window of {context_window}; retrieve fewer or smaller chunks, or lower max_new_tokens")


def _ids(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


class PromptLayout:
    """Where instruction, passages and question go for one tokenizer, derived from its chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.tools = ChatTools(tokenizer)
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
    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: ToolRequest | None = None) -> str:
        """The conversation as the model reads it (its chat template, or plain turns without one).

        Messages are OpenAI-shaped: assistant messages may hold `tool_calls`, and `tool` messages
        results; they and `tools` are shown the template's way, or the fallback's (`ChatTools`).
        Special-token strings inside any text of the messages and tools come out escaped (see
        `_ESCAPE_OPEN`): pass the result to `tokenize_rendered`, never to a tokenizer directly.
        """
        if not messages:
            raise InvalidRequestError("no messages: pass at least one user message")
        adapted, tool_dicts = self.tools.adapt(messages, tools)
        escaped = [{k: v if k == "role" else self._escape_tree(v) for k, v in m.items()} for m in adapted]
        if self.has_template:
            extra = {"tools": self._escape_tree(tool_dicts)} if tool_dicts is not None else {}
            return str(self.tokenizer.apply_chat_template(
                escaped, tokenize=False, add_generation_prompt=add_generation_prompt, **extra))
        text = "\n\n".join(m["content"] for m in escaped) + ("\nAnswer:" if add_generation_prompt else "")
        return (self.tokenizer.bos_token or "") + text

    def _escape_tree(self, value: Any) -> Any:
        """`value` with `escape` applied to every string in it (message contents, call arguments, tools)."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, Mapping):
            return {k: self._escape_tree(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._escape_tree(v) for v in value]
        return value

    def escape(self, text: str) -> str:
        """User or document text with every special-token string replaced by an escape."""
        # NOTE: genuine marks pass unchanged (their MAC covers the text; it is tokenized as plain text).
        return "".join(self._escape_text(p) if isinstance(p, str) else mark_chunk(p.chunk_id, p.text)
                       for p in split_marks(text))

    def _escape_text(self, text: str) -> str:
        """`escape` for text read as plain context through and through (a mark's own text included)."""
        if self._special_re is None:
            return text
        index = self._special_index
        return self._special_re.sub(lambda m: _escape(index[m.group(0)]), text)

    def unescape(self, text: str) -> str:
        """`escape`'s inverse: the text as the user or the document wrote it."""
        return _ESCAPE_RE.sub(lambda m: self._special_at(m.group(0), int(m.group(1))), text)

    def tokenize_rendered(self, text: str) -> list[int]:
        """Ids of rendered text: the template's special strings are specials, escaped ones plain text."""
        ids: list[int] = []
        parts = _ESCAPE_RE.split(text)  # [template text, escape index, template text, ...]
        for j, part in enumerate(parts):
            if j % 2:
                ids += tokenize_plain(self.tokenizer, self._special_at(_escape(int(part)), int(part)))
            elif part:
                ids += tokenize_template(self.tokenizer, part)
        return ids

    def _special_at(self, escaped: str, i: int) -> str:
        # NOTE: only `escape` writes escapes (the nonce); an index out of range stays as written anyway.
        return self._specials[i] if i < len(self._specials) else escaped

    def from_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        find: Callable[[str], Sequence[Match]] | None = None,
        documents: Mapping[str, str] | None = None,
        has_cache: Callable[[str], bool] | None = None,
        spans: Mapping[str, str] | None = None,
        tools: ToolRequest | None = None,
    ) -> FusionPrompt:
        """Split a rendered conversation into a FusionPrompt at the chunks found in it.

        Chunks are found four ways: `mark_chunk` marks made in this process; stored chunks whose
        text occurs verbatim (`find`, e.g. `ContentIndex.find`); `documents` (content id -> text of
        documents retrieved for this request); and, in the text none of these covers, `spans`
        (content id -> text of a piece of the context, e.g. `reuse.spans.conversation_spans`).
        Documents and spans may have their K/V learned as their cache. Each becomes a chunk segment
        (its cache is used only if the token ids match); text between chunks is plain context; text
        before the first is the prefix, after the last the question.

        With `has_cache` (is a cache stored under this id?), a mark whose id has none is read as
        context: its text is searched by content and for documents like any other text (a long
        document's text finds its several chunks, in order), and what is found there is reused
        with `found_by` "mark_then_content" / "mark_then_document". A mark whose text holds
        nothing found stays a chunk under its own id (a reported miss). Without `has_cache`
        every mark is taken at its id. `tools`, when given, are rendered with the messages (`render`).
        """
        require_unicode(list(messages), "messages")
        rendered = self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self.from_rendered(rendered, find=find, documents=documents, has_cache=has_cache, spans=spans)

    def from_text(
        self,
        text: str,
        *,
        find: Callable[[str], Sequence[Match]] | None = None,
        documents: Mapping[str, str] | None = None,
        has_cache: Callable[[str], bool] | None = None,
        spans: Mapping[str, str] | None = None,
    ) -> FusionPrompt:
        """A raw text prompt (a completion: no chat template), split at the chunks found in it as
        `from_messages` does. Special-token strings in `text` stay text."""
        if not text.strip():
            raise InvalidRequestError("the prompt is empty: pass a non-empty prompt")
        require_unicode(text, "prompt")
        return self.from_rendered(self.escape(text), find=find, documents=documents, has_cache=has_cache, spans=spans)

    def from_rendered(
        self,
        rendered: str,
        *,
        find: Callable[[str], Sequence[Match]] | None = None,
        documents: Mapping[str, str] | None = None,
        has_cache: Callable[[str], bool] | None = None,
        spans: Mapping[str, str] | None = None,
    ) -> FusionPrompt:
        """`rendered` (`render`'s output, or escaped text) as a FusionPrompt; see `from_messages`."""
        docs = {cid: self.escape(doc) for cid, doc in (documents or {}).items()}
        cut = {cid: self.escape(span) for cid, span in (spans or {}).items()}
        pieces: list[str | _Found] = []
        for part in split_marks(rendered):
            if isinstance(part, str):
                pieces += _recognised(part, find, docs, cut, has_cache=has_cache)
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
        content id. The text is escaped like any context (its special-token strings stay plain).
        """
        pieces = _recognised(self._escape_text(mark.text), find, documents)
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
        if found.source != "mark":  # found in escaped text: the chunk as its document wrote it
            found = replace(found, text=self.unescape(found.text))
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


def _recognised(text: str, find: Callable[[str], Sequence[Match]] | None, documents: Mapping[str, str],
                spans: Mapping[str, str] | None = None, *,
                has_cache: Callable[[str], bool] | None = None) -> list[str | _Found]:
    """Plain `text` as plain pieces and the chunks found in it, in order: content first (in the text,
    then inside each document's own text), then documents, then spans, each where the ones before
    left the text free.

    With `has_cache`, a document without a cache is searched for stored chunks but never cut out of
    the text: tokenized on its own it would read other tokens than a plain prefill of the prompt,
    and with nothing to reuse in it a plain prefill is what the request must equal."""
    placed = _Placed([(m.start, m.end, m.chunk_id, "content") for m in find(text)] if find is not None else [])
    if find is not None:
        # NOTE: a stored chunk too short for a content anchor is probed only where a line starts, and
        # tools label each document ("Content: <text>"); inside its document's own text it starts one.
        placed.add_occurrences(text, _stored_chunks_in(documents.values(), find), "content")
    cached = documents if has_cache is None else {cid: d for cid, d in documents.items() if has_cache(cid)}
    placed.add_occurrences(text, cached, "document")
    placed.add_occurrences(text, spans or {}, "span")
    out: list[str | _Found] = []
    at = 0
    for start, end, chunk_id, source in placed.items:
        out += [text[at:start], _Found(chunk_id, text[start:end], source)]  # type: ignore[arg-type]
        at = end
    return [*out, text[at:]]


def _stored_chunks_in(texts: Iterable[str], find: Callable[[str], Sequence[Match]]) -> dict[str, str]:
    """Chunk id -> text of the stored chunks found inside each of `texts`."""
    return {m.chunk_id: text[m.start:m.end] for text in texts for m in find(text)}


def _joined(pieces: Sequence[str | _Found]) -> list[str | _Found]:
    """`pieces` with adjacent plain pieces joined and empty ones dropped."""
    out: list[str | _Found] = []
    for piece in pieces:
        if isinstance(piece, str) and out and isinstance(out[-1], str):
            out[-1] += piece
        elif piece != "":
            out.append(piece)
    return out


class _Placed:
    """Non-overlapping `(start, end, chunk_id, source)` places in a text, kept sorted by start.

    NOTE: an overlap check is a binary search, not a scan of every place so far: a text that holds
    one span a thousand times is placed in a thousand searches, not a million comparisons.
    """

    def __init__(self, items: Sequence[tuple[int, int, str, str]]) -> None:
        self.items = sorted(items)
        self._starts = [item[0] for item in self.items]

    def is_free(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self._starts, start)
        return (i == 0 or self.items[i - 1][1] <= start) and (i == len(self.items) or self.items[i][0] >= end)

    def add_occurrences(self, text: str, texts: Mapping[str, str], source: str) -> None:
        """Place every occurrence in `text` of each of `texts` (content id -> text) that is still free."""
        for chunk_id, piece in texts.items():
            if not piece.strip():
                continue
            at = text.find(piece)
            while at >= 0:
                end = at + len(piece)
                if self.is_free(at, end):
                    i = bisect.bisect_right(self._starts, at)
                    self.items.insert(i, (at, end, chunk_id, source))
                    self._starts.insert(i, at)
                at = text.find(piece, end)


def _escape(index: int) -> str:
    """The escape of the special-token string at `index` (see `_ESCAPE_OPEN`)."""
    return f"{_ESCAPE_OPEN}{_ESCAPE_NONCE}{index}{_ESCAPE_CLOSE}"


def _special_strings(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """Every special-token string of `tokenizer`, longest first (so a longer one wins a regex)."""
    specials = set(tokenizer.all_special_tokens)
    specials.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    return tuple(sorted((s for s in specials if s), key=len, reverse=True))

