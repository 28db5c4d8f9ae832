"""bench/starved_host.py runs end to end on a short window and removes what it made.

No figure is asserted (they are the benchmark's to print): this proves the cases apply and
release (the agent is back in the root cgroups, the limits are gone), the counts come from
live agents, and no namespace, cgroup or load process is left behind."""

from __future__ import annotations

import argparse
import os

import pytest

from bench import starved_host
from bench.cpu_weight import CPU_ROOT
from tests.netns import harness


def test_the_benchmark_starves_one_host_and_cleans_up() -> None:
    if not (CPU_ROOT / "cpu.shares").exists():
        pytest.skip("needs cgroup v1's cpu controller (bench/starved_host.py is v1 only)")
    if not (starved_host.MEMORY_ROOT / "memory.limit_in_bytes").exists():
        pytest.skip("needs cgroup v1's memory controller")
    before = set(harness.list_namespaces())
    args = argparse.Namespace(
        profiles="lan",
        cases="quota,memory",
        settings="shipped",
        window_s=1.0,
        quota_pct=1.0,
        loaders=1,
        threads=3,
        memory_slack_mib=1,
    )
    cases = starved_host.run(args)
    assert [(c.condition, c.settings) for c in cases] == [
        ("quota", "shipped"),
        ("memory", "shipped"),
    ]
    for case in cases:
        assert not case.figures.get("exited"), case.figures
        assert case.figures["dead_of"] >= 0 and case.figures["answer_p50_ms"] > 0
    anon_mib = float(cases[1].figures["charged_mib"].split("+")[0])
    assert anon_mib > 5, "the memory cgroup did not hold the agent's pages"
    assert set(harness.list_namespaces()) == before
    leftovers = [
        p
        for root in (CPU_ROOT, starved_host.MEMORY_ROOT)
        for p in root.glob(f"swimbench-starve-{os.getpid()}")
    ]
    assert leftovers == [], leftovers
    result = starved_host.as_result(cases, args)
    assert result["question"] == "starved-host-1s"
