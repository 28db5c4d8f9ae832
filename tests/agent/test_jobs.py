"""Job registrations and views: the pure rules (agent.jobs) and live agents on loopback
with the blocking torchhook client (a watcher thread per registration)."""

from __future__ import annotations

import functools
import re
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from agent.cli_format import jobs_text
from agent.control import (
    ControlClient,
    ControlError,
    FrameDecoder,
    JobMember,
    PauseRefused,
    encode_frame,
    make_request,
)
from agent.jobs import (
    HEALTH_HUNG,
    MAX_LISTED_JOBS,
    MAX_LOCAL_RANKS,
    Generations,
    JobError,
    JobTag,
    LocalJobs,
    Registration,
    check_group,
    check_job,
    fingerprint,
    job_members,
    summaries,
    view,
)
from agent.procs import until_async as until
from swim import Address, Member, NodeStateType
from tests.agent.test_agent import cluster, seen_by
from torchhook.client import Membership, MembershipClosed, View

# --- pure rules -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("1700000000000,29500,ok,", JobTag(1700000000000, 29500, "ok", "")),
        ("5,0,hung,abc.1", JobTag(5, 0, "hung", "abc.1")),
        ("5,0,ok,,8", JobTag(5, 0, "ok", "", 8)),  # a node with 8 local ranks
        ("5,0,ok,g,1", JobTag(5, 0, "ok", "g")),  # four fields mean one rank
        ("5,0,ok", None),  # too few fields
        ("5,0,ok,a,b", None),  # ranks not a count
        ("5,0,ok,,2,spare", JobTag(5, 0, "ok", "", 2, "spare")),  # a hot spare
        ("5,0,ok,g,1,training", JobTag(5, 0, "ok", "g")),  # written without the role
        ("5,0,ok,a,1,1", None),  # not a role
        ("5,0,ok,a,1,Spare", None),  # roles are exact
        ("5,0,ok,a,1,spare,", None),  # too many
        ("²,0,ok,a", None),  # a digit int() refuses
        ("5,0,ok,,0", None),  # no ranks
        (f"5,0,ok,,{MAX_LOCAL_RANKS + 1}", None),  # over the bound
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


def test_job_summaries_agree_with_views_and_are_bounded() -> None:
    from agent import serf

    def tags(m: Member) -> dict[str, str]:
        return serf.decode_tags(m.meta)

    members = [
        _member("a", {"swim.job/j": "10,1,ok,,8", "swim.job/k": "5,0,ok,"}),
        _member("b", {"swim.job/j": "20,1,ok,"}),
        _member("s", {"swim.job/j": "30,1,ok,,1,spare"}),  # a hot spare: in the view
        _member("h", {"swim.job/j": "1,1,hung,"}),
        _member("gone", {"swim.job/old": "1,1,ok,"}, NodeStateType.DEAD),  # listed, no nodes
        _member("x", {"swim.job/bad name": "1,1,ok,", "role": "gpu"}),  # not a job name
    ]
    generations = Generations()
    result = summaries(members, tags, generations, {"mine": 1})
    by_job = {j["job"]: j for j in result["jobs"]}
    assert list(by_job) == ["j", "k", "mine", "old"] and result["omitted"] == 0
    seen = view("j", members, tags, Generations())
    assert by_job["j"] == {
        "job": "j",
        "generation": 1,
        "fingerprint": seen["fingerprint"],
        "nodes": 3,
        "ranks": 10,
        "training": 2,
        "spares": 1,
        "hung": 1,
        "local_ranks": 0,
        "paused": [],
        "refused_frames": 0,
    }
    assert by_job["old"]["nodes"] == 0 and by_job["mine"]["local_ranks"] == 1
    # the same counters as view: listing again changes nothing, a view change counts once
    assert view("j", members[1:], tags, generations)["generation"] == 2
    assert summaries(members[1:], tags, generations, {})["jobs"][0]["generation"] == 2
    many = [_member(f"n{i}", {f"swim.job/j{i:03d}": "1,1,ok,"}) for i in range(300)]
    bounded = summaries(many, tags, Generations(), {})
    assert len(bounded["jobs"]) == MAX_LISTED_JOBS and bounded["omitted"] == 300 - MAX_LISTED_JOBS


