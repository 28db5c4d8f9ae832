"""Benchmark results as data: one JSON file per measured question and run, under results/.

A benchmark answers a *question* ("detection, CPU and traffic at 64 agents: serf ``local``,
swim ``fast``, swim ``lan``"), named by a short id that its arguments determine, so that a
rerun of the same command answers the same question. Each run writes
``results/<question>/<UTC timestamp>-<commit>.json``; BENCHMARKS.md is rendered from the
newest file of each question (``python -m bench.render``), never edited by hand. Older
files may be deleted: the changelog keeps what changed and by how much.

A result file (format 1) is a JSON object:

- ``format``: 1; ``question``: the id (``[a-z0-9-]+``); ``title``: the question as a
  heading (unique across questions);
- ``command``: what reproduces it, run from the repository root;
- ``date``: ISO date or UTC date-time of the run; ``commit``: the code measured (``git
  rev-parse --short HEAD``, ``-dirty`` when the tree had changes), or null;
- ``machine``: ``cpus`` (int), ``load_avg_start`` (the 1/5/15-minute load average when the
  run began, or null), optional ``note``;
- ``source``: ``"measured"``, or ``"transcribed from …"`` for figures copied from an
  older document;
- ``method``: what this run did, in a sentence or two (sizes, repeats, faults);
- ``figures``: the answer, ``{key: figure}``; a figure is ``label``, ``value`` (number or
  null), ``unit``, ``digits`` (decimals shown), and optionally ``spread`` ([min, max] over
  the repeats), ``p99``, ``runs`` and ``text`` (shown instead of the number, e.g. "none
  within 40 s");
- ``peers``: what else ran in the same invocation (the comparison is same-run);
- ``ratios``: same-run ratios, each ``label``, ``value``, optional ``bound`` (">" for a
  lower bound), ``digits``;
- ``tables``: ``caption``, ``columns`` (``key``, ``label``, optional ``digits``), ``rows``
  (cells: number, string, boolean, null, or a statistic ``{median, min, max, p99}``), optional
  ``detail`` (rendered folded);
- ``notes``: sentences about this run (outliers, what the figures do not show).

``validate`` checks all of it; ``write`` validates before writing; ``newest`` loads the
current answer to every question.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DIR",
    "FORMAT",
    "Figure",
    "add_arguments",
    "column",
    "command_line",
    "commit",
    "figure",
    "machine",
    "newest",
    "record",
    "stat",
    "validate",
    "write",
]

ROOT = Path(__file__).resolve().parents[1]
DIR = ROOT / "results"
FORMAT = 1
QUESTION = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}(?:T\d{2}:\d{2}:\d{2}Z)?$")
STAT_KEYS = frozenset({"median", "min", "max", "p99", "mean"})
TOP_KEYS: dict[str, type | tuple[type, ...]] = {
    "format": int,
    "question": str,
    "title": str,
    "command": str,
    "date": str,
    "commit": (str, type(None)),
    "machine": dict,
    "source": str,
    "method": str,
    "figures": dict,
    "peers": list,
    "ratios": list,
    "tables": list,
    "notes": list,
}
Figure = dict[str, Any]


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def stat(
    median: float | None = None,
    *,
    lo: float | None = None,
    hi: float | None = None,
    p99: float | None = None,
) -> dict[str, float] | None:
    """A statistic cell: the median with its range and/or p99; None when nothing is known."""
    out = {k: v for k, v in (("median", median), ("min", lo), ("max", hi), ("p99", p99))}
    kept = {k: float(v) for k, v in out.items() if v is not None}
    return kept or None


def figure(
    label: str,
    value: float | None,
    unit: str,
    digits: int = 2,
    *,
    spread: Sequence[float] | None = None,
    p99: float | None = None,
    runs: int | None = None,
    text: str | None = None,
) -> Figure:
    """One figure of an answer (see the module docstring)."""
    out: Figure = {"label": label, "value": value, "unit": unit, "digits": digits}
    if spread is not None:
        out["spread"] = [float(spread[0]), float(spread[1])]
    if p99 is not None:
        out["p99"] = p99
    if runs is not None:
        out["runs"] = runs
    if text is not None:
        out["text"] = text
    return out


def column(key: str, label: str, digits: int | None = None) -> dict[str, Any]:
    return {"key": key, "label": label} | ({} if digits is None else {"digits": digits})


def machine(note: str | None = None) -> dict[str, Any]:
    """This host: its CPUs and the load average now (call it when the run starts)."""
    out: dict[str, Any] = {
        "cpus": os.cpu_count() or 0,
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
    }
    if note:
        out["note"] = note
    return out


def commit(root: Path = ROOT) -> str | None:
    """The checkout's short commit, ``-dirty`` if tracked files changed; None outside git."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head


