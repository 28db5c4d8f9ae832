"""Design-space exploration: detection latency, false positives and load of several
protocol configurations ("variants") under several network conditions, and their Pareto
frontier.

    python -m simulations.frontier --nodes 64 [--seeds 1,2] [--variants a,b,...]
        [--conditions x,y,...] [--crashes K] [--jobs J] [--out DIR] [--ci]

Method, per run (variant, condition, n, seed):
- Build a converged, checked and measured world (``harness.build``, the variant's
  ``swim.Config``, the condition's latency; independent loss applied after the build;
  with ``lossy_tcp`` a condition with loss loses TCP segments too: ``Network.tcp_loss``),
  settle ``SETTLE_MS``, then make the condition's slow members (drawn with the world's
  RNG): ``SLOW_DELAY_MS`` service time per input, a queue of ``SLOW_QUEUE`` datagrams and
  a ``SLOW_PAUSE_MS`` stop every ``SLOW_EVERY_MS`` (a GC / SIGSTOP pause; the phase drawn
  per member, as ``scenarios_faults`` does).
- Crash K healthy (live, not slow) members one after another: each at a random offset
  within one probe interval, then run until every live member has it dead, at most
  2 × the variant's maximum suspicion timeout + 10 s (else it counts as undetected), then
  ``GAP_MS`` more before the next crash.
- Per crash: all-dead latency (crash to the last live member declaring it dead: the
  cluster-wide detection time; a member that already had the victim dead or forgotten at
  the crash, after a false positive whose refutation never reached it, counts as done at
  once, since it will announce nothing), the same for the healthy members only, and
  first-suspect latency (crash to the first suspicion anywhere). Per run: false positives
  (``Metrics.fp_counts``; the key figure is a dead declaration about a live, non-slow
  member, by anyone, slow members included), load per member over the crash phase
  (``LoadWindow``), simulated time, healthy-member exposure and the trace hash.

Baselines (``BASELINES``): the all-to-all heartbeat protocol of
``simulations.experiments.heartbeat`` (every member heartbeats every other, Phi accrual per
peer) runs through the same method, network, conditions and metrics; it has no suspicion
stage, so its first-suspect column is empty and its detection limit is twice its
conviction time plus 10 s.

Rules:
- No wall clock inside a world; a run is a function of (variant, condition, n, seed), so
  every variant sees the same slow members and victims for a seed (common random
  numbers) and results do not depend on ``--jobs`` (runs are independent processes,
  collected in a fixed order).
- Pooled figures: latency quantiles are nearest-rank over all crashes of a variant, an
  undetected crash counting as infinitely late; FP rates are events per 1000 healthy
  member-hours (live, non-slow members × simulated time, from time 0); the load ratio is
  the variant's mean packets/member/s over the mean of ``lan`` in the same
  (condition, seed) cells.
- Pareto frontier over (median latency, p99 latency, FP dead about healthy per 1000
  member-hours), all minimised: a variant is dominated if another is no worse in all
  three and strictly better in one. Load is shown (marker area), not optimised.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from simulations.experiments import heartbeat as hb
from simulations.experiments.harness import Params, Sim, build, combine_hashes, pauses
from simulations.experiments.variants import VARIANTS
from simulations.model.metrics import CrashRecord, LoadWindow
from simulations.model.world import SlowSpec, World
from swim import PROFILES, Config, EventKind, MemberEvent, Node, suspicion_window_ms

BASELINES: dict[str, Callable[[], hb.HeartbeatConfig]] = {
    "heartbeat": hb.HeartbeatConfig.akka,
    "heartbeat/fast": hb.HeartbeatConfig.fast,
}
"""All-to-all heartbeating with Phi accrual (``simulations.experiments.heartbeat``): the
O(n²) baseline."""


def all_variants() -> list[str]:
    """Every name ``--variants`` accepts: ``VARIANTS`` (the default sweep), the other
    profiles (``wan``), the baselines."""
    return [*VARIANTS, *(p for p in PROFILES if p not in VARIANTS), *BASELINES]


def variant_config(name: str) -> Config:
    """The world's ``swim.Config`` (a baseline's world gets ``heartbeat.WORLD_CONFIG``)."""
    if name in BASELINES:
        return hb.WORLD_CONFIG
    preset, overrides = VARIANTS.get(name, (name, {}))
    return Config.profile(preset, **overrides)


def variant_factory(name: str) -> Callable[..., Node] | None:
    """The node factory of a baseline; None for ``swim.Node``."""
    return hb.factory(BASELINES[name]()) if name in BASELINES else None


def variant_text(name: str) -> str:
    if name in BASELINES:
        c = BASELINES[name]()
        return (
            f"all-to-all heartbeat every {c.heartbeat_interval_ms} ms, Phi check every "
            f"{c.check_interval_ms} ms, {c.phi} (convicts {c.convict_after_ms():.0f} ms "
            "after the last beat)"
        )
    preset, overrides = VARIANTS.get(name, (name, {}))
    return f"Config.{preset}({', '.join(f'{k}={v}' for k, v in overrides.items())})"


@dataclass(frozen=True, slots=True)
class Condition:
    latency: str
    loss: float = 0.0
    slow: int = 0


JITTER = "lognormal:1.8:1.1:1"
"""One-way delay with a heavy tail: mean 3.4 ms, median 2, p99 24, p99.9 54 ms."""

CONDITIONS: dict[str, Condition] = {
    "clean": Condition("uniform:1:5"),
    "loss1": Condition("uniform:1:5", 0.01),
    "loss5": Condition("uniform:1:5", 0.05),
    "loss10": Condition("uniform:1:5", 0.10),
    "loss20": Condition("uniform:1:5", 0.20),
    "jitter": Condition(JITTER),
    "slow1": Condition("uniform:1:5", slow=1),
    "slow4": Condition("uniform:1:5", slow=4),
    "worst": Condition(JITTER, 0.10, 4),
}

SETTLE_MS = 5_000
GAP_MS = 2_000
SLOW_DELAY_MS = 20
SLOW_PAUSE_MS = 2_000
SLOW_EVERY_MS = 6_000
SLOW_QUEUE = 128


@dataclass(frozen=True, slots=True)
class RunSpec:
    variant: str
    condition: str
    n: int
    seed: int
    crashes: int
    lossy_tcp: bool = False


@dataclass(slots=True)
class RunResult:
    row: dict[str, Any]
    crashes: list[dict[str, Any]]
    wall_s: float


@dataclass(slots=True)
class Options:
    nodes: int = 64
    seeds: list[int] = field(default_factory=lambda: [1])
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    conditions: list[str] = field(default_factory=lambda: list(CONDITIONS))
    crashes: int = 8
    jobs: int = 1
    lossy_tcp: bool = False
    """Streams over a lossy condition's links lose and retransmit segments."""

    @classmethod
    def ci(cls, jobs: int = 1) -> Options:
        """Small and short: the variant the test-suite runs."""
        return cls(16, [1], ["lan", "fast"], ["clean", "loss10"], crashes=2, jobs=jobs)

    def specs(self) -> list[RunSpec]:
        return [
            RunSpec(v, c, self.nodes, s, self.crashes, self.lossy_tcp)
            for v in self.variants
            for c in self.conditions
            for s in self.seeds
        ]


