"""Step efficiency under mixed node faults with hot spares: the fraction of failure-free
throughput a job keeps when one node a minute loses power, is SIGKILLed, SIGSTOPped or
slowed, and a spare takes its place.

    python -m bench.mixed_efficiency [--minutes 60] [--every-s 60] [--baseline-s 120]
                                     [--spares 1] [--faults power,kill,stop,slow]

3 training nodes × 2 ranks + ``--spares`` spare nodes (examples/elastic_ddp.py, profile
``fast``, ``--target-nodes 3``, slow policy ``replace``), every node's agent and trainers in
a network namespace of its own (tests/netns/training.py), so that a power loss is real: the
survivors see silence, no reset. The job first trains failure-free for ``--baseline-s``,
then for ``--minutes`` one fault every ``--every-s`` seconds, kinds and victims rotating
(bench/mixed_results.py ``schedule``: every slot of the group, the leader's included):

- ``power``: every packet in and out of the victim's link dropped (the rules of
  examples/job.py's ``power`` fault, committed at once), then its processes SIGKILLed;
  once the job trains at full size without it, the rules are flushed;
- ``kill``: the victim's processes SIGKILLed;
- ``stop``: the victim's processes SIGSTOPped; SIGKILLed once the job goes on without it;
- ``slow``: the victim's steps slowed ``--slow-factor`` times (examples/job.py's
  ``--slow-file``: an injected delay inside the step, not a CPU quota: bench/slow_nodes.py
  says why); the replace policy swaps the spare in and the node's trainers leave; then the
  slowdown is lifted and its agent SIGKILLed.

Then the victim is restarted (same name, same address, as a rebooted host) as a spare.
A rebooting host has CPUs of its own, but here every node shares 2 cores, and any CPU work
slows the training nodes whatever its priority (a start's imports and model build: ~6.5
CPU-seconds, 10-20 % slower steps for its 4-5 s), a cost of this test machine and not of
the recovery. So its processes start ``--restart-sched``'s way (bench/restart_sched.py):
``fork`` (the default) forks its agent and trainers as ``SCHED_IDLE`` from processes that
imported their modules before the baseline (bench/forkserver.py), ``idle`` and ``nice``
start them afresh as ``SCHED_IDLE`` or at ``--restart-nice``; each is set back to normal
once it waits as a spare. The result notes what the restarts still cost
(bench/mixed_restarts.py, from each restart to its spare's first wait), per way.
A fault waits until the job trains at full size with every spare back (the delay is
recorded, as bench/step_efficiency.py does). Step logs are read incrementally (an hour
of steps is too much to reread on every poll); only local rank 0's records are kept.

Every process is stopped by pid and every namespace removed on the way out (``NsTraining``
and the testbed); the rules of a power loss live in the victim's namespace and go with it.
The result file goes under results/ (``--results DIR``, ``--no-results``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agent.control import ControlClient, ControlError
from agent.procs import until
from agent.training_nodes import Launch, Placement, TrainingNode
from bench import mixed_restarts, mixed_results, restart_sched
from bench import results as result_files
from bench.clusters import agent_port
from bench.step_efficiency import load
from tests.netns.training import IFACE, NsTraining

SCRIPT = "examples/elastic_ddp.py"
JOB = "mixed"
ORPHAN_CHECK_S = 60.0
"""While waiting for full size + spare, how often nodes that left on their own are looked
for (a false slow flag under ``replace`` takes a node out without a fault)."""
OUT_TIMEOUT_S = 90.0
"""How long a fault waits for the job to train at full size without the victim before the
victim is restarted anyway (and the fault recorded as not recovered)."""
KEPT = ("t", "step", "rank", "world", "node", "pid", "formations", "leader")
POWER_CUT = f"*filter\n-I INPUT 1 -i {IFACE} -j DROP\n-I OUTPUT 1 -o {IFACE} -j DROP\nCOMMIT\n"
"""examples/job.py ``power_cut_rules`` (not imported: that module imports torch)."""


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Logs:
    """Step logs read incrementally: each file's offset, its last step record, and every
    local rank 0 step record (``KEPT`` keys only)."""

    def __init__(self) -> None:
        self.offsets: dict[Path, int] = {}
        self.last: dict[Path, dict[str, Any]] = {}
        self.kept: list[dict[str, Any]] = []

    def read(self, node: TrainingNode) -> None:
        for lr in range(node.ranks):
            path = node.steps_path(lr)
            with contextlib.suppress(FileNotFoundError), path.open("rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
                end = data.rfind(b"\n") + 1  # a torn last line waits for the next read
                self.offsets[path] = self.offsets.get(path, 0) + end
                for line in data[:end].splitlines():
                    with contextlib.suppress(ValueError):
                        rec = json.loads(line)
                        if "loss" in rec:
                            slim = {k: rec.get(k) for k in KEPT}
                            self.last[path] = slim
                            if lr == 0:
                                self.kept.append(slim)


class Mixed:
    """The nodes, their namespaces and the faults; always ``close()``."""

    def __init__(self, args: argparse.Namespace, work: Path, run_s: float) -> None:
        self.args = args
        self.work = work
        self.nodes, self.ranks = 3, 2
        self.full_world = self.nodes * self.ranks
        self.deadline = time.monotonic() + run_s
        self.logs = Logs()
        self.incarnations = 0
        self.all: list[TrainingNode] = []
        self.niced: list[TrainingNode] = []
        self.scheds = restart_sched.parse(args.restart_sched)
        self.restarted: list[tuple[float, str]] = []
        """(time, sched) of each restart, for ``restart_sched.split``."""
        self.unplanned: list[dict[str, Any]] = []
        self.forks = restart_sched.Forks(self.scheds, work)
        self.ns = NsTraining(self.nodes + args.spares, work, "fast", self.ranks)
        self.live = {n.name: n for n in self.ns.nodes}
        self.host = {n.name: self.ns.index(n) for n in self.ns.nodes}
        try:
            for i, n in enumerate(self.ns.nodes):
                self._start(n, spare=i >= self.nodes)
        except BaseException:
            self.close()
            raise

    def slow_file(self, name: str) -> Path:
        return self.work / f"slow-{name}"

    def _start(self, node: TrainingNode, *, spare: bool, launch: Launch | None = None) -> None:
        a = self.args
        left = max(self.deadline - time.monotonic(), 60)
        node.start_trainers(
            SCRIPT,
            *("--job", JOB, "--steps", "100000000", "--step-sleep", str(a.step_sleep)),
            *("--step-work", str(a.step_work), "--pg-timeout", "60", "--min-nodes", "2"),
            *("--target-nodes", str(self.nodes), "--slow-policy", "replace"),
            *("--slow-file", str(self.slow_file(node.name)), *(["--spare"] if spare else [])),
            timeout_s=left + 120,
            launch=launch,
        )

    def close(self) -> None:
        try:
            for n in self.all:
                n.stop()
        finally:
            self.ns.close()  # the first nodes by pid, then the namespaces
            self.forks.close()

    def view(self) -> list[dict[str, Any]]:
        """The job's view from the first live agent that answers (empty if none does)."""
        for n in self.live.values():
            with contextlib.suppress(ControlError, OSError):
                got = ControlClient(n.control, timeout_s=2).request("view", job=JOB)
                return list(got["members"])
        return []

    def roles(self) -> tuple[list[str], list[str]]:
        """(training, spare) node names, alive in the view."""
        members = [m for m in self.view() if m.get("status") == "alive"]
        return (
            [m["name"] for m in members if m.get("role", "training") == "training"],
            [m["name"] for m in members if m.get("role") == "spare"],
        )

    def ready(self, after: float) -> bool:
        """Full size with every spare back: ``nodes`` training nodes whose every local
        rank last logged a step after ``after`` at the full world, and ``spares`` spares."""
        training, spares = self.roles()
        if len(training) != self.nodes or len(spares) < self.args.spares:
            return False
        for name in training:
            node = self.live.get(name)
            if node is None:
                return False
            self.logs.read(node)
            for lr in range(self.ranks):
                last = self.logs.last.get(node.steps_path(lr))
                if last is None or last["world"] != self.full_world or last["t"] <= after:
                    return False
        return True

    def order(self, training: list[str]) -> list[str]:
        """The training nodes in global rank order (the leader first)."""

        def rank(name: str) -> int:
            last = self.logs.last.get(self.live[name].steps_path(0))
            return int(last["rank"]) if last else 1_000

        return sorted(training, key=rank)

    def inject(self, kind: str, victim: str) -> float:
        """Start the fault; its wall time."""
        node = self.live[victim]
        if kind == "power":
            ns = self.ns.bed.host(self.host[victim]).ns
            subprocess.run(
                ["ip", "netns", "exec", ns, "iptables-restore", "-w", "5", "--noflush"],
                input=POWER_CUT,
                text=True,
                capture_output=True,
                timeout=10,
                check=True,
            )
            t = time.time()
            node.stop()
            return t
        t = time.time()
        if kind == "kill":
            node.stop()
        elif kind == "stop":
            node.signal_all(signal.SIGSTOP)
        elif kind == "slow":
            tmp = self.slow_file(victim).with_suffix(".tmp")
            tmp.write_text(f"{self.args.slow_factor}\n")
            tmp.rename(self.slow_file(victim))  # atomic: a trainer reads all or nothing
        else:
            raise ValueError(f"unknown fault {kind!r}")
        return t

    def out(self, spares: list[str], t: float) -> bool:
        """A node that was a spare at the fault trains at the full world since."""
        for name in spares:
            node = self.live.get(name)
            if node is None:
                continue
            self.logs.read(node)
            last = self.logs.last.get(node.steps_path(0))
            if last is not None and last["t"] > t and last["world"] == self.full_world:
                return True
        return False

    def restart(self, kind: str, victim: str) -> int | None:
        """The victim gone for good, its fault lifted, and a new incarnation started as a
        spare in its namespace; the packets its power cut dropped (power only)."""
        old = self.live[victim]
        old.stop()  # SIGKILL: a stopped or excluded node too
        self.logs.read(old)
        self.slow_file(victim).unlink(missing_ok=True)
        dropped = None
        i = self.host[victim]
        if kind == "power":
            dropped = sum(
                r.packets
                for chain in ("INPUT", "OUTPUT")
                for r in self.ns.bed.counters(i, chain)
                if r.target == "DROP"
            )
            self.ns.bed.heal([i])
        self.incarnations += 1
        seed = next(n for name, n in self.live.items() if name != victim)
        work = self.work / f"{victim}.{self.incarnations}"
        work.mkdir()
        place = self.ns.placement(i)
        sched = self.scheds[len(self.restarted) % len(self.scheds)]
        self.restarted.append((time.time(), sched))
        prefix = restart_sched.wrap(sched, self.args.restart_nice)  # the module docstring
        place = Placement((*prefix, *place.wrap), place.host, place.env)
        how = functools.partial(
            TrainingNode, place=place, join_host=seed.host, launch=self.forks.agent(sched)
        )
        with agent_port(old.port):
            node = how(victim, work, seed.port, "fast", self.ranks)
        self.all.append(node)
        try:
            node.wait_ready()
        except RuntimeError:  # the old port not free after all: a new one
            node.stop()
            (work / "again").mkdir()
            node = how(victim, work / "again", seed.port, "fast", self.ranks)
            self.all.append(node)
            node.wait_ready()
        self.live[victim] = node
        self._start(node, spare=True, launch=self.forks.trainers(sched))
        self.niced.append(node)
        return dropped

    def orphans(self) -> list[str]:
        """Live nodes outside the job's view whose trainers have all exited."""
        training, spares = self.roles()
        if not training:  # no agent answered: no verdict on anyone
            return []
        return [
            name
            for name, n in self.live.items()
            if name not in training and name not in spares and n.trainers_done()
        ]

    def unnice(self) -> None:
        """Every restarted node back to normal scheduling (``restart_sched.restore``)."""
        for node in self.niced:
            restart_sched.restore(node.pgid)  # a node already gone has no thread left
        self.niced.clear()

    def records(self) -> list[dict[str, Any]]:
        for n in [*self.ns.nodes, *self.all]:
            self.logs.read(n)
        return self.logs.kept


