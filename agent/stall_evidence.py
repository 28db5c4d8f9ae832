"""A stalled job and a suspect member: when a job stops waiting for a silent node before
the membership has declared it dead. Participation, not death, as agent/crash_evidence.py,
for the faults that refuse nothing: a frozen process (SIGSTOP, a swap storm) or a host that
lost power answers no probe and resets no connection, so the survivors' collectives simply
block until the suspicion runs out.

The rule (``StallEvidence.excluded``): a member X leaves a job's view *on this agent* while
the membership still lists it, when all of these hold:

1. X is suspect in this agent's table (its own probe or another member's accusation);
2. every local rank of the job here has stepped before (two new steps at least: a rank
   still loading or forming its first group has no step length yet), none is in a
   declared pause (``Membership.paused``: a checkpoint, an evaluation pass), and the node
   is not a spare (a spare runs no collective: its step never moves, and it must not
   leave its view's training nodes out on every suspicion);
3. the job is *stalled* here: no local rank has heartbeated with a new step for
   ``max(STALL_MIN_MS, STALL_STEPS × the ranks' median step)`` (agent/step_clock.py: a
   median, so the stalls of earlier faults do not stretch it). A synchronous job whose
   member froze blocks in its next collective within one step, so every rank of every
   survivor stops stepping at once (a rank waiting on a collective still heartbeats, so
   that its agent does not flag it hung, but with the same step: torchhook's engine);
4. the stall began no more than ``STALL_LEAD_MS`` before X's suspicion: the fault that
   stalls the job is the one that opened the suspicion. A long unrelated stall (a slow
   file system under the data loader) does not borrow a suspicion that came much later;
5. X has not been dropped wrongly in the last ``STALL_BACKOFF_MS`` (below).

Once dropped, X stays out for the rest of that suspicion, even after the job has re-formed
without it and heartbeats again (the stall that justified the drop is over, not the
suspicion); it comes back when it refutes (alive at a new incarnation) and is gone for good
when it is dead.

Why it is safe enough to be on with ``fast``: the membership is untouched (X stays
suspect, its suspicion runs its whole window, and X can refute), so no false *death*
follows from it; RELIABILITY.md's scenarios are unaffected. A wrong drop needs a false
suspicion of X *and* every rank of this node blocked at the same time; it costs one
re-formation without X and, when X refutes, one more to take it back (with a spare: X waits
as the spare instead; ``python -m bench.false_drop`` measures the cost). A refutation while
dropped counts as a wrong drop and turns the rule off for X for ``STALL_BACKOFF_MS``, so a
lossy link that makes X a suspect again and again costs at most one wrong drop per
backoff, not one per suspicion.

Jobs whose steps are long gain little: the stall needs ``STALL_STEPS`` step intervals, and
with steps of a second or more the membership's verdict usually comes first.

Switch: ``job_stall_drop`` in the agent's configuration (agent/config.py; on with the
``fast`` profile). Pure (no trio, no sockets); times are the agent's clock in ms, the clock
of ``Member.state_change_ms``. Bounded: records per job as ``MAX_STALL_NAMES``, jobs as
``agent.jobs.MAX_WATCHED_JOBS``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from agent.control import ROLE_SPARE
from agent.jobs import MAX_WATCHED_JOBS, Registration
from swim import Member, NodeStateType

__all__ = [
    "MAX_STALL_NAMES",
    "STALL_BACKOFF_MS",
    "STALL_LEAD_MS",
    "STALL_MIN_MS",
    "STALL_STEPS",
    "StallEvidence",
    "stall_after_ms",
    "stalled_since_ms",
]

STALL_MIN_MS = 150
"""Shortest silence that counts as a stall: above the scheduling noise of a loaded host
(tens of ms) and a garbage collection pause, and below the ``fast`` suspicion window
(~250 ms at 4 members), which is what the rule saves."""
STALL_STEPS = 3
"""A stall lasts this many step intervals: a step three times its usual length is no
jitter of the data loader any more (docs/training.md's fail-slow rule flags at 2×)."""
STALL_LEAD_MS = 3000
"""Longest time from the stall's start to X's suspicion: a probe of a silent node fails
within one probe interval plus its timeout (1.5 s with ``lan``, 0.4 s with ``fast``), and
the ranks block within one step of the fault."""
STALL_BACKOFF_MS = 300_000
"""After X refuted a stall drop, the rule ignores X this long: at most 12 wrong drops of
one member an hour on a link that keeps losing its probes."""
MAX_STALL_NAMES = 1024
"""Drops and backoffs kept per job: a job has at most this many nodes worth recording; the
oldest go first."""


def stall_after_ms(step_ms: float) -> int:
    """The time without a new step after which a job's ranks count as stalled (rule 3)."""
    return max(STALL_MIN_MS, round(STALL_STEPS * step_ms))


def stalled_since_ms(ranks: Iterable[Registration], now_ms: int) -> int | None:
    """When this node's ranks of a job last made progress (a heartbeat with a new step), if
    they are stalled now (rules 2 and 3), else None."""
    last_ms = None
    steps: list[float] = []
    for reg in ranks:
        reg.settle(now_ms)
        beat_ms, step_ms = reg.steps.since_ms, reg.steps.median_step_ms()
        if reg.role == ROLE_SPARE or reg.paused is not None or beat_ms is None or step_ms is None:
            return None
        last_ms = beat_ms if last_ms is None else max(last_ms, beat_ms)
        steps.append(step_ms)
    if last_ms is None:
        return None
    if now_ms - last_ms < stall_after_ms(min(steps)):
        return None
    return last_ms


@dataclass
class StallEvidence:
    """The members each job left out on a stall, the backoffs, and the rule above."""

    enabled: bool = False
    _dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    """job → member → the ``state_change_ms`` of the suspicion it was dropped in."""
    _backoff: dict[str, dict[str, int]] = field(default_factory=dict)
    """job → member → until when the rule ignores it (a wrong drop)."""
    wrong_drops: int = 0
    """Drops that the member refuted (read by tests; not exported as a metric)."""

    def excluded(
        self, job: str, members: Iterable[Member], stalled_since_ms: int | None, now_ms: int
    ) -> frozenset[str]:
        """The members ``job``'s view on this agent leaves out now. ``stalled_since_ms``:
        when the job's last local heartbeat came, if rules 2 and 3 hold now, else None."""
        if not self.enabled:
            return frozenset()
        dropped = self._dropped.get(job, {})
        backoff = self._backoff.get(job, {})
        out = set()
        kept: dict[str, int] = {}
        for m in members:
            since_ms = dropped.get(m.name)
            if since_ms is not None:
                if m.state == NodeStateType.SUSPECT and m.state_change_ms == since_ms:
                    out.add(m.name)  # the same suspicion: stays out
                    kept[m.name] = since_ms
                    continue
                if m.state == NodeStateType.ALIVE and m.state_change_ms > since_ms:
                    self.wrong_drops += 1
                    backoff = self._backoff.setdefault(job, backoff)
                    _record(backoff, m.name, now_ms + STALL_BACKOFF_MS)
            if m.state != NodeStateType.SUSPECT or stalled_since_ms is None:
                continue
            if backoff.get(m.name, 0) > now_ms:
                continue
            if m.state_change_ms - stalled_since_ms > STALL_LEAD_MS:
                continue
            out.add(m.name)
            kept[m.name] = m.state_change_ms
        if kept:
            if job not in self._dropped and len(self._dropped) >= MAX_WATCHED_JOBS:
                del self._dropped[next(iter(self._dropped))]
            self._dropped[job] = dict(list(kept.items())[-MAX_STALL_NAMES:])
        else:
            self._dropped.pop(job, None)
        if len(self._backoff) > MAX_WATCHED_JOBS:
            del self._backoff[next(iter(self._backoff))]
        return frozenset(out)

    def forget(self, job: str) -> None:
        """The job has no local rank left here."""
        self._dropped.pop(job, None)
        self._backoff.pop(job, None)


def _record(until: dict[str, int], name: str, until_ms: int) -> None:
    until.pop(name, None)
    while len(until) >= MAX_STALL_NAMES:
        del until[next(iter(until))]
    until[name] = until_ms
