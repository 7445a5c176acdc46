"""The docs say what the code does: README.md and docs/**/*.md.

* Every ```python block runs as written, with the session's already-loaded default model, in a
  temporary directory. A block that needs a server or a cluster says so in its info string:
  ```python skip-test: <why>```; nothing else may follow `python`.
* Every relative link (and image) points to a file that exists, and every #anchor to a heading.
* The configuration reference (docs/configuration.md) names every setting of the configuration
  entry points, with the code's defaults, and nothing that does not exist; the README's short
  table names only real settings; the selectors and bench methods documented are the real ones.
* No machine paths, lock files or load averages in user docs.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fusionrag_core.engine import FusionEngine

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
# Pages whose links are checked too, though their snippets are fragments and do not run.
OTHER_PAGES = [ROOT / "benchmarks" / "README.md", *sorted((ROOT / "benchmarks" / "results").glob("*/README.md")),
               ROOT / "fusionrag_integrations" / "llama_index" / "README.md"]
LINKED_PAGES = [*PAGES, *OTHER_PAGES]
CONFIGURATION = DOCS / "configuration.md"

FENCE = re.compile(r"^```python(?P<info>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
SKIP = re.compile(r"^ skip-test: \S")
# NOTE: a floor, so a regex mistake that skips or misses blocks fails here instead of passing silently.
MIN_EXECUTED = 12
MIN_README_EXECUTED = 3


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int  # of the opening fence, 1-based
    info: str
    code: str

    @property
    def skipped(self) -> bool:
        return bool(SKIP.match(self.info))

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets(page: Path) -> list[Snippet]:
    text = page.read_text(encoding="utf-8")
    return [Snippet(page, text.count("\n", 0, m.start()) + 1, m.group("info"), m.group("code"))
            for m in FENCE.finditer(text)]


ALL = [s for page in PAGES for s in snippets(page)]
EXECUTED = [s for s in ALL if not s.skipped]


def test_every_python_block_is_collected_and_marked_right() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        opened = len(re.findall(r"^```python", text, flags=re.MULTILINE))
        found = snippets(page)
        assert len(found) == opened, f"{page.name}: {opened} ```python fences, {len(found)} blocks collected"
        for s in found:
            assert s.info == "" or s.skipped, (
                f"{s.name}: after ```python only ' skip-test: <why>' is allowed, got {s.info!r}")


def test_enough_snippets_run() -> None:
    assert len(EXECUTED) >= MIN_EXECUTED, [s.name for s in ALL]
    assert sum(s.page == README for s in EXECUTED) >= MIN_README_EXECUTED  # quickstart, LangChain, LlamaIndex
    assert len(ALL) - len(EXECUTED) <= len(EXECUTED) // 2, "most snippets must run: skip only what needs a server"


@pytest.mark.slow
@pytest.mark.parametrize("snippet", EXECUTED, ids=[s.name for s in EXECUTED])
def test_snippet_runs(snippet: Snippet, default_engine: FusionEngine, tmp_path: Path,
                      monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # NOTE: from_pretrained() in the snippets returns the session's engine: the same default model,
    # loaded once for the whole suite instead of once per snippet. With config= it builds a real
    # engine of that config around the same weights (what from_pretrained does after loading).
    def shared(cls: type[FusionEngine], model: Any = None, *, config: Any = None, **kwargs: Any) -> FusionEngine:
        assert model is None and not kwargs, "doc snippets load the default model"
        if config is None:
            return default_engine
        return FusionEngine(default_engine.model, default_engine.tokenizer, name=default_engine.name, config=config)

    monkeypatch.setattr(FusionEngine, "from_pretrained", classmethod(shared))
    monkeypatch.chdir(tmp_path)
    # NOTE: padded with newlines, so a traceback names the page's own line.
    code = "\n" * snippet.line + snippet.code
    exec(compile(code, str(snippet.page), "exec"), {"__name__": "__docs__"})
    printed = capsys.readouterr().out
    assert printed.strip(), "each snippet prints what it shows"
    assert "\ue000" not in printed and "\ue002" not in printed  # no chunk marks leak into output
    if snippet.page == README:
        assert (tmp_path / "fusionrag-data").is_dir()


# ---- links --------------------------------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    text = re.sub(r"`[^`\n]*`", "", text)  # NOTE: code spans are not links
    return LINK.findall(text)


def test_relative_links_point_to_existing_files() -> None:
    checked = 0
    for page in LINKED_PAGES:
        for target in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
            assert dest == ROOT or ROOT in dest.parents, f"{page.relative_to(ROOT)} links outside the repository"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{page.relative_to(ROOT)} links to #{anchor}, no such heading"
            checked += 1
    assert checked >= 30


def test_every_docs_page_is_linked_from_somewhere() -> None:
    targets = {(page.parent / t.partition("#")[0]).resolve()
               for page in LINKED_PAGES for t in _links(page) if not re.match(r"^[a-z]+:", t)}
    for page in PAGES[1:]:
        assert page.resolve() in targets, f"{page.relative_to(ROOT)} is linked from no page"


def test_no_machine_paths_locks_or_load_averages_in_user_docs() -> None:
    # NOTE: `flock` the product's lock mechanism is fine; `flock some.lock cmd`, a benchmark's lock file, is not.
    forbidden = re.compile(r"/work/|/tmp/|/home/|\.\./shared|\bflock\s+\S|\.lock\b|load average|uptime", re.IGNORECASE)
    for page in LINKED_PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            assert not forbidden.search(line), f"{page.relative_to(ROOT)}:{n}: {line.strip()}"


# ---- configuration ------------------------------------------------------------------------------
# A settings row: | `Where` | `setting`[, `setting`] | default | meaning |; `Where` is a class (or `FusionIndex.open`),
# which tells these rows from other tables' (the selectors' rows start with a lower-case name).
ROW = re.compile(r"^\| `([A-Z][\w.]*)` \| (.+?) \| (.*?) \|", flags=re.MULTILINE)


def _real_settings() -> dict[str, dict[str, Any]]:
    """Entry point -> setting -> default (inspect.Parameter.empty when required)."""
    from fusionrag_core.batching.prefix_cache import PrefixCacheConfig
    from fusionrag_core.batching.scheduler import SchedulerConfig
    from fusionrag_core.engine import EngineConfig
    from fusionrag_core.index import FusionIndex
    from fusionrag_core.ingest.config import IngestConfig
    from fusionrag_core.ingest.distributed import RayConfig
    from fusionrag_core.query.sampling import SamplingConfig
    from fusionrag_core.query.select import SelectConfig
    from fusionrag_core.store.tiered import TierConfig
    from fusionrag_integrations.openai_server.config import ServerConfig

    def defaults(cls: type) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
            else:
                out[f.name] = inspect.Parameter.empty
        return out

    real = {cls.__name__: defaults(cls)
            for cls in (EngineConfig, SelectConfig, SamplingConfig, IngestConfig, TierConfig, RayConfig, ServerConfig,
                        SchedulerConfig, PrefixCacheConfig)}
    real["FusionIndex.open"] = {name: p.default for name, p in inspect.signature(FusionIndex.open).parameters.items()
                                if name not in ("cls", "engine")}
    return real


def _rows(text: str) -> list[tuple[str, list[str], str]]:
    return [(where, re.findall(r"`(\w+)`", settings), default) for where, settings, default in ROW.findall(text)]


def _literal(cell: str) -> Any:
    """A documented default as a value: 0.15, True, None, (), `fused`; any other cell (prose, a
    call such as `SelectConfig()`, "required") is `inspect.Parameter.empty`: not compared."""
    cell = cell.strip()
    if re.fullmatch(r"`[\w.\-/]+`", cell):
        return cell.strip("`")
    try:
        return ast.literal_eval(cell)
    except (ValueError, SyntaxError):
        return inspect.Parameter.empty


def test_configuration_reference_names_every_setting_with_its_default() -> None:
    real = _real_settings()
    documented: dict[str, set[str]] = {where: set() for where in real}
    rows = _rows(CONFIGURATION.read_text(encoding="utf-8"))
    assert len(rows) >= 40
    compared = 0
    for where, names, default in rows:
        assert where in real, f"docs/configuration.md names {where!r}, which is not a configuration entry point"
        assert len(names) == 1, f"docs/configuration.md: one setting a row, got {names} for {where}"
        (name,) = names
        assert name in real[where], f"docs/configuration.md: {where} has no setting {name!r}"
        documented[where].add(name)
        value, code = _literal(default), real[where][name]
        if value is not inspect.Parameter.empty and (code is None or isinstance(code, (bool, int, float, str, tuple))):
            assert (value == code and type(value) is type(code)) or (
                isinstance(code, float) and isinstance(value, int) and value == code), (
                f"docs/configuration.md: {where}.{name} documented as {default.strip()!r}, the code has {code!r}")
            compared += 1
    assert compared >= 35, "most defaults are plain values the test compares"
    for where, settings in real.items():
        missing = set(settings) - documented[where]
        assert not missing, f"docs/configuration.md does not document {where}: {sorted(missing)}"


def test_readme_configuration_table_names_the_real_api() -> None:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Configuration"):]
    section = section[: section.index("\n## ")]
    rows = _rows(section)
    real = _real_settings()
    assert 8 <= len(rows) <= 14, "the README keeps the ~10 settings people change; the rest is in docs/configuration.md"
    for where, names, _ in rows:
        assert where in real, f"README configuration table names {where!r}, which is not a configuration entry point"
        unknown = sorted(set(names) - set(real[where]))
        assert names and not unknown, f"README configuration table: {where} has no {unknown}"


def _section(page: Path, heading: str) -> str:
    text = page.read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end != -1 else None]


def test_the_documented_selectors_are_the_real_ones() -> None:
    from fusionrag_core.query.select import SELECTORS

    documented = set(re.findall(r"^\| `(\w+)` \|", _section(CONFIGURATION, "Selectors"), flags=re.MULTILINE))
    assert documented == set(SELECTORS), (
        f"documented but not in the code: {sorted(documented - set(SELECTORS))}; "
        f"in the code but not documented: {sorted(set(SELECTORS) - documented)}")


def test_the_documented_bench_methods_are_the_real_ones() -> None:
    from fusionrag_core.bench.methods import METHODS

    section = _section(DOCS / "benchmarks.md", "Methods compared")
    documented = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE))
    assert documented == set(METHODS), (
        f"documented but not in the code: {sorted(documented - set(METHODS))}; "
        f"in the code but not documented: {sorted(set(METHODS) - documented)}")


def test_every_result_folder_is_cited_and_every_cited_one_exists() -> None:
    results = ROOT / "benchmarks" / "results"
    text = "\n".join(p.read_text(encoding="utf-8") for p in [*PAGES, ROOT / "benchmarks" / "README.md"])
    cited = set(re.findall(r"benchmarks/results/([\w.-]+)", text))
    present = {p.name for p in results.iterdir() if p.is_dir()}
    assert cited <= present, f"docs cite result folders that do not exist: {sorted(cited - present)}"
    assert present <= cited, f"result folders no page cites (remove them): {sorted(present - cited)}"