@dataclass(slots=True)
class Report:
    options: Options
    runs: list[dict[str, Any]]
    crashes: list[dict[str, Any]]
    variants: list[dict[str, Any]]
    cells: list[dict[str, Any]]
    trace_hash: str
    command: str = ""


# --- one run ----------------------------------------------------------------------------


def max_suspicion_ms(config: Config, n: int) -> int:
    """Longest suspicion window a member can open (no confirmations), with the RTT in the
    derived window taken as the static probe timeout (a generous bound)."""
    return suspicion_window_ms(config, n, config.probe_timeout_ms)[1]


def detection_limit_ms(variant: str, n: int) -> int:
    if variant in BASELINES:
        c = BASELINES[variant]()
        return 2 * (math.ceil(c.convict_after_ms()) + c.check_interval_ms) + 10_000
    return 2 * max_suspicion_ms(variant_config(variant), n) + 10_000


def run_one(spec: RunSpec) -> RunResult:
    """One world: settle, slow members, K crashes one after another."""
    wall0 = time.perf_counter()
    config = variant_config(spec.variant)
    cond = CONDITIONS[spec.condition]
    lossy = {"lossy_tcp": 1} if spec.lossy_tcp and cond.loss > 0 else {}
    params = Params(nodes=spec.n, seed=spec.seed, latency=cond.latency, extra=lossy)
    sim = build(
        params,
        spec.n,
        config=config,
        loss=cond.loss,
        settle_ms=SETTLE_MS,
        node_factory=variant_factory(spec.variant),
    )
    world = sim.world
    limit = detection_limit_ms(spec.variant, spec.n)
    horizon = world.now_ms + spec.crashes * (config.probe_interval_ms + limit + GAP_MS)
    slow = _make_slow(sim, cond.slow, horizon)
    window = LoadWindow.open(world)
    rows: list[dict[str, Any]] = []
    watches: list[_Watch] = []
    for k in range(spec.crashes):
        healthy = [i for i in world.live_indices() if i not in world.faulty]
        victim = healthy[world.rng.randrange(len(healthy))]
        world.run_until(world.now_ms + world.rng.randrange(config.probe_interval_ms))
        world.crash(victim)
        watches.append(_Watch(world, sim.metrics.crashes[-1]))
        detected = world.run_until_true(functools.partial(_all_dead, watches[-1]), limit)
        rows.append({**_key(spec), "crash": k, "detected": detected >= 0})
        world.run_until(world.now_ms + GAP_MS)
    load = window.close(world)
    for row, watch in zip(rows, watches, strict=True):
        row.update(watch.row(row["detected"]))
    return RunResult(_run_row(spec, sim, rows, load, len(slow)), rows, time.perf_counter() - wall0)


