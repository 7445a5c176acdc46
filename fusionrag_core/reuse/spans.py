"""Content-defined spans: how context is cut into learnable pieces when nothing says where documents are.

A prompt built without retriever callbacks (a `dynamic_prompt` middleware or a LangGraph node that
calls `similarity_search` itself, a chat-message list sent over an HTTP API) holds documents whose
boundaries nobody reports. Its context is cut into *spans* by the text alone: at paragraph breaks
(blank lines), and inside a paragraph longer than `MAX_SPAN_CHARS` at word boundaries chosen by a
hash of the characters before them (content-defined chunking, as in rsync or LBFS). A cut depends
only on the text around it, never on its offset, so the same paragraph gives the same spans in every
prompt, whatever precedes it; inside a long paragraph, the cuts agree again from the first cut
after the texts differ.

A span is learned like a retrieved document (`learned.LearnedCaches`: the K/V the prompt computed
for it, under its content id) and found by content in the next prompt that holds it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from fusionrag_core.recognise.content_index import ANCHOR_CHARS, window_hashes
from fusionrag_core.recognise.marks import split_marks

MIN_SPAN_CHARS = 2 * ANCHOR_CHARS
"""Shorter pieces are not learned: a span must hold whole content-index windows (`ANCHOR_CHARS`) to
be found inside a later prompt at all, and below ~16 tokens a cache saves less prefill than its
lookup, re-rotation and file cost."""

MAX_SPAN_CHARS = 1024
"""A longer paragraph is cut inside: ~256 tokens, the size of an ingested chunk. A change anywhere in
a span makes all of it a miss, so spans stay about as fine-grained as ingested chunks."""

CUT_BITS = 6
"""Inside a long paragraph, a word boundary is a cut when the low `CUT_BITS` bits of the hash of the
`ANCHOR_CHARS` characters before it are zero: one boundary in 64, about one cut per 400 characters."""

PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
"""A blank line: where paragraphs, and so spans, end."""
_WHITESPACE = np.array([ord(c) for c in " \t\n\r"], np.uint32)  # NOTE: word boundaries: a cut never splits a word


def cut_spans(text: str) -> list[str]:
    """The spans of `text`, in order, whitespace-trimmed.

    Each paragraph (blank-line separated) of `MIN_SPAN_CHARS` to `MAX_SPAN_CHARS` characters is one
    span; a longer one is cut at content-defined word boundaries into pieces of at most
    `MAX_SPAN_CHARS`. Pieces shorter than `MIN_SPAN_CHARS` are left out.
    """
    return [span for paragraph in PARAGRAPH_BREAK.split(text) for span in _cut_paragraph(paragraph.strip())]


def conversation_spans(contents: Sequence[str]) -> list[str]:
    """The spans of a conversation's message contents (in order) that are context worth learning.

    Left out: the opening paragraph of the first message (the system prompt or instruction: the
    same in every request, served exactly by the prefix cache), the closing paragraph of the last
    one (the question: new in every request), the chat template's own text (it is in no content),
    and the text of `mark_chunk` marks (a marked chunk is found by its id). A system message's other
    paragraphs are context like any other: that is where chat apps put retrieved text.
    """
    texts = [c for c in contents if c.strip()]
    if not texts:
        return []
    texts[0] = _after_opening(texts[0])
    texts[-1] = _before_closing(texts[-1])
    return [span for content in texts for part in split_marks(content) if isinstance(part, str)
            for span in cut_spans(part)]


def _after_opening(text: str) -> str:
    parts = PARAGRAPH_BREAK.split(text, maxsplit=1)
    return parts[1] if len(parts) > 1 else ""


def _before_closing(text: str) -> str:
    breaks = list(PARAGRAPH_BREAK.finditer(text))
    return text[:breaks[-1].start()] if breaks else ""


def _cut_paragraph(paragraph: str) -> list[str]:
    """`paragraph` whole, or cut into pieces of at most `MAX_SPAN_CHARS`; pieces under `MIN_SPAN_CHARS` left out."""
    if len(paragraph) <= MAX_SPAN_CHARS:
        return [paragraph] if len(paragraph) >= MIN_SPAN_CHARS else []
    codes = np.frombuffer(paragraph.encode("utf-32-le"), dtype="<u4")
    boundaries = np.flatnonzero(np.isin(codes, _WHITESPACE))
    boundaries = boundaries[boundaries >= ANCHOR_CHARS]  # NOTE: a whole window precedes each candidate
    hashes = window_hashes(paragraph).view(np.uint64)[boundaries - ANCHOR_CHARS]
    is_cut = (hashes & np.uint64((1 << CUT_BITS) - 1)) == 0
    pieces: list[str] = []
    at = 0
    while len(paragraph) - at > MAX_SPAN_CHARS:
        cut = _next_cut(at, boundaries, hashes, is_cut)
        pieces.append(paragraph[at:cut].strip())
        at = cut
    pieces.append(paragraph[at:].strip())
    return [p for p in pieces if len(p) >= MIN_SPAN_CHARS]


def _next_cut(at: int, boundaries: np.ndarray, hashes: np.ndarray, is_cut: np.ndarray) -> int:
    """Where the piece starting at `at` ends: the first cut `MIN_SPAN_CHARS` to `MAX_SPAN_CHARS` on.

    Without one, the word boundary there whose hash is smallest: a text that repeats itself (one
    sentence a thousand times) is then cut at the same place in every repeat, so its pieces are
    the same few. Without a word boundary, `MAX_SPAN_CHARS` on.
    """
    lo = int(np.searchsorted(boundaries, at + MIN_SPAN_CHARS))
    hi = int(np.searchsorted(boundaries, at + MAX_SPAN_CHARS, side="right"))
    if lo == hi:
        return at + MAX_SPAN_CHARS
    hits = np.flatnonzero(is_cut[lo:hi])
    return int(boundaries[lo + int(hits[0] if hits.shape[0] else np.argmin(hashes[lo:hi]))])


__all__ = ["CUT_BITS", "MAX_SPAN_CHARS", "MIN_SPAN_CHARS", "PARAGRAPH_BREAK", "conversation_spans", "cut_spans"]
