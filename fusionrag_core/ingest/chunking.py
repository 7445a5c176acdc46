"""Split documents into chunks measured in the LLM's own tokens, and name chunks by content.

Splitting is done by `semantic-text-splitter`: it fills each chunk up to the token budget with the
largest semantic units that fit (paragraphs, then lines, sentences, words), so chunks end at
sentence boundaries whenever a sentence fits.

The splitter re-segments the rest of the line a chunk starts in for every chunk, so its time grows
with the square of a line's length (hours for a 20 MB file without newlines). A document
with a line longer than a window (64 chunks' worth of text) is therefore handed to it one window
at a time: each window's chunks are kept but the last two, which the window's end may have cut
short, and the next window starts where the first of those starts. Documents without such lines
are split whole, exactly as before.

A chunk id is a content hash of the chunk text, the model fingerprint and the chunking settings:
the same text ingested twice (by the same model, with the same settings) gets the same id, which
is what makes re-ingest a no-op and lets the vector DB and the KV store share one key.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from semantic_text_splitter import TextSplitter
from transformers import PreTrainedTokenizerBase

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.runtime.compat import tokenize_plain

# NOTE: bump when the splitting rule changes, so chunks cut by the old rule get new ids.
CHUNKER_VERSION = "semantic-text-splitter/1"
# NOTE: a window holds about this many chunks (at 4 characters a token, an English average); a
# longer line makes a document go through windows. Both bound the splitter's work per chunk.
_WINDOW_CHUNKS = 64
_CHARS_PER_TOKEN = 4
# NOTE: a window's last chunks may end at the window's end, or at a sentence boundary its end made;
# they are cut again from the next window. The chunks before them never see that end.
_RECUT_CHUNKS = 2
# NOTE: the splitter's line breaks (a `str.splitlines` boundary such as U+2028 is not one).
_LINE_BREAK = re.compile(r"[\r\n]")


@dataclass(frozen=True)
class ChunkingConfig:
    """How documents are cut.

    Attributes:
        chunk_tokens: most tokens of chunk text per chunk (the cached chunk adds the passage
            separator, one or two tokens, after it).
        chunk_overlap: most tokens a chunk may share with the previous one (0 = no overlap).
    """

    chunk_tokens: int = 256
    chunk_overlap: int = 0

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise InvalidRequestError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if not 0 <= self.chunk_overlap < self.chunk_tokens:
            raise InvalidRequestError(
                f"chunk_overlap must be in [0, chunk_tokens={self.chunk_tokens}), got {self.chunk_overlap}"
            )

    def identity(self) -> str:
        """A stable string of everything that decides where chunks are cut (hashed into chunk ids)."""
        return json.dumps(
            {"splitter": CHUNKER_VERSION, "tokens": self.chunk_tokens, "overlap": self.chunk_overlap},
            sort_keys=True,
        )


class Chunker:
    """Cuts texts into chunks of at most `config.chunk_tokens` tokens of `tokenizer`.

    Args:
        tokenizer: the LLM's tokenizer (the engine's), so budgets are in the tokens that get cached.
        config: token budget and overlap.

    Example:
        >>> chunker = Chunker(engine.tokenizer, ChunkingConfig(chunk_tokens=128))
        >>> chunker.split("A long document. With sentences.")
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: ChunkingConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config
        # NOTE: counted with the exact tokenization `PromptLayout.chunk_ids` caches (no specials,
        # special-token strings split), not with `backend_tokenizer`: that one may carry truncation
        # (chunks then look shorter than they are) and parses special-token strings in user text.
        self._splitter = self._new_splitter(self._count)
        self._window = config.chunk_tokens * _CHARS_PER_TOKEN * _WINDOW_CHUNKS

    def _count(self, text: str) -> int:
        return len(tokenize_plain(self.tokenizer, text))

    def _new_splitter(self, count: Callable[[str], int]) -> TextSplitter:
        return TextSplitter.from_callback(count, self.config.chunk_tokens, overlap=self.config.chunk_overlap)

    def tokens(self, text: str) -> int:
        """About how many tokens `text` has, counted a window at a time (a cut inside a word may add
        one), so a long text never becomes one list of ids: what its chunks hold, less overlap."""
        return sum(self._count(text[i:i + self._window]) for i in range(0, len(text), self._window))

    def split(self, text: str, on_progress: Callable[[int], None] | None = None) -> list[str]:
        """The chunks of `text`, in order, whitespace-trimmed; empty for blank text.

        Long lines are cut in windows, so the time grows about linearly with the length of `text`
        (see the module docstring).

        Args:
            text: the document.
            on_progress: called with how many characters of `text` are behind the splitter (a lower
                bound, non-decreasing) while it works: a long document takes minutes to cut.
        """
        if max(map(len, _LINE_BREAK.split(text))) > self._window:
            return self._split_windows(text, on_progress)
        splitter = self._splitter if on_progress is None else self._new_splitter(
            _tracking(self._count, text, on_progress))
        return [c for c in splitter.chunks(text) if c.strip()]

    def _split_windows(self, text: str, on_progress: Callable[[int], None] | None) -> list[str]:
        """`split`, handing the splitter one window of `text` at a time."""
        report = None if on_progress is None else _forward_only(on_progress)
        chunks: list[str] = []
        start, window = 0, self._window
        while start < len(text):
            piece = text[start:start + window]
            splitter = self._splitter if report is None else self._new_splitter(
                _tracking(self._count, piece, report, offset=start))
            found = splitter.chunk_indices(piece)
            if start + window >= len(text):
                chunks += [chunk for _, chunk in found]
                break
            restart = found[-_RECUT_CHUNKS][0] if len(found) > _RECUT_CHUNKS else 0
            if not found:  # NOTE: only whitespace, which no chunk keeps.
                start += window
            elif restart == 0:  # NOTE: too few chunks to keep one: mostly whitespace, or very long tokens.
                window *= 2
            else:
                chunks += [chunk for _, chunk in found[:-_RECUT_CHUNKS]]
                start += restart
        return [c for c in chunks if c.strip()]


def _forward_only(on_progress: Callable[[int], None]) -> Callable[[int], None]:
    """`on_progress`, called only with positions past every one reported before (a window that
    starts again at its predecessor's last chunks reports those positions a second time)."""
    last = 0

    def report(at: int) -> None:
        nonlocal last
        if at > last:
            last = at
            on_progress(at)

    return report


def _tracking(count: Callable[[str], int], text: str, on_progress: Callable[[int], None],
              offset: int = 0) -> Callable[[str], int]:
    """`count`, also reporting where in `text` (plus `offset`) the candidate it is asked about starts.

    NOTE: the splitter only hands the callback candidate chunks, never offsets; a candidate starts at
    the current chunk's start, which is at or after the last start found, so searching its opening
    characters from there gives a lower bound that never goes back.
    """
    done = 0

    def counted(candidate: str) -> int:
        nonlocal done
        found = text.find(candidate[:64], done)
        if found > done:
            done = found
            on_progress(offset + done)
        return count(candidate)

    return counted


def chunk_id(text: str, fingerprint: str, chunking: ChunkingConfig) -> str:
    """Content id of a chunk: hash of its text, the model fingerprint and the chunking settings.

    Returns:
        32 hex characters (a valid KV-store key and Chroma id).
    """
    digest = hashlib.sha256()
    for part in (fingerprint, chunking.identity(), text):
        data = part.encode()
        # NOTE: length-prefixed, so no two different triples hash the same bytes.
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()[:32]


__all__ = ["CHUNKER_VERSION", "Chunker", "ChunkingConfig", "chunk_id"]
