"""A rack restarted at once (memberlist #311): 16 ``fast`` agents of a fleet of 20 SIGKILLed
together, declared dead, then restarted together under the same names and addresses, all
on one CPU so that the restart saturates it as a booting rack saturates its hosts (about
35 s; the rules themselves are tested on explicit time in tests/swim/test_starting_members.py).

Every restarted member must be alive again in every view, no member may be declared dead
while its process runs (the restarted ones came back from dead: swim.suspicion's
``recovered_hold_ms``), nothing may be suspected once all are back, and every view must
hold the same incarnation of every member. bench/fleet_start.py runs the same at full size
(128 started at once; 32 restarted five times) beside real Serf and prints the numbers.
Every process is stopped by pid (agent/procs.py ``stop``) whatever happens.
"""

from __future__ import annotations

import os

import pytest

from bench import fleet_start


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_a_rack_restarted_at_once_is_never_declared_dead() -> None:
    cpu = min(os.sched_getaffinity(0))
    t = fleet_start.run_restart("swim", "fast", 20, 16, 1, settle_s=2.0, cpus={cpu})
    print(t.line())
    assert t.dead_events == 0, t.line()
    assert t.flapping == 0, t.line()
    assert t.incarnations_agree, t.line()
