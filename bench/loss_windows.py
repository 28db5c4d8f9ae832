"""False deaths per window under heavy packet loss: 5 namespaced hosts, ours against serf.

The question: on 5 hosts with independent loss p on every packet into every host
(iptables ``-m statistic`` in each host's network namespace, tests/netns/harness.py), how
often does a window of ``--window-s`` seconds contain a *false death* (a live member
declared dead by anyone), and how often do the ``--after-kill-s`` seconds after a SIGKILL
of one host (loss still on) contain one about a member that was not killed? Both
figures are per window, so a rate is a binomial proportion: each comes with its exact
(Clopper–Pearson) 95 % interval.

What runs, at once, so that every implementation sees the same machine: ``--lanes`` test
beds per implementation (each 5 namespaces on one bridge), each taking rounds from its
implementation's queue, loss levels interleaved in the queue. A round: the cluster
converged without loss (after the previous round's kill, the killed host is restarted;
if it does not converge within 60 s, all five are), loss on, the steady window, SIGKILL
of host 5, the after-kill window, then until every survivor holds host 5 dead (its
detection time, or none within 40 s), loss off. Every window records the 1-minute load
average at its start and end. Implementations:

- ``swim-lan``: our agent, profile ``lan`` (memberlist's ``DefaultLANConfig``: 1 s probes,
  500 ms probe timeout, 3 indirect checks, suspicion α = 4, β = 6, so k = 2 confirmations);
- ``swim-lan-a5``, ``swim-lan-a6``: the same with ``suspicion_mult`` 5 or 6 (the knob:
  docs/tuning.md; at 5 members α = 6 asks for k = 4 confirmations where only 3 members
  could give them, so k falls to 0 and every suspicion runs exactly min = 6 s);
- ``serf-lan``: Debian's ``serf agent -profile=lan`` (the same memberlist defaults).

The simulator beside them (``--sim-seeds``): the same 5-member ``lan`` world that the
simulator's ``loss`` scenario builds (``simulations.experiments.harness.build`` with the
loss on every datagram), with lossy TCP (``lossy_tcp``: the iptables rules drop TCP
segments too), one window per seed: ``--window-s`` of loss, a crash, ``--after-kill-s``.

    python -m bench.loss_windows --plan swim-lan:0.2:50,serf-lan:0.2:50 --lanes 2
    python -m bench.loss_windows --plan swim-lan:0.1:20,serf-lan:0.1:20 --sim-seeds 400

Every window is appended to ``windows.jsonl`` in ``--workdir`` as it ends (a partial run
keeps its data); the result file goes under results/ (``--results``, ``--no-results``).
Ctrl-C, SIGTERM or an error closes every test bed: agents killed by pid, namespaces and
their iptables rules deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import queue
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from agent.procs import until
from bench import results
from bench.loss_results import (
    DETECT_TIMEOUT_S,
    HOSTS,
    VICTIM,
    build_result,
    sim_windows,
    summarise,
)
from tests.netns.harness import HarnessError, MemberEvent, Testbed, unavailable_reason

_LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"
CONVERGE_TIMEOUT_S = 60.0
IMPLS: dict[str, tuple[str, str | None]] = {
    "swim-lan": ("swim", None),
    "swim-lan-a5": ("swim", "[protocol]\nsuspicion_mult = 5\n"),
    "swim-lan-a6": ("swim", "[protocol]\nsuspicion_mult = 6\n"),
    "serf-lan": ("serf", None),
}


FAILED_PROBE = re.compile(r"[Ss]uspect \S+ has failed, no acks received")
"""A probe that got no ack, direct, indirect or over TCP: logged by the prober only, in
the same words by memberlist (serf) and by our agent; the like-for-like count of
accusations (our ``member X suspect`` lines are logged by every member that learns of one)."""
REFUTED = re.compile(r"[Rr]efuting a suspect message")


def count_lines(lane_dir: Path, pattern: re.Pattern[str], start: float, end: float) -> int:
    """Lines of the lane's logs matching ``pattern`` stamped in [start, end): serf's lines
    carry the harness's epoch stamp, ours the agent's own date and time."""
    found = 0
    for log in lane_dir.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if not pattern.search(line):
                continue
            head = line.split(" ", 1)[0]
            if head.replace(".", "", 1).isdigit():
                at = float(head)
            else:
                try:
                    at = datetime.datetime.strptime(line[:23], _LOG_TIME).timestamp()
                except ValueError:
                    continue
            found += start <= at < end
    return found


class Interrupted(Exception):
    """The run is stopping (Ctrl-C, SIGTERM): the lane drops its round."""


class Lane:
    """One test bed running one implementation, round after round."""

    def __init__(self, impl: str, index: int, workdir: Path, stopping: threading.Event) -> None:
        self.impl = impl
        self.stopping = stopping
        self.kind, self.toml = IMPLS[impl]
        self.name = f"{impl}-{index}"
        self.bed = Testbed(HOSTS, workdir / self.name)
        self.bed.workdir.mkdir(parents=True, exist_ok=True)
        self.restarts = 0
        self._up = False

    # the two implementations behind one face
    def _start(self, i: int) -> None:
        if self.kind == "swim":
            self.bed.start_agent(i, "lan", config_toml=self.toml)
        else:
            self.bed.start_serf(i, "lan")

    def _running(self, i: int) -> bool:
        h = self.bed.host(i)
        proc = h.agent if self.kind == "swim" else h.serf
        return proc is not None and proc.running()

    def _converged(self) -> bool:
        if self.kind == "swim":
            return self.bed.converged() and len(self.bed.running()) == HOSTS
        return self.bed.serf_converged() and len(self.bed.serfs()) == HOSTS

    def _kill(self, i: int) -> float:
        return self.bed.kill(i) if self.kind == "swim" else self.bed.kill_serf(i)

    def events(self, since: float, kinds: list[str]) -> list[MemberEvent]:
        if self.kind == "swim":
            return self.bed.events(since, kinds)
        return self.bed.serf_events(since, kinds)

    def ready(self) -> None:
        """All five up and alive everywhere, without loss; restarts all if it must."""
        if not self._up:
            self.bed.up()
            self._up = True
        for i in range(1, HOSTS + 1):
            if not self._running(i):
                self._start(i)
        try:
            until(self._converged, CONVERGE_TIMEOUT_S, f"{self.name} converged", poll_s=0.5)
            return
        except TimeoutError:
            self.restarts += 1
        for i in range(1, HOSTS + 1):
            if self._running(i):
                self._kill(i)
        for i in range(1, HOSTS + 1):
            self._start(i)
        until(self._converged, CONVERGE_TIMEOUT_S, f"{self.name} converged after a restart")

    def round(self, loss: float, window_s: float, after_s: float) -> dict[str, Any]:
        self.ready()
        bed = self.bed
        load0 = os.getloadavg()[0]
        bed.host_loss(loss)
        t0 = time.time()
        if self.stopping.wait(window_s):
            raise Interrupted(self.name)
        counts = [bed.packet_counts(h.index) for h in bed.hosts]
        arrived, dropped = sum(c[0] for c in counts), sum(c[1] for c in counts)
        killed = self._kill(VICTIM)
        if self.stopping.wait(max(0.0, killed + after_s - time.time())):
            raise Interrupted(self.name)
        load1 = os.getloadavg()[0]
        survivors = {f"n{i}" for i in range(1, HOSTS + 1) if i != VICTIM}

        def dead_at() -> dict[str, float]:
            out: dict[str, float] = {}
            for e in self.events(killed, ["dead"]):
                if e.member == f"n{VICTIM}" and e.observer in survivors:
                    out.setdefault(e.observer, e.at - killed)
            return out

        with contextlib.suppress(TimeoutError):
            until(lambda: len(dead_at()) == len(survivors), DETECT_TIMEOUT_S, "detection")
        detected = dead_at()
        bed.heal()
        events = self.events(t0, ["dead", "suspect"])
        steady = [e for e in events if e.at < killed]
        after = [e for e in events if killed <= e.at < killed + after_s]
        after_false = [e for e in after if e.member != f"n{VICTIM}"]
        return {
            "impl": self.impl,
            "lane": self.name,
            "loss": loss,
            "start": t0,
            "window_s": killed - t0,
            "after_s": after_s,
            "packets_arrived": arrived,
            "packets_dropped": dropped,
            "drop_rate": dropped / max(arrived, 1),
            "steady_dead": sum(1 for e in steady if e.kind == "dead"),
            "steady_suspect": sum(1 for e in steady if e.kind == "suspect"),
            "failed_probes": count_lines(bed.workdir, FAILED_PROBE, t0, killed),
            "refutations": count_lines(bed.workdir, REFUTED, t0, killed),
            "after_dead": sum(1 for e in after_false if e.kind == "dead"),
            "after_suspect": sum(1 for e in after_false if e.kind == "suspect"),
            "false_dead_pairs": sorted(
                {f"{e.observer}>{e.member}" for e in steady + after_false if e.kind == "dead"}
            ),
            "detect_first_s": min(detected.values()) if detected else None,
            "detect_last_s": max(detected.values()) if len(detected) == len(survivors) else None,
            "load_start": round(load0, 2),
            "load_end": round(load1, 2),
            "cluster_restarts": self.restarts,
        }

    def close(self) -> None:
        self.bed.close()


def run_lanes(
    plan: list[tuple[str, float, int]],
    lanes: int,
    window_s: float,
    after_s: float,
    deadline: float,
    workdir: Path,
    out: Path,
) -> list[dict[str, Any]]:
    """Every implementation's rounds on ``lanes`` beds each, all at once."""
    queues: dict[str, queue.Queue[float]] = {}
    by_impl: dict[str, list[tuple[float, int]]] = {}
    for impl, loss, n in plan:
        by_impl.setdefault(impl, []).append((loss, n))
    for impl, levels in by_impl.items():
        q: queue.Queue[float] = queue.Queue()
        for loss in _interleave(levels):
            q.put(loss)
        queues[impl] = q
    windows: list[dict[str, Any]] = []
    lock = threading.Lock()
    stopping = threading.Event()
    errors: list[str] = []
    beds = [Lane(impl, i, workdir, stopping) for impl in by_impl for i in range(1, lanes + 1)]

    def work(lane: Lane) -> None:
        q = queues[lane.impl]
        try:
            while not stopping.is_set() and time.time() < deadline:
                try:
                    loss = q.get_nowait()
                except queue.Empty:
                    return
                w = lane.round(loss, window_s, after_s)
                with lock:
                    windows.append(w)
                    with out.open("a") as fh:
                        fh.write(json.dumps(w) + "\n")
                print(_line(w), flush=True)
        except Interrupted:
            return
        except (HarnessError, TimeoutError, OSError) as exc:
            errors.append(f"{lane.name}: {exc}")
            print(f"{lane.name} stopped: {exc}", file=sys.stderr, flush=True)

    threads = [threading.Thread(target=work, args=(b,), name=b.name) for b in beds]
    try:
        for t in threads:
            t.start()
            time.sleep(2)  # stagger the start-ups
        for t in threads:
            while t.is_alive():
                t.join(timeout=1)
    except KeyboardInterrupt:
        stopping.set()
        print("interrupted: closing the test beds", file=sys.stderr, flush=True)
        raise
    finally:
        stopping.set()
        for t in threads:
            t.join(timeout=30)  # a lane between its waits finishes that step first
        for b in beds:
            try:
                b.close()
            except HarnessError as exc:
                print(f"closing {b.name}: {exc}", file=sys.stderr)
    if errors:
        print("lanes that stopped early: " + "; ".join(errors), file=sys.stderr)
    return windows


