"""How a restarted victim's processes are scheduled until it waits as a spare
(bench/mixed_efficiency.py), and what each way cost (bench/mixed_restarts.py's windows).

On this test machine a restarted victim starts on the same 2 cores as the training nodes;
a rebooting host on a cluster has CPUs of its own. The training nodes mostly wait (the
stand-in compute and the step sleep are sleeps), so a start (two torch imports and a
model build: ~6 CPU-seconds) runs mostly on idle CPU time. Two ways to start it,
``--restart-sched``:

- ``nice``: ``nice -n N`` (19 by default): the scheduler may let it finish its slice
  before a waking trainer runs.
- ``idle``: ``chrt --idle 0`` (``SCHED_IDLE``): it runs only on a core nobody else wants,
  and a waking normal task preempts it at once (Linux ``check_preempt_wakeup_fair``).

- ``fork``: as ``idle``, and its agent and trainers are forked from processes that
  imported their modules before the measurement (bench/forkserver.py: one for agents, one
  for trainers, so an agent never holds torch), so the start skips the imports (two torch
  imports and the agent's: ~4.1 of its ~6.5 CPU-seconds).

Neither ``nice`` nor ``idle`` makes a start free: over an hour of one fault a minute a
restart cost the training nodes 0.49 s of training at nice 19 and 0.47 s as
``SCHED_IDLE`` (two runs, 60 restarts each). What slows them is the CPU time itself, not
which task the scheduler runs: during a failure-free run one busy loop at ``SCHED_IDLE``
made the steps 86-88 ms against 77-78 ms, one at normal priority 90 ms (bench/forkserver.py
has the measurement). So ``fork`` attacks the CPU-seconds: 0.03 s of training per restart
against 0.46 s for ``idle`` (``--restart-sched fork,idle``, 10 minutes, 5 restarts each).

Either way every thread of the node's processes is set back to ``SCHED_OTHER`` at nice 0
(``restore``) once it waits as a spare, before it can be drafted. A comma-separated list
cycles per restart, so both are measured in one run (``split`` sums each one's windows).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.training_nodes import Launch
from bench.forkserver import ForkServer

__all__ = ["PRELOAD", "SCHEDS", "Forks", "parse", "restore", "split", "wrap"]

SCHEDS = ("nice", "idle", "fork")
PRELOAD = ("torch", "torch.distributed", "elastic_ddp")
"""What the trainers' fork server imports (examples/elastic_ddp.py imports the rest:
torchhook, job)."""
AGENT_PRELOAD = ("agent.cli", "agent.runtime")
"""What the agents' fork server imports (``swimctl agent`` imports the runtime lazily)."""


def parse(text: str) -> tuple[str, ...]:
    """``--restart-sched``: ``nice``, ``idle``, ``fork`` or a comma-separated cycle of them."""
    scheds = tuple(s.strip() for s in text.split(",") if s.strip())
    if not scheds or any(s not in SCHEDS for s in scheds):
        raise ValueError(f"--restart-sched: {text!r} is not a list of {' or '.join(SCHEDS)}")
    return scheds


def wrap(sched: str, nice: int) -> tuple[str, ...]:
    """The command prefix that starts a restarted node's processes ``sched``'s way."""
    if sched in ("idle", "fork"):  # fork: the fork server sets SCHED_IDLE from this prefix
        return ("chrt", "--idle", "0")
    return ("nice", "-n", str(nice)) if nice else ()


class Forks:
    """The fork servers ``fork`` restarts need, started at once (before the baseline) when
    ``scheds`` has ``fork``; ``agent(sched)`` and ``trainers(sched)`` say how a node
    restarted ``sched``'s way starts its processes (None: ``subprocess.Popen``)."""

    def __init__(self, scheds: Sequence[str], work: Path) -> None:
        self.servers: dict[str, ForkServer] = {}
        if "fork" in scheds:
            examples = Path(__file__).resolve().parents[1] / "examples"
            self.servers["agent"] = ForkServer.start(work, AGENT_PRELOAD, name="fork-agents")
            self.servers["trainers"] = ForkServer.start(
                work, PRELOAD, path=(examples,), name="fork-trainers"
            )

    def agent(self, sched: str) -> Launch | None:
        return self.servers["agent"].launch if sched == "fork" else None

    def trainers(self, sched: str) -> Launch | None:
        return self.servers["trainers"].launch if sched == "fork" else None

    def close(self) -> None:
        for server in self.servers.values():
            server.close()


def _pgrp(pid: str) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[2])  # state ppid pgrp
    return None


def restore(pgid: int) -> int:
    """Every thread of every process in group ``pgid`` back to ``SCHED_OTHER`` at nice 0
    (threads keep their own policy and nice value on Linux, so each is set); returns how
    many were set. Threads that exit meanwhile are skipped."""
    done = 0
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        if _pgrp(pid) != pgid:
            continue
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:  # gone meanwhile
            continue
        for tid in tids:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, 0)
                done += 1
    return done


def split(
    per_window: Sequence[tuple[float, float, int, float]],
    restarts: Sequence[tuple[float, str]],
    step_s: float,
) -> dict[str, dict[str, Any]]:
    """bench/mixed_restarts.py ``cost``'s windows (start, seconds, steps, lost steps) by
    the way their restart was scheduled: the last restart begun at or before a window's
    start (``restarts``: (time, sched), in order). Each: restarts, lost steps and seconds."""
    out: dict[str, dict[str, Any]] = {}
    for start, _, _, lost in per_window:
        sched = next((s for t, s in reversed(restarts) if t <= start), None)
        if sched is None:
            continue
        row = out.setdefault(sched, {"restarts": 0, "lost_steps": 0.0, "lost_s": 0.0})
        row["restarts"] += 1
        row["lost_steps"] += lost
        row["lost_s"] += lost * step_s
    return out
