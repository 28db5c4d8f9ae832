"""A window's verdict reaches every rank of a node, even one whose sibling left first.

A node judged slow under ``exclude`` or ``replace`` closes its registration as soon as
one of its ranks has the window's all-gather; the view then drops the node, and a sibling
rank still in its wait for the same gather sees that drop. It must take the gather (every
rank fed it) and reach the verdict too, not abandon it and try to re-form without its own
node. A drop of another node must still end the wait at once.

A real one-rank gloo group in this process; the view is a stand-in (only membership of a
name is read) and the wait raises as the engine's does when a verdict breaks the group.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch hook needs torch (pip install '.[torch]')")

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from torchhook.errors import MembershipChanged
from torchhook.pace import Pace
from torchhook.parallel import Group
from torchhook.settings import Settings
from torchhook.strategy import Layout, Node

WINDOW = 2


class View:
    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.members: list[Any] = []

    def __contains__(self, name: object) -> bool:
        return name in self.names


class Membership:
    node = "n0"

    def __init__(self, names: set[str]) -> None:
        self.view = View(names)

    def report_slow(self, ratios: dict[str, float]) -> None:
        pass


@pytest.fixture
def world() -> Iterator[None]:
    dist.init_process_group(
        "gloo", store=HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _group() -> Group:
    def unused(*_: Any) -> Any:
        raise AssertionError("not used by the window")

    return Group(
        rank=0,
        world_size=1,
        layout=Layout((Node("n0", 1, 1),)),
        token="g1",
        node="n0",
        local_rank=0,
        device=torch.device("cpu"),
        groups=unused,  # type: ignore[arg-type]
        timeout_s=10,
        wait=unused,
        comm_hook=unused,
        capture_state=unused,
    )


def _broken(work: Any) -> None:
    raise MembershipChanged("membership changed during a collective")  # before it completes


def _steps(pace: Pace, group: Group) -> None:
    for step in range(WINDOW + 1):  # the window's boundary is the last one
        with pace.step(group, step):
            pass


@pytest.mark.usefixtures("world")
def test_a_rank_whose_own_node_left_takes_the_window_and_judges() -> None:
    settings = Settings("j", slow_window_steps=WINDOW)
    pace = Pace(settings, Membership(set()), _broken, lambda: None)  # type: ignore[arg-type]
    _steps(pace, _group())
    assert pace.windows == 1
    assert pace.last_verdict is not None


@pytest.mark.usefixtures("world")
def test_a_drop_of_another_node_still_ends_the_window_at_once() -> None:
    settings = Settings("j", slow_window_steps=WINDOW)
    pace = Pace(settings, Membership({"n0"}), _broken, lambda: None)  # type: ignore[arg-type]
    with pytest.raises(MembershipChanged):
        _steps(pace, _group())
    assert pace.windows == 0