def faults(mixed: Mixed, kinds: tuple[str, ...], start: float, end: float) -> list[dict[str, Any]]:
    """One fault every ``--every-s`` from ``start`` until ``end`` (mixed_results.schedule),
    each once the job is at full size with its spares."""
    done: list[dict[str, Any]] = []
    slot, after = start, start - 1
    while slot < end - 1:
        _sleep_until(slot)
        _wait_ready(mixed, after, end)
        mixed.unnice()  # a spare now: it trains at full priority once drafted
        if time.time() >= end - 1:
            break
        training, spares = mixed.roles()
        if len(training) != mixed.nodes:
            break  # the job never came back: no fault on top (recorded by the caller)
        order = mixed.order(training)
        kind, victim = mixed_results.schedule(len(done), kinds, order)
        t = mixed.inject(kind, victim)
        fault: dict[str, Any] = {
            "kind": kind,
            "victim": victim,
            "leader": victim == order[0],
            "t": t,
            "waited_s": t - slot,
            "spares": spares,
        }
        try:
            fault["out_s"] = until(
                functools.partial(mixed.out, spares, t), OUT_TIMEOUT_S, "spare drafted", poll_s=0.1
            )
        except TimeoutError:
            fault["out_s"] = None
        fault["dropped"] = mixed.restart(kind, victim)
        after = time.time()
        done.append(fault)
        say(
            f"   fault {len(done)}: {kind} {victim}{' (leader)' if fault['leader'] else ''} at "
            f"+{t - start:.1f} s, waited {fault['waited_s']:.1f} s, out "
            + (f"{fault['out_s']:.2f} s" if fault["out_s"] is not None else "never")
            + f", load {load()}"
        )
        slot = max(slot + mixed.args.every_s, t + 1)
    _sleep_until(end)
    return done


