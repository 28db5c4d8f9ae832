"""The node's timers: one frozen dataclass per kind, its payload in typed fields.

Rules:
- A timer is a value (docs/design.md §1.3): the node asks for it in ``Output.timers`` and the
  driver hands it back with ``Node.handle_timer(timer, now_ms)`` at or after
  ``deadline_ms``. Every kind subclasses ``swim.Timer`` and so carries ``deadline_ms`` and
  ``timer_id`` (a driver keeps a heap of ``(deadline_ms, timer_id, timer)``); what the timer
  is about (the suspect and its suspicion, the probe's sequence number, the stream) travels
  in the timer itself, typed.
- ``NodeTimer`` is the union of every kind. ``Node.handle_timer`` dispatches on it with a
  ``match`` that mypy proves exhaustive (``assert_never``); a timer of any other type is a
  driver bug and raises ``TypeError``.
- ``swim.context.Context`` numbers the timers and remembers the live ones. Cancelling
  forgets the number; a timer handed back that is no longer live (cancelled, superseded,
  already fired) is ignored, so the driver never cancels anything.
- Arm a timer with ``ctx.set_timer(Kind, delay_ms, *payload)``: the deadline and the number
  come from the context, the payload's types are checked against the kind's fields.

Sources: memberlist @ 1b4c746 state.go (``schedule``: probe, gossip and push-pull tickers;
``probeNode``: probe timeout and deadline; ``suspectNode``/suspicion.go: suspicion timer),
net.go (``handleIndirectPing``: the relay's nack timer); serf serf.go ``reconnect``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from swim.effects import Timer
from swim.frozen import fast_init


@dataclass(frozen=True, slots=True)
class ProbeTick(Timer):
    """Probe the next member of the round (every ``probe_interval_ms``)."""


@dataclass(frozen=True, slots=True)
class GossipTick(Timer):
    """Send queued broadcasts to ``gossip_nodes`` random members (every
    ``gossip_interval_ms``)."""


@dataclass(frozen=True, slots=True)
class PushPullTick(Timer):
    """Exchange full state with one random live member (``push_pull_scale_ms``)."""


@dataclass(frozen=True, slots=True)
class ReconnectTick(Timer):
    """Maybe push-pull with a failed member, to heal a partition (serf ``reconnect``)."""


@dataclass(frozen=True, slots=True)
class SuspicionTimeout(Timer):
    """The suspicion of ``name`` that began at ``state_change_ms`` ran out."""

    name: str
    state_change_ms: int


@dataclass(frozen=True, slots=True)
class SuspicionVerify(Timer):
    """The last-chance ping to an unconfirmed suspect went unanswered."""

    name: str
    state_change_ms: int


@dataclass(frozen=True, slots=True)
class ProbeTimeout(Timer):
    """No ack to probe ``seq_no`` within the probe timeout: ask others (indirect probes)."""

    seq_no: int


@dataclass(frozen=True, slots=True)
class ProbeDeadline(Timer):
    """Probe ``seq_no``'s interval is over: conclude it."""

    seq_no: int


@dataclass(frozen=True, slots=True)
class ProbeTcpGrace(Timer):
    """The driver's moment to report probe ``seq_no``'s TCP ping before it is concluded."""

    seq_no: int


@dataclass(frozen=True, slots=True)
class RelayTimeout(Timer):
    """The member we pinged for someone else (our probe ``seq_no``) did not ack: nack."""

    seq_no: int


@dataclass(frozen=True, slots=True)
class StreamExpire(Timer):
    """Stream ``stream_id`` got no answer by its deadline (plus a grace)."""

    stream_id: int


NodeTimer = (
    ProbeTick
    | GossipTick
    | PushPullTick
    | ReconnectTick
    | SuspicionTimeout
    | SuspicionVerify
    | ProbeTimeout
    | ProbeDeadline
    | ProbeTcpGrace
    | RelayTimeout
    | StreamExpire
)
"""Every timer a ``swim.Node`` asks for."""

NODE_TIMERS: tuple[type[NodeTimer], ...] = get_args(NodeTimer)
"""The kinds of ``NodeTimer``, for ``isinstance`` and for tests that iterate them."""


# made on every input: the faster, same-signature __init__ (swim.frozen)
for _cls in (
    ProbeTick,
    GossipTick,
    PushPullTick,
    ReconnectTick,
    SuspicionTimeout,
    SuspicionVerify,
    ProbeTimeout,
    ProbeDeadline,
    ProbeTcpGrace,
    RelayTimeout,
    StreamExpire,
):
    fast_init(_cls)

__all__ = [
    "NODE_TIMERS",
    "GossipTick",
    "NodeTimer",
    "ProbeDeadline",
    "ProbeTcpGrace",
    "ProbeTick",
    "ProbeTimeout",
    "PushPullTick",
    "ReconnectTick",
    "RelayTimeout",
    "StreamExpire",
    "SuspicionTimeout",
    "SuspicionVerify",
]
