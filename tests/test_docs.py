"""The docs say what the code does: README.md and docs/**/*.md.

* Every ```python block runs as written, with the session's already-loaded default model, in a
  temporary directory. A block that needs a server or a cluster says so in its info string:
  ```python skip-test: <why>```; nothing else may follow `python`.
* Every relative link (and image) points to a file that exists, and every #anchor to a heading.
* The configuration reference (docs/configuration.md) names every setting of the configuration
  entry points, with the code's defaults, and nothing that does not exist; the README's short
  table names only real settings; the selectors and bench methods documented are the real ones.
* No machine paths, lock files or load averages in user docs.
* Every path or dotted name of ours that a doc names exists (`query/stitch.py`, `fusionrag_core.store`,
  `benchmarks/serving.py`, `batching/`), and the README's repository map names every package.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
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
    from fusionrag_core.batching.heal import HealConfig
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
    from fusionrag_integrations.openai_server.vector_stores import VectorStoreConfig

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
                        SchedulerConfig, PrefixCacheConfig, VectorStoreConfig, HealConfig)}
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



# ---- paths and names of ours --------------------------------------------------------------------
# Pages whose every path of ours must exist: the docs, the benchmark and integration READMEs, and
# the cookbook notebooks' markdown cells.
NOTEBOOKS = sorted((ROOT / "cookbook").glob("*.ipynb"))
# Where a relative path of ours (`query/stitch.py`, `openai_server/`) may live.
CODE_ROOTS = [ROOT, *(ROOT / name for name in ("fusionrag_core", "fusionrag_integrations", "benchmarks", "tests",
                                               "scripts"))]
PACKAGES = ("fusionrag_core", "fusionrag_integrations", "benchmarks", "tests")
SKIP_DIRS = {"__pycache__", ".git", ".venv", "node_modules"}
# A file name ending in .py, with or without folders before it: `learn.py`, `serve/scheduler.py`, `../session.py`.
PY_PATH = re.compile(r"(?<![\w/.\-<>])((?:\.{1,2}/)*(?:[\w\-]+/)*[\w\-]+\.py)\b")
# A folder of ours, spelled from the repository root: `fusionrag_core/serve/`, `benchmarks/results/x/`.
TOP_DIRS = ("fusionrag_core", "fusionrag_integrations", "benchmarks", "tests", "scripts", "docs", "cookbook")
ROOTED_DIR = re.compile(r"(?<![\w/.\-<>])((?:" + "|".join(TOP_DIRS) + r")/(?:[\w.\-]+/)*)")
# A folder named alone in a code span: `batching/`, `chroma/`.
BARE_DIR = re.compile(r"`([\w\-]+)/`")
# A dotted name in one of our packages: `fusionrag_core.query.select.SelectConfig`; not a file name (benchmarks.md).
DOTTED = re.compile(r"(?<![\w/.\-])((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)(?![\w\-]|\.\w)")
FILE_SUFFIXES = {"md", "py", "json", "png", "ipynb", "txt", "sh", "log", "toml", "jsonl"}


def _our_files() -> list[Path]:
    out = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT).parts
        if not SKIP_DIRS.intersection(rel) and not rel[0].startswith("."):
            out.append(path)
    return out


OUR_FILES = _our_files()
PY_NAMES = {p.name for p in OUR_FILES if p.suffix == ".py"}
DIR_NAMES = {p.name for p in OUR_FILES if p.is_dir()}


def _data_dirs() -> set[str]:
    """The data directory's folders, as fusionrag_core/paths.py lays them out (`chroma/`, `kv/`, `learned/`)."""
    doc = ast.get_docstring(ast.parse((ROOT / "fusionrag_core" / "paths.py").read_text(encoding="utf-8"))) or ""
    return set(re.findall(r"<data_dir>/(\w+)/", doc))


def _doc_texts() -> list[tuple[str, Path, str]]:
    """(name for messages, the page's folder, text) of every page whose paths are checked."""
    out = [(str(page.relative_to(ROOT)), page.parent, page.read_text(encoding="utf-8")) for page in LINKED_PAGES]
    for nb in NOTEBOOKS:
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        out.append((f"{nb.relative_to(ROOT)} (markdown)", nb.parent, text))
    return out


def _py_path_exists(path: str, folder: Path) -> bool:
    if path.startswith("."):
        return (folder / path).resolve().is_file()
    if "/" not in path:
        return path in PY_NAMES  # a module named alone: one of ours somewhere
    return any((root / path).is_file() for root in CODE_ROOTS)


