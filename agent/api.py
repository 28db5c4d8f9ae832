"""The one API of a running agent that its front ends use: the control server
(agent/control_server.py) and the job watch (agent/watch.py) see the agent only through
``AgentAPI``, never its private members or the Node.

Rules:
- Everything that reads or changes the Node runs in the node task (the agent sends it
  through ``Driver.command``); what comes back is a copy (``Snapshot``, lists of frozen
  ``swim.Member``), safe to use after the node task moved on.
- Errors a client caused are ``ValueError`` (``JobError`` and ``swim.KeyringError`` are
  ValueErrors) with a message for the client.
- ``agent.runtime.Agent`` implements it; a test can implement it with a fake.

Where a new control operation goes: its name and arguments in ``agent.control.OPS`` (the
wire schema the client checks), its handler in ``agent.control_server.HANDLERS``, and if
it needs something new from the agent, one method here (implemented in agent/runtime.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from agent.registrations import JobRegistry
from swim import Address, Member


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The agent's state at one instant (the ``members`` and ``info`` operations)."""

    name: str
    address: Address
    incarnation: int
    health_score: int
    encrypted: bool
    profile: str
    tags: dict[str, str]
    uptime_ms: int
    now_ms: int
    members: list[Member]
    """The core's table plus the failed and left members it has already reaped."""
    phi: dict[str, float]
    stats: dict[str, Any] = field(default_factory=dict)
    """``info``'s ``stats`` map: the Node's counters and the driver's stall counts."""
    rtt_ms: dict[str, int] = field(default_factory=dict)
    """The last direct probe's round trip per member (members never acked directly, or
    reaped, have none)."""


class AgentAPI(Protocol):
    """What the control server and the job watch may ask of the agent."""

    @property
    def name(self) -> str: ...

    @property
    def tags(self) -> Mapping[str, str]:
        """The local tags now (a read-only view)."""
        ...

    @property
    def jobs(self) -> JobRegistry: ...

    @property
    def changed(self) -> trio.Event:
        """Set at the next membership or tag change; take it *before* reading state."""
        ...

    async def snapshot(self) -> Snapshot: ...

    async def ping(self) -> int:
        """Run nothing in the node task and return its clock (ms): the liveness check (the
        status page's ``/healthz``). Waits as long as the node task is busy; bound it."""
        ...

    async def live_members(self) -> list[Member]:
        """The core's member table (alive, suspect, dead and left members not yet reaped)."""
        ...

    async def join(self, addresses: list[str]) -> dict[str, Any]:
        """``{"joined": int, "errors": [str]}`` (the ``join`` schema)."""
        ...

    async def leave(self) -> None:
        """Leave the cluster gracefully, then stop the agent."""
        ...

    async def force_leave(self, name: str) -> Member | None:
        """Mark a failed member left and gossip its leave intent (``ValueError``: unknown
        or live); the member after the change, None once it is only a departed record."""
        ...

    async def update_tags(
        self, set_: Mapping[str, str], delete: Iterable[str], *, replace: bool = False
    ) -> dict[str, str]: ...

    async def probe_now(self, names: Sequence[str]) -> dict[str, Any]:
        """``{"started": [name], "refused": {name: reason}}`` (the ``probe`` schema)."""
        ...

    async def change_keys(self, action: str, key: str | None) -> tuple[list[bytes], bytes]:
        """``action`` one of list, install, use, remove, ``key`` in base64 (the ``keys``
        schema); returns ``(keys, primary)`` after the change, persisted to the keyring
        file. ``ValueError`` without encryption, for a bad key, or one the keyring refuses."""
        ...

    def subscribe(self) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        """Events in the ``monitor`` schema until the agent stops or the reader lags."""
        ...
