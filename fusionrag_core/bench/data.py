"""Loader of the benchmark's multi-hop QA rows (`musique_dev.jsonl`, the LongBench/CacheBlend selection).

The file is JSONL, one row a line:
`{"question": str, "answers": [str, ...], "passages": [{"title": str, "text": str}, ...]}`.
The package never hard-codes where it lives; callers pass its path (in this project it is
`../shared/datasets/musique_dev.jsonl`, next to the repository, never copied into it).

Tokenisation and truncation to the model's context are done elsewhere with the model tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionrag_core.errors import FusionRAGError


class DatasetFormatError(FusionRAGError, ValueError):
    """A benchmark dataset file is missing or one of its lines is not a valid row."""


@dataclass(frozen=True)
class BenchRow:
    """One question with its gold answers and the passages to retrieve/answer from.

    Attributes:
        question: The question, non-empty.
        answers: Acceptable gold answers (aliases), at least one, each non-empty.
        passages: `(title, text)` pairs in dataset order, at least one; titles may be "" (the
            `musique_dev.jsonl` file has none), texts are non-empty.
    """

    question: str
    answers: tuple[str, ...]
    passages: tuple[tuple[str, str], ...]

    def passage_texts(self) -> list[str]:
        """Each passage rendered with `passage_text`, in dataset order."""
        return [passage_text(title, text) for title, text in self.passages]


def passage_text(title: str, text: str) -> str:
    """Renders one passage as a chunk of context: the title on its own line, then the text.

    An empty (or blank) title is left out rather than leaving a stray blank line, because the
    chunk's tokens (and so its KV cache) should not depend on a missing title.

    Args:
        title: Passage title, possibly "".
        text: Passage body.

    Returns:
        `f"{title}\\n{text}"`, or `text` when the title is blank.
    """
    title = title.strip()
    return f"{title}\n{text}" if title else text


def _row_error(path: Path, line_no: int, problem: str) -> DatasetFormatError:
    return DatasetFormatError(
        f"{path}:{line_no}: {problem}; each line must be "
        '{"question": str, "answers": [str, ...], "passages": [{"title": str, "text": str}, ...]} '
        "- fix or delete that line"
    )


def _nonempty_str(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _parse_row(obj: Any, path: Path, line_no: int) -> BenchRow:
    if not isinstance(obj, dict):
        raise _row_error(path, line_no, f"expected a JSON object, got {type(obj).__name__}")
    missing = [key for key in ("question", "answers", "passages") if key not in obj]
    if missing:
        raise _row_error(path, line_no, f"missing key(s) {', '.join(missing)}")

    question = obj["question"]
    if not _nonempty_str(question):
        raise _row_error(path, line_no, "'question' must be a non-empty string")

    answers = obj["answers"]
    if not isinstance(answers, list) or not answers or not all(_nonempty_str(a) for a in answers):
        raise _row_error(path, line_no, "'answers' must be a non-empty list of non-empty strings")

    passages = obj["passages"]
    if not isinstance(passages, list) or not passages:
        raise _row_error(path, line_no, "'passages' must be a non-empty list")
    pairs: list[tuple[str, str]] = []
    for i, passage in enumerate(passages):
        if not isinstance(passage, dict):
            raise _row_error(path, line_no, f"passage {i} must be an object with 'title' and 'text'")
        title = passage.get("title", "")
        text = passage.get("text")
        if not isinstance(title, str):
            raise _row_error(path, line_no, f"passage {i}: 'title' must be a string")
        if not isinstance(text, str) or not text.strip():
            raise _row_error(path, line_no, f"passage {i}: 'text' must be a non-empty string")
        pairs.append((title, text))

    return BenchRow(question=question, answers=tuple(answers), passages=tuple(pairs))


def load_rows(path: str | Path, limit: int | None = None) -> list[BenchRow]:
    """Reads and validates benchmark rows from a JSONL file.

    Blank lines are skipped; every other line must be a valid row. Reading stops after `limit`
    rows, so a small `limit` does not validate (or pay for) the rest of the file.

    Args:
        path: The JSONL file, e.g. `../shared/datasets/musique_dev.jsonl`.
        limit: Read at most this many rows (>= 0); None reads them all.

    Returns:
        The rows in file order.

    Raises:
        DatasetFormatError: The file does not exist, `limit` is negative, or a line is not valid
            JSON or not a valid row (the message names the file and line number).
    """
    path = Path(path)
    if limit is not None and limit < 0:
        raise DatasetFormatError(f"limit must be >= 0 or None, got {limit}")
    if not path.is_file():
        raise DatasetFormatError(
            f"benchmark dataset not found at {path}; pass the path of musique_dev.jsonl "
            "(in this project: ../shared/datasets/musique_dev.jsonl, see its README.md)"
        )
    rows: list[BenchRow] = []
    if limit == 0:
        return rows
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _row_error(path, line_no, f"invalid JSON ({exc.msg} at column {exc.colno})") from exc
            rows.append(_parse_row(obj, path, line_no))
            if limit is not None and len(rows) >= limit:
                break
    return rows
