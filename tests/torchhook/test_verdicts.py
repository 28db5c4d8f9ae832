"""torchhook.verdicts.GroupWatch: which views break a group (rules in its docstring).

Pure logic on real ``View`` objects (no process group: the elastic tests run the comm hook
inside real gloo groups, with verdicts arriving mid-backward).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torchhook needs torch (the [torch] extra)")

from agent.control import JobMember  # noqa: E402
from torchhook.client import View  # noqa: E402
from torchhook.groups import MembershipChanged  # noqa: E402
from torchhook.verdicts import GroupWatch  # noqa: E402

TOKEN = "g1"


def member(name: str, registered_ms: int = 1, group: str = "") -> JobMember:
    return JobMember(name, "127.0.0.1", 7946, 0, registered_ms, group, "alive")


def view(generation: int, *members: JobMember) -> View:
    return View("job", generation, f"fp{generation}", tuple(members))


def armed(formed_on: View, group: tuple[str, ...] = ("a", "b", "c")) -> GroupWatch:
    watch = GroupWatch("a")
    watch.arm(formed_on, frozenset((n, 1) for n in group), TOKEN)
    return watch


# (the view the group formed on, the next view, does it break the group?)
CASES = [
    ("same nodes", view(1, member("a"), member("b"), member("c")), False),
    ("a seen node is gone", view(2, member("a"), member("b")), True),
    ("a seen node restarted (new registration)", view(2, member("a"), member("b"),
                                                       member("c", registered_ms=9)), True),
    ("a newcomer is not a verdict", view(2, member("a"), member("b"), member("c"),
                                         member("d")), False),
    ("a peer confirmed our token", view(2, member("a"), member("b", group=TOKEN),
                                        member("c")), False),
]  # fmt: skip


@pytest.mark.parametrize(("what", "after", "breaks"), CASES, ids=[c[0] for c in CASES])
def test_which_views_break_the_group(what: str, after: View, breaks: bool) -> None:
    watch = armed(view(1, member("a"), member("b"), member("c")))
    watch.on_view(after)
    assert watch.broken is breaks
    assert (watch.verdict_time is not None) is breaks


def test_a_node_only_the_leader_saw_is_late_gossip_until_we_have_seen_it() -> None:
    # the group formed on the leader's view with c; ours has not shown c yet
    watch = armed(view(1, member("a"), member("b")))
    watch.on_view(view(2, member("a"), member("b")))
    assert not watch.broken
    watch.on_view(view(3, member("a"), member("b"), member("c")))  # now seen...
    watch.on_view(view(4, member("a"), member("b")))  # ...and gone: a loss
    assert watch.broken


def test_a_peer_that_confirmed_our_group_and_moved_on_breaks_it() -> None:
    watch = armed(view(1, member("a"), member("b"), member("c")))
    watch.on_view(view(2, member("a"), member("b", group=TOKEN), member("c")))
    assert not watch.broken
    watch.on_view(view(3, member("a"), member("b", group="g2"), member("c")))
    assert watch.broken


def test_differs_sees_newcomers_and_losses() -> None:
    watch = armed(view(1, member("a"), member("b"), member("c")))
    assert not watch.differs(view(1, member("a"), member("b"), member("c")))
    assert watch.differs(view(2, member("a"), member("b"), member("c"), member("d")))
    assert watch.differs(view(3, member("a"), member("b")))


def test_a_disarmed_watch_ignores_views_and_rearming_clears_a_verdict() -> None:
    watch = armed(view(1, member("a"), member("b"), member("c")))
    watch.disarm()
    watch.on_view(view(2, member("a")))
    assert not watch.broken
    watch = armed(view(1, member("a"), member("b"), member("c")))
    watch.on_view(view(2, member("a"), member("b")))
    assert watch.broken
    watch.arm(view(2, member("a"), member("b")), frozenset({("a", 1), ("b", 1)}), "g2")
    assert not watch.broken


def test_after_a_verdict_the_comm_hook_hands_out_a_failed_future() -> None:
    watch = armed(view(1, member("a"), member("b"), member("c")))
    watch.on_view(view(2, member("a"), member("b")))
    # no bucket is touched and no collective starts on a broken group
    failed = watch.comm_hook(bucket=None, world_size=3)
    with pytest.raises(MembershipChanged, match="membership changed"):
        failed.wait()
