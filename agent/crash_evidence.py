"""Strong crash evidence: when a job stops waiting for a node before the membership has
declared it dead. Participation, not death: torchft's per-step quorum decides who takes part
in a step apart from who is alive, and this does the same on top of SWIM's verdicts.

The rule (``CrashEvidence.excluded``): a member X leaves a job's view *on this agent* while
the membership still lists it, when all of these hold:

1. X is suspect in this agent's table;
2. this agent's own probe of X failed on every path *and its TCP ping was refused or reset*
   before the probe's deadline, during X's current suspicion or opening it
   (``probe_refused``; urgent, cross-check or round robin alike; swim/probe.py lists such
   probes in ``Output.probes_refused``): no process listens on X's agent port any more,
   or X's link rejects;
3. and one more sign that is not this probe: (a) one of this agent's own trainers *of that
   job* reported that its collectives lost X (``report_lost``: a connection reset or closed
   by the peer; the ``lost`` frame of agent/watch.py) no more than ``EVIDENCE_WINDOW_MS``
   before or after that probe; or (b) X was suspect already when the probe concluded:
   another failed probe, normally another member's accusation, came first.

Why 3b: measured with `fast` at 3 nodes × 2 ranks, a SIGKILL reaches the collectives of
one survivor node only in four runs of five (a ring all-reduce blocks the other's ranks on
a live neighbour, which never errs), so that survivor's agent has no report, keeps the node
and holds back the formation until the death. Its own probe is refused all the same (a
cross-check of the first accusation), and a refusal is the strong half: it says the
node's agent process is gone, and a trainer whose agent is gone stops at once
(``MembershipLost``, docs/training.md §8), so the node cannot take part any more.

What the trainers can know: gloo's error names the peer's address, so a report names the
node (or, when nodes share an address, every other node of the group); it cannot say which
of the node's ranks closed, and only the ranks whose collectives touch the dead peer see an
error at all (a ring all-reduce blocks its other ranks on a live neighbour). So condition 3
asks for one report from any local rank of the job, and condition 2 separates the crashed
node from the live ones that a report also named.

Why both halves: a reset alone comes from one crashed trainer on a live host (its agent
answers, and takes the node out of the view itself when the registration breaks) or a
report naming nodes that share an address. A failed probe alone comes from a paused
process (SIGSTOP, a swap storm, a starved agent), lost packets, a partition or a power
loss, and none of these refuses a TCP connection: a paused process's kernel still accepts
it, an unreachable host answers nothing. The refused TCP ping is what only a dead agent
process or a rejecting link gives. Together, on a node whose processes live, the halves
need something that resets its TCP connections and makes its agent miss a ping: a firewall
rule with ``REJECT --reject-with tcp-reset``, a device that resets every connection. Such
a node cannot train with the group anyway: its connections are gone, so the group
re-forms either way; the early drop then costs one more re-formation when it comes back
(the regrow; ``python -m bench.false_drop`` measures it).

What it changes: only this agent's job views (``view``, ``watch``, ``jobs``), so the
trainers' verdict comes at the refused probe instead of at the death. The membership is
untouched: X stays suspect, its suspicion runs its whole window, and X can refute. A
refutation makes X alive at a new incarnation (its ``state_change_ms`` moves past the
refused probe), so condition 2 no longer holds and X is back in the view at once; the job
regrows with it at a step boundary. Nothing is gossiped: each agent judges from its own
trainers and its own probe (a survivor whose trainers saw no reset keeps X until the
death, and a group formed without X does not switch back toward a suspect:
torchhook/verdicts.py ``differs``).

Switch: ``job_early_drop`` in the agent's configuration (agent/config.py; on with the
``fast`` profile). Pure (no trio, no sockets); times are the agent's clock in ms, the clock
of ``Member.state_change_ms``. Bounded: ``MAX_EVIDENCE_NAMES`` names per job and refused
probes kept, each for ``EVIDENCE_RETAIN_MS``; jobs as ``agent.jobs.MAX_WATCHED_JOBS``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from agent.jobs import MAX_WATCHED_JOBS
from swim import Member, NodeStateType

__all__ = [
    "EVIDENCE_RETAIN_MS",
    "EVIDENCE_WINDOW_MS",
    "MAX_EVIDENCE_NAMES",
    "CrashEvidence",
]

EVIDENCE_WINDOW_MS = 1000
"""Longest gap between a trainer's lost report and the refused probe that count together.
An urgent probe concludes 40–100 ms after the report on a quiet host (direct timeout, the
helpers' nacks, a refused TCP ping); a loaded host may take several times that. A second
covers it, and stays short of a later, unrelated suspicion borrowing an old report."""
EVIDENCE_RETAIN_MS = 60_000
"""How long a report or a refused probe is kept: far longer than any suspicion window, so
pruning never removes evidence that still counts; bounds the records of a quiet agent."""
MAX_EVIDENCE_NAMES = 1024
"""Names with a record per job, and refused probes kept: a report names at most 64 nodes
(agent/watch.py ``MAX_LOST_NAMES``) and a crash loses a few; the oldest go first."""


@dataclass
class CrashEvidence:
    """Lost reports by job and this agent's refused probes, and the rule above."""

    enabled: bool = False
    _reports: dict[str, dict[str, int]] = field(default_factory=dict)
    """job → member name → when one of the job's local trainers last reported it lost."""
    _refused: dict[str, int] = field(default_factory=dict)
    """member name → when this agent's probe of it last failed, refused (oldest first)."""
    _dropped: dict[str, frozenset[str]] = field(default_factory=dict)
    """job → the members ``excluded`` left out last time (for ``changes``)."""

    def report_lost(self, job: str, names: Sequence[str], now_ms: int) -> None:
        """A trainer of ``job`` on this node lost these peers (names already checked)."""
        if not self.enabled:
            return
        reports = self._reports.get(job)
        if reports is None:
            if len(self._reports) >= MAX_WATCHED_JOBS:
                del self._reports[next(iter(self._reports))]
            reports = self._reports[job] = {}
        for name in names:
            _record(reports, name, now_ms)

    def probe_refused(self, name: str, now_ms: int) -> None:
        """This agent's probe of ``name`` failed on every path, its TCP ping refused."""
        if self.enabled:
            _record(self._refused, name, now_ms)

    def forget(self, job: str) -> None:
        """The job has no local rank left here."""
        self._reports.pop(job, None)
        self._dropped.pop(job, None)

    def excluded(self, job: str, members: Iterable[Member]) -> frozenset[str]:
        """The members that ``job``'s view on this agent leaves out now (module rule)."""
        if not self.enabled or not self._refused:
            return frozenset()
        reports = self._reports.get(job, {})
        out = set()
        for m in members:
            refused_ms = self._refused.get(m.name)
            if m.state != NodeStateType.SUSPECT or refused_ms is None:
                continue
            if refused_ms < m.state_change_ms:
                continue  # an earlier suspicion, which it refuted
            reported_ms = reports.get(m.name)
            lost_here = (
                reported_ms is not None and abs(refused_ms - reported_ms) <= EVIDENCE_WINDOW_MS
            )
            if lost_here or refused_ms > m.state_change_ms:  # 3a or 3b
                out.add(m.name)
        return frozenset(out)

    def changes(self, job: str, dropped: frozenset[str]) -> tuple[list[str], list[str]]:
        """``(newly dropped, back)`` since the last call for ``job``: for the agent's log."""
        before = self._dropped.get(job, frozenset())
        if dropped:
            self._dropped[job] = dropped
        else:
            self._dropped.pop(job, None)
        return sorted(dropped - before), sorted(before - dropped)


def _record(times: dict[str, int], name: str, now_ms: int) -> None:
    """``times[name] = now_ms`` as the newest entry; expired and overflowing ones go."""
    times.pop(name, None)
    while times:
        oldest_name, oldest_ms = next(iter(times.items()))
        if now_ms - oldest_ms < EVIDENCE_RETAIN_MS and len(times) < MAX_EVIDENCE_NAMES:
            break
        del times[oldest_name]
    times[name] = now_ms
