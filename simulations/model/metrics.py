"""What a run measures: detection latency, false positives, load, dissemination.

Definitions:
- Detection (per crash, SWIM §3.1/§5 Fig. 3): the first ping sent to the victim after
  the crash (datagrams to it are tapped until then), first suspect and first dead
  anywhere after the crash, and the time until every live member (other than the victim,
  and live at the crash or still live now) reports it dead. Between them lie the phases
  of the detection budget: waiting for a prober to pick the victim, the probe (direct
  timeout and indirect round), the suspicion window, and the spread of the verdict.
  SWIM's analysis predicts first detection ≈ e/(e−1) ≈ 1.58 protocol periods after the
  failure (docs/design.md §5.8).
- False positives (Lifeguard §V; docs/design.md §5.8): a suspect or dead event about a
  member that is live (running and not leaving), counted separately; FP− are those
  observed at healthy members (observer not in ``world.faulty``: slow or cut off).
  Events about a member restarted within ``restart_grace_ms`` refer to its previous
  process and are not counted.
- Load: packets and bytes sent and received per live member per second, datagrams and
  streams separately, over a measurement window (SWIM Fig. 2: ≈2 msgs/member/period).
- Dissemination: for an injected update (a ``set_meta`` with a unique value, or a
  crash's dead message) the time until 50/99/99.99/100% of the members live at the
  injection have seen it (Serf's convergence model: docs/design.md §5.8).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swim import EventKind, Member, MemberEvent, NodeStateType, Ping, decode_packet

if TYPE_CHECKING:
    from simulations.model.world import World

QUANTILES = (0.5, 0.99, 0.9999, 1.0)


@dataclass(slots=True)
class CrashRecord:
    victim: int
    name: str
    crash_ms: int
    remaining: set[int]
    population: int
    first_ping_ms: int | None = None
    first_ping_by: str = ""
    first_suspect_ms: int | None = None
    first_suspect_by: str = ""
    first_dead_ms: int | None = None
    first_dead_by: str = ""
    all_dead_ms: int | None = None
    dead_times: list[int] = field(default_factory=list)
    closed: str = ""

    def row(self) -> dict[str, Any]:
        def rel(t: int | None) -> float | None:
            return None if t is None else (t - self.crash_ms) / 1000

        return {
            "victim": self.name,
            "crash_s": self.crash_ms / 1000,
            "first_ping_s": rel(self.first_ping_ms),
            "first_ping_by": self.first_ping_by,
            "first_suspect_s": rel(self.first_suspect_ms),
            "first_suspect_by": self.first_suspect_by,
            "first_dead_s": rel(self.first_dead_ms),
            "first_dead_by": self.first_dead_by,
            "all_dead_s": rel(self.all_dead_ms),
            "observers": self.population,
            "declared_dead_by": len(self.dead_times),
            "closed": self.closed,
        }


@dataclass(slots=True)
class FalsePositive:
    t_ms: int
    observer: str
    member: str
    kind: str
    incarnation: int
    observer_healthy: bool
    member_faulty: bool


@dataclass(slots=True)
class Spread:
    """One injected update and who has seen it when."""

    label: str
    origin: str
    start_ms: int
    meta: bytes
    population: set[int]
    reached: dict[int, int] = field(default_factory=dict)

    def quantile_ms(self, q: float) -> int | None:
        need = max(1, math.ceil(q * len(self.population)))
        times = sorted(self.reached.values())
        return times[need - 1] - self.start_ms if len(times) >= need else None

    def row(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "update": self.label,
            "origin": self.origin,
            "start_s": self.start_ms / 1000,
            "population": len(self.population),
            "reached": len(self.reached),
        }
        for q in QUANTILES:
            t = self.quantile_ms(q)
            row[f"t{_qname(q)}_s"] = None if t is None else t / 1000
        return row


def _qname(q: float) -> str:
    return f"{q * 100:g}".replace(".", "_")


class Metrics:
    """Attach with ``Metrics(world)``; it registers itself as a listener."""

    def __init__(self, world: World, *, restart_grace_ms: int | None = None) -> None:
        self.world = world
        c = world.config
        if restart_grace_ms is None:
            n = max(len(world.nodes), 2)
            min_ms = c.suspicion_mult * max(1.0, math.log10(n)) * c.probe_interval_ms
            restart_grace_ms = int(c.suspicion_max_timeout_mult * min_ms) + 2 * c.probe_interval_ms
        self.restart_grace_ms = restart_grace_ms
        self.crashes: list[CrashRecord] = []
        self._pending: dict[int, CrashRecord] = {}
        self.false_positives: list[FalsePositive] = []
        self.spreads: list[Spread] = []
        self._spreading: dict[str, list[Spread]] = {}
        self._restarted_at: dict[int, int] = {}
        self.events_by_kind: dict[str, int] = {}
        world.listeners.append(self)
        world.taps.append(self._on_send)

    # --- listener -----------------------------------------------------------------------

    def on_lifecycle(self, kind: str, idx: int) -> None:
        world = self.world
        if kind == "crash":
            for record in list(self._pending.values()):
                self._drop_observer(record, idx)
            live = [i for i in world.live_indices() if i != idx]
            name = world.names[idx]
            # An observer that already holds the victim dead (a false positive whose
            # refutation never reached it) will announce nothing: it is done at the crash.
            waiting = {i for i in live if _sees_up(world.nodes[i].member(name))}
            record = CrashRecord(idx, name, world.now_ms, waiting, len(live))
            self.crashes.append(record)
            self._pending[idx] = record
            world.tapped.add(idx)  # until its first probe: see _on_send
            self._maybe_done(record)
        elif kind in ("stopped", "leave"):
            for record in list(self._pending.values()):
                self._drop_observer(record, idx)
            for spreads in self._spreading.values():
                for spread in spreads:
                    spread.population.discard(idx)
        elif kind == "restart":
            world.tapped.discard(idx)
            self._restarted_at[idx] = world.now_ms
            closed = self._pending.pop(idx, None)
            if closed is not None:
                closed.closed = "restarted"

    def _on_send(self, src: int, dst: int, data: bytes) -> None:
        """A datagram to a crashed member: the first ping to it after the crash starts the
        probe that will find it gone (the detection budget's first phase ends here)."""
        record = self._pending.get(dst)
        if record is None or record.first_ping_ms is not None:
            self.world.tapped.discard(dst)
            return
        decoded = decode_packet(data, None)  # a keyring's packets stay opaque: no ping seen
        if any(isinstance(m, Ping) and m.node == record.name for m in decoded.messages):
            record.first_ping_ms, record.first_ping_by = self.world.now_ms, self.world.names[src]
            self.world.tapped.discard(dst)

    def _drop_observer(self, record: CrashRecord, idx: int) -> None:
        if idx in record.remaining:
            record.remaining.discard(idx)
            self._maybe_done(record)

    def _maybe_done(self, record: CrashRecord) -> None:
        if not record.remaining and record.all_dead_ms is None:
            record.all_dead_ms = self.world.now_ms
            self._pending.pop(record.victim, None)

    def on_event(self, idx: int, event: MemberEvent) -> None:
        kind = event.kind
        self.events_by_kind[kind.value] = self.events_by_kind.get(kind.value, 0) + 1
        world = self.world
        name = event.member.name
        target = world.index.get(name, -1)
        if kind in (EventKind.SUSPECT, EventKind.DEAD):
            if target >= 0 and world.live(target) and target != idx:
                self._false_positive(idx, target, event)
            record = self._pending.get(target)
            if record is None:
                return
            observer = world.names[idx]
            if kind == EventKind.SUSPECT and record.first_suspect_ms is None:
                record.first_suspect_ms, record.first_suspect_by = world.now_ms, observer
            if kind == EventKind.DEAD:
                if record.first_dead_ms is None:
                    record.first_dead_ms, record.first_dead_by = world.now_ms, observer
                record.dead_times.append(world.now_ms)
                if idx in record.remaining:
                    record.remaining.discard(idx)
                    self._maybe_done(record)
        elif kind in (EventKind.ALIVE, EventKind.JOINED, EventKind.UPDATED):
            record = self._pending.get(target)
            if record is not None and world.live(idx) and kind != EventKind.UPDATED:
                record.remaining.add(idx)
            spreads = self._spreading.get(name)
            if spreads:
                for spread in spreads:
                    if event.member.meta == spread.meta and idx in spread.population:
                        spread.reached.setdefault(idx, world.now_ms)

    def _false_positive(self, idx: int, target: int, event: MemberEvent) -> None:
        world = self.world
        restarted = self._restarted_at.get(target)
        if restarted is not None and world.now_ms - restarted < self.restart_grace_ms:
            return
        self.false_positives.append(
            FalsePositive(
                world.now_ms,
                world.names[idx],
                event.member.name,
                event.kind.value,
                event.member.incarnation,
                idx not in world.faulty,
                target in world.faulty,
            )
        )

    # --- injected updates ---------------------------------------------------------------

    def inject_update(self, origin: int, label: str = "") -> Spread:
        """A metadata change at ``origin`` (unique value), tracked until everyone has it."""
        world = self.world
        meta = f"update-{len(self.spreads)}-{world.now_ms}".encode()
        population = {i for i in world.live_indices() if i != origin}
        spread = Spread(
            label or f"meta@{world.names[origin]}",
            world.names[origin],
            world.now_ms,
            meta,
            population,
        )
        self.spreads.append(spread)
        self._spreading.setdefault(world.names[origin], []).append(spread)
        world.set_meta(origin, meta)
        return spread

    # --- summaries ----------------------------------------------------------------------

    def fp_counts(self) -> dict[str, int]:
        fps = self.false_positives
        return {
            "fp_suspect": sum(1 for f in fps if f.kind == "suspect"),
            "fp_dead": sum(1 for f in fps if f.kind == "dead"),
            "fp_suspect_at_healthy": sum(
                1 for f in fps if f.kind == "suspect" and f.observer_healthy
            ),
            "fp_dead_at_healthy": sum(1 for f in fps if f.kind == "dead" and f.observer_healthy),
            "fp_suspect_about_healthy_members": sum(
                1 for f in fps if f.kind == "suspect" and not f.member_faulty
            ),
            "fp_dead_about_healthy_members": sum(
                1 for f in fps if f.kind == "dead" and not f.member_faulty
            ),
        }

    def fp_rows(self) -> list[dict[str, Any]]:
        return [
            {
                "t_s": f.t_ms / 1000,
                "observer": f.observer,
                "member": f.member,
                "kind": f.kind,
                "incarnation": f.incarnation,
                "observer_healthy": f.observer_healthy,
                "member_faulty": f.member_faulty,
            }
            for f in self.false_positives
        ]

    def crash_rows(self) -> list[dict[str, Any]]:
        return [c.row() for c in self.crashes]

    def crash_dissemination(self) -> list[Spread]:
        """Each crash's dead message as a spread: from its first declaration."""
        spreads = []
        for c in self.crashes:
            if c.first_dead_ms is None:
                continue
            population = set(range(c.population))
            spread = Spread(f"dead({c.name})", c.first_dead_by, c.first_dead_ms, b"", population)
            for i, t in enumerate(sorted(c.dead_times)[: c.population]):
                spread.reached[i] = t
            spreads.append(spread)
        return spreads


@dataclass(slots=True)
class LoadWindow:
    """Traffic between two instants, per member that was live throughout."""

    start_ms: int
    before: dict[str, list[int]]
    members: list[int]

    @classmethod
    def open(cls, world: World) -> LoadWindow:
        return cls(world.now_ms, world.traffic.snapshot(), world.live_indices())

    def close(self, world: World) -> dict[str, Any]:
        seconds = max((world.now_ms - self.start_ms) / 1000, 1e-9)
        after = world.traffic.columns()
        members = [i for i in self.members if world.live(i)]
        result: dict[str, Any] = {"window_s": seconds, "members": len(members)}
        period_s = world.config.probe_interval_ms / 1000
        for column, values in after.items():
            rates = [(values[i] - self.before[column][i]) / seconds for i in members]
            if not rates:
                continue
            result[f"{column}_per_s_mean"] = statistics.fmean(rates)
            result[f"{column}_per_s_p99"] = _percentile(rates, 0.99)
            result[f"{column}_per_s_max"] = max(rates)
        if members:
            result["pkts_sent_per_member_per_period"] = result["pkts_out_per_s_mean"] * period_s
            result["pkts_recv_per_member_per_period"] = result["pkts_in_per_s_mean"] * period_s
        return result


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _sees_up(member: Member | None) -> bool:
    return member is not None and member.state in (NodeStateType.ALIVE, NodeStateType.SUSPECT)