class _Watch:
    """One crash, beside ``Metrics``: who still has to declare the victim dead, counting an
    observer that already had it dead or forgotten at the crash (after a false positive it
    never refuted to that observer, so no new event will come) as done at once; and when
    the last healthy (non-slow) live member has it dead."""

    def __init__(self, world: World, record: CrashRecord) -> None:
        self.world, self.record = world, record
        # Metrics leaves such observers out of the record's ``remaining`` at the crash.
        live = [i for i in world.live_indices() if i != record.victim]
        self.waiting = set(record.remaining)
        self.before = set(live) - self.waiting
        self.healthy = self.waiting - world.faulty
        self.all_ms = None if self.waiting else world.now_ms
        self.healthy_ms = None if self.healthy else world.now_ms
        world.listeners.append(self)

    def on_event(self, idx: int, event: MemberEvent) -> None:
        if event.member.name != self.record.name:
            return
        if event.kind == EventKind.DEAD:
            self._done(idx)
        elif event.kind in (EventKind.ALIVE, EventKind.JOINED) and self.world.live(idx):
            self.waiting.add(idx)  # a stale alive brought it back: it must decide again
            if idx not in self.world.faulty:
                self.healthy.add(idx)

    def on_lifecycle(self, kind: str, idx: int) -> None:
        if kind in ("crash", "stopped", "leave"):
            self._done(idx)

    def _done(self, idx: int) -> None:
        self.waiting.discard(idx)
        self.healthy.discard(idx)
        now = self.world.now_ms
        if not self.waiting and self.all_ms is None:
            self.all_ms = now
        if not self.healthy and self.healthy_ms is None:
            self.healthy_ms = now

    def row(self, detected: bool) -> dict[str, Any]:
        rel = self.record.row()
        crash = self.record.crash_ms

        def since(t: int | None) -> float | None:
            return None if t is None else (t - crash) / 1000

        rel["all_dead_s"] = since(self.all_ms) if detected else None
        rel["all_dead_eventually_s"] = since(self.all_ms)
        rel["healthy_dead_s"] = since(self.healthy_ms)
        rel["dead_before_crash"] = len(self.before)
        return rel


def _all_dead(watch: _Watch) -> bool:
    return watch.all_ms is not None


