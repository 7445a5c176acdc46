"""Tests of fusionrag_core.bench.data: loading and validating benchmark JSONL rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fusionrag_core.bench.data import BenchRow, DatasetFormatError, load_rows, passage_text
from fusionrag_core.data import SampleQuestion, load_sample_questions, sample_corpus_dir

MUSIQUE = Path(__file__).resolve().parents[2] / "shared/datasets/musique_dev.jsonl"


def _good_row(**overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "question": "Who designed the lighthouse?",
        "answers": ["Ada Vell"],
        "passages": [{"title": "Lumen", "text": "Ada Vell designed it."}, {"title": "", "text": "Other."}],
    }
    row.update(overrides)
    return row


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.skipif(not MUSIQUE.is_file(), reason=f"MuSiQue dev set not found at {MUSIQUE}")
def test_load_first_rows_of_musique() -> None:
    rows = load_rows(MUSIQUE, limit=3)
    assert len(rows) == 3
    assert rows[0].question == "Where was the author of Hannibal and Scipio educated at?"
    assert rows[0].answers == ("Exeter College",)
    for row in rows:
        assert len(row.passages) == 10  # per the dataset README
        assert all(text for _, text in row.passages)
        # Titles are empty in this file, so the rendered chunk is exactly the passage text.
        assert row.passage_texts() == [text for _, text in row.passages]


def test_load_rows_parses_and_limits(tmp_path: Path) -> None:
    path = _write(tmp_path, [json.dumps(_good_row(question=f"q{i}?")) for i in range(4)] + [""])
    rows = load_rows(path)
    assert [r.question for r in rows] == ["q0?", "q1?", "q2?", "q3?"]
    assert rows[0] == BenchRow(
        question="q0?",
        answers=("Ada Vell",),
        passages=(("Lumen", "Ada Vell designed it."), ("", "Other.")),
    )
    assert [r.question for r in load_rows(str(path), limit=2)] == ["q0?", "q1?"]
    assert load_rows(path, limit=0) == []


def test_limit_stops_before_bad_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, [json.dumps(_good_row()), "not json"])
    assert len(load_rows(path, limit=1)) == 1
    with pytest.raises(DatasetFormatError, match=r"rows\.jsonl:2: invalid JSON"):
        load_rows(path)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"question": "q?", "answers": ["a"]}), "missing key.*passages"),
        (json.dumps(_good_row(question="  ")), "'question' must be"),
        (json.dumps(_good_row(answers=[])), "'answers' must be"),
        (json.dumps(_good_row(answers="Ada Vell")), "'answers' must be"),
        (json.dumps(_good_row(passages=[])), "'passages' must be"),
        (json.dumps(_good_row(passages=["text only"])), "passage 0 must be an object"),
        (json.dumps(_good_row(passages=[{"title": "t", "text": ""}])), "passage 0: 'text'"),
        (json.dumps(_good_row(passages=[{"title": 3, "text": "x"}])), "passage 0: 'title'"),
    ],
)
def test_bad_row_error_names_line(tmp_path: Path, bad: str, message: str) -> None:
    path = _write(tmp_path, [json.dumps(_good_row()), "", bad])
    with pytest.raises(DatasetFormatError, match=message) as info:
        load_rows(path)
    assert f"{path}:3:" in str(info.value)  # blank line 2 still counts
    assert "fix or delete that line" in str(info.value)


def test_missing_file_and_negative_limit(tmp_path: Path) -> None:
    with pytest.raises(DatasetFormatError, match=r"not found.*musique_dev\.jsonl"):
        load_rows(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetFormatError, match="limit must be >= 0"):
        load_rows(_write(tmp_path, [json.dumps(_good_row())]), limit=-1)


def test_passage_text() -> None:
    assert passage_text("Lumen Lighthouse", "It stands on the cape.") == "Lumen Lighthouse\nIt stands on the cape."
    assert passage_text("", "body") == "body"
    assert passage_text("  ", "body") == "body"


def test_sample_questions_are_two_hop_over_existing_docs() -> None:
    corpus = sample_corpus_dir()
    questions = load_sample_questions()
    assert 5 <= len(questions) <= 6
    docs = {p.name: p.read_text(encoding="utf-8") for p in corpus.glob("*.md")}
    for q in questions:
        assert isinstance(q, SampleQuestion)
        assert len(q.hops) == 2 and len(set(q.hops)) == 2, q
        missing = [hop for hop in q.hops if hop not in docs]
        assert not missing, f"{q.question!r}: hop docs {missing} not in {corpus}"
        assert any(q.answer in docs[hop] for hop in q.hops), q
        # Genuinely two-hop: the answer is stated only in the last doc, not in the one that names
        # the bridge entity, so no single retrieved chunk answers the question on its own.
        assert q.answer in docs[q.hops[-1]], q
        assert q.answer not in docs[q.hops[0]], q


def test_sample_docs_are_short_markdown() -> None:
    docs = sorted(sample_corpus_dir().glob("*.md"))
    assert 6 <= len(docs) <= 8
    for doc in docs:
        text = doc.read_text(encoding="utf-8")
        assert text.startswith("# "), doc.name
        assert 150 <= len(text.split()) <= 400, doc.name
