"""Benchmark results are data, and the documents that quote them follow the data.

- BENCHMARKS.md is exactly what ``python -m bench.render`` makes of results/ (the newest
  file per question), and so is README.md's headline-figures block when README has the
  markers: neither is edited by hand.
- Every file under results/ follows the format of bench/results.py.
- A headline figure quoted elsewhere (README.md, docs/*.md, the comments of
  packaging/*.toml) matches a current result. A quote is found by its phrase (``CLAIMS``:
  "0.71 s at 64 agents", "3.25x `lan`'s CPU", "4.40 ms per agent-second", ...); a quoted
  number matches a figure when it equals it at the quote's precision ("~0.7 s" matches
  0.71 s), and a quoted range when it contains one.
- BENCHMARKS.md reads as a reference: a title, no repeated heading, no scratch paths, no
  work-tracking words (issue numbers, numbered work steps).
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench import render, results

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
README = ROOT / "README.md"
REGENERATE = "python -m bench.render"

Found = Mapping[str, Mapping[str, Any]]


@pytest.fixture(scope="module")
def found() -> Found:
    return results.newest()


def test_benchmarks_md_is_rendered_from_the_results(found: Found) -> None:
    assert BENCHMARKS.read_text() == render.render(found), (
        f"BENCHMARKS.md is generated from results/ and differs from it: run `{REGENERATE}` "
        "(edit results/ or bench/render.py, never BENCHMARKS.md)"
    )


def test_readme_headline_block_is_rendered_from_the_results(found: Found) -> None:
    text = README.read_text()
    if render.BEGIN not in text:
        pytest.skip(f"README.md has no {render.BEGIN} block")
    assert text == render.fill_readme(text, render.headline_block(found)), (
        f"README.md's headline-figures block differs from results/: run `{REGENERATE}`"
    )


def test_the_renderer_fills_the_marked_block_and_nothing_else(tmp_path: Path) -> None:
    """On a copy: the block between the markers is replaced, the rest kept; without the
    markers README is left alone; --check tells a stale file from a current one."""
    marked = tmp_path / "README.md"
    before, after = "# Title\n\nintro\n\n", "\n\n## Next\n\ntext\n"
    marked.write_text(f"{before}{render.BEGIN}\nstale\n{render.END}{after}")
    plain = tmp_path / "PLAIN.md"
    plain.write_text(before + after)
    out = tmp_path / "BENCHMARKS.md"
    assert render.main(["--readme", str(marked), "--out", str(out), "--check"]) == 1
    assert render.main(["--readme", str(marked), "--out", str(out)]) == 0
    text = marked.read_text()
    assert text.startswith(before + render.BEGIN + "\n| question |") and text.endswith(
        render.END + after
    )
    assert "stale" not in text and "](BENCHMARKS.md#" in text
    for h in render.HEADLINES:  # every headline row links to a section that exists
        assert f"[{h.label}](BENCHMARKS.md#" in text, h.label
    anchors = {render.slug(line.lstrip("#").strip()) for line in _headings(out.read_text())}
    for link in re.findall(r"\(BENCHMARKS\.md#([^)]+)\)", text):
        assert link in anchors, link
    assert render.main(["--readme", str(marked), "--out", str(out), "--check"]) == 0
    assert render.main(["--readme", str(plain), "--out", str(out)]) == 0
    assert plain.read_text() == before + after


def test_every_result_file_follows_the_format() -> None:
    paths = results.files()
    assert paths, "results/ holds no result file"
    for path in paths:
        data = json.loads(path.read_text())
        assert results.validate(data) == [], path
        assert data["question"] == path.parent.name, path
        for key, figure in data["figures"].items():
            assert figure.get("value") is not None or figure.get("text"), (path, key)
    titles = [d["title"] for d in results.newest().values()]
    assert len(titles) == len(set(titles)), "two questions share a title"


def test_the_format_check_finds_what_is_wrong() -> None:
    good = json.loads(results.files()[0].read_text())
    assert results.validate(good) == []
    bad = dict(good, date="yesterday", source="made up", figures={})
    del bad["command"]
    errors = results.validate(bad)
    assert "command: missing" in errors
    bad["command"] = "python -m bench.x"
    errors = results.validate(bad)
    assert any(e.startswith("date:") for e in errors)
    assert any(e.startswith("source:") for e in errors)
    assert any(e.startswith("figures:") for e in errors)
    table = {"caption": "t", "columns": [{"key": "a", "label": "A"}], "rows": [{"a": [1, 2]}]}
    cell = results.validate(dict(good, tables=[table]))
    assert cell and "tables[0].rows[0].a" in cell[0]
    figure = dict(good, figures={"x": {"label": "x", "value": None, "unit": "s", "digits": 2}})
    assert any("needs a text" in e for e in results.validate(figure))


def test_a_result_written_by_a_benchmark_becomes_the_current_answer(tmp_path: Path) -> None:
    """bench/results.py ``write``: the file validates, lands in its question's folder, and
    the newest one is the one rendered."""
    fig = {"t": results.figure("time", 1.0, "s")}
    args: dict[str, Any] = {
        "question": "detection-3-swim-fast",
        "title": "A title",
        "command": results.command_line("bench.x", ["--n", "3", "--out", "X.md"]),
        "method": "m",
        "figures": fig,
        "machine_info": results.machine(),
        "directory": tmp_path,
    }
    first = results.write(**args)
    later = results.write(
        **args | {"figures": {"t": results.figure("time", 2.0, "s")}},
        now=datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC),
    )
    assert first.parent == later.parent == tmp_path / "detection-3-swim-fast"
    current = results.newest(tmp_path)["detection-3-swim-fast"]
    assert (
        current["figures"]["t"]["value"] == 2.0 and current["command"] == "python -m bench.x --n 3"
    )
    assert "**2.00 s**" in render.render(results.newest(tmp_path))
    with pytest.raises(results.InvalidResult, match="question"):
        results.write(**args | {"question": "Not An Id"})


# --- headline figures quoted in the documents


def _figures(found: Found, prefix: str, key: Callable[[str], bool]) -> set[float]:
    """Every value, range end and p99 of the matching figures of current results."""
    out: set[float] = set()
    for question, r in found.items():
        if not question.startswith(prefix):
            continue
        for k, f in r["figures"].items():
            if key(k) and f.get("value") is not None:
                out.add(float(f["value"]))
                out.update(float(x) for x in f.get("spread") or ())
                if f.get("p99") is not None:
                    out.add(float(f["p99"]))
    return out


def _ratios(found: Found, prefix: str, words: Iterable[str]) -> set[float]:
    return {
        float(x["value"])
        for q, r in found.items()
        if q.startswith(prefix)
        for x in r["ratios"]
        if all(w in x["label"] for w in words)
    }


@dataclass(frozen=True)
class Claim:
    """A phrase that quotes a headline figure (groups ``a`` and optionally ``b``, a range)
    and the current figures it may quote."""

    what: str
    pattern: re.Pattern[str]
    allowed: Callable[[Found], set[float]]


NUM = r"(?<![\d.,])(?P<a>\d+(?:\.\d+)?)(?:–(?P<b>\d+(?:\.\d+)?))?"
CLAIMS = (
    Claim(
        "detection at 64 agents (kill → dead everywhere)",
        re.compile(NUM + r" s(?: median)? at 64 (?:real )?(?:agents|nodes)\b"),
        lambda f: _figures(f, "detection-", lambda k: k.endswith("-64.last_dead_s")),
    ),
    Claim(
        "`fast`'s CPU against `lan`'s",
        re.compile(NUM + r" ?(?:x|×) (?:(?:`lan`|lan)'s CPU|CPU at 64 agents)"),
        lambda f: _ratios(f, "detection-", ("`fast` / swim `lan`", "CPU")),
    ),
    Claim(
        "agent CPU per agent-second",
        re.compile(NUM + r" ms(?: per agent-second|/agent-s)\b"),
        lambda f: _figures(f, "detection-", lambda k: k.endswith(".cpu_ms")),
    ),
    Claim(
        "simulator wall time",
        re.compile(NUM + r" s of wall\b"),
        lambda f: _figures(f, "sim-scale-", lambda k: k == "wall_s"),
    ),
    Claim(
        "step efficiency",
        re.compile(r"step efficiency(?: of)? " + NUM + r" ?%"),
        lambda f: _figures(f, "step-efficiency-", lambda k: k.endswith(".efficiency")),
    ),
    Claim(
        "alert latency",
        re.compile(r"webhook (?:in|after) " + NUM + r" s\b"),
        lambda f: _figures(f, "alert-latency", lambda k: k == "fire_s"),
    ),
    Claim(
        "Slurm drain after a SIGKILL",
        re.compile(r"(?:drains its node in about |State=DRAIN[^\n]{0,40}?about )" + NUM + " s"),
        lambda f: _figures(f, "slurm-drain", lambda k: k == "drain_s"),
    ),
)
TARGET_WORDS = ("under ", "≤ ", "< ", "at most ", "target ")
"""A number right after these is a target or a bound, not a measured figure."""


def _matches(quoted: str, allowed: set[float]) -> bool:
    digits = len(quoted.partition(".")[2])
    q = float(quoted)
    return any(abs(v - q) <= 0.5 * 10**-digits + 1e-9 for v in allowed)


def quotes(text: str, claim: Claim, allowed: set[float]) -> list[str]:
    """The quotes of ``claim`` in ``text`` that no current figure supports."""
    wrong = []
    for m in claim.pattern.finditer(text):
        if text[max(0, m.start("a") - 9) : m.start("a")].endswith(TARGET_WORDS):
            continue
        a, b = m.group("a"), m.group("b")
        if b is None:
            ok = _matches(a, allowed)
        else:  # a range: it holds a current figure, or its ends are current figures
            inside = any(float(a) <= v <= float(b) for v in allowed)
            ok = inside or (_matches(a, allowed) and _matches(b, allowed))
        if not ok:
            line = text.count("\n", 0, m.start()) + 1
            wrong.append(f"line {line}: {m.group(0)!r} (current: {sorted(allowed)})")
    return wrong


def _documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("packaging/*.toml"))]


def test_headline_figures_quoted_in_the_docs_match_the_results(found: Found) -> None:
    wrong = []
    for claim in CLAIMS:
        allowed = claim.allowed(found)
        assert allowed, f"no current result for {claim.what}"
        for path in _documents():
            for w in quotes(path.read_text(), claim, allowed):
                wrong.append(f"{path.relative_to(ROOT)} {w}: {claim.what}")
    assert not wrong, (
        "figures quoted in the docs that no current result gives (quote the current one, "
        "from BENCHMARKS.md or results/):\n" + "\n".join(wrong)
    )


def test_the_quote_scan_finds_a_stale_figure(found: Found) -> None:
    claim = CLAIMS[0]
    allowed = claim.allowed(found)
    assert quotes("dead everywhere in ~1.3 s at 64 agents", claim, allowed)
    fast = found["detection-64-serf-local-swim-fast-swim-lan"]["figures"]
    now = fast["swim-fast-64.last_dead_s"]["value"]
    assert not quotes(f"dead everywhere in {now:.2f} s at 64 agents", claim, allowed)
    assert not quotes(f"in ~{now:.1f} s at 64 agents", claim, allowed)
    assert quotes("≈ 9.9x lan's CPU", CLAIMS[1], CLAIMS[1].allowed(found))
    assert not quotes("(target under 5 ms/agent-s)", CLAIMS[2], CLAIMS[2].allowed(found))


# --- BENCHMARKS.md reads as a reference


def _headings(text: str) -> list[str]:
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line)
    return out


WORK_WORDS = re.compile(r"\b(?:issue|stop|round|item|session)s? #?\d+\b|\bissue-\d+|/tmp/", re.I)


def test_benchmarks_md_reads_as_a_reference() -> None:
    text = BENCHMARKS.read_text()
    heads = _headings(text)
    assert heads[0] == "# Benchmarks" and sum(h.startswith("# ") for h in heads) == 1
    titles = [h.lstrip("#").strip() for h in heads]
    repeated = {t for t in titles if titles.count(t) > 1}
    assert not repeated, f"repeated headings: {sorted(repeated)}"
    for t in titles[2:]:  # past the title and "Contents", every heading is in the contents
        assert f"](#{render.slug(t)})" in text, t
    found = WORK_WORDS.findall(text)
    assert not found, f"BENCHMARKS.md names work steps or scratch paths: {found}"


def test_a_results_command_leaves_out_local_paths() -> None:
    argv = ["--n", "3", "--lock", "/x/measure.lock", "--workdir=/tmp/w", "--results", "r", "--m"]
    assert results.command_line("bench.x", argv) == "python -m bench.x --n 3 --m"
    for path in sorted(ROOT.glob("results/**/*.json")):
        assert "/work/" not in json.loads(path.read_text())["command"], path


def test_a_benchmark_workdir_is_kept_or_temporary(tmp_path: Path) -> None:
    from bench.results import workdir

    with workdir(None, "swim-test-") as tmp:
        assert tmp.is_dir() and tmp.name.startswith("swim-test-")
    assert not tmp.exists(), "a temporary folder goes on the way out"
    kept = tmp_path / "a" / "b"
    with workdir(kept, "swim-test-") as got:
        assert got == kept and kept.is_dir()
    with workdir(kept, "swim-test-") as again:
        assert again == kept, "kept twice: fine unless fresh"
    assert kept.is_dir(), "kept after the run"
    with pytest.raises(FileExistsError), workdir(kept, "swim-test-", fresh=True):
        pass