def _make_slow(sim: Sim, k: int, end_ms: int) -> list[int]:
    world = sim.world
    slow = world.rng.sample(range(len(world.nodes)), k)
    for idx in slow:
        stops = pauses(world, world.now_ms, end_ms, SLOW_PAUSE_MS, SLOW_EVERY_MS)
        world.set_slow(idx, SlowSpec(SLOW_DELAY_MS, stops, SLOW_QUEUE))
    return slow


def _key(spec: RunSpec) -> dict[str, Any]:
    return {"variant": spec.variant, "condition": spec.condition, "n": spec.n, "seed": spec.seed}


def _run_row(
    spec: RunSpec,
    sim: Sim,
    crashes: list[dict[str, Any]],
    load: dict[str, Any],
    slow: int,
) -> dict[str, Any]:
    world, fps = sim.world, sim.metrics.false_positives
    counts = sim.metrics.fp_counts()
    alls = [c["all_dead_s"] for c in crashes if c["detected"]]
    # healthy member-time from time 0: everyone while settling, then the non-slow members
    # less each victim from its crash on
    exposure_ms = len(world.nodes) * sim.settled_ms + (len(world.nodes) - slow) * (
        world.now_ms - sim.settled_ms
    )
    exposure_ms -= sum(world.now_ms - c.crash_ms for c in sim.metrics.crashes)
    return {
        **_key(spec),
        "slow": slow,
        "crashes": len(crashes),
        "detected": len(alls),
        "all_dead_median_s": statistics.median(alls) if alls else None,
        "all_dead_max_s": max(alls) if alls else None,
        **counts,
        "fp_dead_about_slow_members": counts["fp_dead"] - counts["fp_dead_about_healthy_members"],
        "fp_dead_about_healthy_at_healthy": sum(
            1 for f in fps if f.kind == "dead" and not f.member_faulty and f.observer_healthy
        ),
        "pkts_out_per_member_per_s": load.get("pkts_out_per_s_mean"),
        "bytes_out_per_member_per_s": load.get("bytes_out_per_s_mean"),
        "stream_bytes_out_per_member_per_s": load.get("stream_bytes_out_per_s_mean"),
        "sim_s": world.now_ms / 1000,
        "healthy_member_hours": exposure_ms / 3_600_000,
        "slow_queue_drops": world.slow_dropped(),
        "events": world.events_processed,
        "trace_hash": world.trace_hash(),
    }


# --- the sweep --------------------------------------------------------------------------


def sweep(specs: Sequence[RunSpec], jobs: int = 1) -> Iterator[tuple[RunSpec, RunResult]]:
    """Results in ``specs`` order, whatever the number of worker processes."""
    if jobs <= 1:
        for spec in specs:
            yield spec, run_one(spec)
        return
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        yield from zip(specs, pool.map(run_one, specs), strict=True)


def explore(options: Options, progress: bool = False) -> Report:
    """Run every (variant, condition, seed) and pool the results."""
    runs: list[dict[str, Any]] = []
    crashes: list[dict[str, Any]] = []
    specs = options.specs()
    for i, (spec, result) in enumerate(sweep(specs, options.jobs), start=1):
        runs.append(result.row)
        crashes += result.crashes
        if progress:
            print(f"[{i}/{len(specs)}] {_progress(spec, result)}", flush=True)
    variants = variant_rows(options.variants, runs, crashes)
    cells = [cell_row(v, c, runs, crashes) for v in options.variants for c in options.conditions]
    digest = combine_hashes([r["trace_hash"] for r in runs])
    return Report(options, runs, crashes, variants, cells, digest)


def _progress(spec: RunSpec, result: RunResult) -> str:
    r = result.row
    return (
        f"{spec.variant} × {spec.condition} seed {spec.seed}: wall {result.wall_s:.1f}s "
        f"sim {r['sim_s']:.0f}s detected {r['detected']}/{r['crashes']} fp_dead_healthy "
        f"{r['fp_dead_about_healthy_members']} hash {r['trace_hash']}"
    )