OUTPUT_OPTIONS = ("--out", "--results", "--workdir", "--no-results", "--lock")
"""Options that say where output goes or how runs on one host keep out of each other's way,
not what is measured: left out of a result's command (a work directory or a lock file is a
local path, and a reader's would differ)."""


def command_line(module: str, argv: Sequence[str]) -> str:
    """``python -m MODULE ARGS`` without the output options, as a result's command."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in OUTPUT_OPTIONS:
            skip = "=" not in arg and name != "--no-results"
            continue
        kept.append(arg)
    return " ".join(["python", "-m", module, *kept])


def _check_cell(where: str, cell: object, errors: list[str]) -> None:
    if cell is None or isinstance(cell, str | bool) or _number(cell):
        return
    statistic = isinstance(cell, dict) and cell and set(cell) <= STAT_KEYS
    if statistic and all(_number(v) for v in cell.values()):  # type: ignore[attr-defined]
        return
    errors.append(
        f"{where}: a cell is a number, a string, a boolean, null or a statistic, not {cell!r}"
    )


def _check_figure(where: str, f: object, errors: list[str]) -> None:
    if not isinstance(f, dict):
        errors.append(f"{where}: not an object")
        return
    for key, kind in (("label", str), ("unit", str), ("digits", int)):
        if not isinstance(f.get(key), kind):
            errors.append(f"{where}.{key}: missing or not {kind.__name__}")
    if f.get("value") is not None and not _number(f["value"]):
        errors.append(f"{where}.value: a number or null")
    if f.get("value") is None and not isinstance(f.get("text"), str):
        errors.append(f"{where}: a figure without a value needs a text")
    spread = f.get("spread")
    if spread is not None and not (
        isinstance(spread, list) and len(spread) == 2 and all(_number(v) for v in spread)
    ):
        errors.append(f"{where}.spread: [min, max]")
    elif spread is not None and spread[0] > spread[1]:
        errors.append(f"{where}.spread: min above max")
    for key in ("p99", "runs"):
        if f.get(key) is not None and not _number(f[key]):
            errors.append(f"{where}.{key}: a number")
    unknown = set(f) - {"label", "value", "unit", "digits", "spread", "p99", "runs", "text"}
    if unknown:
        errors.append(f"{where}: unknown keys {sorted(unknown)}")


def _check_table(where: str, t: object, errors: list[str]) -> None:
    if not isinstance(t, dict) or not isinstance(t.get("caption"), str):
        errors.append(f"{where}: an object with a caption")
        return
    cols = t.get("columns")
    if not isinstance(cols, list) or not cols:
        errors.append(f"{where}.columns: a non-empty list")
        return
    for c in cols:
        if not (isinstance(c, dict) and isinstance(c.get("key"), str) and "label" in c):
            errors.append(f"{where}.columns: each has a key and a label, not {c!r}")
    rows = t.get("rows")
    if not isinstance(rows, list) or not rows:
        errors.append(f"{where}.rows: a non-empty list")
        return
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            errors.append(f"{where}.rows[{i}]: an object")
            continue
        for key, cell in row.items():
            _check_cell(f"{where}.rows[{i}].{key}", cell, errors)


def validate(data: object) -> list[str]:
    """Everything wrong with a result file's content; empty when it is well formed."""
    if not isinstance(data, dict):
        return ["a result is a JSON object"]
    errors: list[str] = []
    for key, kind in TOP_KEYS.items():
        if key not in data:
            errors.append(f"{key}: missing")
        elif not isinstance(data[key], kind):
            errors.append(f"{key}: wrong type {type(data[key]).__name__}")
    if errors:
        return errors
    errors += [f"{k}: unknown key" for k in set(data) - set(TOP_KEYS)]
    if data["format"] != FORMAT:
        errors.append(f"format: {data['format']} (this code reads {FORMAT})")
    if not QUESTION.match(data["question"]):
        errors.append(f"question: {data['question']!r} is not [a-z0-9-]+")
    for key in ("title", "command", "method"):
        if not data[key].strip():
            errors.append(f"{key}: empty")
    if not DATE.match(data["date"]):
        errors.append(f"date: {data['date']!r} is not YYYY-MM-DD[THH:MM:SSZ]")
    if not (data["source"] == "measured" or data["source"].startswith("transcribed from ")):
        errors.append("source: 'measured' or 'transcribed from ...'")
    m = data["machine"]
    if not isinstance(m.get("cpus"), int) or m["cpus"] < 1:
        errors.append("machine.cpus: a positive int")
    load = m.get("load_avg_start")
    if load is not None and not (
        isinstance(load, list) and len(load) == 3 and all(_number(x) for x in load)
    ):
        errors.append("machine.load_avg_start: three numbers or null")
    if not data["figures"]:
        errors.append("figures: at least one")
    for key, f in data["figures"].items():
        if not QUESTION.match(key.replace("_", "-").replace(".", "-")):
            errors.append(f"figures: key {key!r} is not [a-z0-9_.-]+")
        _check_figure(f"figures.{key}", f, errors)
    for p in data["peers"]:
        if not isinstance(p, str):
            errors.append(f"peers: {p!r} is not a string")
    for i, r in enumerate(data["ratios"]):
        if not (
            isinstance(r, dict) and isinstance(r.get("label"), str) and _number(r.get("value"))
        ):
            errors.append(f"ratios[{i}]: label and value")
        elif r.get("bound") not in (None, ">"):
            errors.append(f"ratios[{i}].bound: null or '>'")
    for i, t in enumerate(data["tables"]):
        _check_table(f"tables[{i}]", t, errors)
    for n in data["notes"]:
        if not isinstance(n, str):
            errors.append(f"notes: {n!r} is not a string")
    return errors


