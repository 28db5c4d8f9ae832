"""A node loses power: elastic DDP over network namespaces (tests/netns/training.py), three
nodes × one rank, the TCPStore and gloo traffic over the bridge. The victim's trainer drops
every packet of its node's link (examples/job.py's ``power`` fault), then SIGKILLs its
node; the survivors must go on at world 2 having seen silence: packets dropped at the
victim, no TCP reset and no ICMP from it at any survivor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.procs import until
from tests.netns.training import NsTraining

pytest.importorskip("torch", reason="the torch hook needs torch (pip install '.[torch]')")
pytestmark = pytest.mark.slow
SCRIPT = "examples/elastic_ddp.py"


def test_a_node_that_loses_power_sends_nothing_and_the_job_goes_on(tmp_path: Path) -> None:
    fault_file = tmp_path / "fault"
    with NsTraining(3, tmp_path, profile="fast", ranks=1) as job:
        survivors, victim = job.nodes[:2], job.nodes[2]
        for n in job.nodes:
            extra = ["--fault", "power", "--fault-file", str(fault_file)] if n is victim else []
            n.start_trainers(
                SCRIPT,
                *("--job", "j", "--steps", "100000", "--step-sleep", "0.02"),
                *("--pg-timeout", "60", "--min-nodes", "2", *extra),
            )
        until(lambda: all(n.training_at(3) for n in job.nodes), 150, "3 nodes train")
        job.watch(victim)
        fault_file.touch()
        until(lambda: any("fault" in r for r in victim.records()), 20, "the power cut")
        fault_t = next(float(r["t"]) for r in victim.records() if "fault" in r)
        until(lambda: all(n.training_at(2) for n in survivors), 60, "survivors train at 2")
        assert victim.agent.wait(10) is not None, "the victim's agent was killed"
        counts = job.counts(victim)
        assert counts.dropped_in > 0, counts  # the survivors kept sending: dropped
        assert counts.resets == 0, counts
        assert counts.icmp == 0, counts
        later = [r for n in survivors for r in n.steps() if r["t"] > fault_t]
        assert later and all(r["world"] == 2 for r in later[-4:]), later[-4:]
        print(json.dumps({"fault_t": fault_t, **counts.as_row()}))
