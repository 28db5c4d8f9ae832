"""Members declared dead, remembered for serf's reconnect: how two halves of a healed
partition find each other again.

Rules (hashicorp/serf @ v0.9.4 serf/serf.go ``failedMembers``, ``reconnect``,
``reap``; docs/design.md §5.5):
- A member declared dead (not one that left, never ourselves) is remembered with its
  address and when it died, after it is reaped from the member table; alive news about it,
  or its leave, forgets it. Insertion-ordered, at most ``max_members`` (oldest dropped).
- Entries older than ``reconnect_timeout_ms`` expire, oldest first.
- Every ``reconnect_interval_ms``, with probability failed/alive, one failed member picked
  uniformly gets a push-pull (``swim.streams``): each side declared the other dead, and only
  a new exchange of full state lets the accused refute.
"""

from __future__ import annotations

import random

from swim.context import Context
from swim.messages import Address

__all__ = ["FailedMembers"]


class FailedMembers:
    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._failed: dict[str, tuple[Address, int]] = {}

    def __len__(self) -> int:
        return len(self._failed)

    def remember(self, name: str, address: Address) -> None:
        self._failed.pop(name, None)
        self._failed[name] = (address, self._ctx.now_ms)
        while len(self._failed) > self._ctx.config.max_members:
            del self._failed[next(iter(self._failed))]

    def forget(self, name: str) -> None:
        self._failed.pop(name, None)

    def expire(self) -> None:
        """Forget failed members older than the reconnect timeout (oldest first)."""
        horizon = self._ctx.now_ms - self._ctx.config.reconnect_timeout_ms
        while self._failed:
            name, (_, failed_at) = next(iter(self._failed.items()))
            if failed_at > horizon:
                break
            del self._failed[name]

    def pick(self, rng: random.Random, alive: int) -> Address | None:
        """serf ``reconnect``: with probability failed/alive, one failed member's address."""
        if not self._failed or rng.random() > len(self._failed) / max(alive, 1):
            return None
        names = list(self._failed)
        return self._failed[names[rng.randrange(len(names))]][0]
