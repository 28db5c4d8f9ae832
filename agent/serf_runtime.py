"""The agent as a Serf member: what it does with Serf's messages, in the node task.

The codecs and the pure rules live in the package agent/serf/ (messages, push-pull state,
queries); this module is the agent's side of Serf's delegate (serf.go, delegate.go,
internal_query.go): it implements ``agent.driver.Delegate`` and executes through the
driver. Every method runs in the node task (the driver calls it, or ``Driver.command``).

Rules (serf.go ``handleNodeJoinIntent``/``handleNodeLeaveIntent``, delegate.go
``NotifyMsg``/``MergeRemoteState``):
- Witness every Lamport time seen (intents, user events; queries on the query clock;
  ``ltime - 1`` of a push-pull state) so our own intents are never ignored as old.
- An intent matters only if newer than the last one seen for that node; intents that are
  news are re-gossiped (Serf relies on every member passing them on); per-name intent
  clocks are bounded (``MAX_INTENT_NAMES``) and forgotten with the member.
- A stale leave intent about us is answered with a fresh join intent; a leave intent for
  a failed member marks it left (Serf's force-leave), also after the core reaped it
  (agent/departed.py keeps reaped members listed, as serf does).
- Queries: pass news on (unless no-broadcast), ack when asked, answer the key-management
  queries on our keyring so ``serf keys`` rotates it too (and persist it).

Where a new Serf message goes: its codec in agent/serf/messages.py, then one branch in
``SerfRuntime.on_user_message`` here.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from agent import serf
from agent.departed import Departed
from agent.driver import Driver, now_ms
from agent.serf import queries
from swim import (
    LEAVE_FANOUT,
    Address,
    EventKind,
    Keyring,
    KeyringError,
    Member,
    MemberEvent,
    NodeStateType,
)

log = logging.getLogger("swim.agent")

MAX_INTENT_NAMES = 65_536
"""Serf intent clocks remembered (one per member name)."""
MAX_LEFT_MEMBERS = 65_536
"""LeftMembers names honoured from one push-pull state."""


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
        self.clock = serf.LamportClock()
        self.query_clock = serf.LamportClock()
        self._queries_seen = queries.QuerySeen()
        self._status_ltimes: dict[str, int] = {}
        self.leaving = False
        """Set by the agent when it leaves: a leave intent about us is then no longer stale."""

    # --- the driver's delegate hooks -------------------------------------------------------

    def on_event(self, event: MemberEvent) -> None:
        m = event.member
        if event.kind == EventKind.REAPED:
            # Serf keeps failed and left members listed (and their intent clocks) long
            # after memberlist reaps them; so do we, bounded (agent/departed.py).
            self._forget_intents(self.departed.record(m, event.at_ms))
            self._forget_intents(self.departed.expire(event.at_ms))
            if m.name not in self.departed:
                self._status_ltimes.pop(m.name, None)
        elif event.kind == EventKind.JOINED:
            self.departed.forget(m.name)

    def on_user_message(self, payload: bytes) -> None:
        """Serf messages from Serf peers (and from our agents), as serf.go handles them:
        witness Lamport times; re-gossip join/leave intents that are news (Serf relies on
        every member passing intents on); answer a stale leave about us with a join intent;
        and honour a leave intent for a failed member (Serf's force-leave)."""
        try:
            _, message = serf.decode_serf_message(payload)
        except ValueError:
            return
        ltime = getattr(message, "ltime", None)
        if isinstance(message, serf.Query):
            self._on_query(message, payload)
            return
        if isinstance(ltime, int) and not isinstance(message, serf.QueryResponse):
            self.clock.witness(ltime)
        if isinstance(message, serf.JoinIntent | serf.LeaveIntent):
            if self._intent_is_news(message.node, message.ltime):
                self._broadcast(payload)
            else:
                return
        if isinstance(message, serf.LeaveIntent):
            self._on_leave_intent(message.node)
        elif isinstance(message, serf.UserEvent):
            self._driver.events.publish(
                {
                    "type": "user_event",
                    "node": "",
                    "name": message.name,
                    "payload": message.payload,
                    "at_ms": now_ms(),
                    "message": "",
                }
            )

    def on_push_pull_state(self, state: bytes) -> None:
        """Serf's push-pull state: witness its clock (serf delegate.go MergeRemoteState)."""
        try:
            decoded = serf.decode_push_pull_state(state)
        except ValueError:
            return
        ltime = decoded.get("ltime")
        if isinstance(ltime, int) and ltime > 0:
            self.clock.witness(ltime - 1)
        # delegate.go MergeRemoteState: each LeftMembers name is a leave intent one past
        # its join LTime, so a leave we missed in gossip still arrives within a push-pull.
        status_ltimes = decoded.get("status_ltimes", {})
        for name in decoded.get("left_members", [])[:MAX_LEFT_MEMBERS]:
            if self._intent_is_news(name, status_ltimes.get(name, 0) + 1):
                self._on_leave_intent(name)

    # --- what the agent asks for (in the node task) ------------------------------------

    def send_join_intent(self) -> None:
        # serf.go: intents carry the current Lamport time, then the clock moves on.
        node = self._driver.node
        intent = serf.JoinIntent(self.clock.time(), node.name)
        self.clock.increment()
        self._broadcast(serf.encode_join_intent(intent))

    def send_leave_intent(self, name: str, *, direct: bool = False) -> None:
        intent = serf.LeaveIntent(self.clock.time(), name)
        self.clock.increment()
        self._status_ltimes[name] = intent.ltime
        payload = serf.encode_leave_intent(intent)
        self._broadcast(payload)
        if direct:
            # Serf peers call a departure "left" only if the intent came first; tell every
            # live member directly rather than hope gossip gets there in time.
            node = self._driver.node
            now = now_ms()
            alive = [
                m for m in node.members() if m.state == NodeStateType.ALIVE and m.name != node.name
            ]
            for member in alive[:LEAVE_FANOUT]:
                self._driver.apply(node.send_user(member.address, payload, now))

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
        self._forget_intents(self.departed.expire(now))
        live = self._driver.node.members()
        known = {m.name for m in live}
        return live + [m for m in self.departed.members() if m.name not in known]

    def persist_keyring(self) -> None:
        """Write the keyring back to ``keyring_file`` (primary first), as serf does after a
        key change, atomically; without a keyring file there is nothing to keep."""
        keyring = self._driver.node.keyring
        if self._keyring_file is not None and keyring is not None:
            write_keyring(self._keyring_file, keyring)

    # --- internals ------------------------------------------------------------------------

    def _on_query(self, query: serf.Query, payload: bytes) -> None:
        """A Serf query (rules in agent/serf/queries.py): pass news on, ack when asked,
        answer the key-management queries so ``serf keys`` rotates our keyring too."""
        self.query_clock.witness(query.ltime)
        if not self._queries_seen.is_news(query.ltime, query.id):
            return
        if not query.no_broadcast:
            self._broadcast(payload)
        node = self._driver.node
        if not queries.for_us(query.filters, node.name, dict(self._tags())):
            return
        try:
            dest = Address(*queries.response_address(query))
        except ValueError:
            return
        now = now_ms()
        if query.ack:
            ack = queries.response(query, node.name, b"", ack=True)
            self._driver.apply(node.send_user(dest, ack, now))
        name = query.name.removeprefix(serf.INTERNAL_QUERY_PREFIX)
        if query.name.startswith(serf.INTERNAL_QUERY_PREFIX) and name in queries.KEY_QUERIES:
            answer = queries.response(query, node.name, self._key_query(name, query.payload))
            self._driver.apply(node.send_user(dest, answer, now))

    def _key_query(self, name: str, payload: bytes) -> bytes:
        """internal_query.go ``handleInstallKey`` and friends, on our keyring."""
        node = self._driver.node
        keyring = node.keyring
        if keyring is None:
            empty = "Keyring is empty" if name == "list-keys" else "No keyring to modify"
            return queries.key_response(False, f"{empty} (encryption not enabled)", [], None)
        if name == "list-keys":
            return queries.key_response(True, "", list(keyring.keys), keyring.primary_key)
        change = {"install-key": node.install_key, "use-key": node.use_key}
        try:
            key = queries.key_request(payload)
            change.get(name, node.remove_key)(key)
            self.persist_keyring()
        except (ValueError, KeyringError, OSError) as exc:
            log.warning("serf %s query failed: %s", name, exc)
            return queries.key_response(False, str(exc), [], None)
        log.info("serf %s query: done", name)
        return queries.key_response(True, "", [], None)

    def _on_leave_intent(self, name: str) -> None:
        """A leave intent that is news (serf.go ``handleNodeLeaveIntent``)."""
        node = self._driver.node
        if name == node.name:
            if not self.leaving:
                # A stale leave about us (e.g. from before a restart): serf peers would keep
                # us "leaving"; a newer join intent refutes it.
                self.send_join_intent()
            return
        member = node.member(name)
        if member is not None:
            if member.state in (NodeStateType.DEAD, NodeStateType.SUSPECT):
                self._driver.apply(node.force_leave(name, now_ms()))
            return
        self._departed_left(name, now_ms())

    def _departed_left(self, name: str, now: int) -> None:
        """A member the core already reaped as failed left after all: a late leave intent or
        a force-leave turns "failed" into "left" (serf's "EventMemberLeave (forced)")."""
        left = self.departed.mark_left(name, now)
        if left is not None:
            self._driver.emit(MemberEvent(EventKind.LEFT, left, now))

    def _forget_intents(self, names: list[str]) -> None:
        for name in names:
            self._status_ltimes.pop(name, None)

    def _intent_is_news(self, name: str, ltime: int) -> bool:
        """serf.go: an intent matters only if newer than the last one seen for that node.
        Bounded: one entry per name, dropped when the member is forgotten (reaped and,
        if failed or left, its departed record expired or evicted)."""
        if ltime <= self._status_ltimes.get(name, -1):
            return False
        if name not in self._status_ltimes and len(self._status_ltimes) >= MAX_INTENT_NAMES:
            return False
        self._status_ltimes[name] = ltime
        return True

    def _broadcast(self, payload: bytes) -> None:
        self._driver.apply(self._driver.node.broadcast_user(payload, now_ms()))


def write_keyring(path: Path, keyring: Keyring) -> None:
    """The keyring file format serf reads: a JSON list of base64 keys, primary first;
    written atomically, mode 0600."""
    keys = [keyring.primary_key, *(k for k in keyring.keys if k != keyring.primary_key)]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([base64.b64encode(k).decode() for k in keys]) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
