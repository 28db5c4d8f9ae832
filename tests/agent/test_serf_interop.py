"""A mixed cluster of real serf agents (Debian's serf 0.9.4) and our agents on loopback.

Both sides must agree on membership, failures, graceful leaves and tags, in plaintext and
encrypted; a swim agent with the wrong key cannot join. Every process is stopped by pid."""

from __future__ import annotations

import base64
import functools
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from agent.procs import stop, until
from bench.procs import SERF, LocalAgent, LocalSerf, SerfError

pytestmark = pytest.mark.skipif(
    SERF is None, reason="serf not installed (scripts/setup.sh installs it with apt-get)"
)
ROOT = Path(__file__).resolve().parents[2]
KEY = base64.b64encode(bytes(range(16))).decode()
# Gossip alone may miss a member: in the local profile each update or intent is piggybacked
# only RetransmitMult*ceil(log10(n+1)) = 2 times per node at n = 6, on both sides, and some
# of those go to recently dead members. memberlist and serf rely on push-pull (every 15 s
# in the local profile, random stagger; serf's LeftMembers for leaves) to repair that, so an
# update is certain everywhere only after one full push-pull interval, plus slack.
SPREAD_S = 40


# a serf command that fails while its agent is busy is a "not yet"
settle = functools.partial(until, poll_s=0.1, ignore=(SerfError,))
Obs = TypeVar("Obs", LocalSerf, LocalAgent)


@dataclass
class Mixed:
    serfs: list[LocalSerf]
    swims: list[LocalAgent]

    def serf_status(self, observer: LocalSerf, name: str) -> str | None:
        m = observer.members().get(name)
        return None if m is None else str(m["status"])

    def swim_status(self, observer: LocalAgent, name: str) -> str | None:
        m = observer.members().get(name)
        return None if m is None else str(m["status"])


def _start(tmp_path: Path, encrypt: str | None) -> Mixed:
    serfs: list[LocalSerf] = []
    swims: list[LocalAgent] = []
    try:
        first = LocalSerf("s0", tmp_path, tags={"role": "serf"}, encrypt=encrypt)
        serfs.append(first)
        first.wait_ready()
        for i in (1, 2):
            serfs.append(
                LocalSerf(
                    f"s{i}", tmp_path, join=first.port, tags={"role": "serf"}, encrypt=encrypt
                )
            )
        extra = ["--tag", "role=swim"] + (["--encrypt", encrypt] if encrypt else [])
        for i in range(3):
            swims.append(LocalAgent(f"w{i}", tmp_path, "local", first.port, extra))
        for s in serfs:
            s.wait_ready()
        for w in swims:
            w.wait_ready(20)
    except BaseException:
        _stop_all(serfs, swims)
        raise
    return Mixed(serfs, swims)


def _stop_all(serfs: list[LocalSerf], swims: list[LocalAgent]) -> None:
    for s in serfs:
        s.stop(signal.SIGKILL)
    for w in swims:
        w.stop(signal.SIGKILL)


def _see_alive(observers: Sequence[LocalSerf | LocalAgent], names: set[str]) -> bool:
    """Every observer sees exactly ``names`` alive."""
    return all(
        {n for n, m in o.members().items() if m["status"] == "alive"} == names for o in observers
    )


@pytest.fixture(params=[None, KEY], ids=["plain", "encrypted"])
def mixed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Mixed]:
    cluster = _start(tmp_path, request.param)
    try:
        yield cluster
    finally:
        _stop_all(cluster.serfs, cluster.swims)


def test_mixed_cluster_forms_fails_leaves_and_shares_tags(mixed: Mixed) -> None:
    names = {"s0", "s1", "s2", "w0", "w1", "w2"}
    settle(lambda: _see_alive(mixed.serfs, names), 30, "serf sees everyone alive")
    settle(lambda: _see_alive(mixed.swims, names), 30, "swim sees everyone alive")
    # tags cross both ways
    assert mixed.serfs[0].members()["w1"]["tags"] == {"role": "swim"}
    assert mixed.swims[0].members()["s1"]["tags"] == {"role": "serf"}
    mixed.serfs[1].set_tags(zone="z9")
    settle(
        lambda: mixed.swims[2].members()["s1"]["tags"].get("zone") == "z9",
        SPREAD_S,
        "swim sees serf's new tag",
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.cli",
            "--control",
            str(mixed.swims[1].control),
            "tags",
            "--set",
            "gpu=h200",
        ],
        check=True,
        cwd=ROOT,
        timeout=30,
        capture_output=True,
    )
    settle(
        lambda: mixed.serfs[2].members()["w1"]["tags"].get("gpu") == "h200",
        SPREAD_S,
        "serf sees swim's new tag",
    )

    # graceful leave both ways is "left", not failed. The leaves come before the kills: a
    # leaver gossips its leave only a few times, to recently dead members too, and a leave
    # that reaches no live member is a failure to serf as well.
    mixed.swims[1].stop(signal.SIGTERM)
    _settle_status(
        mixed.serfs, mixed.serf_status, "w1", "left", "serf sees the swim agent's leave as left"
    )
    mixed.serfs[1].leave()
    live_swims = [mixed.swims[0], mixed.swims[2]]
    _settle_status(
        live_swims, mixed.swim_status, "s1", "left", "swim sees the serf agent's leave as left"
    )

    # SIGKILL a swim agent: every serf agent marks it failed (and the swims dead)
    stop(mixed.swims[2].proc, sig=signal.SIGKILL)
    live_serfs = [mixed.serfs[0], mixed.serfs[2]]
    _settle_status(
        live_serfs, mixed.serf_status, "w2", "failed", "serf marks the killed swim agent failed"
    )
    _settle_status(
        mixed.swims[:1], mixed.swim_status, "w2", "dead", "swim marks the killed swim agent dead"
    )

    # SIGKILL a serf agent: the swim agent marks it dead
    stop(mixed.serfs[2].proc, sig=signal.SIGKILL)
    _settle_status(
        mixed.swims[:1], mixed.swim_status, "s2", "dead", "swim marks the killed serf agent dead"
    )


def _settle_status(
    observers: Sequence[Obs],
    status: Callable[[Obs, str], str | None],
    name: str,
    want: str,
    what: str,
) -> None:
    """Wait until every observer reports ``name`` as ``want``; a timeout names what each
    reported last."""
    last: dict[str, str | None] = {}

    def done() -> bool:
        for o in observers:
            last[o.name] = status(o, name)
        return all(v == want for v in last.values())

    try:
        settle(done, SPREAD_S, what)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; last seen: {last}") from None


def test_wrong_key_cannot_join(tmp_path: Path) -> None:
    first = LocalSerf("s0", tmp_path, encrypt=KEY)
    wrong = base64.b64encode(bytes(16)).decode()
    agent: LocalAgent | None = None
    try:
        first.wait_ready()
        agent = LocalAgent(
            "intruder",
            tmp_path,
            "local",
            None,
            ["--encrypt", wrong, "--join", f"127.0.0.1:{first.port}"],
        )
        agent.wait_ready(20)
        time.sleep(2)  # give a would-be join every chance to land
        assert "intruder" not in first.members()
        assert set(agent.members()) == {"intruder"}
    finally:
        first.stop(signal.SIGKILL)
        if agent is not None:
            agent.stop(signal.SIGKILL)
