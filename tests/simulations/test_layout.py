"""The simulator's layout: model ← experiments ← reports ← command lines, no import circle,
no module over 500 lines (``simulations/__init__.py`` states the rule)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "simulations"
LAYERS = {"model": 0, "experiments": 1, "reports": 2}
COMMAND = 3
"""A module directly in ``simulations/``: a command line (``python -m simulations.X``)."""
MAX_LINES = 500


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package itself (a docstring)
    return LAYERS.get(parts[1], COMMAND)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, known: set[str]) -> set[str]:
    """The simulations modules ``path`` imports (anywhere in it, lazily or not)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from simulations.reports import scenario`` imports the submodule
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, known) - {name} for name, path in modules.items()}


def test_the_layers_import_only_downwards() -> None:
    bad = []
    for module, imported in sorted(_graph().items()):
        own = _layer(module)
        for other in sorted(imported):
            theirs = _layer(other)
            if own is None or theirs is None:
                continue
            if theirs > own or (theirs == COMMAND and module.startswith("simulations.")):
                bad.append(f"{module} imports {other}")
    assert bad == []


def test_no_import_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                circles.append([*path[path.index(other) :], other])
            elif other not in state:
                visit(other, [*path, other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_modules_stay_small() -> None:
    sizes = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


def test_the_layout_is_what_the_package_docstring_says() -> None:
    top = {_name(p).split(".")[1] for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert top == {"run", "frontier", "scaling", "params", "demo"}
    assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} == set(LAYERS)
