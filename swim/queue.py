"""Transmit-limited broadcast queue: what gets piggybacked on the next packet.

Rules (memberlist queue.go ``TransmitLimitedQueue``, SWIM §4.1 "infection-style
dissemination"):
- Items are ordered by (transmits ascending, length descending, id descending): the
  least-gossiped first, then the largest that still fits, then the newest.
- A broadcast is dropped once it has been sent ``retransmit_limit(mult, n)`` times.
- A named broadcast (about one member) replaces any queued broadcast with the same name:
  only the newest news about a member is worth gossiping.
- The queue is bounded: beyond ``max_items`` the most-transmitted items are pruned.

The queue is pure data: the caller supplies n (the group size estimate) on every take.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from swim.formulas import retransmit_limit

_MIN_ID = -(2**63)


@dataclass(slots=True)
class _Item:
    transmits: int
    msg: bytes
    id: int
    name: str | None
    notify: int | None = field(default=None)

    def key(self) -> tuple[int, int, int]:
        return (self.transmits, -len(self.msg), -self.id)


class BroadcastQueue:
    """Broadcasts waiting to be piggybacked, bounded and transmit-limited."""

    def __init__(self, retransmit_mult: int, max_items: int) -> None:
        self._retransmit_mult = retransmit_mult
        self._max_items = max_items
        self._keys: list[tuple[int, int, int]] = []
        self.pending: Sequence[tuple[int, int, int]] = self._keys
        """The queued items' sort keys, one per broadcast: read-only (``len`` of it is what
        ``len(queue)`` is, without a Python-level call: asked several times per input)."""
        self._items: dict[tuple[int, int, int], _Item] = {}
        self._by_name: dict[str, _Item] = {}
        self._next_id = 0
        self._limit_for: tuple[int, int] = (-1, 0)
        """(n, ``retransmit_limit(mult, n)``) of the last ``take``: n rarely changes."""
        self.finished: list[int] = []
        """Notify tokens of broadcasts that left the queue (sent out or replaced); the
        owner drains this to learn that e.g. its leave message has been fully gossiped."""

    def __len__(self) -> int:
        return len(self._keys)

    def queue(self, msg: bytes, name: str | None = None, notify: int | None = None) -> None:
        """Add an encoded message; ``name`` invalidates older news about the same member."""
        if name is not None:
            old = self._by_name.pop(name, None)
            if old is not None:
                self._remove(old)
                self._finish(old)
        self._next_id += 1
        item = _Item(transmits=0, msg=msg, id=self._next_id, name=name, notify=notify)
        self._insert(item)
        while len(self._keys) > self._max_items:
            self._prune_one()

    def discard(self, name: str) -> bool:
        """Drop the queued news about ``name``, if any (it became stale); True if dropped."""
        item = self._by_name.pop(name, None)
        if item is None:
            return False
        self._remove(item)
        self._finish(item)
        return True

    def take(self, overhead: int, limit: int, n: int) -> list[bytes]:
        """Messages that fit in ``limit`` bytes, each costing ``overhead`` extra bytes.

        Walks transmit levels from the least-sent up; within a level takes the largest
        message that still fits, as memberlist's ``GetBroadcasts`` does.
        """
        keys = self._keys
        if not keys:
            return []
        items = self._items
        limit_n, transmit_limit = self._limit_for
        if limit_n != n:
            transmit_limit = retransmit_limit(self._retransmit_mult, n)
            self._limit_for = (n, transmit_limit)
        if len(keys) == 1:
            return self._take_only(overhead, limit, transmit_limit)
        used = 0
        out: list[bytes] = []
        reinsert: list[_Item] = []
        transmits = keys[0][0]
        max_transmits = keys[-1][0]
        while transmits <= max_transmits:
            free = limit - used - overhead
            if free <= 0:
                break
            index = bisect.bisect_left(keys, (transmits, -free, _MIN_ID))
            if index >= len(keys) or keys[index][0] != transmits:
                transmits += 1
                continue
            # ``_remove`` inlined: the key is unique, so its index is the one just found.
            item = items.pop(keys[index])
            del keys[index]
            msg = item.msg
            used += overhead + len(msg)
            out.append(msg)
            if item.transmits + 1 >= transmit_limit:
                self._drop_name(item)
                self._finish(item)
            else:
                item.transmits += 1
                reinsert.append(item)
        by_name = self._by_name
        for item in reinsert:  # ``_insert`` inlined
            key = (item.transmits, -len(item.msg), -item.id)
            bisect.insort(keys, key)
            items[key] = item
            if item.name is not None:
                by_name[item.name] = item
        return out

    def _take_only(self, overhead: int, limit: int, transmit_limit: int) -> list[bytes]:
        """``take`` when one broadcast is queued (most of the time a broadcast is being
        gossiped): the walk above reduced to "send it if it fits"."""
        key = self._keys[0]
        free = limit - overhead
        if free <= 0 or -key[1] > free:  # key[1] is minus the message's length
            return []
        item = self._items[key]
        if item.transmits + 1 >= transmit_limit:
            self._keys.clear()
            self._items.clear()
            self._drop_name(item)
            self._finish(item)
        else:
            item.transmits += 1
            new_key = (item.transmits, key[1], key[2])
            self._keys[0] = new_key
            del self._items[key]
            self._items[new_key] = item
        return [item.msg]

    def reset(self) -> None:
        for item in list(self._items.values()):
            self._finish(item)
        self._keys.clear()
        self._items.clear()
        self._by_name.clear()

    def _insert(self, item: _Item) -> None:
        key = item.key()
        bisect.insort(self._keys, key)
        self._items[key] = item
        if item.name is not None:
            self._by_name[item.name] = item

    def _remove(self, item: _Item) -> None:
        key = item.key()
        index = bisect.bisect_left(self._keys, key)
        del self._keys[index]
        del self._items[key]

    def _drop_name(self, item: _Item) -> None:
        if item.name is not None and self._by_name.get(item.name) is item:
            del self._by_name[item.name]

    def _prune_one(self) -> None:
        item = self._items[self._keys[-1]]
        self._remove(item)
        self._drop_name(item)
        self._finish(item)

    def _finish(self, item: _Item) -> None:
        if item.notify is not None:
            self.finished.append(item.notify)