def _top_level_names(module: Path) -> dict[str, ast.AST]:
    """Names a module defines or imports at top level, with their definitions."""
    names: dict[str, ast.AST] = {}
    body = list(ast.parse(module.read_text(encoding="utf-8")).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING imports, optional imports
            body += [*node.body, *node.orelse, *getattr(node, "finalbody", ())]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names[n.id] = node
                if isinstance(target, ast.Name) and target.id in ("__all__", "_EXPORTS"):  # lazy exports
                    for c in ast.walk(node.value):
                        if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.isidentifier():
                            names.setdefault(c.value, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def _dotted_name_exists(name: str) -> bool:
    """`a.b.C.d`: the longest prefix that is a module of ours, then names defined in it (and in a class of it)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        module = base / "__init__.py" if (base / "__init__.py").is_file() else base.with_suffix(".py")
        if module.is_file():
            break
    else:
        return False
    rest = parts[i:]
    if not rest:
        return True
    names = _top_level_names(module)
    if rest[0] not in names:
        return False
    node = names[rest[0]]
    if len(rest) > 1 and isinstance(node, ast.ClassDef):
        members = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        members |= {t.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(t := n.target, ast.Name)}
        members |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        return rest[1] in members
    return True  # NOTE: an imported name's attributes are not followed


def _stale_references(name: str, folder: Path, text: str) -> list[str]:
    stale = []
    data_dirs = _data_dirs()
    for path in PY_PATH.findall(text):
        if not _py_path_exists(path, folder):
            stale.append(path)
    for path in ROOTED_DIR.findall(text):
        if not (ROOT / path).is_dir():
            stale.append(path)
    for folder_name in BARE_DIR.findall(text):
        if folder_name not in DIR_NAMES and folder_name not in data_dirs:
            stale.append(folder_name + "/")
    for dotted in DOTTED.findall(text):
        if dotted.rsplit(".", 1)[-1] not in FILE_SUFFIXES and not _dotted_name_exists(dotted):
            stale.append(dotted)
    return [f"{name}: {s}" for s in stale]


def test_path_check_finds_stale_names() -> None:
    # NOTE: the check below passes only if it reads the names; these are the kinds of stale name it exists for.
    text = ("`fusionrag_core/foo.py`, `query/learn.py`, `learn.py`, `serve/scheduler.py`, "
            "`fusionrag_core.query.learn`, `fusionrag_core.query.select.NoSuchName`, `fusionrag_core/serve/`, "
            "`serve/`, `fusionrag_integrations/server/`")
    assert len(_stale_references("x", ROOT, text)) == 9, _stale_references("x", ROOT, text)
    text = ("`fusionrag_core/query/select.py`, `query/stitch.py`, `scheduler.py`, `../benchmarks/serving.py`, "
            "`fusionrag_core.query.select.SelectConfig.ratio`, `fusionrag_core.strip_marks`, `batching/`, "
            "`chroma/`, [docs/benchmarks.md](x), `fusionrag_integrations/openai_server/`, `benchmarks/results/`")
    assert _stale_references("x", ROOT / "docs", text) == []


def test_docs_name_only_paths_and_modules_that_exist() -> None:
    stale = [s for name, folder, text in _doc_texts() for s in _stale_references(name, folder, text)]
    assert not stale, "docs name paths or modules of ours that do not exist:\n" + "\n".join(stale)


def _repository_map() -> list[list[str]]:
    """The README's repository map: the code spans of each row's first cell."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Repository map"):]
    section = section[: section.index("\n## ")]
    return [re.findall(r"`([^`]+)`", row.split("|")[1]) for row in section.splitlines()
            if row.startswith("| `")]


def test_readme_repository_map_names_every_package() -> None:
    named: set[Path] = set()
    for spans in _repository_map():
        # NOTE: later spans of a row are siblings of its first: `fusionrag_core/bench/`, `cli.py`, `demo.py`.
        base = (ROOT / spans[0].rstrip("/")).parent
        for span in spans:
            path = ROOT / span if span == spans[0] else base / span
            assert path.exists(), f"the README's repository map names {span}, which does not exist"
            named.add(path.resolve())
    packages = {init.parent.resolve() for top in ("fusionrag_core", "fusionrag_integrations")
                for init in (ROOT / top).rglob("__init__.py") if "__pycache__" not in init.parts}
    missing = sorted(str(p.relative_to(ROOT)) for p in packages - named)
    assert not missing, f"the README's repository map does not name these packages: {missing}"
