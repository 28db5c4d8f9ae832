"""The pure parts of the mixed-fault step-efficiency benchmark (bench/mixed_results.py):
the fault rotation, what one fault cost from step records, the efficiency figures, and a
result file that validates."""

from __future__ import annotations

from typing import Any

import pytest

from bench import mixed_efficiency, mixed_results
from bench import results as result_files


def test_kinds_are_checked() -> None:
    assert mixed_results.kinds_of("power,kill") == ("power", "kill")
    for bad in ("", "power,power", "reboot", "kill,,boom"):
        with pytest.raises(ValueError, match="--faults"):
            mixed_results.kinds_of(bad)


def test_every_kind_meets_every_slot_the_leaders_included() -> None:
    order = ["a", "b", "c"]  # global rank order: "a" leads
    got = [mixed_results.schedule(i, mixed_results.KINDS, order) for i in range(12)]
    assert {k for k, _ in got} == set(mixed_results.KINDS)
    assert set(got) == {(k, v) for k in mixed_results.KINDS for v in order}
    assert got[0] == ("power", "a") and got[1] == ("kill", "b")
    with pytest.raises(ValueError):
        mixed_results.schedule(0, mixed_results.KINDS, [])


def rec(t: float, step: int, rank: int, world: int, node: str, pid: int, forms: int) -> Any:
    return {
        "t": t,
        "step": step,
        "rank": rank,
        "world": world,
        "node": node,
        "pid": pid,
        "formations": forms,
    }


def job() -> list[dict[str, Any]]:
    """Local rank 0 of n1 (leader), n2, n3 at world 6 for steps 0-9 (t = step); n2 dies
    at t=9.5; the spare n4 is drafted: steps 9-11 again... from step 9 (one rolled back)
    at world 6, first at t=11."""
    out = []
    for step in range(10):
        for rank, (node, pid) in enumerate([("n1", 1), ("n2", 2), ("n3", 3)]):
            out.append(rec(float(step), step, 2 * rank, 6, node, pid, 1))
    for i, step in enumerate(range(9, 12)):
        for rank, (node, pid) in enumerate([("n1", 1), ("n4", 4), ("n3", 3)]):
            out.append(rec(11.0 + i, step, 2 * rank, 6, node, pid, 2))
    return out


def test_one_fault_drafted_a_spare_and_rolled_back_one_step() -> None:
    fault = {"victim": "n2", "t": 9.5, "spares": ["n4"]}
    got = mixed_results.after_fault(job(), fault, 100.0, 6)
    assert got["recover_s"] == pytest.approx(1.5)
    assert got["same_world_s"] == pytest.approx(1.5)
    assert got["recover_world"] == 6
    assert got["drafted"] is True
    assert got["rolled_back"] == 1


def test_a_fault_the_job_never_recovered_from() -> None:
    fault = {"victim": "n2", "t": 9.5, "spares": ["n4"]}
    got = mixed_results.after_fault(job(), fault, 10.0, 6)  # the next fault came first
    assert got["recover_s"] is None and got["same_world_s"] is None
    assert got["drafted"] is False


def test_efficiency_counts_steps_against_the_failure_free_rate() -> None:
    records = job()  # 1 step/s on t 0-9, then nothing until 11: 3 steps in 11-13
    got = mixed_results.summary(records, (-0.5, 9.5), (9.5, 13.5))
    assert got["baseline_rate"] == pytest.approx(1.0)
    assert got["faulty_steps"] == 3
    assert got["efficiency"] == pytest.approx(3 / 4)
    assert got["rank_efficiency"] == pytest.approx(3 / 4)
    assert got["progress"] == 2  # step 9 done twice
    assert got["baseline_step_s"] == pytest.approx(1.0)
    assert got["stall_s"] == 0.0  # a 1.5 s gap is no stall (over 4 failure-free steps is)
    late = mixed_results.summary(records, (-0.5, 9.5), (9.5, 20.5))  # 7.5 s without a step
    assert late["stall_s"] == pytest.approx(7.5 - 1.0)
    assert late["time_efficiency"] == pytest.approx(1 - 6.5 / 11)


