"""The elastic hooks' pure rules (torchhook.strategy): layouts, shrink or reform, teardown,
and where the state comes from. Tables, no torch, no processes."""

from __future__ import annotations

import pytest

from torchhook.strategy import (
    ACTIONS,
    TEARDOWN,
    Layout,
    Node,
    RankInfo,
    decide,
    lost_peers,
    shrink_excludes,
    teardown_of,
    tears_down_at_failure,
)


def L(*nodes: tuple[str, int]) -> Layout:
    """A layout of (name, ranks) pairs; a node's registered_ms is fixed by its name."""
    return Layout(tuple(Node(name, ord(name[0]), ranks) for name, ranks in nodes))


ABC = L(("a", 2), ("b", 2), ("c", 2))


def test_layout_ranks_follow_join_age_then_local_rank() -> None:
    layout = L(("a", 2), ("b", 3), ("c", 1))
    assert layout.world_size == 6 and layout.uniform_ranks is None
    assert [layout.ranks_of(n) for n in "abc"] == [range(0, 2), range(2, 5), range(5, 6)]
    assert layout.rank_of("b", 2) == 4
    assert [layout.node_of(r) for r in range(6)] == [
        ("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2), ("c", 0),
    ]  # fmt: skip
    assert ABC.uniform_ranks == 2
    assert layout.describe() == "a×2 b×3 c×1"
    for bad in (lambda: layout.rank_of("b", 3), lambda: layout.node_of(6)):
        with pytest.raises(KeyError):
            bad()


@pytest.mark.parametrize(
    ("new", "excluded"),
    [
        (L(("a", 2), ("c", 2)), (2, 3)),  # the middle node died
        (L(("b", 2), ("c", 2)), (0, 1)),  # the oldest (rank 0's node) died
        (L(("a", 2)), (2, 3, 4, 5)),
        (ABC, None),  # nothing lost
        (L(("a", 2), ("c", 2), ("d", 2)), None),  # a newcomer: reform
        (Layout((Node("a", 0, 2), Node("b", 99, 2))), None),  # b re-registered: a new member
        (L(), None),
    ],
)
def test_shrink_excludes_whole_nodes_only(new: Layout, excluded: tuple[int, ...] | None) -> None:
    assert shrink_excludes(ABC, new) == excluded


def _held(layout: Layout, token: str, step: int = 7) -> list[RankInfo]:
    return [RankInfo(token, ABC, step, True) for _ in range(layout.world_size)]


AC = L(("a", 2), ("c", 2))


@pytest.mark.parametrize(
    ("backend", "shrinking", "infos", "action", "exclude"),
    [
        ("nccl", True, _held(AC, "T"), "shrink", (2, 3)),
        ("nccl", False, _held(AC, "T"), "reform", ()),  # NCCL < 2.27: no ncclCommShrink
        ("gloo", True, _held(AC, "T"), "reform", ()),  # gloo never shrinks
        ("nccl", True, [*_held(AC, "T")[:3], RankInfo("U", ABC, 7, True)], "reform", ()),
        ("nccl", True, [*_held(AC, "T")[:3], RankInfo("", None, 7, True)], "reform", ()),
    ],
)
def test_shrink_only_when_every_rank_holds_the_same_group_and_the_backend_can(
    backend: str,
    shrinking: bool,
    infos: list[RankInfo],
    action: str,
    exclude: tuple[int, ...],
) -> None:
    plan = decide(AC, infos, backend=backend, supports_shrinking=shrinking)
    assert (plan.action, plan.exclude) == (action, exclude)
    assert plan.action in ACTIONS


def test_teardown_table() -> None:
    assert {k: teardown_of(*k) for k in TEARDOWN} == {
        ("gloo", False): "destroy",
        ("gloo", True): "graveyard",  # gloo cannot abort; destroying blocks on a stuck op
        ("nccl", False): "destroy",
        ("nccl", True): "abort",  # ncclCommAbort ends kernels waiting on a dead peer
    }
    assert tears_down_at_failure("gloo") and not tears_down_at_failure("nccl")
    with pytest.raises(ValueError, match="mpi"):
        teardown_of("mpi", True)


def _info(step: int, has_state: bool = True, applied: str = "", pending: str = "") -> RankInfo:
    return RankInfo("", None, step, has_state, applied, pending)


T_6 = _info(6, applied="T")
T_10 = _info(10, applied="T")


@pytest.mark.parametrize(
    ("infos", "step", "restore", "source", "receivers"),
    [
        ([_info(0, False)] * 4, 0, "fresh", 0, (1, 2, 3)),  # first formation: rank 0's init
        # a failure between steps: every survivor applied step 6 in group T, nobody receives
        ([_info(6, applied="T")] * 4, 6, "memory", 0, ()),
        # mid-step failure: ranks 0 and 3 did not apply step 6
        ([_info(5, applied="T"), T_6, T_6, _info(5, applied="T")], 6, "memory", 1, (0, 3)),
        # back from a stop (old step), a newcomer, and a rank at 10 from another group
        ([_info(3, applied="S"), T_10, _info(0, False), _info(10, applied="U")],
         10, "memory", 1, (0, 2, 3)),
        # no group token known: nobody is assumed identical to the source
        ([_info(5), _info(6), _info(6), _info(4)], 6, "memory", 1, (0, 2, 3)),
    ],
)  # fmt: skip
def test_ddp_state_comes_from_the_lowest_rank_with_the_newest_step(
    infos: list[RankInfo], step: int, restore: str, source: int, receivers: tuple[int, ...]
) -> None:
    plan = decide(L(("a", 2), ("b", 2)), infos, backend="gloo", supports_shrinking=False)
    assert (plan.step, plan.restore, plan.source) == (step, restore, source)
    assert plan.receivers == receivers


AB2 = L(("a", 2), ("b", 2))
T1_10 = _info(10, applied="T1")
T2_10 = _info(10, applied="T2")
T0_4 = _info(4, applied="T0")


@pytest.mark.parametrize(
    ("infos", "step", "restore", "providers", "receivers", "roll"),
    [
        # first formation: everyone builds the same (seeded) init
        ([_info(0, False)] * 4, 0, "fresh", (0, 1), (), ()),
        # a clean shrink: everyone at 10 in T1
        ([_info(10, applied="T1")] * 4, 10, "memory", (0, 1), (), ()),
        # failure between the commit and its end: rank 1 holds step 10's reduced gradients
        (
            [T1_10, _info(9, applied="T1", pending="T1"), T1_10, T1_10],
            10, "memory", (0, 1), (), (1,),
        ),
        # gradients pending from an older group are not step 10's: receive instead
        (
            [T2_10, _info(9, applied="T1", pending="T1"), T2_10, T2_10],
            10, "memory", (0, 3), (1,), (),
        ),
        # regrow: node b is new (no state), node a provides both shards
        ([_info(10, applied="T"), _info(10, applied="T"), _info(0, False), _info(0, False)],
         10, "memory", (0, 1), (2, 3), ()),
        # a node back from a stop (old step) takes shards from the survivors
        ([T0_4, T0_4, _info(12, applied="T"), _info(12, applied="T")],
         12, "memory", (2, 3), (0, 1), ()),
        # every holder of shard 1 at the newest step is gone: reload a checkpoint
        ([_info(10, applied="T"), _info(9, applied="T0"), _info(0, False), _info(0, False)],
         10, "checkpoint", (), (), ()),
    ],
)  # fmt: skip
def test_hsdp_state_per_shard(
    infos: list[RankInfo],
    step: int,
    restore: str,
    providers: tuple[int, ...],
    receivers: tuple[int, ...],
    roll: tuple[int, ...],
) -> None:
    plan = decide(AB2, infos, backend="gloo", supports_shrinking=False, shards=2)
    assert (plan.step, plan.restore) == (step, restore)
    assert (plan.providers, plan.receivers, plan.roll_forward) == (providers, receivers, roll)


def test_hsdp_needs_the_same_local_ranks_everywhere() -> None:
    with pytest.raises(ValueError, match="HSDP"):
        decide(
            L(("a", 2), ("b", 1)),
            [_info(0)] * 3,
            backend="gloo",
            supports_shrinking=False,
            shards=2,
        )
    with pytest.raises(ValueError, match="infos"):
        decide(AB2, [_info(0)] * 3, backend="gloo", supports_shrinking=False)


ORDER = ("a", "b", "c", "d")
ADDRS = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3", "d": "10.0.0.3"}


@pytest.mark.parametrize(
    ("error", "lost"),
    [
        ("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:41234", ["b"]),
        ("Read error [10.0.0.3]:7 Connection reset by peer", ["c", "d"]),  # one host, 2 nodes
        ("Connection closed by peer [192.168.9.9]:1", ["b", "c", "d"]),  # another network
        ("Timed out waiting 5000ms for recv operation to complete", ["b", "c", "d"]),
        ("Connection closed by peer [10.0.0.1]:3", ["b", "c", "d"]),  # ourselves: unknown
    ],
)
def test_a_connection_error_names_the_lost_peers(error: str, lost: list[str]) -> None:
    assert lost_peers(error, ORDER, "a", ADDRS) == lost
