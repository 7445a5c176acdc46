"""The README's Python snippets run as written (with the session's already-loaded default model)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from fusionrag_core.engine import FusionEngine

README = Path(__file__).resolve().parents[1] / "README.md"
_TEXT = README.read_text(encoding="utf-8")
# NOTE: each snippet is padded with the newlines before it, so a traceback names its README line.
SNIPPETS = [
    "\n" * _TEXT.count("\n", 0, m.start(1)) + m.group(1)
    for m in re.finditer(r"```python\n(.*?)```", _TEXT, flags=re.DOTALL)
]


def test_readme_has_the_snippets() -> None:
    assert len(SNIPPETS) >= 3  # quickstart, LangChain, LlamaIndex


def test_configuration_table_names_the_real_api() -> None:
    """Every (Where, Setting) row of the README's configuration table is a field or parameter that exists."""
    import dataclasses
    import inspect

    from fusionrag_core.engine import EngineConfig
    from fusionrag_core.index import FusionIndex
    from fusionrag_core.ingest.config import IngestConfig
    from fusionrag_core.query.sampling import SamplingConfig
    from fusionrag_core.query.select import SelectConfig

    section = _TEXT[_TEXT.index("## Configuration"):]
    section = section[: section.index("\n## ")]
    rows = re.findall(r"^\| `([\w.]+)` \| (.+?) \|", section, flags=re.MULTILINE)
    real: dict[str, set[str]] = {
        cls.__name__: {f.name for f in dataclasses.fields(cls)}
        for cls in (EngineConfig, SelectConfig, SamplingConfig, IngestConfig)
    }
    real["FusionIndex.open"] = set(inspect.signature(FusionIndex.open).parameters) - {"cls", "engine"}
    assert len(rows) >= 10
    for where, settings in rows:
        names = set(re.findall(r"`(\w+)`", settings))
        assert where in real, f"README configuration table names {where!r}, which is not a configuration entry point"
        assert names and names <= real[where], f"{where}: {sorted(names - real[where])} do not exist"


@pytest.mark.slow
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_readme_snippet_runs(snippet: str, default_engine: FusionEngine, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # NOTE: from_pretrained() in the snippets returns the session's engine: the same default model,
    # loaded once for the whole suite instead of once per snippet.
    def shared(cls: type[FusionEngine], *args: Any, **kwargs: Any) -> FusionEngine:
        assert not args and not kwargs, "README snippets load the default model"
        return default_engine

    monkeypatch.setattr(FusionEngine, "from_pretrained", classmethod(shared))
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, str(README), "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    assert printed.strip(), "each snippet prints its answer"
    assert "\ue000" not in printed and "\ue002" not in printed  # no chunk marks leak into output
    assert (tmp_path / "fusionrag-data").is_dir()