def test_the_result_file_validates() -> None:
    records = job()
    fault: dict[str, Any] = {
        "kind": "power",
        "victim": "n2",
        "leader": False,
        "t": 9.5,
        "waited_s": 0.2,
        "spares": ["n4"],
        "out_s": 1.6,
        "dropped": 12,
    }
    fault |= mixed_results.after_fault(records, fault, 100.0, 6)
    result = {
        "nodes": 3,
        "ranks": 2,
        "spares": 1,
        "profile": "fast",
        "kinds": list(mixed_results.KINDS),
        "minutes": 0.1,
        "every_s": 30.0,
        "baseline_s": 10.0,
        "step_sleep": 0.03,
        "step_work": 0.02,
        "slow_factor": 3.0,
        "restart_nice": 19,
        "load_before": "1 / 1 / 1",
        "load_after": "1 / 1 / 1",
        "problems": [],
        "faults": [fault],
        **mixed_results.summary(records, (-0.5, 9.5), (9.5, 13.5)),
    }
    built = mixed_results.built(result)
    data = {
        "format": result_files.FORMAT,
        "command": "python -m bench.mixed_efficiency",
        "date": "2026-01-01",
        "commit": None,
        "machine": {"cpus": 2, "load_avg_start": None},
        "source": "measured",
        "peers": [],
        "ratios": [],
        **built,
    }
    assert result_files.validate(data) == []
    assert data["question"] == "step-efficiency-mixed-3x2-fast-1spare"
    assert data["figures"]["efficiency"]["value"] == 75.0
    text = mixed_results.report(result)
    assert "power loss" in text and "n2" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--faults", "reboot"],
        ["--every-s", "1"],
        ["--minutes", "0"],
        ["--spares", "0"],
        ["--restart-nice", "20"],
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        mixed_efficiency.main(argv)
    assert exc.value.code == 2


def test_a_restart_window_costs_the_steps_it_did_not_complete() -> None:
    from bench import mixed_restarts

    # 0.1 s a step, then a stall (1 s, not counted), then a 2 s restart window at 0.125 s
    # a step (16 steps where 20 were due), then the normal pace again
    ts = [round(0.1 * i, 3) for i in range(50)]
    ts += [5.9 + 1.0]
    ts += [round(ts[-1] + 0.125 * i, 3) for i in range(1, 17)]
    ts += [round(ts[-1] + 0.1 * i, 3) for i in range(1, 30)]
    recs = [{"t": t, "rank": 0, "world": 6, "step": i} for i, t in enumerate(ts)]
    start = 6.9
    got = mixed_restarts.cost(recs, [(start, start + 2.0)])
    assert got["step_s"] == pytest.approx(0.1, abs=1e-6)  # neither the stall nor the window
    assert len(got["per_window"]) == 1
    _, seconds, done, lost = got["per_window"][0]
    assert (seconds, done) == (pytest.approx(2.0), 16)
    assert lost == pytest.approx(4.0, abs=0.01)
    assert got["lost_s"] == pytest.approx(0.4, abs=0.01)
    assert mixed_restarts.cost(recs, [])["lost_steps"] == 0
    with pytest.raises(ValueError, match="no global steps"):
        mixed_restarts.cost([], [])


def test_restart_windows_come_from_the_incarnations_logs(tmp_path: Any) -> None:
    from bench import mixed_restarts

    d = tmp_path / "n1.2"
    d.mkdir()
    (d / "n1.agent.log").write_text("2026-12-06 03:16:29,552 [INFO] swim.agent: listening\n")
    (d / "n1.r0.trainer.log").write_text(
        "[W1206 03:16:33.150] socket.cpp: noise\n"
        "2026-12-06 03:16:34,938 torchhook.elastic node n1 is a spare\n"
    )
    never = tmp_path / "n2.3"  # never waited as a spare: no window
    never.mkdir()
    (never / "n2.agent.log").write_text("2026-12-06 03:17:00,000 [INFO] swim.agent: up\n")
    (tmp_path / "n0.sock").write_text("")
    got = mixed_restarts.windows(tmp_path)
    assert len(got) == 1
    assert got[0][1] - got[0][0] == pytest.approx(5.386, abs=1e-3)


def test_the_pace_between_faults_leaves_out_recoveries_and_holds_the_window_against_it() -> None:
    # 0.1 s a step; a fault every 60 s: a 1 s stall, then 10 s at 0.2 s a step, then 0.1 s
    ts, t = [], 0.0
    fault_ts = [0.0, 60.0]
    end = 120.0
    for f in fault_ts:
        t = f + 1.0  # the stall
        while t < f + 11:
            ts.append(t)
            t += 0.2
        while t < f + 60:
            ts.append(t)
            t += 0.1
    recs = [{"t": round(x, 6), "rank": 0, "world": 6, "step": i} for i, x in enumerate(ts)]
    step_s, n = mixed_results.between_faults(recs, fault_ts, end)  # type: ignore[misc]
    assert step_s == pytest.approx(0.1, abs=1e-6)  # 15 s after each fault: only the pace
    assert n > 400
    got = mixed_results.pace_between(recs, fault_ts, end)
    # 2 × (50 slow steps + 490 normal) steps where 1200 were due at 0.1 s
    assert got["efficiency_between_faults"] == pytest.approx(len(ts) / 1200, rel=1e-3)
    assert mixed_results.pace_between(recs, [], end)["efficiency_between_faults"] is None
