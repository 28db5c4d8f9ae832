"""Hot spares on the agent side: a node's role (training or spare) is checked, gossiped in
its job tag, carried by every agent's view without changing the fingerprint, and shown by
``swimctl view``/``jobs``, the status endpoints and the metrics. The pure rules first, then
two real agents on loopback with the torchhook client (the frames are the ones a trainer
sends)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
import trio
from click.testing import CliRunner

from agent import serf
from agent.cli import main
from agent.cli_format import jobs_text, view_text
from agent.control import (
    MAX_TARGET_NODES,
    ControlClient,
    ControlError,
    JobMember,
    check_role,
    check_target,
    encode_frame,
    make_request,
)
from agent.job_metrics import role_counts
from agent.jobs import (
    Generations,
    JobError,
    JobTag,
    LocalJobs,
    Registration,
    fingerprint,
    job_members,
    view,
)
from agent.procs import until_async
from swim import Address, Member, NodeStateType
from tests.agent.test_agent import cluster, seen_by
from torchhook.client import Membership, View

BAD_ROLES: list[object] = ["", "Spare", "spare ", "idle", None, 1, True, ["spare"], {"r": 1}]
BAD_TARGETS: list[object] = [0, -1, MAX_TARGET_NODES + 1, True, 2.0, "3", None, [3]]

# --- pure rules -------------------------------------------------------------------------


@pytest.mark.parametrize("bad", BAD_ROLES)
def test_bad_roles_are_refused_everywhere(bad: object) -> None:
    with pytest.raises(ControlError, match="role must be one of training, spare"):
        check_role(bad)
    with pytest.raises(JobError, match="role must be"):
        Registration.create("j", role=bad)


@pytest.mark.parametrize("bad", BAD_TARGETS)
def test_bad_targets_are_refused(bad: object) -> None:
    with pytest.raises(ControlError, match="target must be an int"):
        check_target(bad)


def test_roles_and_targets_that_are_valid() -> None:
    assert [check_role(r) for r in ("training", "spare")] == ["training", "spare"]
    assert [check_target(n) for n in (1, MAX_TARGET_NODES)] == [1, MAX_TARGET_NODES]


def test_job_members_read_without_a_role_are_training() -> None:
    spare = JobMember("a", "h", 1, 2, 3, "g", "alive", 2, "spare")
    assert JobMember.from_dict(spare.as_dict()) == spare
    old = {k: v for k, v in spare.as_dict().items() if k != "role"}  # an agent before spares
    assert JobMember.from_dict(old).role == "training"


def test_a_spares_tag_is_short_and_training_tags_are_unchanged() -> None:
    training = JobTag(1_700_000_000_000, 29500, "ok", "g" * 32, 64)
    assert training.encode().count(",") == 4  # what agents before spares read
    spare = JobTag(1_700_000_000_000, 29500, "ok", "g" * 32, 64, "spare")
    assert spare.encode() == training.encode() + ",spare"
    key = "swim.job/" + "j" * 64  # the longest job name and group: 3 jobs still fit
    tags = {f"{key[:-1]}{i}": spare.encode() for i in range(3)}
    assert len(serf.encode_tags(tags)) <= 512


def test_local_rank_0_sets_the_nodes_role_and_registered_ms_stays() -> None:
    jobs = LocalJobs()
    ranks = [Registration.create("j", local_rank=r, local_world_size=2) for r in (0, 1)]
    for reg in ranks:
        jobs.add(reg, 30)
    assert jobs.tag("j", 0) == JobTag(30, 0, "ok", "", 2)
    ranks[1].role = "spare"  # a node's role is its local rank 0's
    assert jobs.tag("j", 0) == JobTag(30, 0, "ok", "", 2)
    ranks[0].role = "spare"
    assert jobs.tag("j", 0) == JobTag(30, 0, "ok", "", 2, "spare")
    assert jobs.jobs["j"].target_nodes() is None
    ranks[0].target_nodes = 3
    assert jobs.jobs["j"].target_nodes() == 3


def _member(name: str, value: str, state: NodeStateType = NodeStateType.ALIVE) -> Member:
    meta = serf.encode_tags({"swim.job/j": value})
    return Member(name, Address("127.0.0.1", 7946), meta, 1, state, 0, (2, 5, 5))


def _tags(m: Member) -> dict[str, str]:
    return serf.decode_tags(m.meta)


def test_a_role_change_keeps_the_fingerprint_and_the_generation() -> None:
    before = [_member("a", "10,1,ok,"), _member("b", "20,1,ok,,2")]
    after = [_member("a", "10,1,ok,"), _member("b", "20,1,ok,,2,spare")]
    generations = Generations()
    first, second = view("j", before, _tags, generations), view("j", after, _tags, generations)
    assert (first["fingerprint"], first["generation"]) == (
        second["fingerprint"],
        second["generation"],
    )
    assert [m["role"] for m in second["members"]] == ["training", "spare"]
    assert first != second  # a watcher is sent the new view
    assert fingerprint(job_members("j", after, _tags)) == first["fingerprint"]


def test_role_counts_follow_the_view() -> None:
    members = [
        _member("a", "10,1,ok,"),
        _member("s", "20,1,ok,,1,spare"),
        _member("t", "30,1,ok,,1,spare", NodeStateType.SUSPECT),  # still in the view
        _member("h", "40,1,hung,,1,spare"),  # hung: out of the view
        _member("d", "50,1,ok,,1,spare", NodeStateType.DEAD),
        _member("x", "60,1,ok,,1,idle"),  # a role from the future: ignored
    ]
    assert role_counts(members, _tags) == {"j": (1, 2)}
    assert role_counts(members[4:5], _tags) == {"j": (0, 0)}  # listed with zeros


def test_swimctl_formats_spares() -> None:
    members = [
        JobMember("a", "10.0.0.1", 7946, 29500, 1000, "g", "alive", 2),
        JobMember("s", "10.0.0.2", 7946, 0, 2000, "", "alive", 2, "spare"),
        JobMember("b", "10.0.0.3", 7946, 0, 3000, "", "alive", 2),
    ]
    shown = {"job": "j", "generation": 4, "fingerprint": "ab", "members": []}
    shown["members"] = [m.as_dict() for m in members]
    text = view_text(shown, 4000).splitlines()
    assert text[0].endswith("2 training node(s), 4 rank(s), 1 spare(s)")
    assert [line.split()[:6] for line in text[2:]] == [
        ["a", "10.0.0.1:7946", "alive", "training", "2", "0-1"],
        ["s", "10.0.0.2:7946", "alive", "spare", "2", "-"],
        ["b", "10.0.0.3:7946", "alive", "training", "2", "2-3"],
    ]
    job = {"job": "j", "generation": 4, "fingerprint": "ab", "nodes": 3, "ranks": 6}
    job |= {"hung": 0, "local_ranks": 2, "training": 2, "spares": 1, "target": 3}
    row = jobs_text({"jobs": [job], "omitted": 0}).splitlines()[1].split()
    assert row[:4] == ["j", "4", "2/3", "1"]
    del job["target"], job["training"], job["spares"]  # an agent before spares
    assert jobs_text({"jobs": [job], "omitted": 0}).splitlines()[1].split()[:4] == [
        *("j", "4", "3", "0")
    ]


# --- live agents --------------------------------------------------------------------------


def _role(v: View, name: str) -> str | None:
    member = v.member(name)
    return None if member is None else member.role


def _jobs(path: Path) -> dict[str, Any]:
    (job,) = ControlClient(path, timeout_s=5).request("jobs")["jobs"]
    return dict(job)


@pytest.mark.trio
async def test_a_spare_shows_in_every_agents_view_swimctl_and_metrics(tmp_path: Path) -> None:
    """n1's local rank 0 turns its node into a spare: n0's trainer sees it in its view
    (same fingerprint, generation and registered_ms), ``swimctl view``/``jobs`` on n0 show
    it, n0's metrics count it; bad role and target frames are refused and counted on n1;
    turning it back to training is seen the same way."""
    async with cluster(tmp_path, 2, metrics_addr="127.0.0.1:0") as agents:
        await until_async(lambda: all(len(a.node.members()) == 2 for a in agents), 20)
        n0, n1 = tmp_path / "n0.sock", tmp_path / "n1.sock"
        trainer = await trio.to_thread.run_sync(lambda: Membership("train", control=n0))
        other = await trio.to_thread.run_sync(lambda: Membership("train", control=n1))
        try:
            both = await trio.to_thread.run_sync(
                lambda: trainer.wait(lambda v: len(v.members) == 2, 10)
            )
            other._send({"role": "spare", "target": 1})
            # gossip carries the tag (2 transmissions at n = 2); a lost one is repaired by
            # the next push-pull (15 s with local), so wait past one
            seen: View = await trio.to_thread.run_sync(
                lambda: trainer.wait(lambda v: _role(v, "n1") == "spare", 20)
            )
            assert (seen.fingerprint, seen.generation) == (both.fingerprint, both.generation)
            before, after = both.member("n1"), seen.member("n1")
            assert before is not None and after is not None
            assert after.registered_ms == before.registered_ms
            assert _role(seen, "n0") == "training"

            argv = ["view", "train", "--control", str(n0)]
            out = await trio.to_thread.run_sync(lambda: CliRunner().invoke(main, argv))
            assert out.exit_code == 0, out.output
            rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[2:]}
            assert rows["n1"][3] == "spare" and rows["n0"][3] == "training"
            assert "1 training node(s), 1 rank(s), 1 spare(s)" in out.stdout.splitlines()[0]
            listed = await trio.to_thread.run_sync(_jobs, n0)
            assert (listed["training"], listed["spares"], listed["nodes"]) == (1, 1, 2)
            assert listed["ranks"] == 1  # the world the job trains at
            assert listed["target"] is None  # n0's trainer reported none
            assert (await trio.to_thread.run_sync(_jobs, n1))["target"] == 1

            url = f"http://127.0.0.1:{agents[0].agent.metrics_port}"

            def scrape() -> str:
                page: bytes = urlopen(f"{url}/metrics", timeout=5).read()
                return page.decode()

            page = await trio.to_thread.run_sync(scrape)
            assert 'swim_job_spare_nodes{job="train"} 1.0' in page
            assert 'swim_job_training_nodes{job="train"} 1.0' in page
            assert "swim_job_target_nodes{" not in page  # n0's trainer reported none
            url1 = f"http://127.0.0.1:{agents[1].agent.metrics_port}/metrics"
            page1 = await trio.to_thread.run_sync(lambda: urlopen(url1, timeout=5).read())
            assert b'swim_job_target_nodes{job="train"} 1.0' in page1
            assert b'swim_job_spare_nodes{job="train"} 1.0' in page1
            status = await trio.to_thread.run_sync(
                lambda: json.loads(urlopen(f"{url}/v1/jobs", timeout=5).read())
            )
            (job,) = status["jobs"]
            assert (job["training"], job["spares"], job["ranks"]) == (1, 1, 1)
            assert {n["name"]: n["role"] for n in job["nodes"]} == {
                "n0": "training",
                "n1": "spare",
            }

            # bad frames: refused, counted, nothing changed, the connection stays
            for bad in [*BAD_ROLES[:4], None]:
                other._send({"role": bad})
            other._send({"target": 0})
            with trio.fail_after(10):
                while (await trio.to_thread.run_sync(_jobs, n1))["refused_frames"] != 6:
                    await trio.sleep(0.05)
            assert other.closed is None and _role(trainer.view, "n1") == "spare"

            other._send({"role": "training"})
            back = await trio.to_thread.run_sync(
                lambda: trainer.wait(lambda v: _role(v, "n1") == "training", 20)
            )
            assert back.fingerprint == both.fingerprint
        finally:
            trainer.close()
            other.close()
        await until_async(
            lambda: not any(k.startswith("swim.job/") for a in agents for k in a.agent.tags),
            5,
            describe=seen_by(agents),
        )


@pytest.mark.trio
async def test_a_node_registered_as_a_spare_is_never_seen_training(tmp_path: Path) -> None:
    """``register`` with a role: the node's first view already says spare (a role frame
    after registering would leave a moment where it looks like a training node)."""
    path = tmp_path / "n0.sock"
    async with cluster(tmp_path, 1) as agents:
        observer = await trio.to_thread.run_sync(
            lambda: Membership("train", control=path, register=False)
        )
        roles: list[tuple[str, ...]] = []
        observer.add_listener(lambda v: roles.append(tuple(m.role for m in v.members)))
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            raw.settimeout(5)
            raw.connect(str(path))
            register = {"register": {"role": "spare"}}
            raw.sendall(encode_frame(make_request("watch", job="train", **register)))
            await trio.to_thread.run_sync(lambda: observer.wait(lambda v: len(v.members) == 1, 10))
            assert roles[-1] == ("spare",) and ("training",) not in roles
        finally:
            raw.close()
            observer.close()
        # unregistered before the agent stops (its last tag update would wait otherwise)
        await until_async(lambda: "swim.job/train" not in agents[0].agent.tags, 5)


@pytest.mark.trio
async def test_a_role_whose_tag_would_not_fit_is_refused_and_the_old_one_kept(
    tmp_path: Path,
) -> None:
    """The node's other tags leave room for a training tag but not for ``,spare``: the
    role frame is refused and counted, the published tag and the connection stay."""
    training = f"{1_700_000_000_000},0,ok,,1"
    pad = max(
        n
        for n in range(300, 500)
        if len(serf.encode_tags({"pad": "x" * n, "swim.job/train": training})) <= 512
    )
    assert len(serf.encode_tags({"pad": "x" * pad, "swim.job/train": training + ",spare"})) > 512
    path = tmp_path / "n0.sock"
    async with cluster(tmp_path, 1, tags={"pad": "x" * pad}) as agents:
        rank = await trio.to_thread.run_sync(lambda: Membership("train", control=path))
        try:
            rank._send({"role": "spare"})
            with trio.fail_after(10):
                while (await trio.to_thread.run_sync(_jobs, path))["refused_frames"] != 1:
                    await trio.sleep(0.05)
            assert agents[0].agent.tags["swim.job/train"].count(",") == 4  # still training
            listed = await trio.to_thread.run_sync(_jobs, path)
            assert (listed["training"], listed["spares"]) == (1, 0) and rank.closed is None
        finally:
            rank.close()
        await until_async(lambda: "swim.job/train" not in agents[0].agent.tags, 5)
