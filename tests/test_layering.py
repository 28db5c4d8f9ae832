"""The import rules of docs/design.md §1, enforced.

swim/ (the sans-IO core): stdlib, msgpack, cryptography — and no sockets, clocks, threads,
logging, environment, or module-level randomness. phi/: stdlib and numpy under the same
bans. simulations/ runs the core: swim, phi and plotting, never the agent or trio. torchhook
reaches the agent only through its pure control-protocol module.

Across the whole repository (swim, phi, agent, torchhook, simulations, bench, tests,
examples, scripts): no import circle (module-level, function-level and ``TYPE_CHECKING``
imports all count); no module outside tests/ over ``MAX_MODULE_LINES`` lines unless
``LONG_MODULES`` says why; outside swim/ and tests/swim/, swim only through
``import swim`` / ``from swim import`` names of ``swim.__all__``, which is complete and
sorted.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"swim", "phi", "agent", "torchhook", "simulations"}
BANNED_IN_CORE = {
    "socket",
    "socketserver",
    "ssl",
    "select",
    "selectors",
    "asyncio",
    "threading",
    "_thread",
    "multiprocessing",
    "concurrent",
    "subprocess",
    "signal",
    "time",
    "datetime",
    "logging",
    "os",
    "sys",
    "io",
    "pathlib",
    "shutil",
    "tempfile",
    "trio",
    "prometheus_client",
    "torch",
    "urllib",
    "http",
}
RULES: dict[str, dict[str, set[str]]] = {
    "swim": {"first_party": {"swim"}, "third_party": {"msgpack", "cryptography"}},
    "phi": {"first_party": {"phi"}, "third_party": {"numpy"}},
    "simulations": {
        "first_party": {"simulations", "swim", "phi"},
        "third_party": {"numpy", "matplotlib", "msgpack"},
    },
    "agent": {
        "first_party": {"agent", "swim", "phi"},
        "third_party": {"trio", "msgpack", "numpy", "prometheus_client", "click", "cryptography"},
    },
    "torchhook": {
        "first_party": {"torchhook", "agent"},
        "third_party": {"torch", "numpy", "msgpack"},
    },
}
PURE_MODULES = {
    # torchhook may only reach the agent through this module, which must stay free of trio
    # and of the Node (docs/design.md §1.1: "torchhook ──► agent.control").
    "agent/control.py": {"trio", "swim", "phi", "agent"},
}


def _imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
    return found


def _random_misuse(path: Path) -> list[str]:
    """``random`` may be imported only for the ``random.Random`` type an RNG is injected as."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad: list[str] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "random"
            and node.attr != "Random"
        ):
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno} uses random.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "random":
            names = {a.name for a in node.names}
            if names - {"Random"}:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {names} from random")
    return bad


def _violations(package: str) -> list[str]:
    rules = RULES[package]
    core = package in ("swim", "phi")
    problems: list[str] = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for module, line in _imports(path):
            top = module.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            if top == "__future__":
                continue
            if top in FIRST_PARTY:
                if top not in rules["first_party"]:
                    problems.append(where + f" (only {sorted(rules['first_party'])} allowed)")
                elif package == "torchhook" and top == "agent" and module != "agent.control":
                    problems.append(where + " (torchhook may import only agent.control)")
            elif top in sys.stdlib_module_names:
                if core and top in BANNED_IN_CORE:
                    problems.append(where + " (banned in the sans-IO core)")
            elif top not in rules["third_party"]:
                problems.append(where + f" (third-party allowed: {sorted(rules['third_party'])})")
        if core:
            problems.extend(_random_misuse(path))
    return problems


@pytest.mark.parametrize("path", sorted(PURE_MODULES))
def test_pure_modules_stay_pure(path: str) -> None:
    banned = PURE_MODULES[path]
    found = [m for m, _ in _imports(ROOT / path) if m.split(".")[0] in banned]
    assert found == []


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_imports_follow_design(package: str) -> None:
    assert (ROOT / package).is_dir()
    assert _violations(package) == []


