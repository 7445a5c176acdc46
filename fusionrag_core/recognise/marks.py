"""`mark_chunk` marks: the explicit way to name a stored chunk inside a flattened prompt.

Private-use code points around the chunk's text carry its chunk id and a MAC under a per-process
key, so only this process can make one; anything else that looks like a mark is plain text. Marks
never reach the tokenizer (`query.prompt` takes them apart first).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from fusionrag_core.errors import InvalidRequestError

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
