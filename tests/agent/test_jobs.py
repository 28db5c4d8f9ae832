"""Job registrations and views: the pure rules (agent.jobs) and live agents on loopback
with the blocking torchhook client (a watcher thread per registration)."""

from __future__ import annotations

import functools
import socket
import struct
from pathlib import Path

import pytest
import trio

from agent.control import ControlClient, ControlError
from agent.jobs import (
    HEALTH_HUNG,
    Generations,
    JobError,
    JobTag,
    Registration,
    check_group,
    check_job,
    fingerprint,
    job_members,
)
from swim import Address, Member, NodeStateType
from tests.agent.test_agent import cluster, until
from torchhook.client import Membership, MembershipClosed, View

# --- pure rules -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("1700000000000,29500,ok,", JobTag(1700000000000, 29500, "ok", "")),
        ("5,0,hung,abc.1", JobTag(5, 0, "hung", "abc.1")),
        ("5,0,ok", None),  # too few fields
        ("5,0,ok,a,b", None),  # too many
        ("-5,0,ok,", None),  # not a count
        ("5,70000,ok,", None),  # not a port
        ("5,0,maybe,", None),  # unknown health
        ("5,0,ok," + "g" * 33, None),  # group too long
        ("5,0,ok,a b", None),  # group charset
    ],
)
def test_job_tag_decode(value: str, parsed: JobTag | None) -> None:
    assert JobTag.decode(value) == parsed
    if parsed is not None:
        assert JobTag.decode(parsed.encode()) == parsed


def _member(name: str, tags: dict[str, str], state: NodeStateType = NodeStateType.ALIVE) -> Member:
    from agent import serf

    return Member(name, Address("127.0.0.1", 7946), serf.encode_tags(tags), 1, state, 0, (2, 5, 5))


def test_view_orders_by_registration_age_and_filters() -> None:
    from agent import serf

    def tags(m: Member) -> dict[str, str]:
        return serf.decode_tags(m.meta)

    key = "swim.job/j"
    members = [
        _member("c", {key: "30,1,ok,"}),
        _member("a", {key: "30,1,ok,"}),  # same age as c: the name breaks the tie
        _member("b", {key: "10,1,ok,"}),
        _member("hung", {key: "1,1,hung,"}),
        _member("dead", {key: "1,1,ok,"}, NodeStateType.DEAD),
        _member("sus", {key: "50,1,ok,"}, NodeStateType.SUSPECT),
        _member("other", {"swim.job/k": "1,1,ok,"}),
        _member("bad", {key: "garbage"}),
    ]
    listed = job_members("j", members, tags)
    assert [m.name for m in listed] == ["b", "a", "c", "sus"]
    assert listed[-1].status == "suspect"
    assert fingerprint(listed) == fingerprint(job_members("j", reversed(members), tags))
    assert fingerprint(listed) != fingerprint(listed[:-1])


def test_generations_count_fingerprint_changes() -> None:
    g = Generations()
    assert [g.number("j", fp) for fp in ["a", "a", "b", "b", "a"]] == [1, 1, 2, 2, 3]
    assert g.number("k", "a") == 1


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 65, 3, None, "a b"])
def test_bad_job_names(bad: object) -> None:
    with pytest.raises(JobError):
        check_job(bad)


def test_bad_group_and_registration() -> None:
    with pytest.raises(JobError):
        check_group("x" * 33)
    with pytest.raises(JobError, match="store_port"):
        Registration.create("j", 1, store_port=70_000)
    with pytest.raises(JobError, match="heartbeat"):
        Registration.create("j", 1, heartbeat_pause_ms=-1)


