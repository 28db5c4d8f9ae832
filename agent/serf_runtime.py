"""The agent as a Serf member: executes the pure Serf delegate's actions in the node task.

The rules live in the package agent/serf/: ``SerfDelegate`` (agent/serf/delegate.py) decides
what a member does with each serf message, push-pull state and intent of its own, and
returns actions; this module feeds it (``agent.driver.Delegate`` hooks: user messages,
push-pull states, member events) and executes what it returns through the driver:
``Broadcast`` -> ``Node.broadcast_user``, ``SendUser`` -> ``Node.send_user``,
``ForceLeave`` -> ``Node.force_leave``, ``MarkDepartedLeft`` -> agent/departed.py and a
"left" event, ``UserEventReceived`` -> the events fan-out (and ``on_user_event``, the event
handlers), ``QueryReceived`` -> ``on_query`` (the event handlers, whose output
``answer_query`` sends back), ``Log`` -> the log. Every
method runs in the node task (the driver calls it, or ``Driver.command``).

It also keeps Serf's view of members that are gone (agent/departed.py: serf lists failed
and left members long after memberlist reaps them) and forgets their intent clocks with
them, and writes the keyring file after a key change (serf's keyring file format).

Where a new Serf message goes: its codec in agent/serf/messages.py, its row in
``agent.serf.delegate.MESSAGE_RULES``; a new kind of action, one branch in ``_execute``.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from agent.departed import Departed
from agent.driver import Driver, now_ms
from agent.keyfiles import write_keyring
from agent.serf import queries
from agent.serf.constants import QUERY_RESPONSE_SIZE_LIMIT
from agent.serf.delegate import (
    Broadcast,
    ForceLeave,
    Log,
    MarkDepartedLeft,
    QueryReceived,
    SendUser,
    SerfAction,
    SerfDelegate,
    SerfView,
    UserEventReceived,
)
from swim import EventKind, Member, MemberEvent

log = logging.getLogger("swim.agent")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


class SerfRuntime:
    """Serf's behaviour for one agent (``Driver.delegate``)."""

    def __init__(
        self,
        driver: Driver,
        *,
        departed: Departed,
        tags: Callable[[], Mapping[str, str]],
        keyring_file: Path | None,
    ) -> None:
        self._driver = driver
        self.departed = departed
        self._tags = tags
        self._keyring_file = keyring_file
        self.delegate = SerfDelegate(driver.node.name)
        self.leaving = False
        """Set by the agent when it leaves: a leave intent about us is then no longer stale."""
        self.on_user_event: Callable[[UserEventReceived], None] | None = None
        """Called with every user event (the event handlers; must not block)."""
        self.on_query: Callable[[QueryReceived], None] | None = None
        """Called with every user query for us (the event handlers; must not block)."""

    # --- the driver's delegate hooks -------------------------------------------------------

    def on_event(self, event: MemberEvent) -> None:
        m = event.member
        if event.kind == EventKind.REAPED:
            # Serf keeps failed and left members listed (and their intent clocks) long
            # after memberlist reaps them; so do we, bounded (agent/departed.py).
            self.delegate.forget(self.departed.record(m, event.at_ms))
            self.delegate.forget(self.departed.expire(event.at_ms))
            if m.name not in self.departed:
                self.delegate.forget([m.name])
        elif event.kind == EventKind.JOINED:
            self.departed.forget(m.name)
        self._execute(self.delegate.on_member_event(event.kind, m.name))

    def on_user_message(self, payload: bytes) -> None:
        self._execute(self.delegate.on_user_message(payload, self._view()))

    def on_push_pull_state(self, state: bytes) -> None:
        self._execute(self.delegate.on_push_pull_state(state, self._view()))

    # --- what the agent asks for (in the node task) ------------------------------------

    def send_join_intent(self) -> None:
        self._execute(self.delegate.join_intent())

    def send_leave_intent(self, name: str, *, direct: bool = False) -> None:
        self._execute(self.delegate.leave_intent(name, self._view(), direct=direct))

    def force_leave(self, name: str, now: int) -> Member | None:
        """Serf ``force-leave``: a failed member is marked left and a leave intent for it
        is gossiped. Raises ``ValueError`` for an unknown or live member."""
        node = self._driver.node
        if node.member(name) is None and name in self.departed:
            self._departed_left(name, now)
            member = self.departed.get(name)
        else:
            self._driver.apply(node.force_leave(name, now))
            member = node.member(name)
        self.send_leave_intent(name)
        return member

    def all_members(self, now: int) -> list[Member]:
        """The core's table plus departed members it has already reaped (as serf lists
        failed and left members until their reconnect/tombstone timeout)."""
        self.delegate.forget(self.departed.expire(now))
        return self.listed_members()

    def listed_members(self) -> list[Member]:
        """``all_members`` without expiring departed records first (reads only)."""
        live = self._driver.node.members()
        known = {m.name for m in live}
        return live + [m for m in self.departed.members() if m.name not in known]

    def persist_keyring(self) -> None:
        """Write the keyring back to ``keyring_file`` (primary first), as serf does after a
        key change, atomically; without a keyring file there is nothing to keep."""
        keyring = self._driver.node.keyring
        if self._keyring_file is not None and keyring is not None:
            write_keyring(self._keyring_file, keyring)

    def change_keys(self, action: str, key: str | None) -> tuple[list[bytes], bytes]:
        """The control API's ``keys``: list, or install/use/remove a base64 key, then
        persist the keyring; ``(keys, primary)`` after. ``ValueError`` (``KeyringError``
        is one) with the client's message."""
        node = self._driver.node
        keyring = node.keyring
        if keyring is None:
            raise ValueError("encryption is not enabled on this agent")
        if action != "list":
            if key is None:
                raise ValueError(f"keys {action} needs a key")
            try:
                raw = base64.b64decode(key, validate=True)
            except ValueError:
                raise ValueError("the key is not valid base64") from None
            ops = {"install": node.install_key, "use": node.use_key, "remove": node.remove_key}
            if action not in ops:
                raise ValueError(f"unknown keys action {action!r}")
            ops[action](raw)
            try:
                self.persist_keyring()
            except OSError as exc:
                raise ValueError(
                    f"the keyring changed in memory but was not saved to "
                    f"{self._keyring_file}: {exc.strerror}"
                ) from exc
        return list(keyring.keys), keyring.primary_key

    def answer_query(self, received: QueryReceived, payload: bytes) -> bool:
        """Answer a user query with ``payload`` (an event handler's output), as serf's
        ``Query.Respond``: refused (False, logged) when the response is over
        ``QUERY_RESPONSE_SIZE_LIMIT``."""
        response = queries.response(received.query, self._driver.node.name, payload)
        if len(response) > QUERY_RESPONSE_SIZE_LIMIT:
            log.warning(
                "query %s: the answer takes %d bytes; the limit is %d: not sent",
                received.query.name,
                len(response),
                QUERY_RESPONSE_SIZE_LIMIT,
            )
            return False
        self._execute([SendUser(received.dest, response)])
        return True

    # --- internals ------------------------------------------------------------------------

    def _view(self) -> SerfView:
        node = self._driver.node
        return SerfView(
            members=node,
            tags=self._tags(),
            leaving=self.leaving,
            keys=node,
            persist_keys=self.persist_keyring,
        )

    def _execute(self, actions: list[SerfAction]) -> None:
        driver = self._driver
        node = driver.node
        for action in actions:
            now = now_ms()
            if isinstance(action, Broadcast):
                driver.apply(node.broadcast_user(action.payload, now))
            elif isinstance(action, SendUser):
                driver.apply(node.send_user(action.dest, action.payload, now))
            elif isinstance(action, ForceLeave):
                driver.apply(node.force_leave(action.name, now))
            elif isinstance(action, MarkDepartedLeft):
                self._departed_left(action.name, now)
            elif isinstance(action, UserEventReceived):
                if self.on_user_event is not None:
                    self.on_user_event(action)
                driver.events.publish(
                    {
                        "type": "user_event",
                        "node": "",
                        "name": action.name,
                        "payload": action.payload,
                        "at_ms": now,
                        "message": "",
                    }
                )
            elif isinstance(action, QueryReceived):
                if self.on_query is not None:
                    self.on_query(action)
            elif isinstance(action, Log):
                log.log(_LEVELS.get(action.level, logging.INFO), "%s", action.message)
            else:
                raise TypeError(f"unknown serf action {action!r}")

    def _departed_left(self, name: str, now: int) -> None:
        """A member the core already reaped as failed left after all: a late leave intent or
        a force-leave turns "failed" into "left" (serf's "EventMemberLeave (forced)")."""
        left = self.departed.mark_left(name, now)
        if left is not None:
            self._driver.emit(MemberEvent(EventKind.LEFT, left, now))
