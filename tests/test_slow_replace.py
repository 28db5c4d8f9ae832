"""bench/slow_replace.py's counting: steps per second in a window, the longest gap between
steps, the failure-free rate, and a run's numbers becoming a well-formed result that
renders (the benchmark itself runs for minutes: not here)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import render, results, slow_replace


def _steps(times: list[float], first: int = 0) -> list[dict[str, Any]]:
    return [{"step": first + i, "t": t} for i, t in enumerate(times)]


def test_rate_counts_steps_between_the_first_and_last_record_inside_the_window() -> None:
    records = _steps([0.0, 1.0, 2.0, 3.0, 4.0, 4.5, 5.0, 9.0], first=100)
    # inside [0.5, 5.5): steps 101..106 between t 1.0 and 5.0: 5 steps in 4 s
    assert slow_replace.rate(records, 0.5, 5.5) == 5 / 4
    assert slow_replace.rate(records, 0.0, 1.0) is None  # one record only
    assert slow_replace.rate(records, 10.0, 20.0) is None
    # a re-formation that re-runs no step: the step counter, not the record count
    assert slow_replace.rate([*_steps([0.0, 1.0]), {"step": 5, "t": 2.0}], 0, 3) == 2.5


def test_longest_gap_is_the_largest_interval_between_consecutive_steps() -> None:
    records = _steps([0.0, 0.1, 0.2, 0.9, 1.0, 3.0])
    assert slow_replace.longest_gap(records, 0.0, 1.5) == 0.9 - 0.2
    assert slow_replace.longest_gap(records, 0.0, 3.5) == 2.0
    assert slow_replace.longest_gap(records, 2.0, 2.5) is None


def _run() -> dict[str, Any]:
    def trial(policy: str, factor: float, after: float | None) -> dict[str, Any]:
        row = {"policy": policy, "factor": factor, "victim": "n2", "steps_to_flag": 21}
        row |= {"flag_s": 1.5, "slowed_steps_per_s": 12.0, "steps_per_s": after, "load": "3 2 1"}
        if policy == "replace":
            return row | {"exit_codes": [3, 3], "swap_s": 0.2, "pause_s": 0.25, "spare": "n3"}
        return row | {"still_training": True}

    return {
        "load_before": "1 1 1",
        "load_after": "2 2 2",
        "clean": {"steps_per_s": 18.0, "load": "1 1 1"},
        "clean_end": {"steps_per_s": 22.0, "load": "2 2 2"},
        "trials": [
            trial("replace", 1.5, 19.0),
            trial("replace", 3.0, 21.0),
            trial("kept (no spare)", 1.5, 16.0),
            trial("kept (no spare)", 3.0, None),  # a window with no figure
        ],
    }


def test_a_run_becomes_a_result_with_ratios_to_failure_free_and_to_the_kept_node(
    tmp_path: Path,
) -> None:
    run = _run()
    assert slow_replace.failure_free(run) == 20.0
    assert slow_replace.failure_free(run | {"clean_end": {"steps_per_s": None}}) == 18.0
    args = argparse.Namespace(window_s=25.0, step_work=0.02)
    built = slow_replace.built(run, args)
    ratios = {r["label"]: r["value"] for r in built["ratios"]}
    assert ratios == {
        "slowed 1.5x: after the swap / failure-free": 19.0 / 20.0,
        "slowed 3.0x: after the swap / failure-free": 21.0 / 20.0,
        "slowed 1.5x: with the slow node kept / failure-free": 16.0 / 20.0,
        "slowed 1.5x: after the swap / kept": 19.0 / 16.0,
    }
    assert built["figures"]["replace_3_0x_swap_s"]["value"] == 0.2
    assert built["figures"]["kept_3_0x_ratio"]["value"] is None
    path = results.write(
        command="python -m bench.slow_replace",
        machine_info=results.machine(),
        directory=tmp_path,
        **built,
    )
    page = render.render(results.newest(path.parents[1]))
    assert "Fail-slow with replace" in page and "after the swap / kept" in page
