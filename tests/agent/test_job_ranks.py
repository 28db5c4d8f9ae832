"""Global ranks in job views: the trainers publish their slots' first global ranks
(agent/job_ranks.py) and every view shows them, so a hot spare that took a failed node's
slot shows that node's ranks. The pure rules (the rank tag both ways between agent
versions, the numbering, the registry's tags), then three real agents on loopback with the
torchhook client sending the frames a trainer sends."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
import trio
from click.testing import CliRunner

from agent import serf
from agent.cli import main
from agent.cli_format import view_text
from agent.control import ControlClient, JobMember
from agent.job_ranks import (
    MAX_FIRST_RANK,
    RANK_TAG_PREFIX,
    RANKS_FROM_JOIN_ORDER,
    RANKS_FROM_TRAINERS,
    check_first_rank,
    decode_first_rank,
    encode_first_rank,
    number,
    rank_key,
)
from agent.job_tag import TAG_PREFIX, JobTag
from agent.jobs import Generations, Registration, fingerprint, job_members, summaries, view
from agent.procs import until_async
from agent.registrations import JobRegistry
from swim import Address, Member, NodeStateType
from tests.agent.test_agent import cluster, seen_by
from torchhook.client import Membership, View

# --- the rank tag, both ways between agent versions -----------------------------------------


def test_rank_tag_round_trips_and_a_malformed_one_is_ignored() -> None:
    for first in (0, 1, 63, MAX_FIRST_RANK):
        assert decode_first_rank(encode_first_rank(first)) == first
    for bad in ["", "-1", "1.0", " 1", "1 ", "\u00b2", "0x10", str(MAX_FIRST_RANK + 1), "1" * 8]:
        assert decode_first_rank(bad) is None, bad
    assert decode_first_rank(None) is None
    for wrong in [-1, MAX_FIRST_RANK + 1, True, 1.0, "1", None]:
        with pytest.raises(ValueError, match="rank must be an int"):
            check_first_rank(wrong)


def _member(name: str, tags: dict[str, str]) -> Member:
    meta = serf.encode_tags(tags)
    return Member(name, Address("127.0.0.1", 7946), meta, 1, NodeStateType.ALIVE, 0, (2, 5, 5))


def _tags(m: Member) -> dict[str, str]:
    return serf.decode_tags(m.meta)


def test_an_older_agent_reads_a_new_nodes_tags_as_before() -> None:
    """The job tag's value is unchanged (five fields for a training node), so the parser
    every agent since multi-rank jobs runs (``JobTag.decode``) takes it; an extra field
    would not be (why the rank has its own key). The rank key is outside ``swim.job/``,
    so a job listing (``summaries``: every key under that prefix names a job) ignores it."""
    tag = JobTag(1000, 29500, "ok", "g1", 2)
    new = {"swim.job/j": tag.encode(), rank_key("j"): "4"}
    assert new["swim.job/j"] == "1000,29500,ok,g1,2"
    assert JobTag.decode(new["swim.job/j"]) == tag
    assert JobTag.decode(new["swim.job/j"] + ",4") is None  # the old parser's answer
    assert not rank_key("j").startswith(TAG_PREFIX) and RANK_TAG_PREFIX == "swim.rank/"
    listed = summaries([_member("a", new)], _tags, Generations(), {})
    assert [j["job"] for j in listed["jobs"]] == ["j"] and listed["jobs"][0]["ranks"] == 2
    # an older agent's view reads only the job tag: the member as without a rank tag
    without = {"swim.job/j": new["swim.job/j"]}
    assert fingerprint(job_members("j", [_member("a", new)], _tags)) == fingerprint(
        job_members("j", [_member("a", without)], _tags)
    )


def test_a_new_agent_numbers_older_nodes_in_join_order() -> None:
    """Nodes without a rank tag (older agents or trainers): join order, as before."""
    members = [
        _member("b", {"swim.job/j": "2000,0,ok,g,1"}),
        _member("a", {"swim.job/j": "1000,0,ok,g,2", rank_key("j"): "1"}),
        _member("s", {"swim.job/j": "3000,0,ok,,1,spare"}),
    ]
    shown = view("j", members, _tags, Generations())
    assert shown["ranks_from"] == RANKS_FROM_JOIN_ORDER
    assert [(m["name"], m["first_rank"]) for m in shown["members"]] == [
        ("a", 0),
        ("b", 2),
        ("s", None),
    ]


# --- the numbering ------------------------------------------------------------------------


def _jm(name: str, registered_ms: int, group: str, ranks: int = 1, role: str = "training") -> Any:
    return JobMember(name, "h", 1, 0, registered_ms, group, "alive", ranks, role)


def _firsts(members: Iterable[JobMember]) -> list[tuple[str, int | None]]:
    return [(m.name, m.first_rank) for m in members]


def test_a_spare_in_a_failed_older_nodes_slot_holds_its_ranks() -> None:
    """a, b, c trained (slots 0-1, 2-3, 4-5); a failed and spare s took its slot: join
    order would give b 0-1, c 2-3, s 4-5; the trainers' numbering is s 0-1, b 2-3, c 4-5."""
    members = [_jm("b", 20, "g2", 2), _jm("c", 30, "g2", 2), _jm("s", 40, "g2", 2)]
    got, source = number(members, {"s": 0, "b": 2, "c": 4})
    assert source == RANKS_FROM_TRAINERS
    assert _firsts(got) == [("b", 2), ("c", 4), ("s", 0)]
    assert [m.name for m in got] == ["b", "c", "s"]  # the view's order stays join order
    # a waiting spare has no ranks and needs none published
    spare = _jm("t", 50, "", 2, "spare")
    got, source = number([*members, spare], {"s": 0, "b": 2, "c": 4})
    assert source == RANKS_FROM_TRAINERS and got[-1].first_rank is None