def quantile(values: Iterable[float], q: float) -> float | None:
    """Nearest rank: the ceil(q·N)-th smallest."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _latencies(crashes: list[dict[str, Any]], key: str) -> list[float]:
    return [math.inf if c[key] is None else c[key] for c in crashes]


def _pooled(runs: list[dict[str, Any]], crashes: list[dict[str, Any]]) -> dict[str, Any]:
    hours = sum(r["healthy_member_hours"] for r in runs)
    fp_dead = sum(r["fp_dead_about_healthy_members"] for r in runs)
    alls = _latencies(crashes, "all_dead_s")
    return {
        "crashes": len(crashes),
        "detected": sum(1 for c in crashes if c["detected"]),
        "all_dead_median_s": quantile(alls, 0.5),
        "all_dead_p99_s": quantile(alls, 0.99),
        "healthy_dead_p99_s": quantile(_latencies(crashes, "healthy_dead_s"), 0.99),
        # None for a protocol without a suspicion stage (the heartbeat baseline)
        "first_suspect_median_s": quantile(_latencies(crashes, "first_suspect_s"), 0.5)
        if any(c["first_suspect_s"] is not None for c in crashes)
        else None,
        "fp_dead_about_healthy": fp_dead,
        "fp_dead_about_healthy_per_1000h": 1000 * fp_dead / hours if hours else None,
        "fp_dead_about_healthy_at_healthy": sum(
            r["fp_dead_about_healthy_at_healthy"] for r in runs
        ),
        "fp_suspect_about_healthy": sum(r["fp_suspect_about_healthy_members"] for r in runs),
        "fp_dead_about_slow": sum(r["fp_dead_about_slow_members"] for r in runs),
        "pkts_per_member_per_s": statistics.fmean(r["pkts_out_per_member_per_s"] for r in runs),
        "bytes_per_member_per_s": statistics.fmean(r["bytes_out_per_member_per_s"] for r in runs),
        "stream_bytes_per_member_per_s": statistics.fmean(
            r["stream_bytes_out_per_member_per_s"] or 0.0 for r in runs
        ),
    }


def _of(rows: list[dict[str, Any]], variant: str, condition: str = "") -> list[dict[str, Any]]:
    return [r for r in rows if r["variant"] == variant and condition in ("", r["condition"])]


def _load_ratio(variant: str, runs: list[dict[str, Any]]) -> float | None:
    """Mean load of ``variant`` over the mean of ``lan`` in the same (condition, seed)."""
    lan = {(r["condition"], r["seed"]): r for r in _of(runs, "lan")}
    pairs = [(r, lan.get((r["condition"], r["seed"]))) for r in _of(runs, variant)]
    mine = [r["pkts_out_per_member_per_s"] for r, b in pairs if b is not None]
    base = [b["pkts_out_per_member_per_s"] for _, b in pairs if b is not None]
    return sum(mine) / sum(base) if base and sum(base) else None


def variant_rows(
    variants: list[str], runs: list[dict[str, Any]], crashes: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    rows = [{"variant": v, **_pooled(_of(runs, v), _of(crashes, v))} for v in variants]
    for row in rows:
        row["load_vs_lan"] = _load_ratio(row["variant"], runs)
    keys = ("all_dead_median_s", "all_dead_p99_s", "fp_dead_about_healthy_per_1000h")
    for row, on in zip(rows, pareto(rows, keys), strict=True):
        row["frontier"] = on
    return rows


def cell_row(
    variant: str, condition: str, runs: list[dict[str, Any]], crashes: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "variant": variant,
        "condition": condition,
        **_pooled(_of(runs, variant, condition), _of(crashes, variant, condition)),
    }


def pareto(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[bool]:
    """For each row, whether no other row is ≤ in every key and < in one (all minimised;
    None counts as infinitely bad)."""

    def vec(row: dict[str, Any]) -> list[float]:
        return [math.inf if row[k] is None else float(row[k]) for k in keys]

    points = [vec(r) for r in rows]

    def dominates(a: list[float], b: list[float]) -> bool:
        return all(x <= y for x, y in zip(a, b, strict=True)) and a != b

    return [not any(dominates(other, p) for other in points) for p in points]
