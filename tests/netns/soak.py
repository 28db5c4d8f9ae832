"""Soak: N namespaced agents under loss, a paused member, churn and real crashes at once.

    python -m tests.netns.soak --agents 32 --minutes 10 --loss 0.10   (root, repo root)

Roles (hosts numbered 1..N; n1 is everyone's join target and stays healthy):

- ``paused``: host N, SIGSTOPped for 1-3 s, then SIGCONTed for 1-3 s, over and over;
- ``churned``: the next ``--churned`` hosts below it: every 3-5 s one of them that is up
  is SIGKILLed and restarted with the same name, address and namespace 1-4 s later;
- ``crashed``: the next ``--crashes`` hosts: SIGKILLed once each (spread over the middle
  of the run) and left down, the real failures whose detection latency is measured;
- ``healthy``: the rest. A ``dead`` event about a healthy member, logged by anyone, is a
  false positive (must be 0); suspicions about them are counted and reported.

Every host drops each arriving packet with probability ``--loss`` (iptables statistic).
Every ``--sample-s`` the CPU (utime+stime from /proc/<pid>/stat) and RSS (VmRSS from
/proc/<pid>/status) of every agent process are sampled and printed (min/median/max over
agents); the RSS check compares each never-restarted agent's RSS at the end with its RSS
after the warm-up. Detection latency: crash -> first ``dead`` event about the crashed member
at each healthy observer (per observer: p50/p99/max) and at all of them ("everywhere").
After the run the churned members are brought up and the run waits (at most two push-pull
intervals) until every live agent sees exactly the live agents alive.

Everything is single-threaded: one loop runs the scheduled pauses, kills, restarts and
samples. The testbed (namespaces, agents) is removed at the end, also on errors or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.control import ControlError
from agent.procs import until
from swim import PROFILES, Config
from tests.netns import harness
from tests.netns.harness import MemberEvent, Testbed

CLK_TCK = os.sysconf("SC_CLK_TCK")
PUSH_PULL_S = {name: Config.profile(name).push_pull_interval_ms / 1000 for name in PROFILES}


@dataclass(frozen=True, slots=True)
class SoakPlan:
    agents: int = 8
    seconds: float = 75.0
    loss: float = 0.10
    profile: str = "lan"
    seed: int = 1
    churned: int = 2
    crashes: int = 1
    sample_s: float = 5.0
    warmup_s: float | None = None  # default: a quarter of the run, at most 120 s

    @property
    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s is not None else min(120.0, self.seconds / 4)

    def roles(self) -> dict[str, list[int]]:
        n = self.agents
        if n < self.churned + self.crashes + 4:
            raise ValueError(
                f"{n} agents are too few for {self.churned} churned, "
                f"{self.crashes} crashed, 1 paused and 3 healthy"
            )
        paused = [n]
        churned = list(range(n - 1, n - 1 - self.churned, -1))
        low = n - 1 - self.churned
        crashed = list(range(low, low - self.crashes, -1))
        taken = set(paused + churned + crashed)
        healthy = [i for i in range(1, n + 1) if i not in taken]
        return {"paused": paused, "churned": churned, "crashed": crashed, "healthy": healthy}


@dataclass(slots=True)
class Sample:
    at: float  # seconds since the faults started
    host: int
    pid: int
    cpu_ticks: int
    rss_kib: int


@dataclass(slots=True)
class SoakResult:
    plan: SoakPlan
    roles: dict[str, list[int]]
    false_dead: list[MemberEvent] = field(default_factory=list)
    healthy_suspect_events: int = 0
    paused_suspect_events: int = 0
    paused_dead_events: int = 0
    churned_dead_events: int = 0
    pauses: int = 0
    kills: int = 0
    restarts: int = 0
    crash_latency_s: dict[str, list[float]] = field(default_factory=dict)  # per observer
    undetected: list[str] = field(default_factory=list)  # "member@observer"
    settle_s: float | None = None
    final_views: dict[str, dict[str, str]] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    rss_growth: dict[str, float] = field(default_factory=dict)  # node -> end/warm-up ratio
    paused_incarnation: tuple[int, int] = (0, 0)  # (before, after) at n1

    def observer_latencies(self) -> list[float]:
        return sorted(x for lat in self.crash_latency_s.values() for x in lat)

    def everywhere_latencies(self) -> list[float]:
        return sorted(max(lat) for lat in self.crash_latency_s.values() if lat)

    def figures(self) -> dict[str, Any]:
        obs, every = self.observer_latencies(), self.everywhere_latencies()
        cpu = cpu_percent(self.samples)
        cpu_all = [c for _, _, c in cpu]
        rss = [s.rss_kib / 1024 for s in self.samples]
        return {
            "agents": self.plan.agents,
            "seconds": self.plan.seconds,
            "loss": self.plan.loss,
            "profile": self.plan.profile,
            "seed": self.plan.seed,
            "false_dead": len(self.false_dead),
            "healthy_suspect_events": self.healthy_suspect_events,
            "paused_suspect_events": self.paused_suspect_events,
            "paused_dead_events": self.paused_dead_events,
            "churned_dead_events": self.churned_dead_events,
            "pauses": self.pauses,
            "kills": self.kills,
            "restarts": self.restarts,
            "crashes": len(self.crash_latency_s),
            "undetected": len(self.undetected),
            "detect_p50_s": percentile(obs, 50),
            "detect_p99_s": percentile(obs, 99),
            "detect_max_s": max(obs, default=float("nan")),
            "dead_everywhere_max_s": max(every, default=float("nan")),
            "settle_s": self.settle_s if self.settle_s is not None else float("nan"),
            "cpu_pct_median": statistics.median(cpu_all) if cpu_all else float("nan"),
            "cpu_pct_max": max(cpu_all, default=float("nan")),
            "rss_mib_min": min(rss, default=float("nan")),
            "rss_mib_max": max(rss, default=float("nan")),
            "rss_growth_max": max(self.rss_growth.values(), default=float("nan")),
            **self.rss_slopes(),
            "paused_incarnation": "{}->{}".format(*self.paused_incarnation),
        }

    def rss_slopes(self) -> dict[str, float]:
        """RSS growth in MiB per hour of the never-restarted agents (healthy and paused),
        least squares over the samples after the warm-up, and over the second half of
        those alone: a leak keeps its slope in the second half, a plateau loses it."""
        keep = set(self.roles["healthy"]) | set(self.roles["paused"])
        start = self.plan.warmup
        middle = (start + self.plan.seconds) / 2
        whole: list[float] = []
        late: list[float] = []
        for host in sorted(keep):
            points = [(s.at, s.rss_kib / 1024) for s in self.samples if s.host == host]
            if len({s.pid for s in self.samples if s.host == host}) != 1:
                continue  # restarted: its RSS started over
            for since, into in ((start, whole), (middle, late)):
                xs = [at / 3600 for at, _ in points if at >= since]
                ys = [mib for at, mib in points if at >= since]
                if len(xs) >= 3 and len(set(xs)) > 1:
                    into.append(statistics.linear_regression(xs, ys).slope)
        nan = float("nan")
        return {
            "rss_slope_mib_per_h_median": statistics.median(whole) if whole else nan,
            "rss_slope_mib_per_h_max": max(whole, default=nan),
            "rss_slope_late_mib_per_h_median": statistics.median(late) if late else nan,
            "rss_slope_late_mib_per_h_max": max(late, default=nan),
        }


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile of sorted values (nan if none)."""
    if not values:
        return float("nan")
    rank = max(1, min(len(values), round(p / 100 * len(values) + 0.5)))
    return values[rank - 1]


