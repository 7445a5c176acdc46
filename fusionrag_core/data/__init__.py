"""A small sample corpus that ships with the package, for the demo, notebooks and tests.

`sample/` holds seven short markdown documents about a fictional harbour town (Quillhaven, its
lighthouse, a clock company, the people behind them) and `sample/questions.json`, questions whose
answer needs facts from two different documents: the first document names a bridge entity, the
second states the answer about it. That is the case where chunk caches computed in isolation lose
quality and cross-chunk recompute is needed. All text is original to this project.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionrag_core.errors import FusionRAGError

_SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
_QUESTIONS_FILE = "questions.json"
_REINSTALL_HINT = "the package data is incomplete or was edited; reinstall fusionrag (pip install -e . in a checkout)"


@dataclass(frozen=True)
class SampleQuestion:
    """One two-hop question over the sample corpus.

    Attributes:
        question: The question.
        answer: The short gold answer, stated verbatim in the last hop document.
        hops: File names (in `sample_corpus_dir()`) of the documents needed, in reasoning order.
    """

    question: str
    answer: str
    hops: tuple[str, ...]


def sample_corpus_dir() -> Path:
    """Directory of the sample corpus: `*.md` documents plus `questions.json`.

    Raises:
        FusionRAGError: The directory is missing (a broken install).
    """
    if not _SAMPLE_DIR.is_dir():
        raise FusionRAGError(f"sample corpus not found at {_SAMPLE_DIR}; {_REINSTALL_HINT}")
    return _SAMPLE_DIR


def _parse_question(item: Any, index: int) -> SampleQuestion:
    if not isinstance(item, dict):
        raise FusionRAGError(f"{_QUESTIONS_FILE} entry {index} is not an object; {_REINSTALL_HINT}")
    question, answer, hops = item.get("question"), item.get("answer"), item.get("hops")
    if not isinstance(question, str) or not question or not isinstance(answer, str) or not answer:
        raise FusionRAGError(
            f"{_QUESTIONS_FILE} entry {index} needs non-empty 'question' and 'answer' strings; {_REINSTALL_HINT}"
        )
    if not isinstance(hops, list) or not hops or not all(isinstance(h, str) and h for h in hops):
        raise FusionRAGError(
            f"{_QUESTIONS_FILE} entry {index} needs 'hops', a non-empty list of file names; {_REINSTALL_HINT}"
        )
    return SampleQuestion(question=question, answer=answer, hops=tuple(hops))


def load_sample_questions() -> list[SampleQuestion]:
    """Reads the sample corpus's two-hop questions from `questions.json`.

    Returns:
        The questions in file order.

    Raises:
        FusionRAGError: The file is missing or not a list of valid entries (a broken install).
    """
    path = sample_corpus_dir() / _QUESTIONS_FILE
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise FusionRAGError(f"cannot read {path}: {exc}; {_REINSTALL_HINT}") from exc
    if not isinstance(items, list):
        raise FusionRAGError(f"{path} must hold a JSON list of questions; {_REINSTALL_HINT}")
    return [_parse_question(item, i) for i, item in enumerate(items)]
