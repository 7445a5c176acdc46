"""A request as segments: system prefix, context (known chunks and plain text), question.

Each piece is tokenized on its own, so a chunk's token ids are the same at ingest and at query,
whatever surrounds it. The layout comes from the model's chat template: rendering it once with
sentinel strings shows where the instruction, the passages and the question go.

Chunks can also be recognised inside a *flattened* prompt (what LangChain and LlamaIndex hand a
model): `mark_chunk` wraps a chunk's text in private-use code points carrying its chunk id, and
`PromptLayout.from_messages` splits the rendered conversation at those marks. The marks never
reach the tokenizer, and text without marks is simply prefilled.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from fusionrag_core.compat import tokenize_plain, tokenize_template
from fusionrag_core.errors import InvalidRequestError

DEFAULT_INSTRUCTION = (
    "Answer the question using the passages. Reply with a short answer only: a name, place, date or short phrase."
)
CHUNK_SEPARATOR = "\n\n"
QUESTION_TEMPLATE = "Question: {question}"

# Private-use code points: they do not occur in ordinary text and no tokenizer merges across them.
MARK_OPEN, MARK_SEP, MARK_CLOSE = "\ue000", "\ue001", "\ue002"
MARK_CHARS = (MARK_OPEN, MARK_SEP, MARK_CLOSE)
_MARK_DELETE = str.maketrans(dict.fromkeys(MARK_CHARS))
_MARK_RE = re.compile(f"{MARK_OPEN}([^{MARK_SEP}{MARK_CLOSE}]*){MARK_SEP}(.*?){MARK_CLOSE}", re.DOTALL)
_SENTINEL_CONTEXT, _SENTINEL_QUESTION = "\ue010CONTEXT\ue010", "\ue011QUESTION\ue011"


def mark_chunk(chunk_id: str, text: str) -> str:
    """Wrap a chunk's text so a FusionRAG model can find it (and its cache) in a flattened prompt."""
    if any(c in chunk_id for c in (MARK_OPEN, MARK_SEP, MARK_CLOSE)):
        raise InvalidRequestError(f"chunk id {chunk_id!r} contains a reserved marker character")
    return f"{MARK_OPEN}{chunk_id}{MARK_SEP}{text}{MARK_CLOSE}"


def strip_marks(text: str) -> str:
    """The text a reader (or another model) should see: marks removed, chunk text kept."""
    return _MARK_RE.sub(lambda m: m.group(2), text)


def check_marks(text: str) -> None:
    """Refuse text holding mark characters outside complete `mark_chunk` marks.

    Raises:
        InvalidRequestError: a broken mark (it would otherwise reach the tokenizer as text).
    """
    if any(c in strip_marks(text) for c in MARK_CHARS):
        raise InvalidRequestError(
            "the prompt holds a broken chunk mark (private-use characters U+E000-U+E002 outside a complete mark): "
            "build context with mark_chunk/format_docs and do not cut or edit marked text; if a framework split "
            "it, retrieve fewer or smaller chunks so they fit one prompt"
        )


def clean_output(text: str) -> str:
    """`text` without mark characters.

    NOTE: marks never reach the tokenizer, so a model can only emit these code points on its own;
    they are removed anyway, because a later FusionRAG request would read them as chunk marks.
    """
    return text.translate(_MARK_DELETE)


@dataclass(frozen=True)
class Segment:
    """A piece of context. `chunk_id` set: a chunk whose cache may be reused; else plain text."""

    kind: Literal["chunk", "text"]
    token_ids: torch.Tensor  # [T] int64
    chunk_id: str | None = None

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
            Segment("chunk" if cid else "text", ids, cid) for cid, ids in chunks
        )
        return FusionPrompt(self.prefix_ids(instruction), segments, self.question_ids(question, instruction))

    def full_text(self, passages: Sequence[str], question: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
        """What `apply_chat_template` renders for the same request (for checks and plain baselines)."""
        before, after = self._render(instruction)
        context = "".join(p + CHUNK_SEPARATOR for p in passages)
        return f"{before}{context}{QUESTION_TEMPLATE.format(question=question.strip())}{after}"

    # ---- flattened prompts from frameworks -------------------------------------------------------
    def from_messages(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> FusionPrompt:
        """Split a conversation whose text may contain `mark_chunk` marks into a FusionPrompt.

        Marked chunks become chunk segments (their cache is looked up by id and used only if the
        token ids match); text between them is plain context; text after the last mark is the
        question. Order does not matter: every mark carries its own id.
        """
        if not messages:
            raise InvalidRequestError("no messages: pass at least one user message")
        for m in messages:
            check_marks(m["content"])
        if self.has_template:
            text = str(self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt))
        else:
            text = "\n\n".join(m["content"] for m in messages) + ("\nAnswer:" if add_generation_prompt else "")
            text = (self.tokenizer.bos_token or "") + text
        pieces = _MARK_RE.split(text)  # [text, id, chunk, text, id, chunk, ..., text]
        prefix = _ids(tokenize_template(self.tokenizer, pieces[0])) if len(pieces) > 1 else _ids([])
        segments: list[Segment] = []
        for j in range(1, len(pieces) - 1, 3):
            chunk_id, chunk_text = pieces[j], pieces[j + 1]
            if chunk_text.strip():
                segments.append(Segment("chunk" if chunk_id else "text", self.chunk_ids(chunk_text), chunk_id or None))
            between = pieces[j + 2]
            if between and j + 3 < len(pieces) - 1:
                segments.append(Segment("text", _ids(tokenize_template(self.tokenizer, between))))
        tail = pieces[-1] if len(pieces) > 1 else pieces[0]
        question = _ids(tokenize_template(self.tokenizer, tail))
        if question.numel() == 0:
            raise InvalidRequestError("the prompt ends with a chunk: put the question after the context")
        return FusionPrompt(prefix, tuple(segments), question)
