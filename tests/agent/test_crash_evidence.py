"""Strong crash evidence (agent/crash_evidence.py): the pure rule, its bounds, and the job
views it shapes (agent.jobs ``view`` and ``summaries`` agree). The real-agent test, a
crashed node left out before its death and a refuting one re-admitted, is in
tests/agent/test_crash_evidence_live.py."""

from __future__ import annotations

from typing import Any

import pytest

from agent import serf
from agent.crash_evidence import (
    EVIDENCE_RETAIN_MS,
    EVIDENCE_WINDOW_MS,
    MAX_EVIDENCE_NAMES,
    CrashEvidence,
)
from agent.jobs import Generations, JobTag, summaries, tag_key, view
from swim import Address, Member, NodeStateType

ALIVE, SUSPECT, DEAD = NodeStateType.ALIVE, NodeStateType.SUSPECT, NodeStateType.DEAD
W = EVIDENCE_WINDOW_MS


def member(name: str, state: NodeStateType = SUSPECT, since_ms: int = 1000) -> Member:
    tags = {tag_key("j"): JobTag(int(name[-1]), 0, "ok", "").encode()}
    return Member(name, Address("127.0.0.1", 7946), serf.encode_tags(tags), 1, state, since_ms, ())


def tags_of(m: Member) -> Any:
    return serf.decode_tags(m.meta)


# (state, suspect since, report at, refused probe at, excluded?); None: no such record
RULE = [
    (SUSPECT, 1000, 990, 1040, True),  # the crash: report, then our urgent probe fails
    (SUSPECT, 1000, 1200, 1040, True),  # the report after our refused probe
    (SUSPECT, 1000, 1000 - W, 1000, True),  # the report a whole window earlier
    (SUSPECT, 1000, 999 - W, 1000, False),  # just too old (and our probe opened it)
    (SUSPECT, 1000, 1001 + W, 1000, False),  # just too late
    (SUSPECT, 1000, 1000, 1000, True),  # our refused probe opened the suspicion
    (SUSPECT, 1000, 990, 999, False),  # our probe failed in an earlier suspicion (refuted)
    (SUSPECT, 1000, None, 1040, True),  # no report, but another accusation came first (3b)
    (SUSPECT, 1000, None, 1000, False),  # no report, and our refused probe alone accused it
    (SUSPECT, 1000, 990, None, False),  # another member's accusation, our probe not refused
    (ALIVE, 1000, 990, 1040, False),  # it refuted: back in the view
    (DEAD, 1000, 990, 1040, False),  # dead: out of the view anyway, not by this rule
]


@pytest.mark.parametrize(("state", "since", "reported", "failed", "excluded"), RULE)
def test_the_rule(
    state: NodeStateType, since: int, reported: int | None, failed: int | None, excluded: bool
) -> None:
    ev = CrashEvidence(enabled=True)
    if reported is not None:
        ev.report_lost("j", ["n1", "n2"], reported)  # the report names a live node too
    if failed is not None:
        ev.probe_refused("n2", failed)
    members = [member("n1", ALIVE), member("n2", state, since)]
    assert ev.excluded("j", members) == ({"n2"} if excluded else set())
    three_b = failed is not None and failed > since and state == SUSPECT
    assert ev.excluded("other", members) == ({"n2"} if three_b else set()), "no report there"


def test_off_records_nothing() -> None:
    ev = CrashEvidence(enabled=False)
    ev.report_lost("j", ["n2"], 990)
    ev.probe_refused("n2", 1040)
    assert ev.excluded("j", [member("n2")]) == frozenset()
    ev.enabled = True
    assert ev.excluded("j", [member("n2")]) == frozenset()


def test_forget_drops_a_jobs_reports() -> None:
    ev = CrashEvidence(enabled=True)
    ev.report_lost("j", ["n2"], 1000)
    ev.probe_refused("n2", 1000)  # it opened the suspicion: only the report backs it
    assert ev.excluded("j", [member("n2")]) == {"n2"}
    ev.forget("j")
    assert ev.excluded("j", [member("n2")]) == frozenset()


def test_records_are_bounded_in_number_and_age() -> None:
    ev = CrashEvidence(enabled=True)
    names = [f"m{i}" for i in range(MAX_EVIDENCE_NAMES + 5)]
    for i, name in enumerate(names):
        ev.probe_refused(name, 1000 + i)
        ev.report_lost("j", [name], 1000 + i)
    assert len(ev._refused) == len(ev._reports["j"]) == MAX_EVIDENCE_NAMES
    assert "m0" not in ev._refused and names[-1] in ev._refused  # the oldest went first
    ev.probe_refused("late", 1000 + len(names) + EVIDENCE_RETAIN_MS)
    assert list(ev._refused) == ["late"], "expired records go as new ones come"


def test_changes_say_what_was_dropped_and_what_came_back() -> None:
    ev = CrashEvidence(enabled=True)
    assert ev.changes("j", frozenset({"n2"})) == (["n2"], [])
    assert ev.changes("j", frozenset({"n2"})) == ([], [])
    assert ev.changes("j", frozenset()) == ([], ["n2"])


def test_view_and_jobs_leave_out_the_same_members() -> None:
    members = [member("n0", ALIVE), member("n1", SUSPECT), member("n2", SUSPECT)]
    generations = Generations()
    full = view("j", members, tags_of, generations)
    assert [m["name"] for m in full["members"]] == ["n0", "n1", "n2"], "suspects stay in"
    dropped = view("j", members, tags_of, generations, frozenset({"n2"}))
    assert [m["name"] for m in dropped["members"]] == ["n0", "n1"]
    assert dropped["generation"] == full["generation"] + 1
    listed = summaries(members, tags_of, generations, {"j": 1}, excluded={"j": {"n2"}})
    [entry] = listed["jobs"]
    assert (entry["nodes"], entry["fingerprint"]) == (2, dropped["fingerprint"])
    assert entry["generation"] == dropped["generation"], "the same view: no new generation"
