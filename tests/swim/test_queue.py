"""The transmit-limited piggyback queue (memberlist queue.go / queue_test.go)."""

from __future__ import annotations

import random

from swim.queue import BroadcastQueue


def test_fewest_transmits_first_then_largest_then_newest() -> None:
    q = BroadcastQueue(retransmit_mult=3, max_items=100)
    q.queue(b"aa", name="a")
    q.queue(b"bbbb", name="b")
    q.queue(b"cc", name="c")
    # all at 0 transmits: largest first, then newest among equals (c before a)
    assert q.take(overhead=0, limit=100, n=10) == [b"bbbb", b"cc", b"aa"]
    q.queue(b"dd", name="d")
    # d has 0 transmits, the rest 1
    assert q.take(overhead=0, limit=2, n=10) == [b"dd"]


def test_named_broadcast_invalidates_older_news_about_the_member() -> None:
    q = BroadcastQueue(3, 100)
    q.queue(b"old", name="x", notify=1)
    q.queue(b"new", name="x", notify=2)
    assert len(q) == 1
    assert q.finished == [1]
    assert q.take(0, 100, 10) == [b"new"]


def test_retransmit_limit_drops_after_mult_ceil_log10_n_plus_1_sends() -> None:
    # memberlist queue_test.go TestTransmitLimited_GetBroadcasts_Limit: mult 1, n=10 -> 2
    q = BroadcastQueue(1, 100)
    q.queue(b"m", name="m", notify=7)
    sends = 0
    while q.take(0, 100, 10):
        sends += 1
    assert sends == 2
    assert q.finished == [7]
    q4 = BroadcastQueue(4, 100)
    q4.queue(b"m")
    sends = 0
    while q4.take(0, 100, 50):  # LAN at n=50: 4 * ceil(log10(51)) = 8
        sends += 1
    assert sends == 8


def test_packet_budget_counts_overhead() -> None:
    q = BroadcastQueue(4, 100)
    for i in range(10):
        q.queue(bytes(10), name=str(i))
    got = q.take(overhead=2, limit=50, n=10)
    assert len(got) == 4  # 4 * (10 + 2) = 48 <= 50
    assert q.take(overhead=2, limit=5, n=10) == []


def test_queue_is_bounded_and_prunes_the_most_sent() -> None:
    q = BroadcastQueue(4, max_items=3)
    q.queue(b"1", name="1")
    q.take(0, 100, 10)  # "1" now has 1 transmit
    q.queue(b"2", name="2")
    q.queue(b"3", name="3")
    q.queue(b"4", name="4", notify=4)
    assert len(q) == 3
    assert sorted(q.take(0, 100, 10)) == [b"2", b"3", b"4"]


def test_reset_finishes_everything() -> None:
    q = BroadcastQueue(4, 10)
    q.queue(b"a", notify=1)
    q.queue(b"b", notify=2)
    q.reset()
    assert len(q) == 0 and sorted(q.finished) == [1, 2]


def test_pending_follows_every_change() -> None:
    """``pending`` is read instead of ``len(queue)`` on hot paths: it must track queue,
    take (sent, reinserted and dropped items), replacement, discard, pruning and reset."""
    q = BroadcastQueue(retransmit_mult=1, max_items=3)
    seen = []

    def check() -> None:
        seen.append(len(q))
        assert len(q.pending) == len(q)

    for i in range(5):
        q.queue(bytes([i]) * (i + 1), name=f"m{i % 4}")  # m0 replaced once, then pruned
        check()
    q.take(overhead=1, limit=4, n=1)
    check()
    q.discard("m3")
    check()
    q.take(overhead=1, limit=1000, n=1)  # everything sent its last time
    check()
    q.queue(b"x")
    q.reset()
    check()
    assert seen == [1, 2, 3, 3, 3, 2, 1, 0, 0]


def test_one_queued_broadcast_is_taken_as_the_general_walk_takes_it() -> None:
    """A lone broadcast takes a shortcut; the same sequence of takes with a second,
    never-fitting broadcast queued goes the general way and must give the same answers."""
    rng = random.Random(3)
    taken = 0
    for _ in range(300):
        size, overhead, n = rng.randrange(1, 40), rng.randrange(0, 5), rng.choice([1, 9, 10, 99])
        lone, pair = BroadcastQueue(2, 100), BroadcastQueue(2, 100)
        lone.queue(b"x" * size, name="m", notify=1)
        pair.queue(b"x" * size, name="m", notify=1)
        pair.queue(b"y" * 10_000, name="big")  # never fits, never taken
        for _ in range(12):
            limit = rng.randrange(0, 50)
            got = lone.take(overhead, limit, n)
            assert got == pair.take(overhead, limit, n)
            taken += len(got)
            assert lone.finished == pair.finished
            assert len(lone) == len(pair) - 1
    assert taken > 300  # the limits let it through often, and not always
