"""torchhook.verdicts.GroupWatch: which views break a group (rules in its docstring).

Pure logic on real ``View`` objects (the elastic tests run the comm hook inside real gloo
groups, with verdicts arriving mid-backward); the last test wakes a real gloo wait
(``groups.ProcessGroups.wait``) with a verdict and with a completion.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torchhook needs torch (the [torch] extra)")

from agent.control import JobMember  # noqa: E402
from torchhook.client import View  # noqa: E402
from torchhook.groups import MembershipChanged  # noqa: E402
from torchhook.verdicts import GroupWatch  # noqa: E402

TOKEN = "g1"


def member(name: str, registered_ms: int = 1, group: str = "", status: str = "alive") -> JobMember:
    return JobMember(name, "127.0.0.1", 7946, 0, registered_ms, group, status)


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


def test_a_suspect_outside_the_group_is_no_reason_to_switch() -> None:
    """Another agent left c out early on crash evidence and the group formed without it;
    our view still lists c as suspect: no switch until it refutes (alive) or dies."""
    watch = armed(view(1, member("a"), member("b")), group=("a", "b"))
    assert not watch.differs(view(2, member("a"), member("b"), member("c", status="suspect")))
    assert watch.differs(view(3, member("a"), member("b"), member("c")))  # it refuted
    assert not watch.differs(view(4, member("a"), member("b", status="suspect")))
    assert watch.differs(view(4, member("a"))), "a loss is a loss"
    watch.on_view(
        view(5, member("a"), member("b", status="suspect"), member("c", status="suspect"))
    )
    assert not watch.broken, "a suspect of the group stays in it until it is gone"


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


# --- the lock: views hammered against arming, on real torch Futures -----------------------


class Bucket:
    """DDP's GradBucket as the comm hook uses it: only ``buffer()``."""

    def __init__(self) -> None:
        self._buffer = torch.ones(4)

    def buffer(self) -> Any:
        return self._buffer


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A real one-rank gloo group: the comm hook's all-reduce runs and completes."""
    dist = torch.distributed
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def busy_switching() -> Iterator[None]:
    """Switch threads every few microseconds, so interleavings that a 5 ms switch interval
    makes rare happen in a few hundred rounds."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


ROUNDS = 1500
HOOKS_PER_GROUP = 1
DRILL = "drill: fail_pending from a third thread"


def test_views_hammered_against_arming_keep_every_future_exactly_once(
    world_of_one: None, busy_switching: None
) -> None:
    """The watcher thread alternates a view with every node and one without ``c``; the
    training thread arms, in turns, a group of ``a, b`` (which no view drops: its Futures
    must complete, or fail only by the third thread's ``fail_pending``) and a group of
    ``a, b, c`` (which the second view drops: its Futures may fail); a third thread calls
    ``fail_pending`` now and then. Every Future must end exactly once, no thread may
    raise, and nothing may stay pending."""
    full = view(1, member("a"), member("b"), member("c"))
    without_c = view(2, member("a"), member("b"))
    small, large = frozenset({("a", 1), ("b", 1)}), frozenset({("a", 1), ("b", 1), ("c", 1)})
    watch = GroupWatch("a")
    errors: list[BaseException] = []
    wrong: list[str] = []
    ends: dict[int, int] = {}
    ends_lock = threading.Lock()  # Future number -> times it ended
    stop = threading.Event()

    def guarded(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # recorded and asserted below
                errors.append(exc)
                stop.set()

        return run

    def viewer() -> None:
        while not stop.is_set():
            watch.on_view(full)
            watch.on_view(without_c)

    def failer() -> None:
        while not stop.wait(0.002):
            watch.fail_pending(DRILL)

    def trainer() -> None:
        for round_ in range(ROUNDS):
            if stop.is_set():
                return
            for ids, may_be_dropped in ((small, False), (large, True)):
                watch.arm(full, ids, f"g{round_}-{len(ids)}")
                futures = [watch.comm_hook(Bucket(), 1) for _ in range(HOOKS_PER_GROUP)]
                for fut in futures:
                    finished = threading.Event()
                    key = len(ends)
                    ends[key] = 0

                    def ended(f: Any, key: int = key, event: threading.Event = finished) -> None:
                        with ends_lock:
                            ends[key] += 1
                        event.set()

                    fut.add_done_callback(ended)
                    assert finished.wait(10), "a Future never ended"
                    try:
                        fut.value()
                    except MembershipChanged as exc:
                        if not may_be_dropped and DRILL not in str(exc):
                            wrong.append(f"group of a, b failed by a verdict: {exc}")
                watch.disarm()
        stop.set()

    threads = [threading.Thread(target=guarded(t)) for t in (viewer, failer, trainer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a hammer thread did not end"
    assert errors == []
    assert wrong == []
    assert ends and set(ends.values()) == {1}, "a Future ended more or less than once"
    with watch._lock:  # the state at rest: nothing pending, the last group disarmed
        assert watch._pending == [] and not watch._running


@pytest.fixture
def two_gloo_ranks() -> Iterator[dict[int, Any]]:
    """Two real gloo ranks in this process (one thread each to connect), no default group:
    rank 0's all-reduce stays in flight until rank 1 joins it."""
    from torch._C._distributed_c10d import HashStore, ProcessGroupGloo

    store, pgs = HashStore(), {}

    def connect(rank: int) -> None:
        pgs[rank] = ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))

    threads = [threading.Thread(target=connect, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(pgs) == {0, 1}
    yield pgs


def test_a_verdict_ends_a_wait_at_once_and_a_completion_too(
    two_gloo_ranks: dict[int, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ProcessGroups.wait`` with the watch as its ``wakes``: the verdict wakes the wait,
    and so does the op's completion; neither waits for a slice to run out (a slice as
    long as the group timeout here: a slice-bound wait would hold on for a minute)."""
    from torchhook import groups

    monkeypatch.setattr(groups, "WAIT_SLICE", timedelta(seconds=60))
    pg = groups.ProcessGroups("gloo", 0)
    watch = armed(view(1, member("a"), member("b"), member("c")))
    stuck = two_gloo_ranks[0].allreduce([torch.ones(2)])  # rank 1 has not joined
    threading.Timer(0.1, watch.on_view, args=(view(2, member("a"), member("b")),)).start()
    started = time.monotonic()
    with pytest.raises(MembershipChanged):
        pg.wait(stuck, lambda: watch.broken, lambda: None, watch)
    assert time.monotonic() - started < 30
    # the same op, once rank 1 joins it, completes and ends a wait on an intact group
    fresh = armed(view(1, member("a"), member("b"), member("c")))
    threading.Timer(0.1, two_gloo_ranks[1].allreduce, args=([torch.ones(2)],)).start()
    started = time.monotonic()
    pg.wait(stuck, lambda: fresh.broken, lambda: None, fresh)
    assert time.monotonic() - started < 30
    assert not fresh._waiters and not watch._waiters  # every wait unregistered its event