def read_proc(pid: int) -> tuple[int, int] | None:
    """(utime+stime in clock ticks, VmRSS in KiB) of a process, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    ticks = int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
    rss = next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0
    )
    return ticks, rss


def cpu_percent(samples: list[Sample]) -> list[tuple[float, int, float]]:
    """(at, host, % of one core) between consecutive samples of the same process."""
    last: dict[int, Sample] = {}
    out = []
    for s in sorted(samples, key=lambda s: s.at):
        prev = last.get(s.host)
        if prev is not None and prev.pid == s.pid and s.at > prev.at:
            out.append(
                (s.at, s.host, 100 * (s.cpu_ticks - prev.cpu_ticks) / CLK_TCK / (s.at - prev.at))
            )
        last[s.host] = s
    return out


def views_agree(bed: Testbed, gone: set[str] | None = None) -> bool:
    """Every running agent sees every running agent alive, and no member of ``gone``
    (crashed for good) alive."""
    agents = bed.running()
    names = {a.name for a in agents}
    try:
        for a in agents:
            members = a.members()
            if {n for n, m in members.items() if m["status"] == "alive"} != names:
                return False
            if gone and any(members.get(g, {}).get("status") == "alive" for g in gone):
                return False
    except ControlError:
        return False
    return True


def safe_statuses(bed: Testbed) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for a in bed.running():
        try:
            out[a.name] = {n: m["status"] for n, m in a.members().items()}
        except ControlError as exc:
            out[a.name] = {"<error>": str(exc)}
    return out


def _sample(bed: Testbed, t0: float, into: list[Sample]) -> list[Sample]:
    now = time.time() - t0
    taken = []
    for h in bed.hosts:
        if h.agent is None or not h.agent.running():
            continue
        got = read_proc(h.agent.pid)
        if got is not None:
            taken.append(Sample(now, h.index, h.agent.pid, got[0], got[1]))
    into.extend(taken)
    return taken


def _print_sample(
    taken: list[Sample], cpu: list[tuple[float, int, float]], out: Callable[[str], None]
) -> None:
    if not taken:
        return
    rss = sorted(s.rss_kib / 1024 for s in taken)
    at = taken[0].at
    now_cpu = sorted(c for t, _, c in cpu if t == at)
    cpu_text = (
        f"cpu% min/med/max {now_cpu[0]:.1f}/{statistics.median(now_cpu):.1f}/{now_cpu[-1]:.1f}"
        if now_cpu
        else "cpu% -"
    )
    out(
        f"SOAK-SAMPLE t={at:6.1f}s agents={len(taken)} {cpu_text} "
        f"rss MiB min/med/max {rss[0]:.1f}/{statistics.median(rss):.1f}/{rss[-1]:.1f}"
    )


def run_soak(
    bed: Testbed,
    plan: SoakPlan,
    out: Callable[[str], None] = print,
    gate: contextlib.AbstractContextManager[Any] | None = None,
) -> SoakResult:
    """Run the plan on a testbed that is up (``plan.agents`` hosts, no agents yet); the
    agents start and converge inside ``gate`` if given (tests/together.py: one bring-up
    at a time)."""
    rng = random.Random(plan.seed)
    roles = plan.roles()
    res = SoakResult(plan, roles)
    node = {h.index: h.node for h in bed.hosts}
    healthy = {node[i] for i in roles["healthy"]}
    paused, churned = roles["paused"][0], roles["churned"]
    out(
        f"soak: {plan}; roles " + ", ".join(f"{k}={[node[i] for i in v]}" for k, v in roles.items())
    )

    with gate if gate is not None else contextlib.nullcontext():
        bed.start_agents(plan.profile)
        took = until(
            lambda: views_agree(bed), 60 + plan.agents, "the agents to converge", poll_s=0.5
        )
    out(f"soak: {plan.agents} agents converged after {took:.1f}s")
    inc_before = int(bed.agent(1).members()[node[paused]]["incarnation"])
    bed.host_loss(plan.loss)
    t0 = time.time()
    end = t0 + plan.seconds

    # the schedule: next time each activity is due
    stopped = False
    next_pause = t0 + rng.uniform(1, 3)
    next_churn = t0 + rng.uniform(3, 5)
    restart_due: dict[int, float] = {}
    span = max(1, plan.crashes - 1)
    crash_due = {
        host: t0 + plan.seconds * (0.25 + 0.35 * j / span if plan.crashes > 1 else 0.35)
        for j, host in enumerate(roles["crashed"])
    }
    crashed_at: dict[int, float] = {}
    next_sample = t0
    warm_rss: dict[int, int] = {}
    try:
        while True:
            now = time.time()
            if now >= end:
                break
            if now >= next_pause:
                os.kill(bed.agent(paused).pid, signal.SIGCONT if stopped else signal.SIGSTOP)
                stopped = not stopped
                res.pauses += stopped
                next_pause = now + rng.uniform(1, 3)
            if now >= next_churn:
                up = [i for i in churned if i not in restart_due]
                if up:
                    victim = rng.choice(up)
                    bed.kill(victim)
                    res.kills += 1
                    restart_due[victim] = time.time() + rng.uniform(1, 4)
                next_churn = now + rng.uniform(3, 5)
            for host, due in list(restart_due.items()):
                if now >= due:
                    bed.start_agent(host, plan.profile)
                    res.restarts += 1
                    del restart_due[host]
            for host, due in list(crash_due.items()):
                if now >= due:
                    crashed_at[host] = bed.kill(host)
                    out(f"soak: crashed {node[host]} at t={crashed_at[host] - t0:.1f}s")
                    del crash_due[host]
            if now >= next_sample:
                taken = _sample(bed, t0, res.samples)
                _print_sample(taken, cpu_percent(res.samples), out)
                if not warm_rss and now - t0 >= plan.warmup:
                    warm_rss = {s.host: s.rss_kib for s in taken}
                next_sample += plan.sample_s
            dead = [
                h.node
                for h in bed.hosts
                if h.agent is not None
                and h.index not in crashed_at
                and h.index not in restart_due
                and not h.agent.running()
            ]
            if dead:
                raise AssertionError(f"agent(s) exited on their own: {dead}")
            due_times = [
                end,
                next_pause,
                next_churn,
                next_sample,
                *restart_due.values(),
                *crash_due.values(),
            ]
            time.sleep(max(0.0, min(min(due_times) - time.time(), 0.5)))
    finally:
        if stopped:
            os.kill(bed.agent(paused).pid, signal.SIGCONT)
    final = _sample(bed, t0, res.samples)
    _print_sample(final, cpu_percent(res.samples), out)
    keep = set(roles["healthy"]) | {paused}
    for s in final:
        if s.host in keep and s.host in warm_rss:
            res.rss_growth[node[s.host]] = s.rss_kib / warm_rss[s.host]

    # bring the churned members back and wait for one membership everywhere
    for host in list(restart_due):
        bed.start_agent(host, plan.profile)
        res.restarts += 1
    for host in churned:
        bed.agent(host).wait_ready()
    gone = {node[i] for i in crashed_at}
    bound = 2 * PUSH_PULL_S[plan.profile]
    with contextlib.suppress(TimeoutError):  # settle_s stays None: reported, not raised
        res.settle_s = until(lambda: views_agree(bed, gone), bound, "one view", poll_s=0.5)
    res.final_views = safe_statuses(bed)

    events = bed.events(since=t0)
    res.false_dead = [e for e in events if e.kind == "dead" and e.member in healthy]
    res.healthy_suspect_events = sum(e.kind == "suspect" and e.member in healthy for e in events)
    res.paused_suspect_events = sum(
        e.kind == "suspect" and e.member == node[paused] for e in events
    )
    res.paused_dead_events = sum(e.kind == "dead" and e.member == node[paused] for e in events)
    churned_names = {node[i] for i in churned}
    res.churned_dead_events = sum(e.kind == "dead" and e.member in churned_names for e in events)
    for host, at in crashed_at.items():
        lat = []
        for o in sorted(healthy):
            first = next(
                (
                    e.at
                    for e in events
                    if e.kind == "dead"
                    and e.member == node[host]
                    and e.observer == o
                    and e.at >= at
                ),
                None,
            )
            if first is None:
                res.undetected.append(f"{node[host]}@{o}")
            else:
                lat.append(first - at)
        res.crash_latency_s[node[host]] = lat
    res.paused_incarnation = (inc_before, int(bed.agent(1).members()[node[paused]]["incarnation"]))
    return res


def check(res: SoakResult, rss_limit: float = 1.10) -> list[str]:
    """What is wrong with a soak result (empty: nothing)."""
    problems = []
    if res.false_dead:
        problems.append(f"healthy members declared dead: {res.false_dead}")
    if res.undetected:
        problems.append(f"crashes not detected: {res.undetected}")
    if res.settle_s is None:
        problems.append(f"no single membership after the run: {res.final_views}")
    grown = {n: round(r, 3) for n, r in res.rss_growth.items() if r > rss_limit}
    if grown:
        problems.append(f"RSS grew more than {rss_limit - 1:.0%} after the warm-up: {grown}")
    return problems


def format_figures(figures: dict[str, Any]) -> str:
    return " ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.netns.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--loss", type=float, default=0.10)
    parser.add_argument("--profile", default="lan", choices=sorted(PUSH_PULL_S))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--churned", type=int, default=3)
    parser.add_argument("--crashes", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--workdir", type=Path, help="agent logs (default: a new temp dir)")
    parser.add_argument("--json", type=Path, help="append the figures as one JSON line")
    args = parser.parse_args(argv)
    reason = harness.unavailable_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    plan = SoakPlan(
        args.agents,
        args.minutes * 60,
        args.loss,
        args.profile,
        args.seed,
        args.churned,
        args.crashes,
        args.sample_s,
    )
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="swim-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    with Testbed(plan.agents, workdir) as bed:
        res = run_soak(bed, plan)
    figures = res.figures()
    print(f"SOAK-RESULT {format_figures(figures)}")
    print(
        f"SOAK-RESULT rss_growth {json.dumps({k: round(v, 3) for k, v in res.rss_growth.items()})}"
    )
    print(
        f"SOAK-RESULT crash_latency_s "
        f"{json.dumps({k: [round(x, 2) for x in v] for k, v in res.crash_latency_s.items()})}"
    )
    if args.json:
        with args.json.open("a") as fh:
            fh.write(json.dumps({"scenario": "soak", "at": time.time(), **figures}) + "\n")
    problems = check(res)
    for p in problems:
        print(f"SOAK-PROBLEM {p}")
    print(f"logs in {workdir}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
