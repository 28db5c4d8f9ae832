"""The operator's parameter table (simulations.params, docs/tuning.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulations import params as params_cli
from simulations import scaling
from simulations.experiments.frontier import explore
from simulations.reports import params
from simulations.reports import scaling as scaling_report


@pytest.mark.parametrize(
    ("profile", "n", "expected"),
    [
        # memberlist DefaultLANConfig at 100 members (docs/design.md §5.1):
        # suspicion min = 4·log10(100)·1 s, max = 6·min, k = 4 − 2, retransmit
        # 4·ceil(log10(101)), push-pull 30 s · (ceil(log2 100 − 5) + 1)
        ("lan", 100, (1000, "500", 8.0, 48.0, 2, 12, 90.0)),
        ("lan", 10_000, (1000, "500", 16.0, 96.0, 2, 20, 300.0)),
        # DefaultWANConfig: 5 s probes, 3 s timeout, α = 6
        ("wan", 1_000, (5000, "3,000", 90.0, 540.0, 4, 16, 360.0)),
        # Config.fast: derived window 2·2·(ceil(log5 100)+1)·(50 + 1) ms, β = 4
        ("fast", 100, (250, "100 (adaptive 20–125)", 0.816, 3.264, 2, 12, 90.0)),
    ],
)
def test_computed_rows_are_the_node_formulas(
    profile: str, n: int, expected: tuple[int, str, float, float, int, int, float]
) -> None:
    row = params.computed_row(profile, n, rtt_ms=2)
    got = (
        row["probe_interval_ms"],
        row["probe_timeout_ms"],
        row["suspicion_min_s"],
        row["suspicion_max_s"],
        row["confirmations_k"],
        row["retransmit_limit"],
        row["push_pull_s"],
    )
    assert got == pytest.approx(expected)


def test_the_computed_table_has_every_profile_and_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert params_cli.main(["--nodes", "10,10000"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 4 * 2
    assert lines[2].startswith("| lan | 10 | 1,000 | 500 |")


def test_measured_rows_from_a_scaling_run(tmp_path: Path) -> None:
    sweep = scaling.parse(
        ["--nodes", "8", "--variants", "lan", "--conditions", "clean,loss10", "--crashes", "1",
         "--seeds", "1", "--out", str(tmp_path)]
    )  # fmt: skip
    sweep.add(8, explore(sweep.options(0)), 0.0)
    scaling_report.write(sweep, tmp_path)
    (row,) = params.measured_rows(tmp_path)
    assert row["profile"] == "lan" and row["n"] == 8
    assert row["median_s"] is not None and 3.0 < row["median_s"] < 30.0
    assert row["fp_loss10"].startswith("0 in ") and row["fp_loss10"].endswith(" h")
    assert "fp_loss1" not in row  # that condition was not run
    assert row["bytes_per_s"] > 0
    (cmp,) = params.compare_rows(tmp_path)
    assert cmp["variant"] == "lan" and cmp["pkts"] == pytest.approx(row["pkts_per_s"])
    assert cmp["det_clean"].count(" / ") == 1 and cmp["det_slow1"] == "—"
    with pytest.raises(SystemExit, match=r"no cells\.csv"):
        params_cli.main(["--measured", str(tmp_path / "missing")])


def test_measured_rows_take_later_cells_over_earlier_ones(tmp_path: Path) -> None:
    """docs/tuning.md's table: clean runs of one sweep, loss runs of another (lossy TCP)."""
    dirs = []
    runs = (("all", "clean,loss10", "1", "1"), ("loss", "loss10", "2", "2"))
    for name, conditions, seed, crashes in runs:
        out = tmp_path / name
        sweep = scaling.parse(
            ["--nodes", "8", "--variants", "lan", "--conditions", conditions, "--crashes",
             crashes, "--seeds", seed, "--out", str(out)]
        )  # fmt: skip
        sweep.add(8, explore(sweep.options(0)), 0.0)
        scaling_report.write(sweep, out)
        dirs.append(out)
    (first,) = params.measured_rows(dirs[0])
    (second,) = params.measured_rows(dirs[1])
    (merged,) = params.measured_rows(*dirs)
    assert merged["median_s"] == first["median_s"] is not None  # clean: only in the first
    assert "median_s" not in second or second["median_s"] is None
    assert first["median_loss10_s"] != second["median_loss10_s"]  # another seed
    assert merged["median_loss10_s"] == second["median_loss10_s"]
    assert merged["fp_loss10"] == second["fp_loss10"]