class InvalidResult(ValueError):
    """A result file that does not follow the format; the message lists what is wrong."""


def write(
    *,
    question: str,
    title: str,
    command: str,
    method: str,
    figures: Mapping[str, Figure],
    machine_info: Mapping[str, Any],
    peers: Iterable[str] = (),
    ratios: Iterable[Mapping[str, Any]] = (),
    tables: Iterable[Mapping[str, Any]] = (),
    notes: Iterable[str] = (),
    directory: Path = DIR,
    now: datetime.datetime | None = None,
) -> Path:
    """Validate a run's result and write it as a new file; returns its path."""
    stamp = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    code = commit()
    data: dict[str, Any] = {
        "format": FORMAT,
        "question": question,
        "title": title,
        "command": command,
        "date": stamp,
        "commit": code,
        "machine": dict(machine_info),
        "source": "measured",
        "method": method,
        "figures": dict(figures),
        "peers": list(peers),
        "ratios": [dict(r) for r in ratios],
        "tables": [dict(t) for t in tables],
        "notes": list(notes),
    }
    errors = validate(json.loads(json.dumps(data)))
    if errors:
        raise InvalidResult(f"result {question!r}: " + "; ".join(errors))
    path = directory / question / f"{stamp.replace(':', '')}-{code or 'nogit'}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump(data))
    return path


def dump(data: Mapping[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def files(directory: Path = DIR) -> list[Path]:
    return sorted(directory.glob("*/*.json"))


def newest(directory: Path = DIR) -> dict[str, dict[str, Any]]:
    """The current answer to every question: its newest file by date (then file name).
    Raises InvalidResult naming the file if one does not follow the format."""
    best: dict[str, tuple[tuple[str, str], dict[str, Any]]] = {}
    for path in files(directory):
        data = json.loads(path.read_text())
        errors = validate(data)
        if errors:
            raise InvalidResult(f"{path}: " + "; ".join(errors))
        if data["question"] != path.parent.name:
            raise InvalidResult(f"{path}: question {data['question']!r} in the wrong folder")
        key = (data["date"], path.name)
        if data["question"] not in best or key > best[data["question"]][0]:
            best[data["question"]] = (key, data)
    return {q: d for q, (_, d) in sorted(best.items())}


@contextlib.contextmanager
def workdir(kept: Path | None, prefix: str, *, fresh: bool = False) -> Iterator[Path]:
    """A benchmark's working folder: ``kept`` (its ``--workdir``, created, kept for reading
    the logs afterwards; ``fresh``: refused if it exists, so that no earlier run's logs
    mix in) or a temporary folder removed on the way out."""
    if kept is not None:
        kept.mkdir(parents=True, exist_ok=not fresh)
        yield kept
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """A benchmark's ``--results DIR`` (default results/) and ``--no-results``."""
    parser.add_argument(
        "--results",
        type=Path,
        default=DIR,
        help="write the run's result file under this folder (bench/results.py)",
    )
    parser.add_argument("--no-results", action="store_true", help="write no result file")


def record(
    args: argparse.Namespace,
    module: str,
    argv: Sequence[str] | None,
    machine_info: Mapping[str, Any],
    built: Mapping[str, Any],
    notes: Iterable[str] = (),
) -> Path | None:
    """Write a benchmark's result (``built``: question, title, method, figures and
    optionally peers, ratios, tables) unless ``--no-results``; say where on stderr."""
    if args.no_results:
        return None
    path = write(
        command=command_line(module, sys.argv[1:] if argv is None else argv),
        machine_info=machine_info,
        notes=[*built.get("notes", ()), *notes],
        directory=args.results,
        **{k: v for k, v in built.items() if k != "notes"},
    )
    print(f"result: {path}", file=sys.stderr, flush=True)
    return path
