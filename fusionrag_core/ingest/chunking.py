"""Split documents into chunks measured in the LLM's own tokens, and name chunks by content.

Splitting is done by `semantic-text-splitter`: it fills each chunk up to the token budget with the
largest semantic units that fit (paragraphs, then lines, sentences, words), so chunks end at
sentence boundaries whenever a sentence fits.

A chunk id is a content hash of the chunk text, the model fingerprint and the chunking settings:
the same text ingested twice (by the same model, with the same settings) gets the same id, which
is what makes re-ingest a no-op and lets the vector DB and the KV store share one key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from semantic_text_splitter import TextSplitter
from transformers import PreTrainedTokenizerBase

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.runtime.compat import tokenize_plain

# NOTE: bump when the splitting rule changes, so chunks cut by the old rule get new ids.
CHUNKER_VERSION = "semantic-text-splitter/1"


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
        self._splitter = TextSplitter.from_callback(self._count, config.chunk_tokens, overlap=config.chunk_overlap)

    def _count(self, text: str) -> int:
        return len(tokenize_plain(self.tokenizer, text))

    def split(self, text: str, on_progress: Callable[[int], None] | None = None) -> list[str]:
        """The chunks of `text`, in order, whitespace-trimmed; empty for blank text.

        Args:
            text: the document.
            on_progress: called with how many characters of `text` are behind the splitter (a lower
                bound, non-decreasing) while it works: a long document takes minutes to cut.
        """
        splitter = self._splitter if on_progress is None else TextSplitter.from_callback(
            _tracking(self._count, text, on_progress), self.config.chunk_tokens, overlap=self.config.chunk_overlap)
        return [c for c in splitter.chunks(text) if c.strip()]


def _tracking(count: Callable[[str], int], text: str, on_progress: Callable[[int], None]) -> Callable[[str], int]:
    """`count`, also reporting where in `text` the candidate it is asked about starts.

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
            on_progress(done)
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
