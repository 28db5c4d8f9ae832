"""Whether the agent has a CPU cgroup of its own: on a saturated host that, not its nice
value, decides whether a ``fast`` agent answers probes in time.

Measured with bench/starved_host.py (5 namespaced hosts, one of them beside 300 runnable
threads on 2 cores, Linux 6.18, cgroup v1, 60 s windows): a ``fast`` agent in the threads'
cgroup left 72-100 dead events a minute (summed over its 4 peers) at nice 0 and still 4-8
at nice -10, -15 and -20, while in a cgroup of its own (the systemd unit's
``CPUWeight=1000``) it was never declared dead (0 in 60 s, 0 in 10 minutes). The kernel
shares CPU between cgroups first and between the threads of a cgroup second, so inside the
job's cgroup the agent is one thread among hundreds whatever its weight. The agent cannot
move itself (that needs root), so it says so at start (``check_cpu_cgroup``, called by the
daemon's entry point before its trio loop).

Rules:
- The CPU cgroup is read from ``/proc/<pid>/cgroup``: the cgroup-v1 line whose controller
  list has ``cpu``, else the cgroup-v2 line ``0::``; its directory is looked for under
  ``/sys/fs/cgroup`` (v1: ``cpu,cpuacct``, ``cpu``; v2: the unified tree).
- ``others`` counts the processes in that cgroup's ``cgroup.procs`` other than the agent
  and its own children (its event handlers), read once, up to ``MAX_COUNTED`` (whether the
  cgroup is shared is the question, not by how many: this bounds the reads at start).
- Anything unreadable (no cgroup file system, another OS, a container that hides it) is
  ``None``: the check says nothing rather than guess.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_COUNTED", "CpuCgroup", "check_cpu_cgroup", "cpu_cgroup"]

log = logging.getLogger("swim.agent")

MAX_COUNTED = 1000
"""Other processes counted at most (the root cgroup of a busy host lists thousands; each
costs a read of ``/proc/<pid>/stat``)."""


@dataclass(frozen=True, slots=True)
class CpuCgroup:
    path: str
    """The cgroup as ``/proc/<pid>/cgroup`` names it ("/" is the root: shared with
    everything systemd did not give a CPU cgroup of its own)."""
    others: int
    """Processes in it that are neither the agent nor its children (at most
    ``MAX_COUNTED``)."""


def _cgroup_dir(proc: Path, root: Path) -> tuple[str, Path] | None:
    try:
        lines = (proc / "cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = [ln.split(":", 2) for ln in lines if ln.count(":") >= 2]
    for _, controllers, path in v1:
        if "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct"):
                if (root / mount / "cgroup.procs").exists():
                    return path, root / mount / path.lstrip("/")
            return None
    for hier, controllers, path in v1:
        if hier == "0" and controllers == "":
            return path, root / path.lstrip("/")
    return None


def cpu_cgroup(pid: int, root: Path = Path("/sys/fs/cgroup")) -> CpuCgroup | None:
    """Process ``pid``'s CPU cgroup and how many other processes share it; None where it
    cannot be read."""
    found = _cgroup_dir(Path(f"/proc/{pid}"), root)
    if found is None:
        return None
    path, directory = found
    others = 0
    try:
        with (directory / "cgroup.procs").open() as procs:
            for line in procs:
                other = line.strip()
                if other.isdigit() and int(other) != pid and _parent(int(other)) != pid:
                    others += 1
                    if others >= MAX_COUNTED:
                        break
    except OSError:
        return None
    return CpuCgroup(path, others)


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def check_cpu_cgroup(profile: str) -> CpuCgroup | None:
    """Log, at the daemon's start, when it shares its CPU cgroup: a WARNING with ``fast``
    (that is what gets it declared dead on a saturated host), INFO otherwise."""
    found = cpu_cgroup(os.getpid())
    if found is None or found.others == 0:
        return found
    log.log(
        logging.WARNING if profile == "fast" else logging.INFO,
        "the agent shares its CPU cgroup %s with %s other process(es): where they keep the "
        "cores busy, a fast agent answers probes late and is declared dead, whatever its "
        "nice value; give it a cgroup of its own (the systemd unit's CPUWeight=; "
        'docs/runbook.md "CPU for the agent on a saturated host")',
        found.path,
        f"{found.others}+" if found.others >= MAX_COUNTED else found.others,
    )
    return found
