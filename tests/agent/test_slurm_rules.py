"""The drain handler's decisions (agent/slurm.py), without Slurm: who acts, which node,
what command for which event and state; and the handler's run against a fake scontrol and
no agent (exit codes)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from agent.slurm import (
    Member,
    NodeState,
    SlurmError,
    candidates,
    decide,
    drain_reason,
    elect,
    parse_actor_tag,
    parse_map,
    parse_member_line,
    parse_node,
    ranking,
    slurm_node,
    update_command,
)

ROOT = Path(__file__).resolve().parents[2]


def _alive(*names: str, **tags: dict[str, str]) -> list[dict[str, object]]:
    return [{"name": n, "status": "alive", "tags": tags.get(n, {})} for n in names]


def test_every_agent_with_the_same_view_elects_the_same_one() -> None:
    names = [f"gpu{i}" for i in range(1000)]
    view = _alive(*names)
    for subject in ("gpu7", "gpu500", "other"):
        chosen = {elect(subject, candidates(view, subject, None)) for _ in range(3)}
        order = {elect(subject, reversed(candidates(view, subject, None)))}
        assert len(chosen | order) == 1
        assert chosen.pop() != subject


def test_the_ranking_starts_with_the_elected_one_and_its_backups_follow() -> None:
    names = [f"gpu{i}" for i in range(20)]
    ranked = ranking("gpu99", names)
    assert ranked[0] == elect("gpu99", names) and sorted(ranked) == sorted(names)
    # without the first (dead but still listed in other views), the backups move up
    assert ranking("gpu99", [n for n in names if n != ranked[0]]) == ranked[1:]


def test_election_spreads_work_and_moves_only_for_the_subjects_of_a_leaver() -> None:
    names = [f"n{i}" for i in range(50)]
    subjects = [f"s{i}" for i in range(2000)]
    before = {s: elect(s, names) for s in subjects}
    load = Counter(before.values())
    assert len(load) == 50 and max(load.values()) < 4 * 2000 / 50  # no hot spot
    gone = "n3"
    after = {s: elect(s, [n for n in names if n != gone]) for s in subjects}
    moved = {s for s in subjects if before[s] != after[s]}
    assert moved == {s for s in subjects if before[s] == gone}


def test_candidates_exclude_the_subject_the_non_alive_and_those_without_the_tag() -> None:
    view: list[dict[str, object]] = [
        *_alive("a", "b", "c", b={"slurm-actor": "1"}, c={"slurm-actor": "0"}),
        {"name": "d", "status": "suspect", "tags": {"slurm-actor": "1"}},
    ]
    assert candidates(view, "a", None) == ["b", "c"]
    assert candidates(view, "b", parse_actor_tag("slurm-actor")) == ["c"]
    assert candidates(view, "a", parse_actor_tag("slurm-actor=1")) == ["b"]
    assert elect("x", []) is None
    with pytest.raises(SlurmError, match="KEY or KEY=VALUE"):
        parse_actor_tag("=1")


def test_member_lines_as_serf_writes_them() -> None:
    m = parse_member_line("gpu2\t10.0.0.2\ttrainer\tslurm=gpu-002,rack=r1\n")
    assert m == Member("gpu2", "10.0.0.2", "trainer", {"slurm": "gpu-002", "rack": "r1"})
    assert parse_member_line("gpu2\t10.0.0.2\t\t") == Member("gpu2", "10.0.0.2", "", {})
    assert parse_member_line("gpu2").name == "gpu2"
    with pytest.raises(SlurmError):
        parse_member_line("\t10.0.0.2")


def test_mapping_map_first_then_tag_then_identity() -> None:
    mapping = parse_map("# member  slurm node\nhost-a gpu-001\nhost-b=gpu-002  # comment\n\n")
    assert mapping == {"host-a": "gpu-001", "host-b": "gpu-002"}
    tagged = Member("host-a", "", "", {"slurm": "gpu-009"})
    assert slurm_node(tagged, mapping, "slurm") == "gpu-001"
    assert slurm_node(Member("host-c", "", "", {"slurm": "gpu-009"}), mapping, "slurm") == "gpu-009"
    assert slurm_node(Member("host-c", "", "", {"slurm": "gpu-009"}), {}, None) == "host-c"
    assert slurm_node(Member("host-d", "", "", {}), mapping, "slurm") == "host-d"
    with pytest.raises(SlurmError, match="line 1"):
        parse_map("one two three\n")
    with pytest.raises(SlurmError, match="single Slurm node"):
        parse_map("a gpu[1-4]\n")  # a hostlist would drain many nodes
    with pytest.raises(SlurmError, match="single Slurm node"):
        slurm_node(Member("x y", "", "", {}), {}, None)


SHOW_DRAINED = """NodeName=gpu2 Arch=x86_64 CoresPerSocket=1
   CPUAlloc=0 CPUEfctv=1 CPUTot=1 CPULoad=0.76
   State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=main
   Reason=swim: gpu2 failed at 2026-12-05T14:20:01Z, seen by gpu3 [root@2026-12-05T14:13:44]
