"""A slow member (Lifeguard's case), churn, and a short soak, on namespaced agents.

- ``test_slow_member_stop_cont``: one agent SIGSTOPped for 1-3 s, then resumed for 1-3 s
  (seeded random), for ``SWIM_NETNS_SLOW_S`` (default 40 s).
- ``test_slow_member_cpu_starved``: one agent in a CPU cgroup with a tiny quota
  (cgroup v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``, or v2 ``cpu.max``: 2 ms of CPU per
  1 s period, a third of what an idle agent needs, so it stalls for most of each second);
  where no CPU cgroup can be created, a SIGSTOP duty cycle (100-400 ms stopped out of each
  500 ms) instead. The report says which was used.
  Both: no healthy member may be declared dead by anyone; suspicions about healthy
  members are counted and reported; once the slow one runs normally again it must be
  alive everywhere, with a higher incarnation if it was suspected (it refuted).
- ``test_churn``: every 3-5 s a random member of {n4, n5, n6} is SIGKILLed and restarted
  with the same name 0-8 s later (so some are declared dead first, some not), for
  ``SWIM_NETNS_CHURN_S`` (default 60 s); afterwards, within two push-pull intervals, every
  live member sees exactly the live members alive.
  n1-n3 are never declared dead.
- ``test_soak_short``: ``tests.netns.soak`` with 8 agents for ``SWIM_NETNS_SOAK_S``
  (default 60 s) under 10% loss (the full one: ``python -m tests.netns.soak``).

The four scenarios of the selected tests run at the same time, each on its own testbed
(tests/together.py): agents are brought up one testbed at a time, then the windows overlap,
so the module takes about as long as its longest scenario plus the bring-ups. Each keeps
its hosts, windows, schedule and assertions; what runs beside it is the other testbeds'
agents (the churned restarts and the soak's loss included, so a slow member's window now
also sees the CPU bursts of other agents starting). Each test passes or fails on its own.

Profile ``lan`` throughout (``local`` declares live members dead under stress; see
RELIABILITY.md). ``SWIM_NETNS_SEED`` (default 1) seeds every random schedule. Each test
prints a ``NETNS-RESULT`` line (``-s``). Namespaces, agents and cgroups are removed also
when a test fails.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.procs import until
from tests.netns import harness, soak
from tests.netns.harness import Testbed
from tests.netns.test_faults import report
from tests.together import Scenario, Together, run_together

pytestmark = pytest.mark.slow

PROFILE = "lan"
PUSH_PULL_S = 30.0  # Config.lan push_pull_interval_ms
SEED = int(os.environ.get("SWIM_NETNS_SEED", "1"))
SLOW_S = float(os.environ.get("SWIM_NETNS_SLOW_S", "40"))
STARVED_S = float(os.environ.get("SWIM_NETNS_STARVED_S", "30"))
CHURN_S = float(os.environ.get("SWIM_NETNS_CHURN_S", "60"))
SOAK_S = float(os.environ.get("SWIM_NETNS_SOAK_S", "60"))
QUOTA_US, PERIOD_US = 2_000, 1_000_000


# --- CPU cgroup ---------------------------------------------------------------------------


def _cpu_cgroup_root() -> tuple[Path, bool] | None:
    """(directory to create a child cgroup in, is cgroup v2) or None if there is none."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    with contextlib.suppress(OSError):
        if v2.exists() and "cpu" in v2.read_text().split():
            return v2.parent, True
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
        return v1, False
    return None


