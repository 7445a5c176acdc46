"""The package's shape: layers import downward only, no import cycles, no private name crosses modules.

The imports are read from the source (every `import` statement, those inside functions and under
`TYPE_CHECKING` included), so a lazy or type-only import cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# fusionrag_core's layers, bottom first: a module may import its own layer and the ones below.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "paths", "data", "scope"),
    ("runtime",),
    ("store",),
    ("recognise",),
    ("query",),
    ("batching",),
    ("engine", "engine_config"),
    ("ingest",),
    ("reuse",),
    ("index",),
    ("bench",),
    ("cli",),
    ("demo",),
)


def modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package`."""
    out: dict[str, Path] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, str | None]]:
    """(imported module, imported name or None) for each import in `module`'s source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub, None) if sub in known else (base, alias.name)


def layer_of(module: str) -> int | None:
    """The layer of a fusionrag_core module (None for the package's own `__init__`, the facade)."""
    parts = module.split(".")
    if parts[0] != "fusionrag_core" or len(parts) == 1:
        return None
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i
    raise AssertionError(f"{module} is in no layer: add its package or module to LAYERS")


ALL = {**modules("fusionrag_core"), **modules("fusionrag_integrations")}
EDGES = {m: {(t, n) for t, n in imports(m, p, ALL) if t.split(".")[0] in ("fusionrag_core", "fusionrag_integrations",
                                                                                "benchmarks", "tests")}
         for m, p in ALL.items()}


def test_every_module_has_a_layer() -> None:
    for module in modules("fusionrag_core"):
        layer_of(module)


def test_layers_import_downward_only() -> None:
    upward = [f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
              for m in modules("fusionrag_core") for t, _ in EDGES[m]
              if t.startswith("fusionrag_core.") and layer_of(m) is not None
              and (layer_of(t) or 0) > (layer_of(m) or 0)]
    assert not upward, "\n".join(upward)


def test_the_core_never_imports_the_integrations_the_benchmarks_or_the_tests() -> None:
    bad = [f"{m} imports {t}" for m in ALL for t, _ in EDGES[m]
           if t.split(".")[0] in ("benchmarks", "tests")
           or (m.startswith("fusionrag_core") and t.startswith("fusionrag_integrations"))]
    assert not bad, "\n".join(bad)


def test_no_private_name_is_imported_from_another_module() -> None:
    bad = [f"{m} imports {n} from {t}" for m in ALL for t, n in EDGES[m]
           if n is not None and n.startswith("_") and not n.startswith("__") and t != m]
    assert not bad, "\n".join(bad)


def test_there_is_no_import_cycle() -> None:
    graph = {m: {t for t, _ in EDGES[m] if t in ALL and t != m} for m in ALL}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(t):], t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_walk_sees_imports_inside_functions_and_type_checking_blocks(tmp_path: Path) -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a.b import C\ndef f():\n    import d.e\n"
    (tmp_path / "m.py").write_text(source)
    assert set(imports("m", tmp_path / "m.py", {})) >= {("a.b", "C"), ("d.e", None)}
