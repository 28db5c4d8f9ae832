"""Fault scenarios: slow members (the Lifeguard ablation), partitions, churn.

- ``slow-members``: K members are slow (CPU exhaustion, Lifeguard arXiv 1707.00788 §V and
  Fig. 1: "even a single overloaded member is sufficient to cause some false positive
  failure detection events"). Their datagrams wait behind each other with a service time
  (``slow_delay_ms``, default 150 ms) in a bounded queue, optionally with pauses
  (``pause_ms`` every ``pause_every_ms``). Halfway through, a healthy member crashes, so
  one run gives false positives (total, FP− at healthy observers, about healthy members),
  the detection latency of a real failure under stress and the message load. With
  ``--lifeguard all`` the run is repeated for every ablation mode (docs/design.md §5.8
  table: SWIM 100%, LHA-Probe 68%, LHA-Suspicion 3%, Buddy 94%, Lifeguard 1.5% FPs).
- ``partition``: the members split in two halves (symmetric, or asymmetric with
  ``asymmetric=1``) for longer than the maximum suspicion timeout, then heal; measured:
  deaths across the cut, time until one membership again (serf's reconnect merges the
  halves: serf ``ReconnectInterval`` 30 s, docs/design.md §5.5). Then, unless
  ``partial=0``, one member is reachable only from three peers for ``partial_s``
  (serf#185): false positives about the *other* members show the collateral damage.
- ``churn``: Poisson crash/restart/join/leave at given rates per minute (``crash_per_min``,
  ``restart_per_min``, ``join_per_min``, ``leave_per_min``), then a quiet period; measured:
  detection of each crash, false positives, and whether and when the live members agree
  again. Restarts reuse the name and address (new process, new incarnation).
"""

from __future__ import annotations

from typing import Any

from simulations.experiments.harness import (
    LIFEGUARD,
    Params,
    build,
    combine_hashes,
    drive,
    mean,
    pauses,
    scenario,
)
from simulations.experiments.result import Plot, Result
from simulations.model.metrics import LoadWindow, Metrics
from simulations.model.views import converged
from simulations.model.world import SlowSpec, World

ABLATION_ORDER = ["swim", "lha-probe", "lha-suspicion", "buddy", "full"]
"""The Lifeguard paper's table order (docs/design.md §5.8), SWIM first as the baseline."""
assert sorted(ABLATION_ORDER) == sorted(LIFEGUARD)