def test_the_rules_catch_a_violation(tmp_path: Path) -> None:
    """The checker itself must be able to fail: plant a banned import and see it reported."""
    bad = ROOT / "swim" / "_layering_probe_tmp.py"
    bad.write_text("import socket\nimport random\nx = random.random()\n")
    try:
        problems = _violations("swim")
    finally:
        bad.unlink()
    assert any("imports socket" in p for p in problems)
    assert any("random.random" in p for p in problems)


def test_agent_runtime_does_not_import_numpy() -> None:
    """The agent must stay under 40 MiB RSS; numpy alone costs ~14 MiB. phi's scalar path is
    pure stdlib and only phi.vector imports numpy. Fresh interpreter: this one has numpy."""
    code = "import sys, agent.runtime; print(sorted(m for m in sys.modules if m == 'numpy'))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


# --- the project's module graph (docs/design.md §1) -----------------------------------------

GRAPH_DIRS = (
    "swim",
    "phi",
    "agent",
    "torchhook",
    "simulations",
    "bench",
    "tests",
    "examples",
    "scripts",
)
"""Every directory of Python code in the repository; the import-circle check covers them all."""

MAX_MODULE_LINES = 500
LONG_MODULES: dict[str, str] = {}
"""Modules outside tests/ allowed over ``MAX_MODULE_LINES`` lines, each with its reason."""


def _python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def _module_name(path: Path) -> str:
    """Dotted name of a module inside packages (``swim/wire.py`` -> ``swim.wire``); a file in
    a directory without ``__init__.py`` (examples/, scripts/) is a script named by its stem."""
    parts = [] if path.name == "__init__.py" else [path.stem]
    folder = path.parent
    while (folder / "__init__.py").exists():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)


def _all_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement: at module level, inside functions and classes, and under
    ``if TYPE_CHECKING:`` too. A type-only back reference never runs, but it is still a
    circle in the design (swim/shared.py <-> swim/table.py was one): move the shared type
    into a module both can import, or name a Protocol."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def _targets(
    node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set[str]
) -> list[str]:
    """The project modules an import statement loads, by name (others are left out).

    ``from pkg import name`` loads ``pkg.name`` when that is a module, else ``pkg`` itself
    (its ``__init__``). Parent packages that Python imports on the way are not edges:
    ``import swim.wire`` inside swim would otherwise make every submodule depend on the
    package that re-exports it.
    """

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        hits = [known(alias.name) for alias in node.names]
        return [h for h in hits if h is not None]
    base = node.module or ""
    if node.level:
        package = importer if is_package else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    out: list[str] = []
    for alias in node.names:
        full = f"{base}.{alias.name}"
        hit = full if full in modules else known(base)
        if hit is not None:
            out.append(hit)
    return out


def _import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in _python_files(*GRAPH_DIRS)}
    modules = set(files)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _all_imports(tree):
            is_package = path.name == "__init__.py"
            graph[name].update(t for t in _targets(node, name, is_package, modules) if t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected component with more than one module
    (Tarjan's algorithm, iterative), as the list of modules along it, first repeated."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [_circle_in(graph, set(c)) for c in sorted(components)]


def _circle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle from the component's first module back to itself (BFS)."""
    start = min(component)
    parent: dict[str, str] = {}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node] & component):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start] if node != start else [start, start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"no circle in {sorted(component)}")


def test_no_import_circle_anywhere() -> None:
    circles = [" -> ".join(c) for c in _cycles(_import_graph())]
    assert circles == [], "import circles:\n" + "\n".join(circles)


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    source = "if TYPE_CHECKING:\n    import x\ndef f():\n    from y import z\n"
    assert [ast.unparse(n) for n in _all_imports(ast.parse(source))] == [
        "import x",
        "from y import z",
    ]


