"""Waiting for a view the job can form a group on, and for the next view after a failure.

Rules: a usable view lists this node, at least ``min_nodes`` nodes, and (``quorum=
"majority"``) a strict majority of the nodes of the last group this rank held, so a
partitioned minority waits instead of training on its own (split brain). The wait is
bounded by ``join_timeout_s`` and cut into slices with a heartbeat between them; the
backoff between failed formations ends early when a new view arrives.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from torchhook.client import Membership, View
from torchhook.settings import Settings

__all__ = ["await_new_view", "has_quorum", "wait_for_usable_view"]

SLICE_S = 1.0
"""The longest wait between heartbeats while no usable view is there."""


def has_quorum(quorum: str, group_names: tuple[str, ...], view: View) -> bool:
    if quorum == "any" or not group_names:
        return True
    kept = sum(1 for n in group_names if n in view)
    return 2 * kept > len(group_names)


def wait_for_usable_view(
    membership: Membership,
    node: str,
    settings: Settings,
    group_names: tuple[str, ...],
    deadline: float,
    beat: Callable[[], None],
) -> View:
    def usable(v: View) -> bool:
        return (
            node in v
            and len(v.members) >= settings.min_nodes
            and has_quorum(settings.quorum, group_names, v)
        )

    while (remaining := deadline - time.monotonic()) > 0:
        try:
            return membership.wait(usable, min(remaining, SLICE_S))
        except TimeoutError:
            beat()
    raise TimeoutError(
        f"no usable view of {membership.job!r} within {settings.join_timeout_s} s "
        f"(min_nodes={settings.min_nodes}, last group {list(group_names)})"
    )


def await_new_view(membership: Membership, fingerprint: str, seconds: float) -> None:
    """The backoff between formations: ended early by a new view."""
    if seconds > 0:
        with contextlib.suppress(TimeoutError):
            membership.wait(lambda v: v.fingerprint != fingerprint, seconds)