@scenario("slow-members")
def slow_members(p: Params) -> Result:
    n = p.n(50, 12)
    k = p.slow if p.slow is not None else (2 if p.ci else 4)
    duration = p.duration_ms(120, 24)
    modes = ABLATION_ORDER if p.lifeguard == "all" else [p.lifeguard]
    rows: list[dict[str, Any]] = []
    hashes = []
    fp_rows: list[dict[str, Any]] = []
    for mode in modes:
        sim = build(p, n, config=p.make_config(mode), loss=p.loss or 0.0)
        world = sim.world
        start = world.now_ms
        end = start + duration
        slow = world.rng.sample(range(n), k)
        for idx in slow:
            spec = SlowSpec(
                delay_ms=p.get("slow_delay_ms", 150),
                pauses=pauses(world, start, end, p.get("pause_ms", 0), p.get("pause_every_ms", 0)),
                queue_limit=p.get("queue_limit", 128),
                timer_delay_ms=p.get("timer_delay_ms", 0),
            )
            world.set_slow(idx, spec)
        healthy = [i for i in range(n) if i not in slow]
        victim = healthy[world.rng.randrange(len(healthy))]
        world.at(start + duration // 2, world.crash, victim)
        window = LoadWindow.open(world)
        drive(world, end, p.progress)
        load = window.close(world)
        hashes.append(world.trace_hash())
        crash_row = sim.metrics.crash_rows()[0] if sim.metrics.crashes else {}
        row: dict[str, Any] = {
            "lifeguard": mode,
            "slow": k,
            **sim.metrics.fp_counts(),
            "crash_first_suspect_s": crash_row.get("first_suspect_s"),
            "crash_first_dead_s": crash_row.get("first_dead_s"),
            "crash_all_dead_s": crash_row.get("all_dead_s"),
            "pkts_out_per_member_per_s": load.get("pkts_out_per_s_mean"),
            "bytes_out_per_member_per_s": load.get("bytes_out_per_s_mean"),
            "slow_queue_drops": world.slow_dropped(),
        }
        rows.append(row)
        fp_rows += [{"lifeguard": mode, **r} for r in sim.metrics.fp_rows()]
    result = Result("slow-members", p.seed, combine_hashes(hashes), {**p.describe(), "nodes": n})
    result.summary.update(rows[0] if len(rows) == 1 else {"modes": len(rows)})
    result.tables["ablation"] = rows
    result.tables["false_positives"] = fp_rows
    base = rows[0]["fp_suspect"] + rows[0]["fp_dead"] if rows else 0
    if len(rows) > 1:
        for row in rows:
            total = row["fp_suspect"] + row["fp_dead"]
            row["fp_pct_of_swim"] = 100.0 * total / base if base else None
    result.plots.append(
        Plot(
            "fp",
            "false positives by Lifeguard mode (x: mode number)",
            "mode",
            "events",
            {
                "dead": [(i, r["fp_dead"]) for i, r in enumerate(rows)],
                "dead at healthy": [(i, r["fp_dead_at_healthy"]) for i, r in enumerate(rows)],
                "suspect": [(i, r["fp_suspect"]) for i, r in enumerate(rows)],
            },
        )
    )
    result.notes.append("modes in plot order: " + ", ".join(modes))
    return result


@scenario("partition")
def partition(p: Params) -> Result:
    n = p.n(40, 12)
    split_ms = int(p.get("split_s", 25.0 if p.ci else 60.0) * 1000)
    asymmetric = bool(p.get("asymmetric", 0))
    partial = bool(p.get("partial", 0 if p.ci else 1))
    partial_ms = int(p.get("partial_s", 30.0) * 1000)
    heal_limit_ms = int(p.get("heal_limit_s", 120.0) * 1000)
    sim = build(p, n, loss=p.loss or 0.0, settle_ms=3_000)
    world = sim.world
    metrics = sim.metrics
    left = set(range(n // 2))
    split_at = world.now_ms
    world.network.partition([sorted(left)], symmetric=not asymmetric)
    drive(world, split_at + split_ms, p.progress)
    healed_at = world.now_ms
    world.network.heal()
    merged_at = _run_until_agree(world, heal_limit_ms, p)
    cut = [
        f
        for f in metrics.false_positives
        if split_at <= f.t_ms <= healed_at
        and (world.index[f.observer] in left) != (world.index[f.member] in left)
    ]
    summary: dict[str, Any] = {
        "split_s": split_ms / 1000,
        "asymmetric": asymmetric,
        "dead_across_cut": sum(1 for f in cut if f.kind == "dead"),
        "suspect_across_cut": sum(1 for f in cut if f.kind == "suspect"),
        "fp_within_sides": sum(
            1 for f in metrics.false_positives if split_at <= f.t_ms <= healed_at
        )
        - len(cut),
        "merged_after_heal_s": None if merged_at < 0 else (merged_at - healed_at) / 1000,
    }
    if partial and merged_at >= 0:
        summary.update(_partial_phase(world, metrics, p, partial_ms, heal_limit_ms))
    result = Result("partition", p.seed, world.trace_hash(), {**p.describe(), "nodes": n})
    result.summary.update(summary)
    result.tables["false_positives"] = metrics.fp_rows()
    return result


def _run_until_agree(world: World, limit_ms: int, p: Params) -> int:
    end = world.now_ms + limit_ms
    while world.now_ms < end:
        if converged(world):
            return world.now_ms
        drive(world, min(end, world.now_ms + 500), p.progress, chunk_ms=500)
    return world.now_ms if converged(world) else -1


def _partial_phase(
    world: World, metrics: Metrics, p: Params, phase_ms: int, limit_ms: int
) -> dict[str, Any]:
    live = world.live_indices()
    target = live[world.rng.randrange(len(live))]
    peers = [i for i in live if i != target]
    allowed = world.rng.sample(peers, min(3, len(peers)))
    start = world.now_ms
    world.faulty.add(target)
    world.network.reachable_only_from(target, allowed, range(len(world.nodes)))
    drive(world, start + phase_ms, p.progress)
    world.network.heal()
    world.faulty.discard(target)
    merged = _run_until_agree(world, limit_ms, p)
    name = world.names[target]
    others = [f for f in metrics.false_positives if f.t_ms >= start and f.member != name]
    return {
        "partial_target": name,
        "partial_collateral_fp_suspect": sum(1 for f in others if f.kind == "suspect"),
        "partial_collateral_fp_dead": sum(1 for f in others if f.kind == "dead"),
        "partial_s": phase_ms / 1000,
        "partial_merged_after_s": None if merged < 0 else (merged - start - phase_ms) / 1000,
    }


@scenario("churn")
def churn(p: Params) -> Result:
    n = p.n(50, 16)
    duration = p.duration_ms(180, 30)
    quiet_ms = int(p.get("quiet_s", 30.0 if p.ci else 90.0) * 1000)
    busy = 3.0 if p.ci else 1.0  # the short CI run needs more churn per minute
    rates = {
        "crash": p.get("crash_per_min", 2.0 * busy),
        "restart": p.get("restart_per_min", 2.0 * busy),
        "join": p.get("join_per_min", 1.0 * busy),
        "leave": p.get("leave_per_min", 1.0 * busy),
    }
    sim = build(p, n, loss=p.loss or 0.0, settle_ms=3_000)
    world = sim.world
    churner = _Churner(world, rates, min_live=max(3, n // 2))
    start = world.now_ms
    churner.schedule(start, start + duration)
    window = LoadWindow.open(world)
    drive(world, start + duration, p.progress)
    load = window.close(world)
    agreed = _run_until_agree(world, quiet_ms, p)
    drive(world, start + duration + quiet_ms, p.progress)
    assert sim.checker is not None  # a SWIM world
    sim.checker.scan_all()
    rows = sim.metrics.crash_rows()
    alls = [r["all_dead_s"] for r in rows if r["all_dead_s"] is not None]
    result = Result("churn", p.seed, world.trace_hash(), {**p.describe(), "nodes": n})
    result.summary.update(
        {
            **{_plural(k): v for k, v in churner.done.items()},
            "live_at_end": len(world.live_indices()),
            "agreed_after_churn_s": None if agreed < 0 else (agreed - start - duration) / 1000,
            "crashes_detected_by_all": len(alls),
            "all_dead_mean_s": mean(alls),
            **sim.metrics.fp_counts(),
        }
    )
    result.tables["detection"] = rows
    result.tables["actions"] = churner.log
    result.tables["load"] = [load]
    result.tables["false_positives"] = sim.metrics.fp_rows()
    return result


def _plural(action: str) -> str:
    return action + ("es" if action.endswith("sh") else "s")


class _Churner:
    """Poisson arrivals of churn actions, drawn from the world's scenario RNG."""

    def __init__(self, world: World, rates_per_min: dict[str, float], min_live: int) -> None:
        self.world = world
        self.rates = {k: v for k, v in rates_per_min.items() if v > 0}
        self.total = sum(self.rates.values())
        self.min_live = min_live
        self.crashed: list[int] = []
        self.done = {k: 0 for k in rates_per_min}
        self.log: list[dict[str, Any]] = []
        self._end = 0

    def schedule(self, now_ms: int, end_ms: int) -> None:
        self._end = end_ms
        self._next(now_ms)

    def _next(self, now_ms: int) -> None:
        if self.total <= 0:
            return
        gap_ms = int(self.world.rng.expovariate(self.total / 60_000))
        if now_ms + gap_ms < self._end:
            self.world.at(now_ms + gap_ms, self._act)

    def _act(self) -> None:
        world = self.world
        rng = world.rng
        pick = rng.random() * self.total
        kinds = list(self.rates)
        kind = kinds[-1]
        for candidate in kinds:
            pick -= self.rates[candidate]
            if pick < 0:
                kind = candidate
                break
        live = world.live_indices()
        target: int | None = None
        if kind in ("crash", "leave") and len(live) > self.min_live:
            target = live[rng.randrange(len(live))]
            if kind == "crash":
                world.crash(target)
                self.crashed.append(target)
            else:
                world.leave(target)
        elif kind == "restart" and self.crashed:
            target = self.crashed.pop(rng.randrange(len(self.crashed)))
            world.restart(target)
        elif kind == "join":
            target = world.join_new()
        if target is not None:
            self.done[kind] += 1
            self.log.append(
                {"t_s": world.now_ms / 1000, "action": kind, "node": world.names[target]}
            )
        self._next(world.now_ms)
