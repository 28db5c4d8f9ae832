"""The serf comparison benchmark runs end to end on a tiny cluster and writes its report.

No timing is asserted here (speed targets are checked by reading the benchmark's numbers,
see BENCHMARKS.md); this only proves the benchmark works and cleans up after itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import agent_cpu, compare_serf, render, results
from bench.procs import SERF


@pytest.mark.skipif(SERF is None, reason="serf not installed (scripts/setup.sh installs it)")
def test_benchmark_produces_a_report(tmp_path: Path) -> None:
    out = tmp_path / "BENCH.md"
    rc = compare_serf.main(
        [
            "--sizes",
            "3",
            "--runs",
            "serf:local,swim:fast",
            "--settle-s",
            "1",
            "--window-s",
            "2",
            "--kills",
            "1",
            "--out",
            str(out),
            "--results",
            str(tmp_path / "results"),
        ]
    )
    assert rc == 0
    (written,) = results.files(tmp_path / "results")  # the run's result file (bench/results.py)
    found = results.newest(tmp_path / "results")
    assert written.parent.name == "detection-3-serf-local-swim-fast" and list(found) == [
        written.parent.name
    ]
    current = found[written.parent.name]
    assert current["command"] == (
        "python -m bench.compare_serf --sizes 3 --runs serf:local,swim:fast --settle-s 1 "
        "--window-s 2 --kills 1"
    )
    assert current["figures"]["swim-fast-3.last_dead_s"]["value"] is not None
    assert "### Detection, CPU and traffic at 3 agents: serf `local` and swim `fast`" in (
        render.render(found)
    )
    text = out.read_text()
    assert "| serf | local | 3 |" in text and "| swim | fast | 3 |" in text
    assert "| swim `fast` | 3 |" in text.split("Ratios to serf `local`")[1]
    main, budget = text.split("Detection budget")
    for line in main.splitlines():
        if line.startswith(("| serf | local | 3", "| swim | fast | 3")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert not cells[6].startswith("n/a"), "every survivor saw the killed agent dead"
            assert cells[9] == "0 (0)", "no false positives on an idle loopback cluster"
    rows = [line for line in budget.splitlines() if line.startswith(("| serf |", "| swim |"))]
    assert len(rows) == 2
    for row in rows:  # to suspicion, suspicion, spread, total: each "median / p99"
        phases = [c.strip() for c in row.strip("|").split("|")][3:]
        assert len(phases) == 4 and all(" / " in p and "n/a" not in p for p in phases), row


def test_runs_are_checked() -> None:
    assert compare_serf.parse_runs(None, "lan") == [("serf", "lan"), ("swim", "lan")]
    assert compare_serf.parse_runs("serf:local, swim:fast", "lan") == [
        ("serf", "local"),
        ("swim", "fast"),
    ]
    for bad in ("serf:fast", "swim:turbo", "etcd:lan", "swim"):
        with pytest.raises(ValueError, match=r"serf has no profile|bad run"):
            compare_serf.parse_runs(bad, "lan")


def test_agent_cpu_measures_a_tiny_cluster_and_summarizes_a_profile(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """bench/agent_cpu.py end to end: two agents of this checkout, one short window; and
    the committed profile's summary (no numbers asserted)."""
    root = Path(__file__).resolve().parents[1]
    rc = agent_cpu.main(
        [
            *("--trees", str(root), "--sizes", "2", "--profiles", "fast", "--reps", "1"),
            *("--settle-s", "0.5", "--window-s", "1", "--results", str(tmp_path)),
        ]
    )
    assert rc == 0
    assert "N=2 fast" in capsys.readouterr().out
    (current,) = results.newest(tmp_path).values()
    assert current["command"].startswith("python -m bench.agent_cpu --trees . --sizes 2")
    assert agent_cpu.main(["--summarize", str(root / "bench/profiles/fast64-new.txt")]) == 0
    assert "| self, by package % |" in capsys.readouterr().out