@contextlib.contextmanager
def cpu_quota(pid: int, quota_us: int, period_us: int) -> Iterator[Callable[[], dict[str, int]]]:
    """Run ``pid`` in a new CPU cgroup limited to quota_us per period_us; yields a reader
    of that cgroup's cpu.stat. The process is moved back and the cgroup removed on exit.
    Raises OSError if the cgroup cannot be set up (nothing is left behind then)."""
    found = _cpu_cgroup_root()
    if found is None:
        raise OSError("no writable CPU cgroup controller")
    root, v2 = found
    child = root / f"{harness.PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    child.mkdir()
    try:
        if v2:
            (child / "cpu.max").write_text(f"{quota_us} {period_us}")
        else:
            (child / "cpu.cfs_period_us").write_text(str(period_us))
            (child / "cpu.cfs_quota_us").write_text(str(quota_us))
        (child / "cgroup.procs").write_text(str(pid))

        def stat() -> dict[str, int]:
            lines = (child / "cpu.stat").read_text().split("\n")
            return {k: int(v) for k, v in (ln.split() for ln in lines if ln.strip())}

        yield stat
    finally:
        for p in (child / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(p)

        def removed() -> bool:  # the kernel frees it a moment after its last process left
            child.rmdir()
            return True

        until(removed, 5, f"rmdir {child}", poll_s=0.1, ignore=(OSError,))


# --- slow member --------------------------------------------------------------------------


def _stop_cont(
    pid: int,
    seconds: float,
    stopped_s: tuple[float, float],
    running_s: tuple[float, float],
    rng: random.Random,
) -> int:
    """SIGSTOP/SIGCONT pid in cycles for ``seconds``; leaves it running; returns #stops."""
    end = time.monotonic() + seconds
    stops = 0
    try:
        while time.monotonic() < end:
            os.kill(pid, signal.SIGSTOP)
            stops += 1
            time.sleep(rng.uniform(*stopped_s))
            os.kill(pid, signal.SIGCONT)
            time.sleep(rng.uniform(*running_s))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return stops


def _slow_verdict(
    bed: Testbed, slow: int, start: float, inc_before: int, scenario: str, **figures: object
) -> None:
    """Wait until the slow member runs normally again, then check and report."""
    slow_name = bed.host(slow).node
    recovered_at = time.time()
    recover_s = until(
        bed.converged, 30, f"{slow_name} alive everywhere after the slowness", poll_s=0.2
    )
    time.sleep(2)  # still alive a moment later
    stable = bed.converged()
    events = bed.events(since=start)
    healthy = {h.node for h in bed.hosts if h.index != slow}
    false_dead = [e for e in events if e.kind == "dead" and e.member in healthy]
    sus_healthy = [e for e in events if e.kind == "suspect" and e.member in healthy]
    sus_slow = [e for e in events if e.kind == "suspect" and e.member == slow_name]
    dead_slow = [e for e in events if e.kind == "dead" and e.member == slow_name]
    late_dead = [e for e in events if e.kind == "dead" and e.at > recovered_at + recover_s]
    peers = [h.index for h in bed.hosts if h.index != slow]
    incs = {bed.host(o).node: bed.agent(o).members()[slow_name]["incarnation"] for o in peers}
    own_inc = bed.agent(slow).info()["incarnation"]
    report(
        scenario,
        profile=PROFILE,
        hosts=len(bed.hosts),
        **figures,
        suspect_events_healthy=len(sus_healthy),
        suspect_events_healthy_by_slow=sum(e.observer == slow_name for e in sus_healthy),
        false_dead=len(false_dead),
        suspect_events_slow=len(sus_slow),
        dead_events_slow=len(dead_slow),
        recover_alive_everywhere_s=recover_s,
        incarnation_slow=f"{inc_before}->{min(incs.values())}..{max(incs.values())}",
        own_incarnation=own_inc,
    )
    assert not false_dead, f"healthy members declared dead: {false_dead}"
    assert stable and not late_dead, f"not stable after recovery: {bed.statuses()} {late_dead}"
    if sus_slow or dead_slow:
        assert all(i > inc_before for i in incs.values()), f"not refuted: {inc_before} {incs}"


def _bring_up(make: harness.Testbeds, gate: threading.Lock, k: int) -> Testbed:
    """k hosts running ``lan`` agents, converged; inside ``gate`` (tests/together.py)."""
    with gate:
        bed = make(k)
        bed.start_agents(PROFILE)
        bed.wait_converged(30)
    return bed


def stop_cont_scenario(workdir: Path, gate: threading.Lock) -> None:
    """``test_slow_member_stop_cont``."""
    with harness.testbeds(workdir) as make:
        _stop_cont_window(_bring_up(make, gate, 5))


def _stop_cont_window(bed: Testbed) -> None:
    slow = 5
    inc_before = bed.agent(1).members()[f"n{slow}"]["incarnation"]
    start = time.time()
    stops = _stop_cont(bed.agent(slow).pid, SLOW_S, (1, 3), (1, 3), random.Random(SEED))
    _slow_verdict(bed, slow, start, inc_before, "slow-stop-cont", window_s=SLOW_S, stops=stops)


def cpu_starved_scenario(workdir: Path, gate: threading.Lock) -> None:
    """``test_slow_member_cpu_starved``."""
    with harness.testbeds(workdir) as make:
        _cpu_starved_window(_bring_up(make, gate, 5))


def _cpu_starved_window(bed: Testbed) -> None:
    slow = 5
    inc_before = bed.agent(1).members()[f"n{slow}"]["incarnation"]
    pid = bed.agent(slow).pid
    start = time.time()
    figures: dict[str, object] = {"window_s": STARVED_S}
    try:
        with cpu_quota(pid, QUOTA_US, PERIOD_US) as cpu_stat:
            figures["method"] = f"cgroup-quota-{QUOTA_US}us-per-{PERIOD_US}us"
            time.sleep(STARVED_S)
            st = cpu_stat()
            figures["periods"] = st.get("nr_periods", -1)
            figures["throttled"] = st.get("nr_throttled", -1)
            throttled_us = st.get("throttled_usec", st.get("throttled_time", 0) // 1000)
            figures["throttled_s"] = throttled_us / 1e6
    except OSError as exc:  # no usable CPU cgroup: a SIGSTOP duty cycle instead
        figures["method"] = f"sigstop-duty-cycle ({exc})".replace(" ", "_")
        figures["stops"] = _stop_cont(pid, STARVED_S, (0.1, 0.4), (0.1, 0.1), random.Random(SEED))
    _slow_verdict(bed, slow, start, inc_before, "slow-cpu-starved", **figures)


# --- churn --------------------------------------------------------------------------------


def churn_scenario(workdir: Path, gate: threading.Lock) -> None:
    """``test_churn``."""
    with harness.testbeds(workdir) as make:
        _churn(_bring_up(make, gate, 6))


def _churn(bed: Testbed) -> None:
    k, churned = len(bed.hosts), [4, 5, 6]
    rng = random.Random(SEED)
    start = time.time()
    end = start + CHURN_S
    down: dict[int, float] = {}  # host -> restart due
    kills = restarts = 0
    next_kill = start + rng.uniform(3, 5)
    while time.time() < end:
        now = time.time()
        if now >= next_kill:
            up = [i for i in churned if i not in down]
            if up:
                victim = rng.choice(up)
                bed.kill(victim)
                kills += 1
                down[victim] = time.time() + rng.uniform(0, 8)
            next_kill = now + rng.uniform(3, 5)
        for host, due in list(down.items()):
            if now >= due:
                bed.start_agent(host, PROFILE)
                restarts += 1
                del down[host]
        exited = [
            h.node
            for h in bed.hosts
            if h.agent is not None and h.index not in down and not h.agent.running()
        ]
        assert not exited, f"agent(s) exited on their own: {exited}"
        time.sleep(0.1)
    for host in list(down):
        bed.start_agent(host, PROFILE)
        restarts += 1
    for host in churned:
        bed.agent(host).wait_ready()
    stopped_at = time.time()
    settle_s = until(
        lambda: soak.views_agree(bed), 2 * PUSH_PULL_S, "one complete view", poll_s=0.2
    )
    time.sleep(2)
    stable = soak.views_agree(bed)
    events = bed.events(since=start)
    healthy = {f"n{i}" for i in range(1, k + 1) if i not in churned}
    false_dead = [e for e in events if e.kind == "dead" and e.member in healthy]
    churned_dead = [e for e in events if e.kind == "dead" and e.member not in healthy]
    late_dead = [e for e in events if e.kind == "dead" and e.at > stopped_at + settle_s]
    incs = {n: m["incarnation"] for n, m in bed.agent(1).members().items()}
    report(
        "churn",
        profile=PROFILE,
        hosts=k,
        churned="n4,n5,n6",
        window_s=CHURN_S,
        kills=kills,
        restarts=restarts,
        dead_events_churned=len(churned_dead),
        suspect_events_healthy=sum(e.kind == "suspect" and e.member in healthy for e in events),
        false_dead=len(false_dead),
        settle_s=settle_s,
        bound_s=2 * PUSH_PULL_S,
        incarnations_at_n1=",".join(f"{n}:{i}" for n, i in sorted(incs.items())),
    )
    assert not false_dead, f"never-churned members declared dead: {false_dead}"
    assert stable and not late_dead, f"views diverged again: {soak.safe_statuses(bed)}"


# --- soak (short) -------------------------------------------------------------------------


def soak_scenario(workdir: Path, gate: threading.Lock) -> None:
    """``test_soak_short``."""
    plan = soak.SoakPlan(
        agents=8,
        seconds=SOAK_S,
        loss=0.10,
        profile=PROFILE,
        seed=SEED,
        churned=2,
        crashes=1,
        sample_s=5.0,
    )
    with harness.testbeds(workdir) as make:
        bed = make(plan.agents)
        res = soak.run_soak(bed, plan, out=lambda line: print(line, flush=True), gate=gate)
    report("soak-short", **res.figures())
    problems = soak.check(res)
    assert not problems, "; ".join(problems)


# --- the tests: each re-raises its own scenario's failure (tests/together.py) -------------

SCENARIOS: dict[str, Scenario] = {  # longest first: they set the module's wall time
    "test_churn": churn_scenario,
    "test_soak_short": soak_scenario,
    "test_slow_member_stop_cont": stop_cont_scenario,
    "test_slow_member_cpu_starved": cpu_starved_scenario,
}


@pytest.fixture(scope="module")
def together(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Together:
    return run_together(request, SCENARIOS, tmp_path_factory.mktemp("slow_churn"))


def test_slow_member_stop_cont(together: Together, request: pytest.FixtureRequest) -> None:
    """n5 of 5 SIGSTOPped 1-3 s, resumed 1-3 s, for ``SLOW_S``: nobody healthy declared
    dead, then n5 alive everywhere (refuted if suspected) and still so 2 s later."""
    together.check(request)


def test_slow_member_cpu_starved(together: Together, request: pytest.FixtureRequest) -> None:
    """n5 of 5 in a CPU cgroup of 2 ms per second for ``STARVED_S`` (a SIGSTOP duty cycle
    without cgroups): the same verdict as the stop/cont test."""
    together.check(request)


def test_churn(together: Together, request: pytest.FixtureRequest) -> None:
    """n4-n6 SIGKILLed and restarted for ``CHURN_S``: n1-n3 never dead, one complete view
    within two push-pull intervals after the last restart, still so 2 s later."""
    together.check(request)


def test_soak_short(together: Together, request: pytest.FixtureRequest) -> None:
    """8 agents, 10 % loss, a paused, two churned and one crashed member for ``SOAK_S``:
    no healthy member dead, the crash detected everywhere, one view after, RSS bounded."""
    together.check(request)
