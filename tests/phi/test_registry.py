"""Tests for phi.registry: slot management, registry == scalar detector, and
phi.vector.phi_array (numpy) == registry to rounding.

The reference for every peer is phi.detector.PhiAccrualDetector (Akka
PhiAccrualFailureDetector.scala semantics). Time is plain integers (ms).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phi.detector import PhiAccrualDetector, PhiConfig
from phi.registry import PhiRegistry, RegistryFullError
from phi.vector import phi_array

SMALL = PhiConfig(max_sample_size=4)


def beat_steadily(registry: PhiRegistry, peer: str, beats: int, interval_ms: int) -> int:
    now_ms = 0
    for i in range(beats):
        now_ms = i * interval_ms
        registry.heartbeat(peer, now_ms)
    return now_ms


# --- construction and membership -------------------------------------------------


@pytest.mark.parametrize("capacity", [0, -1, 2.0, True])
def test_capacity_must_be_positive_int(capacity: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        PhiRegistry(SMALL, capacity)  # type: ignore[arg-type]


def test_empty_registry() -> None:
    registry = PhiRegistry(SMALL, capacity=3)
    assert len(registry) == 0
    assert registry.peers() == []
    assert registry.capacity == 3
    assert registry.config is SMALL
    names, values = phi_array(registry, 1_000)
    assert names == []
    assert values.shape == (0,)
    assert registry.phi_all(1_000) == {}
    assert registry.suspects(1_000) == []


def test_add_is_idempotent_and_keeps_insertion_order() -> None:
    registry = PhiRegistry(SMALL, capacity=4)
    for peer in ["c", "a", "b", "a", "c"]:
        registry.add(peer)
    assert registry.peers() == ["c", "a", "b"]
    assert list(registry) == ["c", "a", "b"]
    assert len(registry) == 3
    assert "a" in registry
    assert "z" not in registry


def test_added_peer_without_heartbeat_scores_zero() -> None:
    registry = PhiRegistry(SMALL, capacity=2)
    registry.add("a")
    assert registry.phi("a", 10**9) == 0.0
    assert registry.is_available("a", 10**9)
    assert registry.last_heartbeat_ms("a") is None
    assert registry.intervals_ms("a") == []
    assert registry.phi_all(10**9) == {"a": 0.0}


def test_heartbeat_auto_adds() -> None:
    registry = PhiRegistry(SMALL, capacity=2)
    registry.heartbeat("a", 500)
    assert registry.peers() == ["a"]
    assert registry.last_heartbeat_ms("a") == 500
    assert registry.intervals_ms("a") == [750, 1250]


def test_unknown_peer_raises_key_error() -> None:
    registry = PhiRegistry(SMALL, capacity=2)
    for call in (
        lambda: registry.phi("ghost", 0),
        lambda: registry.remove("ghost"),
        lambda: registry.last_heartbeat_ms("ghost"),
        lambda: registry.intervals_ms("ghost"),
    ):
        with pytest.raises(KeyError, match="ghost"):
            call()


def test_capacity_is_a_bound() -> None:
    registry = PhiRegistry(SMALL, capacity=2)
    registry.add("a")
    registry.heartbeat("b", 0)
    with pytest.raises(RegistryFullError, match="capacity"):
        registry.add("c")
    with pytest.raises(RegistryFullError, match="capacity"):
        registry.heartbeat("c", 0)
    assert registry.peers() == ["a", "b"]
    # Re-adding a known peer at capacity is still a no-op, not an error.
    registry.add("a")


def test_removed_slot_is_reused_with_fresh_state() -> None:
    registry = PhiRegistry(SMALL, capacity=2)
    beat_steadily(registry, "a", 10, 1000)
    registry.add("b")
    registry.remove("a")
    assert "a" not in registry
    assert registry.peers() == ["b"]
    registry.add("c")
    assert registry.peers() == ["b", "c"]
    # "c" took a's slot but none of a's history.
    assert registry.phi("c", 10**6) == 0.0
    assert registry.intervals_ms("c") == []
    registry.heartbeat("c", 50_000)
    assert registry.intervals_ms("c") == [750, 1250]
    # A removed peer can come back (it starts over).
    registry.remove("b")
    registry.add("a")
    assert registry.intervals_ms("a") == []


def test_suspects_in_slot_order_after_reuse() -> None:
    registry = PhiRegistry(SMALL, capacity=3)
    for peer in ["a", "b", "c"]:
        registry.heartbeat(peer, 0)
    registry.remove("a")
    registry.heartbeat("d", 0)  # reuses slot 0
    assert registry.peers() == ["b", "c", "d"]
    assert registry.suspects(100_000) == ["d", "b", "c"]
    assert list(registry.phi_all(100_000)) == ["b", "c", "d"]


def test_suspects_use_threshold() -> None:
    registry = PhiRegistry(PhiConfig.akka_cluster(), capacity=3)
    last_ms = beat_steadily(registry, "steady", 50, 1000)
    registry.heartbeat("late", 0)
    registry.add("silent")
    now_ms = last_ms + 2_000
    assert registry.suspects(now_ms) == ["late"]
    phis = registry.phi_all(now_ms)
    assert phis["late"] >= 8.0 > phis["steady"]
    assert phis["silent"] == 0.0
    assert not registry.is_available("late", now_ms)


def test_phi_array_matches_phi_all_and_scalar() -> None:
    registry = PhiRegistry(PhiConfig.akka_cluster(), capacity=8)
    for k, peer in enumerate(["p0", "p1", "p2", "p3"]):
        for i in range(30):
            registry.heartbeat(peer, i * (900 + 50 * k) + (i % 3) * 17)
    registry.add("idle")
    names, values = phi_array(registry, 30_000)
    assert names == ["p0", "p1", "p2", "p3", "idle"]
    assert values.dtype == np.float64
    phis = registry.phi_all(30_000)
    assert list(phis) == names
    # phi_all is the scalar code itself; the numpy pass agrees with it to rounding.
    assert phis == {name: registry.phi(name, 30_000) for name in names}
    np.testing.assert_allclose(values, list(phis.values()), rtol=0.0, atol=1e-9)
    assert phis["idle"] == 0.0
    assert float(values[-1]) == 0.0


# --- vectorised == scalar detector (property test) -------------------------------


@dataclass(frozen=True)
class Beat:
    peer: int
    gap_ms: int


@dataclass(frozen=True)
class Remove:
    peer: int


PEERS = ["alpha", "beta", "gamma", "delta", "epsilon"]

events = st.lists(
    st.one_of(
        # Mostly heartbeats with occasional reordering (negative gaps) and long failures.
        st.builds(
            Beat,
            peer=st.integers(0, len(PEERS) - 1),
            gap_ms=st.one_of(
                st.integers(min_value=-300, max_value=3000),
                st.integers(min_value=5000, max_value=120_000),
            ),
        ),
        st.builds(Remove, peer=st.integers(0, len(PEERS) - 1)),
    ),
    max_size=120,
)

configs = st.builds(
    PhiConfig,
    threshold=st.sampled_from([1.0, 3.0, 8.0, 12.0]),
    max_sample_size=st.integers(min_value=2, max_value=8),
    min_std_deviation_ms=st.integers(min_value=1, max_value=500),
    acceptable_heartbeat_pause_ms=st.integers(min_value=0, max_value=5000),
    first_heartbeat_estimate_ms=st.integers(min_value=1, max_value=3000),
)


@settings(max_examples=200, deadline=None)
@given(config=configs, script=events, probes_ms=st.lists(st.integers(-2000, 200_000), max_size=5))
def test_registry_equals_single_peer_detectors(
    config: PhiConfig, script: list[Beat | Remove], probes_ms: list[int]
) -> None:
    registry = PhiRegistry(config, capacity=len(PEERS))
    detectors: dict[str, PhiAccrualDetector] = {}
    clock_ms: dict[str, int] = {}
    for event in script:
        name = PEERS[event.peer]
        if isinstance(event, Remove):
            if name in detectors:
                registry.remove(name)
                del detectors[name]
            continue
        clock_ms[name] = clock_ms.get(name, 0) + event.gap_ms
        detectors.setdefault(name, PhiAccrualDetector(config)).heartbeat(clock_ms[name])
        registry.heartbeat(name, clock_ms[name])
    assert registry.peers() == list(detectors)
    for name, detector in detectors.items():
        assert registry.intervals_ms(name) == detector.intervals_ms()
        assert registry.last_heartbeat_ms(name) == detector.last_heartbeat_ms
    latest_ms = max(clock_ms.values(), default=0)
    for probe_ms in [latest_ms, *(latest_ms + p for p in probes_ms)]:
        names, values = phi_array(registry, probe_ms)
        assert names == list(detectors)
        expected = [detectors[n].phi(probe_ms) for n in names]
        np.testing.assert_allclose(values, expected, rtol=0.0, atol=1e-9)
        for name in names:
            assert registry.phi(name, probe_ms) == detectors[name].phi(probe_ms)
        assert registry.phi_all(probe_ms) == {n: detectors[n].phi(probe_ms) for n in names}
        flagged = {n for n, v in zip(names, values.tolist(), strict=True) if v >= config.threshold}
        assert set(registry.suspects(probe_ms)) == flagged


def test_large_registry_scores_all_peers() -> None:
    config = PhiConfig.akka_cluster()
    registry = PhiRegistry(config, capacity=5000)
    for i in range(5000):
        registry.heartbeat(f"n{i}", 0)
        registry.heartbeat(f"n{i}", 1000 + (i % 7))
    names, values = phi_array(registry, 1000 + 4000)
    assert len(names) == 5000
    reference = PhiAccrualDetector(config)
    reference.heartbeat(0)
    reference.heartbeat(1003)
    assert values[3] == pytest.approx(reference.phi(5000), abs=1e-9)
    assert values[10] == values[3]
