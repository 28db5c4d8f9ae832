"""The all-to-all heartbeat baseline (simulations.experiments.heartbeat) in the simulated
world, and the scaling sweep that compares it with SWIM across cluster sizes."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest

from simulations import scaling
from simulations.experiments import heartbeat as hb
from simulations.experiments import scaling as scaling_sweep
from simulations.experiments.frontier import explore
from simulations.experiments.harness import Params, Sim, build
from simulations.model.metrics import LoadWindow
from simulations.reports import scaling as scaling_report
from swim import Address, EventKind, MemberEvent, NodeStateType

LATENCY = "uniform:1:5"


def _world(n: int, config: hb.HeartbeatConfig, seed: int = 1, settle_ms: int = 5_000) -> Sim:
    p = Params(nodes=n, seed=seed, latency=LATENCY)
    return build(p, n, config=hb.WORLD_CONFIG, node_factory=hb.factory(config), settle_ms=settle_ms)


@pytest.mark.parametrize(
    ("config", "expected_ms"),
    [
        # docs/design.md §6.2: Akka cluster defaults convict ≈ 4.52 s after
        # the last of steady 1 s heartbeats (mean 1 s + pause 3 s + z(φ=8)·100 ms).
        (hb.HeartbeatConfig.akka(), 4522),
        # 250 ms beats, pause 500 ms, min std 50 ms: 750 ms + 5.23 · 50 ms.
        (hb.HeartbeatConfig.fast(), 1011),
    ],
)
def test_conviction_time_of_the_presets(config: hb.HeartbeatConfig, expected_ms: int) -> None:
    assert config.convict_after_ms() == pytest.approx(expected_ms, abs=2)


def test_every_member_sends_one_heartbeat_to_every_other_per_interval() -> None:
    n = 12
    sim = _world(n, hb.HeartbeatConfig.akka())
    window = LoadWindow.open(sim.world)
    sim.world.run_for(20_000)
    load = window.close(sim.world)
    # O(n) per member, O(n²) in all: (n − 1) per second each way, nothing else.
    assert load["pkts_out_per_s_mean"] == pytest.approx(n - 1, rel=0.06)
    assert load["pkts_in_per_s_mean"] == pytest.approx(n - 1, rel=0.06)
    assert load["streams_out_per_s_mean"] == 0
    assert sim.metrics.false_positives == []


def test_a_crash_is_judged_by_every_member_alone_within_the_phi_bound() -> None:
    config = hb.HeartbeatConfig.akka()
    sim = _world(10, config)
    world = sim.world
    world.crash(4)
    world.run_for(10_000)
    record = sim.metrics.crashes[0]
    assert record.all_dead_ms is not None and record.first_dead_ms is not None
    assert len(record.dead_times) == 9  # every live member, each on its own evidence
    assert record.first_suspect_ms is None  # no suspicion stage
    # Each observer convicts at its first check after phi crosses 8, i.e. after its own
    # detector's silence-to-convict past the last beat it got (a young window: > 4.52 s).
    assert all(t >= record.crash_ms for t in record.dead_times)
    for i in (j for j in range(10) if j != 4):
        node = cast(hb.HeartbeatNode, world.nodes[i])  # what the factory built
        detector = node.detector(world.names[4])
        last_ms, convict_ms = detector.last_heartbeat_ms, detector.silence_to_convict_ms()
        assert last_ms is not None and convict_ms is not None
        assert convict_ms >= config.convict_after_ms()
        since = node.member(world.names[4])
        assert since is not None
        assert last_ms + convict_ms <= since.state_change_ms
        assert since.state_change_ms <= last_ms + convict_ms + config.check_interval_ms
    assert sim.metrics.false_positives == []
    member = world.nodes[0].member(world.names[4])
    assert member is not None and member.state == NodeStateType.DEAD


def test_a_partitioned_member_is_declared_dead_then_alive_again_when_heard() -> None:
    sim = _world(6, hb.HeartbeatConfig.fast())
    world = sim.world
    others = [i for i in range(6) if i != 5]
    world.network.partition([others, [5]])
    world.run_for(3_000)
    assert {(f.observer, f.member) for f in sim.metrics.false_positives} >= {
        (world.names[0], world.names[5]),
        (world.names[5], world.names[0]),
    }
    seen: list[EventKind] = []

    class Spy:
        def on_event(self, idx: int, event: MemberEvent) -> None:
            if idx == 0:
                seen.append(event.kind)

        def on_lifecycle(self, kind: str, idx: int) -> None:
            pass

    world.listeners.append(Spy())
    world.network.heal()
    world.run_for(1_000)
    assert seen == [EventKind.ALIVE]
    member = world.nodes[0].member(world.names[5])
    assert member is not None and member.state == NodeStateType.ALIVE


def test_hostile_or_unknown_datagrams_are_counted_and_change_nothing() -> None:
    node = hb.HeartbeatNode(
        "a",
        Address("10.0.0.1", 7946),
        rng=__import__("random").Random(1),
        now_ms=0,
        config=hb.HeartbeatConfig.akka(),
    )
    stranger = Address("10.9.9.9", 7946)
    for data in (b"", b"\xff garbage", b"\x00"):
        out = node.handle_datagram(stranger, data, 10)
        assert out.events == [] and out.packets == []
    assert node.drops == 3
    assert node.num_members() == 1
    with pytest.raises(NotImplementedError, match="bootstrap"):
        node.join([stranger], 0)


def test_scaling_sweep_tables_and_the_computed_baseline(tmp_path: Path) -> None:
    sweep = scaling.parse(
        [
            "--nodes", "8,16", "--variants", "lan,heartbeat", "--conditions", "clean",
            "--crashes", "1", "--seeds", "1", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    for i, n in enumerate(sweep.nodes):
        report = explore(sweep.options(i))
        sweep.add(n, report, 0.0)
    scaling_report.write(sweep, tmp_path)
    cells = {(c["variant"], c["n"]): c for c in sweep.cells}
    # the baseline's load grows with n (n − 1 per member per second), SWIM's does not
    hb8, hb16 = cells["heartbeat", 8], cells["heartbeat", 16]
    assert hb16["pkts_per_member_per_s"] / hb8["pkts_per_member_per_s"] == pytest.approx(
        15 / 7, rel=0.1
    )
    lan8, lan16 = cells["lan", 8], cells["lan", 16]
    assert lan16["pkts_per_member_per_s"] < 1.5 * lan8["pkts_per_member_per_s"]
    computed = scaling_sweep.computed_baseline(sweep)
    assert [(r["variant"], r["n"]) for r in computed] == [("heartbeat", 10_000)]
    assert computed[0]["pkts_per_member_per_s"] == 9_999
    summary = (tmp_path / "summary.md").read_text()
    assert "python -m simulations.scaling --nodes 8,16" in summary
    assert "| heartbeat | 10,000 | 9,999 |" in summary
    again = scaling_report.load(tmp_path)  # what --render re-draws the plot from
    assert len(again.cells) == len(sweep.cells) == 4
    for read, kept in zip(again.cells, sweep.cells, strict=True):
        assert read.keys() == kept.keys()
        assert read["pkts_per_member_per_s"] == pytest.approx(kept["pkts_per_member_per_s"], 1e-4)
        # no suspicion stage in the baseline: an empty cell comes back as None
        assert (read["first_suspect_median_s"] is None) == (kept["variant"] == "heartbeat")
    assert again.variants == ["lan", "heartbeat"] and again.nodes == [8, 16]
    big = scaling_sweep.Sweep([5_000], ["lan", "heartbeat"], ["clean"], [1], [[1]])
    assert big.options(0).variants == ["lan"]  # n² detectors: refused, computed instead
