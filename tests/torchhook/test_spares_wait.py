"""A spare's wait for a draft (torchhook/spares.py) on in-memory fakes: the rules of its
module docstring, without torch or agents (tests/torchhook/test_spares.py runs them on
real ones)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from agent.control import JobMember
from torchhook import formation_wire as wire
from torchhook.client import View
from torchhook.errors import SpareWaitOver
from torchhook.formation import ABSENT, FORMATION_KEY
from torchhook.spares import PASS_S, READ_TIMEOUT, Spares
from torchhook.strategy import Layout


def member(name: str, reg: int, group: str = "") -> JobMember:
    return JobMember(name, "10.0.0.1", 7946, 4000 + reg, reg, group, "alive", 2)


class FakeMembership:
    def __init__(self, node: str, views: list[View], local_rank: int = 0) -> None:
        self.node, self.local_rank = node, local_rank
        self._views = views
        self.sent: list[tuple[str, Any]] = []
        self.beats = 0

    @property
    def view(self) -> View:
        return self._views[0]

    def wait(self, predicate: Callable[[View], bool], timeout_s: float) -> View:
        if len(self._views) > 1:
            self._views.pop(0)  # the next view arrives
        if predicate(self._views[0]):
            return self._views[0]
        raise TimeoutError

    def set_role(self, role: str) -> None:
        self.sent.append(("role", role))

    def set_target(self, nodes: int) -> None:
        self.sent.append(("target", nodes))

    def heartbeat(self, step: int) -> None:
        self.beats += 1


class FakeStore:
    def __init__(self, data: dict[str, bytes]) -> None:
        self.data = data

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self.data.get(key, ABSENT.encode())

    def set_timeout(self, timeout: timedelta) -> None:
        pass


class FakeFormation:
    def __init__(self, directories: dict[int, dict[str, bytes]]) -> None:
        self.directories = directories
        self.connects: list[int] = []

    def connect(self, addr: str, port: int, what: str) -> FakeStore:
        self.connects.append(port)
        if port not in self.directories:
            raise RuntimeError("connection refused")
        return FakeStore(self.directories[port])


def view(*members: JobMember) -> View:
    return View("j", 1, ",".join(f"{m.name}@{m.registered_ms}" for m in members), members)


def offer(*members: JobMember) -> bytes:
    return wire.encode_offer(wire.Offer("fp", 5000, "tok", Layout.of(members))).encode()


A, B, C = member("a", 1, "g"), member("b", 2, "g"), member("c", 3, "g")
D = member("d", 4)


def spares(m: FakeMembership, f: FakeFormation, wait_s: float = 5.0) -> Spares:
    return Spares(3, m, f, lambda: m.heartbeat(0), wait_s)  # type: ignore[arg-type]


def test_a_spare_waits_heartbeating_and_tells_its_role_once_then_is_drafted() -> None:
    at_target = view(A, B, C, D)
    waits = [at_target] * 5
    m = FakeMembership("d", [*waits, view(A, C, D)])
    directory: dict[str, bytes] = {}
    f = FakeFormation({4001: directory})
    s = spares(m, f)
    # the leader offers a layout with d in b's place once the view drops b
    calls = {"n": 0}
    real = f.connect

    def connect(addr: str, port: int, what: str) -> FakeStore:
        store = real(addr, port, what)
        original = store.compare_set

        def compare_set(key: str, expected: str, desired: str) -> bytes:
            calls["n"] += 1
            if calls["n"] >= 6:
                directory[FORMATION_KEY] = offer(A, D, C)
            return original(key, expected, desired)

        store.compare_set = compare_set  # type: ignore[method-assign]
        return store

    f.connect = connect  # type: ignore[method-assign]
    s.wait_for_draft()
    assert m.sent == [("target", 3), ("role", "spare")]  # the role once, not per poll
    assert m.beats >= 5
    assert f.connects == [4001]  # one connection to the leader's directory, kept
    s.tell("training")
    assert m.sent[-1] == ("role", "training")


def test_an_offer_without_this_node_keeps_it_waiting_until_spare_wait_s() -> None:
    m = FakeMembership("d", [view(A, B, C, D)])
    f = FakeFormation({4001: {FORMATION_KEY: offer(A, B, C)}})
    with pytest.raises(SpareWaitOver, match="spare_wait_s"):
        spares(m, f, wait_s=0.05).wait_for_draft()


def test_the_oldest_node_leads_and_a_dead_leader_is_skipped() -> None:
    # every training node gone: d is the oldest and leads at once
    m = FakeMembership("d", [view(D)])
    spares(m, FakeFormation({})).wait_for_draft()
    # a leader whose directory refuses: the spare reads the next leader after a new view
    m = FakeMembership("d", [view(A, B, C, D), view(B, C, D)])
    f = FakeFormation({4002: {FORMATION_KEY: offer(D, B, C)}})
    spares(m, f).wait_for_draft()
    assert f.connects == [4001, 4002]


def test_only_local_rank_0_tells_the_agent() -> None:
    m = FakeMembership("d", [view(A, B, C, D)], local_rank=1)
    s = spares(m, FakeFormation({}))
    s.tell("spare")
    assert m.sent == [] and s.role == "spare"


class HeldStore(FakeStore):
    """A stopped leader's directory: the kernel took the connection, nobody answers."""

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        time.sleep(READ_TIMEOUT.total_seconds() * 2)
        raise RuntimeError("Socket Timeout")


def test_a_leader_that_holds_the_read_is_passed_for_the_next_offer_in_the_same_view() -> None:
    """A stopped or cut-off leader stays in the spare's view until its death: the spare
    passes it (as a refusing one) and follows the next member whose offer lists it."""
    m = FakeMembership("d", [view(A, B, C, D)])
    f = FakeFormation({4002: {FORMATION_KEY: offer(D, B, C)}})
    real = f.connect

    def connect(addr: str, port: int, what: str) -> FakeStore:
        f.connects.append(port)
        return HeldStore({}) if port == 4001 else real(addr, port, what)

    f.connect = connect  # type: ignore[method-assign]
    started = time.monotonic()
    assert spares(m, f).wait_for_draft() == "b"
    assert time.monotonic() - started < PASS_S, "drafted before the pass ran out"
    assert f.connects.count(4001) == 1, "the held leader is not read again while passed"


def test_a_leader_passed_for_a_held_read_is_read_again_after_the_pass() -> None:
    m = FakeMembership("d", [view(A, B, C, D)])
    directory: dict[str, bytes] = {}
    f = FakeFormation({4002: {FORMATION_KEY: offer(A, B, C)}})
    held = {"n": 0}
    real = f.connect

    def connect(addr: str, port: int, what: str) -> FakeStore:
        if port != 4001:
            return real(addr, port, what)
        f.connects.append(port)
        held["n"] += 1
        if held["n"] == 1:
            return HeldStore({})
        directory[FORMATION_KEY] = offer(A, D, C)  # it was only slow: now it drafts d
        return FakeStore(directory)

    f.connect = connect  # type: ignore[method-assign]
    started = time.monotonic()
    assert spares(m, f).wait_for_draft() == "a"
    assert time.monotonic() - started >= PASS_S
