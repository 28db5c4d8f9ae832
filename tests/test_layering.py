"""The import rules of DESIGN.md, enforced.

swim/ (the sans-IO core): stdlib, msgpack, cryptography — and no sockets, clocks, threads,
logging, environment, or module-level randomness. phi/: stdlib and numpy under the same
bans. simulations/ runs the core: swim, phi and plotting, never the agent or trio. torchhook
reaches the agent only through its pure control-protocol module.
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
    # and of the Node (DESIGN.md: "torchhook ──► agent's pure control-protocol module").
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
