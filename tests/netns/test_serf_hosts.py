"""Real ``serf agent``s on namespaced hosts (tests/netns/harness.py ``start_serf``), as
bench/loss_windows.py runs them beside ours: they form one cluster over the bridge, the
harness sees their view and their events, and a SIGKILLed one is reported failed.

Skipped, with the reason, where namespaces cannot be made or serf is not installed."""

from __future__ import annotations

import pytest

from agent.procs import until
from tests.netns.harness import SERF, Testbeds

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(SERF is None, reason="serf is not installed (apt-get install -y serf)"),
]


def test_serf_hosts_form_a_cluster_and_report_a_crash(testbed: Testbeds) -> None:
    bed = testbed(3)
    for i in (1, 2, 3):
        bed.start_serf(i, "local")
    until(bed.serf_converged, 30, "the serf agents to see each other alive", poll_s=0.25)
    joined = {(e.observer, e.member) for e in bed.serf_events(kinds=["joined"])}
    assert {(f"n{o}", f"n{m}") for o in (1, 2, 3) for m in (1, 2, 3)} <= joined
    killed_at = bed.kill_serf(3)

    def failed_at_both() -> bool:
        dead = bed.serf_events(killed_at, ["dead"])
        return {e.observer for e in dead if e.member == "n3"} == {"n1", "n2"}

    until(failed_at_both, 30, "n3 reported failed by n1 and n2", poll_s=0.25)
    first = bed.host(1).serf
    assert first is not None
    assert first.members()["n3"]["status"] == "failed", first.members()
    assert [e for e in bed.serf_events(killed_at, ["dead"]) if e.member != "n3"] == []