def test_a_member_name_that_is_not_utf8_joins_the_fingerprint() -> None:
    """A Go peer's name may hold any bytes; the wire decodes them with surrogateescape,
    and hashing them must not raise (it once would have broken every watch of the job)."""
    from agent import serf

    key = "swim.job/j"
    members = [_member("ok", {key: "1,1,ok,"}), _member("\udcff\udcfe", {key: "2,1,ok,"})]
    listed = job_members("j", members, lambda m: serf.decode_tags(m.meta))
    assert [m.name for m in listed] == ["ok", "\udcff\udcfe"]
    assert fingerprint(listed) != fingerprint(listed[:1])


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
        Registration.create("j", store_port=70_000)
    with pytest.raises(JobError, match="heartbeat"):
        Registration.create("j", heartbeat_pause_ms=-1)
    for size in (0, MAX_LOCAL_RANKS + 1, True, "2"):
        with pytest.raises(JobError, match="local_world_size"):
            Registration.create("j", local_world_size=size)
    for rank in (-1, 2, None):
        with pytest.raises(JobError, match="local_rank"):
            Registration.create("j", local_rank=rank, local_world_size=2)


def test_a_node_joins_with_all_its_local_ranks_and_leaves_with_any() -> None:
    jobs = LocalJobs()
    rank = {
        r: Registration.create("j", store_port=100 + r, local_rank=r, local_world_size=3)
        for r in range(3)
    }
    jobs.add(rank[1], wall_ms=10)
    jobs.add(rank[0], wall_ms=20)
    assert jobs.tag("j", 0) is None, "incomplete: rank 2 has not registered"
    before = jobs.count()
    for bad in (
        Registration.create("j", local_rank=1, local_world_size=3),  # rank 1 again
        Registration.create("j", local_rank=0, local_world_size=2),  # another size
    ):
        with pytest.raises(JobError):
            jobs.add(bad, wall_ms=25)
    assert jobs.count() == before and jobs.tag("j", 0) is None, "a refusal changes nothing"
    jobs.add(rank[2], wall_ms=30)
    # complete: since the last rank came; local rank 0's store port and group
    assert jobs.tag("j", 0) == JobTag(30, 100, "ok", "", 3)
    rank[1].group = "not-gossiped"
    rank[0].group = "g7"
    assert jobs.tag("j", 0) == JobTag(30, 100, "ok", "g7", 3)
    # one rank stops heartbeating: the whole node is hung
    for t in range(0, 1000, 100):
        for r in rank.values():
            r.heartbeat(t // 100, t)
    for t in range(1000, 60_000, 100):
        rank[0].heartbeat(t // 100, t)
        rank[1].heartbeat(t // 100, t)
    tag = jobs.tag("j", 60_000)
    assert tag is not None and tag.health == HEALTH_HUNG
    # one rank leaves: the node leaves; it returns as a new member
    jobs.remove(rank[2])
    assert jobs.tag("j", 0) is None
    fresh = Registration.create("j", local_rank=2, local_world_size=3)
    jobs.add(fresh, wall_ms=90)
    tag = jobs.tag("j", 60_000)
    assert tag is not None and tag.registered_ms == 90 and tag.health == "ok"
    for r in (rank[0], rank[1], fresh):
        jobs.remove(r)
    assert "j" not in jobs and jobs.count() == 0
    jobs.remove(fresh)  # twice: nothing happens


def test_view_ranks_and_fingerprints_of_multi_rank_nodes() -> None:
    one = [JobMember("a", "h", 1, 2, 10, "", "alive"), JobMember("b", "h", 1, 2, 20, "", "alive")]
    # one-rank members hash exactly as agents before multi-rank jobs did (mixed clusters)
    import hashlib

    old = hashlib.sha256(b"a@10;b@20;").hexdigest()[:16]
    assert fingerprint(one) == old
    eight = [JobMember("a", "h", 1, 2, 10, "", "alive", 8), one[1]]
    assert fingerprint(eight) != old
    view = View("j", 1, fingerprint(eight), (eight[0], one[1]))
    assert view.world_size == 9
    assert view.ranks_of("a") == range(0, 8) and view.ranks_of("b") == range(8, 9)
    with pytest.raises(KeyError):
        view.ranks_of("c")


def test_registration_is_hung_only_after_heartbeats_stop() -> None:
    reg = Registration.create("j", heartbeat_pause_ms=500, first_heartbeat_estimate_ms=100)
    assert reg.health_at(10**9) == "ok", "no heartbeat yet: loading is not a hang"
    for t in range(0, 1000, 100):
        reg.heartbeat(t // 100, t)
    assert reg.health_at(1000) == "ok"
    assert reg.health_at(1400) == "ok", "within the acceptable pause"
    assert reg.health_at(3000) == HEALTH_HUNG
    reg.heartbeat(10, 3000)
    assert reg.health_at(3050) == "ok"


def _stepping(pause_ms: int = 500) -> Registration:
    """A rank that stepped every 100 ms from 0 to 900 ms."""
    reg = Registration.create("j", heartbeat_pause_ms=pause_ms, first_heartbeat_estimate_ms=100)
    for t in range(0, 1000, 100):
        reg.heartbeat(t // 100, t)
    return reg


def test_a_pause_spares_a_rank_and_scoring_resumes_afresh() -> None:
    reg = _stepping()
    assert reg.health_at(3000) == HEALTH_HUNG, "a stall with no pause is a hang"
    reg = _stepping()
    reg.pause("checkpoint", 10, 1000)
    assert reg.health_at(8000) == "ok" and reg.phi(8000) == 0.0
    samples = reg.detector.sample_count
    reg.heartbeat(10, 8500)  # alive mid-pause: no sample of the step rhythm
    assert reg.detector.sample_count == samples
    assert reg.resume(9000) is not None and reg.paused is None
    assert reg.health_at(9400) == "ok", "silence counts from the resume, not the last step"
    assert reg.detector.sample_count == samples, "the pause's gap is no sample"
    assert reg.health_at(11_000) == HEALTH_HUNG, "a stall after the pause is still a hang"
    assert (reg.pauses, reg.overruns) == (1, 0)


def test_a_pause_that_overruns_max_s_is_scored_from_its_deadline() -> None:
    reg = _stepping()
    reg.pause("eval", 2, 1000)
    assert reg.health_at(2900) == "ok"
    assert reg.health_at(3300) == "ok", "within the tolerance after the deadline (3000)"
    assert reg.paused is None and reg.overruns == 1
    assert reg.health_at(5000) == HEALTH_HUNG
    assert reg.resume(5000) is None, "a late resume ends nothing"


@pytest.mark.parametrize(
    ("reason", "max_s", "error"),
    [
        ("", 5, "reason"),
        ("x" * 65, 5, "reason"),
        ("a\x1b[2J", 5, "reason"),  # no terminal escapes in operators' tables
        (7, 5, "reason"),
        ("ckpt", 0, "max_s"),
        ("ckpt", -1, "max_s"),
        ("ckpt", float("nan"), "max_s"),
        ("ckpt", 3601, "max_s"),
        ("ckpt", True, "max_s"),
        ("ckpt", "5", "max_s"),
    ],
)
def test_bad_pauses_are_refused_and_change_nothing(
    reason: object, max_s: object, error: str
) -> None:
    reg = _stepping()
    reg.pause("first", 60, 1000)
    before = (reg.paused, reg.pauses)
    with pytest.raises(JobError, match=error):
        reg.pause(reason, max_s, 1100)
    assert (reg.paused, reg.pauses) == before


# --- live agents --------------------------------------------------------------------------


def _views(tmp_path: Path, n: int, job: str) -> list[View]:
    from torchhook.client import fetch_view

    return [fetch_view(job, tmp_path / f"n{i}.sock") for i in range(n)]


@pytest.mark.trio
async def test_registrations_make_the_same_view_everywhere(tmp_path: Path) -> None:
    async with cluster(tmp_path, 3) as agents:
        await until(
            lambda: all(len(a.node.members()) == 3 for a in agents),
            20,
            describe=seen_by(agents),
        )
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
        await until(
            lambda: all(len(a.node.members()) == 2 for a in agents),
            20,
            describe=seen_by(agents),
        )
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


@pytest.mark.trio
async def test_a_multi_rank_node_is_one_member_of_every_view(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as agents:
        await until(
            lambda: all(len(a.node.members()) == 2 for a in agents),
            20,
            describe=seen_by(agents),
        )
        rank = functools.partial(Membership, "mr", control=tmp_path / "n0.sock", local_world_size=2)
        other = await trio.to_thread.run_sync(
            lambda: Membership("mr", control=tmp_path / "n1.sock")
        )
        r0 = await trio.to_thread.run_sync(lambda: rank(local_rank=0))
        r1 = None
        try:
            await trio.sleep(0.5)
            assert other.view.names == ("n1",), "n0 is incomplete with one of two ranks"
            with pytest.raises(ControlError, match="local rank 0"):
                await trio.to_thread.run_sync(lambda: rank(local_rank=0))
            r1 = await trio.to_thread.run_sync(lambda: rank(local_rank=1))
            view = await trio.to_thread.run_sync(
                lambda: other.wait(lambda v: v.names == ("n1", "n0"), 10)
            )
            assert [m.ranks for m in view.members] == [1, 2] and view.world_size == 3
            assert view.ranks_of("n0") == range(1, 3)
            # the ranks on n0 see the same view through their own agent
            assert r1.wait(lambda v: v.fingerprint == view.fingerprint, 10).names == view.names
            # a rank whose collective lost n1 tells its agent, which probes n1 at once (n1
            # answers: evidence is not a verdict); garbage reports are ignored
            before = sum(agents[0].node.stats.urgent_probes.values())
            r0.report_lost(["n1", 7])  # type: ignore[list-item]
            r0.report_lost(["n1"])
            await until(lambda: sum(agents[0].node.stats.urgent_probes.values()) > before, 5)
            assert agents[0].node.stats.urgent_probes["started"] >= 1
            assert agents[0].state_of("n1") == NodeStateType.ALIVE
            # one local rank gone (its process died): the whole node leaves every view
            r1.close()
            await trio.to_thread.run_sync(lambda: other.wait(lambda v: v.names == ("n1",), 10))
            assert r0.wait(lambda v: v.names == ("n1",), 10).world_size == 1
        finally:
            for m in (other, r0, r1):
                if m is not None:
                    m.close()


def _beat(m: Membership, steps: int, every_s: float = 0.05) -> None:
    for step in range(steps):
        m.heartbeat(step)
        time.sleep(every_s)  # the step time the detector learns


class RawRegistration:
    """A registration spoken frame by frame, to send what the client would refuse."""

    def __init__(self, path: Path, job: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(str(path))
        self.sock.sendall(encode_frame(make_request("watch", job=job, register={})))
        self._decoder = FrameDecoder()
        self._frames: list[dict[str, object]] = []
        while not self._frames:  # the agent reads frames of the watch once it answered
            self._frames += self._decoder.feed(self.sock.recv(65536))
        assert self._frames.pop(0)["ok"] is True

    def pause_reply(self) -> dict[str, object]:
        """The agent's next answer to a pause frame (views pass by)."""
        while True:
            while self._frames:
                frame = self._frames.pop(0)
                if isinstance(frame.get("pause"), dict):
                    return frame["pause"]  # type: ignore[return-value]
            data = self.sock.recv(65536)
            assert data, "the agent closed the registration"
            self._frames += self._decoder.feed(data)


@pytest.mark.trio
async def test_pauses_with_a_live_agent(tmp_path: Path) -> None:
    """A pause longer than the hang threshold keeps the node in the view and shows in
    ``jobs``; a stall with no pause, and a pause past its ``max_s``, are hangs; bad pause
    frames are refused with the reason, counted, and change nothing."""
    path = tmp_path / "n0.sock"
    async with cluster(tmp_path, 1) as agents:
        rank = await trio.to_thread.run_sync(
            lambda: Membership(
                "p", control=path, heartbeat_pause_ms=200, first_heartbeat_estimate_ms=50
            )
        )
        observer = await trio.to_thread.run_sync(
            lambda: Membership("p", control=path, register=False)
        )
        views: list[tuple[str, ...]] = []
        observer.add_listener(lambda v: views.append(v.names))
        jobs = ControlClient(path)
        try:
            await trio.to_thread.run_sync(_beat, rank, 10)
            del views[:]

            def checkpoint() -> dict[str, Any]:
                with rank.paused("checkpoint", 5):
                    time.sleep(1.0)  # 4x the tolerated silence
                    return dict(jobs.request("jobs")["jobs"][0])

            during = await trio.to_thread.run_sync(checkpoint)
            assert [p["reason"] for p in during["paused"]] == ["checkpoint"]
            assert re.search(r"  0 \(checkpoint, [34] s left\)  ", jobs_text({"jobs": [during]}))
            await trio.to_thread.run_sync(_beat, rank, 3)
            assert all(names == ("n0",) for names in views), f"left the view: {views}"
            assert observer.view.names == ("n0",)
            # a stall without a pause is a hang, and stepping again ends it
            await trio.to_thread.run_sync(lambda: observer.wait(lambda v: v.names == (), 10))
            await trio.to_thread.run_sync(_beat, rank, 3)
            await trio.to_thread.run_sync(lambda: observer.wait(lambda v: v.names == ("n0",), 10))

            # a pause that overruns its max_s is scored from its deadline: a hang
            def overrun() -> float:
                with rank.paused("eval", 0.3):
                    start = time.monotonic()
                    observer.wait(lambda v: v.names == (), 10)
                    return time.monotonic() - start

            assert await trio.to_thread.run_sync(overrun) >= 0.3
            await trio.to_thread.run_sync(_beat, rank, 3)
            await trio.to_thread.run_sync(lambda: observer.wait(lambda v: v.names == ("n0",), 10))
            listed = await trio.to_thread.run_sync(jobs.request, "jobs")
            assert listed["jobs"][0]["paused"] == []

            # bad pause frames: refused with the reason, counted, nothing changed
            raw = await trio.to_thread.run_sync(RawRegistration, path, "q")
            try:
                for bad in ({"reason": "", "max_s": 5}, {"reason": "x", "max_s": 1e9}, "ckpt"):
                    raw.sock.sendall(encode_frame({"pause": bad}))
                    reply = await trio.to_thread.run_sync(raw.pause_reply)
                    assert reply["ok"] is False and "pause" in str(reply["error"])
                listed = await trio.to_thread.run_sync(jobs.request, "jobs")
                q = next(j for j in listed["jobs"] if j["job"] == "q")
                assert q["refused_frames"] == 3 and q["paused"] == [] and q["local_ranks"] == 1
                raw.sock.sendall(encode_frame({"pause": {"reason": "ok", "max_s": 5}}))
                assert (await trio.to_thread.run_sync(raw.pause_reply))["ok"] is True
            finally:
                raw.sock.close()
            with pytest.raises(PauseRefused, match="max_s"), rank.paused("eval", 0):
                pass
        finally:
            rank.close()
            observer.close()
        # unregistered before the agent stops (its last tag update would wait otherwise)
        await until(lambda: not any(k.startswith("swim.job/") for k in agents[0].agent.tags), 5)