def test_no_module_over_the_line_limit_without_a_reason() -> None:
    dirs = [d for d in GRAPH_DIRS if d != "tests"]
    long = {
        str(p.relative_to(ROOT)): n
        for p in _python_files(*dirs)
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    unexplained = sorted(f"{p} ({n} lines)" for p, n in long.items() if p not in LONG_MODULES)
    assert unexplained == [], "split along a concern:\n" + "\n".join(unexplained)
    stale = sorted(set(LONG_MODULES) - set(long))
    assert stale == [], "no longer long: remove from LONG_MODULES"


# --- swim's public API ------------------------------------------------------------------------

SWIM_INTERNAL = ("swim", "tests/swim")
"""Where swim's submodules may be imported: swim itself and its own unit tests."""


def _swim_submodules() -> set[str]:
    return {p.stem for p in (ROOT / "swim").glob("*.py") if p.stem != "__init__"} | {
        p.name for p in (ROOT / "swim").iterdir() if (p / "__init__.py").exists()
    }


def _swim_uses(path: Path) -> tuple[list[str], set[str]]:
    """(submodule imports, names taken from ``swim``) in one file outside swim/."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return _swim_uses_in(tree, str(path.relative_to(ROOT)))


def _swim_uses_in(tree: ast.AST, where: str) -> tuple[list[str], set[str]]:
    submodules = _swim_submodules()
    bad: list[str] = []
    names: set[str] = set()
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("swim."):
                    bad.append(f"{where}:{node.lineno} import {alias.name}")
                elif alias.name == "swim":
                    bound.add(alias.asname or "swim")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("swim."):
                bad.append(f"{where}:{node.lineno} from {node.module} import ...")
            elif node.module == "swim":
                for alias in node.names:
                    if alias.name in submodules:
                        bad.append(f"{where}:{node.lineno} from swim import {alias.name}")
                    else:
                        names.add(alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
        ):
            if node.attr in submodules:
                bad.append(f"{where}:{node.lineno} swim.{node.attr}")
            elif not node.attr.startswith("__"):
                names.add(node.attr)
    return bad, names


def _outside_swim() -> list[Path]:
    dirs = [d for d in GRAPH_DIRS if d != "swim"]
    return [p for p in _python_files(*dirs) if not p.is_relative_to(ROOT / "tests" / "swim")]


def test_nothing_outside_swim_imports_its_submodules() -> None:
    """Outside swim/ and tests/swim/ only ``import swim`` and ``from swim import ...`` of
    names in ``swim.__all__`` (docs/design.md §1): the submodules are free to move."""
    bad = sorted(b for p in _outside_swim() for b in _swim_uses(p)[0])
    assert bad == [], "import these from swim itself:\n" + "\n".join(bad)


def test_the_swim_checks_catch_submodule_imports() -> None:
    source = (
        "import swim\nimport swim.wire\nfrom swim.node import Node\nfrom swim import wire, Config\n"
        "swim.membership.PRECEDENCE\nswim.Address\n"
    )
    bad, names = _swim_uses_in(ast.parse(source), "x.py")
    assert bad == [
        "x.py:2 import swim.wire",
        "x.py:3 from swim.node import ...",
        "x.py:4 from swim import wire",
        "x.py:5 swim.membership",
    ]
    assert names == {"Config", "Address"}


def test_swim_all_is_complete_sorted_and_importable() -> None:
    import swim

    exported = list(swim.__all__)
    # ruff's RUF022 order: SCREAMING_CASE, then CamelCase, then the rest, each alphabetical
    order = sorted(exported, key=lambda n: (0 if n.isupper() else 1 if n[0].isupper() else 2, n))
    assert exported == order
    assert len(set(exported)) == len(exported)
    missing = [name for name in exported if not hasattr(swim, name)]
    assert missing == []
    used = {name for p in _outside_swim() for name in _swim_uses(p)[1]}
    assert sorted(used - set(exported)) == []
