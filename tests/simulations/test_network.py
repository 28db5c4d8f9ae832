"""The network model: latency distributions, loss, bursts, partitions, reachability."""

from __future__ import annotations

import random

import pytest

from simulations.model.network import (
    Constant,
    GilbertElliott,
    LogNormal,
    Network,
    Normal,
    Uniform,
    parse_latency,
)
from simulations.model.world import World


def test_latency_specs_parse_and_sample_within_bounds() -> None:
    rng = random.Random(1)
    assert parse_latency("const:3") == Constant(3)
    assert parse_latency("uniform:1:5") == Uniform(1, 5)
    assert parse_latency("lognormal:2:0.5:1") == LogNormal(2.0, 0.5, 1)
    assert parse_latency("normal:10:3:2") == Normal(10.0, 3.0, 2)
    samples = [Uniform(1, 5).sample(rng) for _ in range(2000)]
    assert set(samples) == {1, 2, 3, 4, 5}
    assert min(LogNormal(2.0, 1.0, 1).sample(rng) for _ in range(2000)) >= 1
    assert min(Normal(1.0, 5.0, 0).sample(rng) for _ in range(2000)) == 0
    with pytest.raises(ValueError):
        parse_latency("pareto:1")


def test_independent_loss_rate() -> None:
    net = Network(random.Random(2), Constant(1), loss=0.2)
    lost = sum(net.delay(0, 1) < 0 for _ in range(20_000))
    assert 0.18 < lost / 20_000 < 0.22


def test_gilbert_elliott_loss_is_bursty_with_the_stationary_mean() -> None:
    net = Network(random.Random(3), Constant(1))
    model = GilbertElliott(p_good_bad=0.02, p_bad_good=0.2, loss_good=0.0, loss_bad=1.0)
    net.set_burst(model)
    outcomes = [net.delay(0, 1) < 0 for _ in range(50_000)]
    rate = sum(outcomes) / len(outcomes)
    assert abs(rate - model.mean_loss()) < 0.02
    runs, current = [], 0
    for lost in outcomes:
        if lost:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    assert 3 < sum(runs) / len(runs) < 7  # mean burst ≈ 1/p_bad_good = 5 packets


def test_partitions_and_partial_reachability() -> None:
    net = Network(random.Random(4), Constant(1))
    net.partition([[0, 1]])
    assert net.delay(0, 1) == 1 and net.delay(2, 3) == 1
    assert net.delay(0, 2) < 0 and net.delay(2, 0) < 0
    net.partition([[0, 1]], symmetric=False)
    assert net.delay(0, 2) < 0, "the later group cannot send to the earlier one"
    assert net.delay(2, 0) == 1, "the other direction still works"
    net.heal()
    net.reachable_only_from(5, [1], range(8))
    assert net.delay(1, 5) == 1 and net.delay(5, 1) == 1
    assert net.delay(2, 5) < 0 and net.delay(5, 2) < 0
    assert net.stream_delay(2, 5) < 0
    net.heal()
    assert net.delay(2, 5) == 1


def test_explicit_reordering_delays_some_packets() -> None:
    net = Network(random.Random(5), Constant(1))
    net.set_reorder(0.5, 100)
    delays = [net.delay(0, 1) for _ in range(1000)]
    assert min(delays) == 1 and max(delays) > 50


def test_duplication_delivers_extra_copies() -> None:
    world = World(6, seed=6)
    world.network.duplicate = 0.5
    world.start_all()
    world.run_until(10_000)
    sent, received = sum(world.traffic.pkts_out), sum(world.traffic.pkts_in)
    assert received > 1.3 * sent
    # duplicates are harmless: no false suspicion
    assert all(n.num_members() == 6 for n in world.nodes)