"""


def test_parse_scontrol_show_node() -> None:
    state = parse_node(SHOW_DRAINED)
    assert state.flags == {"IDLE", "DRAIN"} and state.drained and state.ours
    assert state.reason == "swim: gpu2 failed at 2026-12-05T14:20:01Z, seen by gpu3"
    idle = parse_node("NodeName=gpu1\n   State=IDLE ThreadsPerCore=1\n")
    assert idle == NodeState(frozenset({"IDLE"}), None) and not idle.drained
    admin = parse_node("   State=DOWN+DRAIN+NOT_RESPONDING\n   Reason=bad dimm [admin@t]\n")
    assert admin.drained and not admin.ours and admin.reason == "bad dimm"
    with pytest.raises(SlurmError):
        parse_node("Node gpu9 not found")


IDLE = NodeState(frozenset({"IDLE"}), None)
OURS = NodeState(frozenset({"IDLE", "DRAIN"}), "swim: gpu2 failed at t, seen by gpu3")
ADMIN = NodeState(frozenset({"ALLOCATED", "DRAIN"}), "bad dimm")


@pytest.mark.parametrize(
    ("event", "state", "resume", "kind"),
    [
        ("member-failed", IDLE, False, "drain"),
        ("member-failed", OURS, False, "none"),  # repeated verdict: reason not rewritten
        ("member-failed", ADMIN, False, "none"),  # an admin's reason is never overwritten
        ("member-leave", IDLE, False, "none"),  # a graceful leave does not drain by default
        ("member-join", OURS, True, "resume"),
        ("member-join", OURS, False, "none"),
        ("member-join", ADMIN, True, "none"),  # drained for another reason: kept
        ("member-join", IDLE, True, "none"),
        ("member-update", OURS, True, "none"),
        ("user", IDLE, True, "none"),
    ],
)
def test_decide(event: str, state: NodeState, resume: bool, kind: str) -> None:
    action = decide(event, "gpu2", state, reason="swim: r", resume=resume)
    assert action.kind == kind, action.why


def test_drain_on_leave_when_asked_and_the_commands() -> None:
    member = Member("gpu2", "10.0.0.2", "", {})
    reason = drain_reason("member-leave", member, "2026-12-05T14:20:01Z", "gpu3")
    assert reason == "swim: gpu2 left at 2026-12-05T14:20:01Z, seen by gpu3"
    drain_events = frozenset({"member-failed", "member-leave"})
    action = decide("member-leave", "gpu-002", IDLE, reason=reason, drain_events=drain_events)
    assert update_command("scontrol", "gpu-002", action) == [
        "scontrol",
        "update",
        "NodeName=gpu-002",
        "State=DRAIN",
        f"Reason={reason}",
    ]
    resume = decide("member-join", "gpu-002", OURS, reason="", resume=True)
    assert update_command("/usr/bin/scontrol", "gpu-002", resume) == [
        "/usr/bin/scontrol",
        "update",
        "NodeName=gpu-002",
        "State=RESUME",
    ]


def _handler(
    tmp_path: Path, stdin: str, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.slurm_handler", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        env={**os.environ, "SWIM_CONTROL": str(tmp_path / "none.sock"), **env},
        check=False,
    )


def test_handler_exit_codes_without_an_agent_or_with_bad_settings(tmp_path: Path) -> None:
    line = "gpu2\t127.0.0.1\t\t\n"
    failed = {"SERF_EVENT": "member-failed", "SERF_SELF_NAME": "gpu1"}
    out = _handler(tmp_path, line, failed)
    assert out.returncode == 3 and "nobody here acts" in out.stderr
    out = _handler(tmp_path, line, {"SERF_EVENT": "member-update", "SERF_SELF_NAME": "gpu1"})
    assert out.returncode == 0 and "nothing to do" in out.stderr
    out = _handler(tmp_path, line, {"SERF_EVENT": "member-join", "SERF_SELF_NAME": "gpu1"})
    assert out.returncode == 0 and "nothing to do" in out.stderr  # resume is off
    out = _handler(tmp_path, line, {})
    assert out.returncode == 2 and "SERF_EVENT is not set" in out.stderr
    out = _handler(tmp_path, line, failed, "--drain-on", "member-join")
    assert out.returncode == 2 and "member-failed, member-leave, member-reap" in out.stderr
    (tmp_path / "map").write_text("gpu2 gpu[2-3]\n")
    out = _handler(tmp_path, line, {**failed, "SWIM_SLURM_MAP": str(tmp_path / "map")})
    assert out.returncode == 2 and "single Slurm node" in out.stderr


def test_check_without_an_agent_reports_and_is_strict_only_when_asked(tmp_path: Path) -> None:
    log = tmp_path / "check.log"
    env = {"SLURMD_NODENAME": "gpu1", "SLURM_JOB_ID": "7", "SWIM_SLURM_LOG": str(log)}
    out = _handler(tmp_path, "", env, "--phase", "prolog")
    assert out.returncode == 0
    assert "swim-slurm-prolog[gpu1 job 7]: FAILED: cannot reach the agent" in out.stderr
    assert "(not strict: exit 0)" in out.stderr and "FAILED" in log.read_text()
    out = _handler(tmp_path, "", {**env, "SWIM_SLURM_STRICT": "1"}, "--phase", "epilog")
    assert out.returncode == 1 and "swim-slurm-epilog[gpu1 job 7]: FAILED" in out.stderr