@pytest.mark.parametrize(
    ("groups", "published", "why"),
    [
        (("g2", "g2", "g2"), {"s": 0, "b": 2}, "one node published none"),
        (("g2", "g1", "g2"), {"s": 0, "b": 2, "c": 4}, "a node still in the old group"),
        (("", "", ""), {"s": 0, "b": 2, "c": 4}, "no group"),
        (("g2", "g2", "g2"), {"s": 0, "b": 2, "c": 2}, "two nodes on the same ranks"),
        (("g2", "g2", "g2"), {"s": 0, "b": 2, "c": 6}, "a gap"),
        (("g2", "g2", "g2"), {"s": 2, "b": 4, "c": 6}, "not from 0"),
    ],
)
def test_published_ranks_that_do_not_add_up_fall_back_to_join_order(
    groups: tuple[str, str, str], published: Mapping[str, int], why: str
) -> None:
    members = [_jm("b", 20, groups[0], 2), _jm("c", 30, groups[1], 2), _jm("s", 40, groups[2], 2)]
    got, source = number(members, published)
    assert source == RANKS_FROM_JOIN_ORDER, why
    assert _firsts(got) == [("b", 0), ("c", 2), ("s", 4)]


def test_swimctl_and_the_torchhook_view_show_the_published_ranks() -> None:
    members, _ = number(
        [_jm("b", 20, "g2", 2), _jm("c", 30, "g2", 2), _jm("s", 40, "g2", 2)],
        {"s": 0, "b": 2, "c": 4},
    )
    shown = {"job": "j", "generation": 2, "fingerprint": "ab", "ranks_from": "trainers"}
    shown["members"] = [m.as_dict() for m in members]
    text = view_text(shown, 100).splitlines()
    assert text[0].endswith("global ranks from trainers")
    assert [line.split()[5] for line in text[2:]] == ["2-3", "4-5", "0-1"]
    got = View.from_dict(shown)
    assert [got.ranks_of(n) for n in "bcs"] == [range(2, 4), range(4, 6), range(0, 2)]
    # a view from an agent before published ranks: join order, as before
    old = {**shown, "members": [{**m.as_dict(), "first_rank": None} for m in members]}
    del old["ranks_from"]
    assert [line.split()[5] for line in view_text(old, 100).splitlines()[2:]] == [
        *("0-1", "2-3", "4-5")
    ]
    assert View.from_dict(old).ranks_of("s") == range(4, 6)


# --- the registry's tags --------------------------------------------------------------------


class _Metadata:
    """The agent's tag store in memory: ``update_tags`` refuses what exceeds ``limit``."""

    def __init__(self, limit: int = 512, **tags: str) -> None:
        self.tags = dict(tags)
        self.limit = limit

    async def update(self, set_: Mapping[str, str], delete: Iterable[str]) -> dict[str, str]:
        tags = {**self.tags, **set_}
        for key in delete:
            tags.pop(key, None)
        if len(serf.encode_tags(tags)) > self.limit:
            raise ValueError("tags would not fit")
        self.tags = tags
        return tags


@pytest.mark.trio
async def test_the_registry_publishes_a_training_nodes_rank_with_its_group() -> None:
    meta = _Metadata()
    jobs = JobRegistry(lambda: meta.tags, meta.update)
    reg = Registration.create("j", local_world_size=1)
    jobs.add(reg, 1000)
    await jobs.sync_tag("j")
    assert set(meta.tags) == {"swim.job/j"}  # no group, no rank yet
    reg.group, reg.first_rank = "g1", 2
    await jobs.sync_tag("j")
    assert meta.tags == {"swim.job/j": "1000,0,ok,g1,1", "swim.rank/j": "2"}
    reg.role = "spare"  # a spare has no ranks
    await jobs.sync_tag("j")
    assert set(meta.tags) == {"swim.job/j"}
    reg.role = "training"
    await jobs.sync_tag("j")
    assert meta.tags["swim.rank/j"] == "2"
    reg.group, reg.first_rank = "g2", None  # a group without a rank removes it
    await jobs.sync_tag("j")
    assert meta.tags == {"swim.job/j": "1000,0,ok,g2,1"}
    reg.first_rank = 0
    await jobs.sync_tag("j")
    jobs.remove(reg)
    await jobs.sync_tag("j")
    assert meta.tags == {}