def _wait_ready(mixed: Mixed, after: float, end: float) -> None:
    """Until the job is at full size with its spares, or ``end``. A node that is neither
    training nor a spare and whose trainers all exited (a false slow flag replaced it, or
    its trainers failed) is restarted as a spare every ``ORPHAN_CHECK_S`` (each one
    recorded in ``mixed.unplanned``): else the run would wait for its spare to the end."""
    while time.time() < end - 1:
        wait_s = min(ORPHAN_CHECK_S, max(end - time.time(), 0.1))
        try:
            until(functools.partial(mixed.ready, after), wait_s, "full size + spare", poll_s=0.2)
            return
        except TimeoutError:
            for name in mixed.orphans():
                say(f"   {name}: neither training nor a spare, its trainers gone: restarted")
                mixed.unplanned.append({"t": time.time(), "node": name})
                mixed.restart("orphan", name)


def _sleep_until(t: float) -> None:
    left = t - time.time()
    if left > 0:
        time.sleep(left)


def run(args: argparse.Namespace, kinds: tuple[str, ...]) -> dict[str, Any]:
    """Start, train failure-free for ``--baseline-s``, then the faults for ``--minutes``;
    every process and namespace is gone on return."""
    window_s = args.minutes * 60
    result: dict[str, Any] = {
        "nodes": 3,
        "ranks": 2,
        "spares": args.spares,
        "profile": "fast",
        "kinds": list(kinds),
        "minutes": args.minutes,
        "every_s": args.every_s,
        "baseline_s": args.baseline_s,
        "step_sleep": args.step_sleep,
        "step_work": args.step_work,
        "slow_factor": args.slow_factor,
        "restart_nice": args.restart_nice,
        "restart_sched": args.restart_sched,
        "load_before": load(),
        "problems": [],
    }
    with result_files.workdir(args.workdir, "swim-mixed-", fresh=True) as work:
        began = time.monotonic()
        mixed = Mixed(args, work, args.start_timeout_s + args.baseline_s + window_s + 120)
        try:
            until(lambda: mixed.ready(0.0), args.start_timeout_s, "full size + spare", poll_s=0.5)
            result["startup_s"] = time.monotonic() - began
            time.sleep(5)  # past the first steps' warm-up
            base0 = time.time()
            time.sleep(args.baseline_s)
            base1 = time.time()
            say(f"   baseline done, load {load()}")
            done = faults(mixed, kinds, base1, base1 + window_s)
            end = base1 + window_s
            records = mixed.records()
        finally:
            mixed.close()
        result["load_after"] = load()
        spans = mixed_restarts.windows(work)  # before a temporary workdir goes
        spans = mixed_restarts.from_restarts(spans, [t for t, _ in mixed.restarted])
    result |= mixed_results.summary(records, (base0, base1), (base1, end))
    restarts = mixed_restarts.cost(records, [w for w in spans if base1 <= w[0] < end])
    result["restarts"] = len(restarts["per_window"])
    result["restart_lost_s"] = restarts["lost_s"]
    result["restart_by_sched"] = restart_sched.split(
        restarts["per_window"], mixed.restarted, restarts["step_s"]
    )
    for i, fault in enumerate(done):
        until_t = done[i + 1]["t"] if i + 1 < len(done) else end
        fault |= mixed_results.after_fault(records, fault, until_t, 6)
        if fault["out_s"] is None:
            result["problems"].append(
                f"fault {i + 1} ({fault['kind']} {fault['victim']}): no spare trained at the "
                f"full world within {OUT_TIMEOUT_S:.0f} s; restarted anyway"
            )
    result["faults"] = done
    result |= mixed_results.pace_between(records, [f["t"] for f in done], end)
    for u in mixed.unplanned:
        result["problems"].append(
            f"{u['node']} left the job without a fault at +{u['t'] - base1:.0f} s (its "
            "trainers exited: a false slow flag?); restarted as a spare"
        )
    expected = int(window_s // args.every_s)
    if len(done) < expected:
        result["problems"].append(f"{len(done)} faults of {expected} planned (waits)")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--every-s", type=float, default=60.0)
    parser.add_argument("--baseline-s", type=float, default=120.0)
    parser.add_argument("--spares", type=int, default=1, choices=(1, 2))
    parser.add_argument("--faults", default=",".join(mixed_results.KINDS))
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--step-work", type=float, default=0.02, help="compute slept per step")
    parser.add_argument("--step-sleep", type=float, default=0.03, help="sleep after each step")
    parser.add_argument(
        "--restart-nice", type=int, default=19, choices=range(20), metavar="0-19",
        help="with --restart-sched nice: a restarted node starts at this nice level until it "
        "waits as a spare (0: off)",
    )  # fmt: skip
    parser.add_argument(
        "--restart-sched", default="fork",
        help="fork, idle (SCHED_IDLE), nice, or a comma-separated cycle of them (one per "
        "restart): how a restarted node starts until it waits as a spare (bench/restart_sched.py)",
    )  # fmt: skip
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep every log here")
    result_files.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        kinds = mixed_results.kinds_of(args.faults)
        restart_sched.parse(args.restart_sched)
    except ValueError as exc:
        parser.error(str(exc))
    if args.every_s < 10 or args.minutes <= 0 or args.baseline_s < 10:
        parser.error("--every-s and --baseline-s at least 10, --minutes above 0")
    # SIGTERM unwinds like Ctrl-C: every node stopped and every namespace removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = result_files.machine()
    say(f"-- mixed faults: {args.minutes} min, one every {args.every_s} s, load {load()}")
    result = run(args, kinds)
    print(mixed_results.report(result))
    result_files.record(args, "bench.mixed_efficiency", argv, started, mixed_results.built(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