def test_registration_is_hung_only_after_heartbeats_stop() -> None:
    reg = Registration.create("j", 1, heartbeat_pause_ms=500, first_heartbeat_estimate_ms=100)
    assert reg.health_at(10**9) == "ok", "no heartbeat yet: loading is not a hang"
    for t in range(0, 1000, 100):
        reg.heartbeat(t // 100, t)
    assert reg.health_at(1000) == "ok"
    assert reg.health_at(1400) == "ok", "within the acceptable pause"
    assert reg.health_at(3000) == HEALTH_HUNG
    reg.heartbeat(10, 3000)
    assert reg.health_at(3050) == "ok"


# --- live agents --------------------------------------------------------------------------


def _views(tmp_path: Path, n: int, job: str) -> list[View]:
    from torchhook.client import fetch_view

    return [fetch_view(job, tmp_path / f"n{i}.sock") for i in range(n)]


@pytest.mark.trio
async def test_registrations_make_the_same_view_everywhere(tmp_path: Path) -> None:
    async with cluster(tmp_path, 3) as agents:
        await until(lambda: all(len(a.node.members()) == 3 for a in agents), 20, agents)
        open_ = functools.partial(Membership, "train", heartbeat_pause_ms=300)
        first = await trio.to_thread.run_sync(lambda: open_(control=tmp_path / "n1.sock"))
        second = await trio.to_thread.run_sync(lambda: open_(control=tmp_path / "n0.sock"))
        try:
            assert first.node == "n1" and second.node == "n0"
            want = ("n1", "n0")  # registration order, not name order
            view = await trio.to_thread.run_sync(lambda: first.wait(lambda v: v.names == want, 10))
            views: list[View] = []
            with trio.fail_after(10):
                while len({(v.names, v.fingerprint) for v in views}) != 1 or views[0].names != want:
                    views = await trio.to_thread.run_sync(_views, tmp_path, 3, "train")
                    await trio.sleep(0.05)
            assert views[0].fingerprint == view.fingerprint
            # the group token travels to peers; the view's generation does not change.
            # Gossip carries it (local profile: 2 transmissions at n = 3); should those
            # be lost, the next push-pull (15 s) repairs it, so wait past one.
            await trio.to_thread.run_sync(second.set_group, "g1")
            seen = await trio.to_thread.run_sync(
                lambda: first.wait(lambda v: v.members[1].group == "g1", 20)
            )
            assert seen.generation == view.generation
            # heartbeats, then silence: the agent flags the worker hung and peers drop it
            for step in range(5):
                await trio.to_thread.run_sync(second.heartbeat, step)
                await trio.sleep(0.05)
            hung = await trio.to_thread.run_sync(
                lambda: first.wait(lambda v: v.names == ("n1",), 10)
            )
            assert hung.generation > view.generation
            await trio.to_thread.run_sync(second.heartbeat, 5)
            await trio.to_thread.run_sync(lambda: first.wait(lambda v: v.names == want, 10))
            # a closed registration (a dead trainer on a live host) leaves every view
            second.close()
            await trio.to_thread.run_sync(lambda: first.wait(lambda v: v.names == ("n1",), 10))
        finally:
            first.close()
            second.close()


@pytest.mark.trio
async def test_bad_watch_requests_leave_the_agent_serving(tmp_path: Path) -> None:
    async with cluster(tmp_path, 1) as agents:
        path = tmp_path / "n0.sock"
        for job in ["", "a/b", 7]:
            with pytest.raises(ControlError, match="job must match"):
                await trio.to_thread.run_sync(lambda job=job: Membership(job, control=path))  # type: ignore[misc]
        with pytest.raises(ControlError, match="store_port"):
            await trio.to_thread.run_sync(lambda: Membership("j", control=path, store_port=-1))
        keep = await trio.to_thread.run_sync(lambda: Membership("j", control=path))
        try:
            with pytest.raises(ControlError, match="already registered"):
                await trio.to_thread.run_sync(lambda: Membership("j", control=path))
            watcher = await trio.to_thread.run_sync(
                lambda: Membership("j", control=path, register=False)
            )
            assert watcher.view.names == ("n0",)
            watcher.close()
            # a garbage frame on a registration drops that connection only
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.connect(str(path))
            from agent.control import encode_frame, make_request

            raw.sendall(encode_frame(make_request("watch", job="k", register={})))
            raw.sendall(struct.pack(">I", 2**31) + b"x")
            await trio.sleep(0.2)
            raw.close()
            await until(lambda: "swim.job/k" not in agents[0].agent.tags, 5)
            assert "swim.job/j" in agents[0].agent.tags
            view = await trio.to_thread.run_sync(
                lambda: ControlClient(path).request("view", job="j")
            )
            assert [m["name"] for m in view["members"]] == ["n0"]
        finally:
            keep.close()
        await until(lambda: "swim.job/j" not in agents[0].agent.tags, 5)
        with pytest.raises(MembershipClosed):
            keep.heartbeat(1)


@pytest.mark.trio
async def test_streams_outlive_the_idle_timeout(tmp_path: Path, monkeypatch) -> None:
    """The idle timeout bounds the wait for a request, not a watch it opened (a bug once
    cut every watch and monitor after 30 s)."""
    import agent.control_server

    monkeypatch.setattr(agent.control_server, "IDLE_TIMEOUT_S", 0.2)
    async with cluster(tmp_path, 2) as agents:
        await until(lambda: all(len(a.node.members()) == 2 for a in agents), 20, agents)
        watch = await trio.to_thread.run_sync(
            lambda: Membership("j", control=tmp_path / "n0.sock", register=False)
        )
        try:
            await trio.sleep(1.0)
            assert watch.closed is None
            reg = await trio.to_thread.run_sync(
                lambda: Membership("j", control=tmp_path / "n1.sock")
            )
            await trio.to_thread.run_sync(lambda: watch.wait(lambda v: v.names == ("n1",), 10))
            reg.close()
        finally:
            watch.close()