@pytest.mark.trio
async def test_a_rank_tag_that_would_not_fit_leaves_the_job_tag_published() -> None:
    job_tag = {"swim.job/j": "1000,0,ok,g1,1"}
    room = len(serf.encode_tags({"pad": "x" * 100, **job_tag}))
    meta = _Metadata(room, pad="x" * 100)
    jobs = JobRegistry(lambda: meta.tags, meta.update)
    reg = Registration.create("j")
    reg.group, reg.first_rank = "g1", 3
    jobs.add(reg, 1000)
    await jobs.sync_tag("j")
    assert meta.tags == {"pad": "x" * 100, **job_tag}


# --- live agents --------------------------------------------------------------------------


def _has(n: int) -> Callable[[View], bool]:
    return lambda v: len(v.members) == n


def _firsts_of(v: View) -> dict[str, int | None]:
    return {m.name: m.first_rank for m in v.members}


@pytest.mark.trio
async def test_a_spare_that_took_a_failed_older_nodes_slot_shows_its_ranks(
    tmp_path: Path,
) -> None:
    """n0 and n1 train (ranks 0 and 1), n2 waits as a spare; n0's trainer dies and the
    spare takes its slot (rank 0), n1 keeps rank 1. Join order would say n1 0, n2 1; every
    agent's view, ``swimctl view`` and the status endpoint show the trainers' ranks."""
    socks = [tmp_path / f"n{i}.sock" for i in range(3)]
    async with cluster(tmp_path, 3, metrics_addr="127.0.0.1:0") as agents:
        await until_async(lambda: all(len(a.node.members()) == 3 for a in agents), 20)
        trainers: list[Membership] = []
        try:
            for i, sock in enumerate(socks):  # registered in order: join age n0, n1, n2
                trainers.append(
                    await trio.to_thread.run_sync(functools.partial(Membership, "t", control=sock))
                )
                await trio.to_thread.run_sync(trainers[0].wait, _has(i + 1), 20)
            failed, survivor, spare = trainers
            failed.set_group("g1", 0)
            survivor.set_group("g1", 1)
            spare.set_role("spare")
            await trio.to_thread.run_sync(
                lambda: survivor.wait(lambda v: _firsts_of(v) == {"n0": 0, "n1": 1, "n2": None}, 20)
            )
            failed.close()  # n0's trainer died: its node leaves the job
            spare.set_group("g2", 0)
            spare.set_role("training")
            survivor.set_group("g2", 1)
            seen = await trio.to_thread.run_sync(
                lambda: survivor.wait(lambda v: _firsts_of(v) == {"n1": 1, "n2": 0}, 20)
            )
            assert seen.names == ("n1", "n2")  # join order
            assert seen.ranks_of("n2") == range(0, 1)

            argv = ["view", "t", "--control", str(socks[1])]
            out = await trio.to_thread.run_sync(lambda: CliRunner().invoke(main, argv))
            assert out.exit_code == 0, out.output
            lines = out.stdout.splitlines()
            assert lines[0].endswith("global ranks from trainers")
            assert {line.split()[0]: line.split()[5] for line in lines[2:]} == {
                "n1": "1",
                "n2": "0",
            }
            url = f"http://127.0.0.1:{agents[2].agent.metrics_port}/v1/jobs"
            status = await trio.to_thread.run_sync(
                lambda: json.loads(urlopen(url, timeout=5).read())
            )
            (job,) = status["jobs"]
            assert {n["name"]: n["first_rank"] for n in job["nodes"]} == {"n1": 1, "n2": 0}

            # a bad rank: the whole group frame refused and counted, nothing changed
            survivor._send({"group": "g3", "rank": -1})
            client = ControlClient(socks[1], timeout_s=5)
            with trio.fail_after(10):
                while (await trio.to_thread.run_sync(client.request, "jobs"))["jobs"][0][
                    "refused_frames"
                ] != 1:
                    await trio.sleep(0.05)
            assert agents[1].agent.tags["swim.rank/t"] == "1"
            assert agents[1].agent.tags["swim.job/t"].split(",")[3] == "g2"
        finally:
            for trainer in trainers:
                trainer.close()
        await until_async(
            lambda: not any(k.startswith("swim.") for a in agents for k in a.agent.tags),
            5,
            describe=seen_by(agents),
        )
