"""The frontier exploration's CI path, and its Pareto helper on hand-made tables."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from simulations.experiments import frontier
from simulations.experiments.frontier import Options, explore, pareto, quantile
from simulations.frontier import seeds
from simulations.reports import frontier as frontier_report


@pytest.fixture(scope="module")
def ci_report() -> frontier.Report:
    return explore(Options.ci())


def test_every_crash_is_detected_and_fast_beats_lan(ci_report: frontier.Report) -> None:
    assert len(ci_report.runs) == 4 and len(ci_report.crashes) == 8
    assert all(c["detected"] and c["all_dead_s"] is not None for c in ci_report.crashes)
    by = {r["variant"]: r for r in ci_report.variants}
    assert by["fast"]["all_dead_median_s"] < by["lan"]["all_dead_median_s"]
    assert by["lan"]["load_vs_lan"] == pytest.approx(1.0)


def test_rows_and_columns(ci_report: frontier.Report, tmp_path: Path) -> None:
    run_cols = {"variant", "condition", "n", "seed", "crashes", "detected", "trace_hash"}
    run_cols |= {"fp_dead_about_healthy_members", "fp_suspect_about_healthy_members"}
    run_cols |= {"fp_dead_about_slow_members", "pkts_out_per_member_per_s", "sim_s"}
    assert all(run_cols <= set(r) for r in ci_report.runs)
    crash_cols = {"variant", "condition", "seed", "crash", "all_dead_s", "first_suspect_s"}
    crash_cols |= {"healthy_dead_s", "all_dead_eventually_s", "dead_before_crash"}
    assert all(crash_cols <= set(c) for c in ci_report.crashes)
    assert {(c["variant"], c["condition"]) for c in ci_report.cells} == {
        (v, c) for v in ("lan", "fast") for c in ("clean", "loss10")
    }
    assert set(frontier_report.VARIANT_COLS) <= set(ci_report.variants[0])
    ci_report.command = "python -m simulations.frontier --ci"
    frontier_report.write(ci_report, tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "python -m simulations.frontier --ci" in summary.splitlines()[2]
    assert "| fast |" in summary
    assert (tmp_path / "runs.csv").read_text().startswith("variant,condition,n,seed,")
    assert len((tmp_path / "crashes.csv").read_text().splitlines()) == 1 + 8


def test_the_detection_budget_cuts_each_crash_in_order(ci_report: frontier.Report) -> None:
    """crash → first ping to the victim → first suspect → first dead → all dead, and the
    probe phase is about one probe interval: the failed probe's indirect round ends there
    (docs/design.md §5.2)."""
    for c in ci_report.crashes:
        times = [0.0, c["first_ping_s"], c["first_suspect_s"], c["first_dead_s"], c["all_dead_s"]]
        assert None not in times, c
        assert times == sorted(times), c
        interval_s = frontier.variant_config(c["variant"]).probe_interval_ms / 1000
        assert c["first_suspect_s"] - c["first_ping_s"] <= interval_s + 0.05, c
    rows = frontier_report.budget_rows(ci_report.crashes)
    assert {(r["variant"], r["condition"]) for r in rows} == {
        (v, c) for v in ("lan", "fast") for c in ("clean", "loss10")
    }
    by = {(r["variant"], r["condition"]): r for r in rows}
    # fast's gains are in the probe and the suspicion window, not the wait for a prober
    assert by["fast", "clean"]["suspicion_median_s"] < by["lan", "clean"]["suspicion_median_s"]
    assert by["fast", "clean"]["probe_median_s"] < by["lan", "clean"]["probe_median_s"]
    table = frontier_report.budget_table(ci_report.crashes)
    assert table[0].startswith("| variant | condition | crashes | wait | probe |")
    assert len(table) == 2 + 4


def test_same_seed_same_hashes_whatever_the_jobs(ci_report: frontier.Report) -> None:
    again = explore(Options.ci(jobs=2))
    assert [r["trace_hash"] for r in again.runs] == [r["trace_hash"] for r in ci_report.runs]
    assert again.trace_hash == ci_report.trace_hash
    other = frontier.run_one(frontier.RunSpec("fast", "clean", 16, 2, 1))
    assert other.row["trace_hash"] != ci_report.runs[2]["trace_hash"]


def _rows(points: list[tuple[float | None, ...]]) -> list[dict[str, Any]]:
    return [{"a": p[0], "b": p[1], "c": p[2]} for p in points]


@pytest.mark.parametrize(
    ("points", "want"),
    [
        ([(1, 1, 1)], [True]),
        ([(1, 1, 1), (2, 2, 2)], [True, False]),
        ([(1, 2, 0), (2, 1, 0)], [True, True]),  # a trade-off: both on the frontier
        ([(1, 1, 0), (1, 1, 0)], [True, True]),  # equal: neither dominates the other
        ([(1, 1, 0), (1, 1, 1)], [True, False]),  # no worse anywhere, better in one
        ([(1, 5, 0), (2, 2, 0), (3, 1, 0), (3, 3, 0)], [True, True, True, False]),
        ([(1, 1, None), (5, 5, 5)], [True, True]),  # None is infinitely bad
        ([(1, 1, math.inf), (1, 1, 3)], [False, True]),
    ],
)
def test_pareto(points: list[tuple[float | None, ...]], want: list[bool]) -> None:
    assert pareto(_rows(points), ["a", "b", "c"]) == want


def test_quantile_is_nearest_rank() -> None:
    assert quantile([], 0.5) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([float(x) for x in range(1, 101)], 0.99) == 99.0
    assert quantile([1.0, math.inf], 0.99) == math.inf


def test_seeds_take_lists_and_ranges() -> None:
    assert seeds("1,2") == [1, 2]
    assert seeds("3-5, 9") == [3, 4, 5, 9]
    with pytest.raises(SystemExit, match="--seeds"):
        seeds("1,x")