def _interleave(levels: list[tuple[float, int]]) -> list[float]:
    """Rounds of each loss level spread evenly over the queue (by their fraction done)."""
    done = dict.fromkeys((loss for loss, _ in levels), 0)
    total = dict(levels)
    order: list[float] = []
    while len(order) < sum(total.values()):
        loss = min((x for x in total if done[x] < total[x]), key=lambda x: done[x] / total[x])
        done[loss] += 1
        order.append(loss)
    return order


def _line(w: dict[str, Any]) -> str:
    return (
        f"{w['lane']:<14} loss {w['loss']:.2f} drop {w['drop_rate']:.3f} "
        f"failed probes {w['failed_probes']:>3} dead {w['steady_dead']} | after kill: dead "
        f"{w['after_dead']} detect {w['detect_last_s']} load {w['load_start']}"
    )


def enrich(windows: list[dict[str, Any]], workdir: Path) -> None:
    """Counts a window of an older run lacks, from the lane logs it left in ``workdir``."""
    for w in windows:
        lane_dir = workdir / w.get("lane", "-")
        if "failed_probes" in w or not lane_dir.is_dir():
            continue
        end = w["start"] + w["window_s"]
        w["failed_probes"] = count_lines(lane_dir, FAILED_PROBE, w["start"], end)
        w["refutations"] = count_lines(lane_dir, REFUTED, w["start"], end)


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def parse_plan(text: str) -> list[tuple[str, float, int]]:
    plan = []
    for item in text.split(","):
        impl, loss, n = item.split(":")
        if impl not in IMPLS:
            raise argparse.ArgumentTypeError(f"unknown implementation {impl!r} ({list(IMPLS)})")
        plan.append((impl, float(loss), int(n)))
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loss_windows", description=__doc__)
    parser.add_argument("--plan", type=parse_plan, default=parse_plan("swim-lan:0.2:50"))
    parser.add_argument("--lanes", type=int, default=2, help="test beds per implementation")
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--after-kill-s", type=float, default=10.0)
    parser.add_argument("--minutes", type=float, default=70.0, help="stop starting rounds then")
    parser.add_argument("--sim-seeds", type=int, default=0)
    parser.add_argument("--sim-losses", default="0.1,0.2,0.3")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--from-jsonl", type=Path, nargs="*", default=[],
                        help="summarise these windows files instead of measuring")  # fmt: skip
    parser.add_argument("--measured-with", default=None,
                        help="with --from-jsonl: the arguments that measured them (the "
                        "result's command)")  # fmt: skip
    parser.add_argument("--note", action="append", default=[], help="a note for the result")
    results.add_arguments(parser)
    args = parser.parse_args(argv)
    started = results.machine()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="loss-windows-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "windows.jsonl"
    windows: list[dict[str, Any]] = []
    for path in args.from_jsonl:
        windows += [json.loads(line) for line in path.read_text().splitlines() if line]
        enrich(windows, path.parent)
    signal.signal(signal.SIGTERM, _interrupt)
    if args.plan and not args.from_jsonl:
        reason = unavailable_reason()
        if reason:
            print(f"cannot run: {reason}", file=sys.stderr)
            return 2
        deadline = time.time() + args.minutes * 60
        print(f"windows go to {out}", flush=True)
        try:
            windows += run_lanes(
                args.plan, args.lanes, args.window_s, args.after_kill_s, deadline, workdir, out
            )
        except KeyboardInterrupt:
            print(f"stopped; the windows so far are in {out}", file=sys.stderr)
            return 130
    for loss in [float(x) for x in args.sim_losses.split(",")] if args.sim_seeds else []:
        sims = sim_windows(loss, args.sim_seeds, args.window_s, args.after_kill_s)
        with out.open("a") as fh:
            fh.writelines(json.dumps(w) + "\n" for w in sims)
        windows += sims
    rows = summarise(windows)
    for r in rows:
        print(json.dumps(r))
    if rows:
        real = [w for w in windows if "lane" in w]
        lanes_used = max(  # test beds whose windows overlapped, at most
            (len({v["lane"] for v in real if abs(v["start"] - w["start"]) < w["window_s"]})
             for w in real),
            default=0,
        )  # fmt: skip
        built = build_result(rows, args, lanes_used)
        as_run = args.measured_with.split() if args.measured_with else argv
        results.record(args, "bench.loss_windows", as_run, started, built, notes=args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
