"""The scenario registry and the fault-free scenarios: steady, crash, dissemination, loss,
scale. Fault scenarios (slow members, partition, churn) live in ``scenarios_faults``.

Each scenario is ``Params -> Result`` and documents what it measures and which published
number it is compared with:
- ``steady``: load with no faults; SWIM §5 Fig. 2 reports ≈2 msgs sent per member per
  period (ping+ack) for SWIM:Basic; memberlist adds gossip rounds (200 ms, 3 nodes) that
  only send when broadcasts are pending. No false positives may occur.
- ``crash``: members crash one at a time after settling; first suspect/dead and
  everyone-agrees latency. SWIM §3.1: expected first detection ≤ e/(e−1) ≈ 1.58 periods
  (the target is picked by someone within that), plus the probe's own period.
- ``dissemination``: metadata updates injected at random members; time to 50/99/99.99/100%
  for a sweep of n (SWIM §4.1: O(log n) periods; Serf's model in docs/design.md §5.8).
- ``loss``: the same under independent packet loss p, next to Serf's convergence model
  ``1/(1 + (n+1)·e^(−contact·n·r))``, contact = (fanout/n)(1−p)·0.5, rounds of the
  gossip interval (a lower bound: it ignores retransmit and packet-size limits).
- ``scale``: 10,000 nodes for 60 s with one crash and one update: wall time, events/s and
  memory per simulated node.
"""

from __future__ import annotations

import math
import resource
import time

from simulations.experiments import scenarios_faults
from simulations.experiments.harness import (
    REGISTRY,
    Params,
    RateSampler,
    build,
    combine_hashes,
    drive,
    mean,
    scenario,
)
from simulations.experiments.result import Plot, Result
from simulations.model.metrics import LoadWindow, Metrics, Spread
from simulations.model.world import World


def run(name: str, p: Params) -> Result:
    """Run the scenario ``name`` (see ``REGISTRY``)."""
    if name not in REGISTRY:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name](p)


def _fp_summary(result: Result, counts: dict[str, int]) -> None:
    result.summary.update(counts)


@scenario("steady")
def steady(p: Params) -> Result:
    n = p.n(100, 12)
    duration = p.duration_ms(60, 8)
    sim = build(p, n, loss=p.loss or 0.0)
    world = sim.world
    sampler = RateSampler(world)
    window = LoadWindow.open(world)
    drive(world, world.now_ms + duration, p.progress)
    load = window.close(world)
    result = Result("steady", p.seed, world.trace_hash(), {**p.describe(), "nodes": n})
    result.summary.update(
        {
            "bootstrapped": sim.bootstrapped,
            "member_events": world.member_events,
            "events_processed": world.events_processed,
            "pkts_sent_per_member_per_period": load.get("pkts_sent_per_member_per_period"),
            "pkts_recv_per_member_per_period": load.get("pkts_recv_per_member_per_period"),
            "bytes_out_per_member_per_s": load.get("bytes_out_per_s_mean"),
            "streams_out_per_member_per_s": load.get("streams_out_per_s_mean"),
        }
    )
    _fp_summary(result, sim.metrics.fp_counts())
    result.tables["load"] = [load]
    result.tables["false_positives"] = sim.metrics.fp_rows()
    result.plots.append(
        Plot(
            "rate",
            "packets sent per member per second",
            "time (s)",
            "packets/s",
            {"sent": sampler.points},
        )
    )
    result.notes.append("SWIM §5 Fig. 2: ≈2.0 msgs/member/period sent (ping+ack), SWIM:Basic.")
    return result


@scenario("crash")
def crash(p: Params) -> Result:
    n = p.n(50, 12)
    crashes = p.get("crashes", 2 if p.ci else 5)
    config = p.make_config()
    gap_ms = p.get("gap_s", 12.0 if p.ci else 25.0) * 1000
    duration = p.duration_ms(crashes * gap_ms / 1000 + 30, crashes * gap_ms / 1000 + 14)
    sim = build(p, n, loss=p.loss or 0.0, settle_ms=5_000)
    world = sim.world
    start = world.now_ms
    victims = world.rng.sample(range(n), crashes)
    for k, victim in enumerate(victims):
        world.at(
            start + int(k * gap_ms) + world.rng.randrange(config.probe_interval_ms),
            world.crash,
            victim,
        )
    window = LoadWindow.open(world)
    drive(world, start + duration, p.progress)
    metrics = sim.metrics
    rows = metrics.crash_rows()
    for row in rows:
        for key in ("first_suspect_s", "first_dead_s", "all_dead_s"):
            value = row[key]
            row[key[:-2] + "_periods"] = (
                None if value is None else value * 1000 / config.probe_interval_ms
            )
    period_s = config.probe_interval_ms / 1000
    suspects: list[float] = [r["first_suspect_s"] for r in rows if r["first_suspect_s"] is not None]
    deads = [r["first_dead_s"] for r in rows if r["first_dead_s"] is not None]
    alls = [r["all_dead_s"] for r in rows if r["all_dead_s"] is not None]
    result = Result("crash", p.seed, world.trace_hash(), {**p.describe(), "nodes": n})
    result.summary.update(
        {
            "crashes": len(rows),
            "detected_by_all": len(alls),
            "first_suspect_mean_s": mean(suspects),
            "first_suspect_mean_periods": None
            if not suspects
            else sum(suspects) / len(suspects) / period_s,
            "swim_expected_first_detection_periods": math.e / (math.e - 1),
            "first_dead_mean_s": mean(deads),
            "all_dead_mean_s": mean(alls),
            "all_dead_max_s": max(alls) if alls else None,
        }
    )
    _fp_summary(result, metrics.fp_counts())
    result.tables["detection"] = rows
    result.tables["false_positives"] = metrics.fp_rows()
    result.tables["load"] = [window.close(world)]
    spreads = metrics.crash_dissemination()
    result.tables["dead_dissemination"] = [s.row() for s in spreads]
    result.plots.append(_spread_plot("dead_spread", "dead message reaching the others", spreads))
    result.notes.append(
        "first_suspect includes the failed probe itself (one period); SWIM's e/(e−1) counts "
        "from the failure to the start of the probe that catches it."
    )
    return result


def _spread_plot(name: str, title: str, spreads: list[Spread]) -> Plot:
    series = {}
    for s in spreads[:8]:
        times = sorted(t - s.start_ms for t in s.reached.values())
        total = max(1, len(s.population))
        series[s.label] = [(t / 1000, (i + 1) / total) for i, t in enumerate(times)]
    return Plot(name, title, "time since injection (s)", "fraction of members", series, step=True)


def _spread_run(
    p: Params, n: int, updates: int, loss: float, seed: int
) -> tuple[str, list[Spread]]:
    sim = build(p, n, seed=seed, loss=loss)
    world = sim.world
    gap_ms = p.get("update_gap_s", 5.0) * 1000
    for k in range(updates):
        world.at(world.now_ms + int(k * gap_ms), _inject, sim.metrics, world.rng.randrange(n))
    drive(world, world.now_ms + int(updates * gap_ms) + 10_000, p.progress)
    return world.trace_hash(), sim.metrics.spreads


def _inject(metrics: Metrics, origin: int) -> None:
    metrics.inject_update(origin)


def _spread_summary(spreads: list[Spread]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in ("t50_s", "t99_s", "t99_99_s", "t100_s"):
        values = [s.row()[key] for s in spreads if s.row()[key] is not None]
        out[key] = mean(values)
        out[key + "_max"] = max(values) if values else None
    return out


def serf_model_s(n: int, q: float, loss: float, interval_ms: int, fanout: int) -> float:
    """Serf simulator: first whole round r with converged(r) ≥ q (docs/design.md §5.8)."""
    contact = (fanout / n) * (1 - loss) * 0.5
    r = math.log((n + 1) * q / (1 - q)) / (contact * n) if q < 1 else math.inf
    return math.ceil(r) * interval_ms / 1000


@scenario("dissemination")
def dissemination(p: Params) -> Result:
    top = p.n(200, 24)
    sweep = [x for x in (10, 30, 100, 300, 1000, 3000, 10000) if x < top] + [top]
    if p.ci:
        sweep = [8, top]
    updates = p.get("updates", 2 if p.ci else 5)
    return _spread_scenario("dissemination", p, sweep, [p.loss or 0.0], updates)


@scenario("loss")
def loss(p: Params) -> Result:
    n = p.n(100, 16)
    losses = [p.loss] if p.loss is not None else ([0.1] if p.ci else [0.0, 0.1, 0.3])
    updates = p.get("updates", 2 if p.ci else 10)
    return _spread_scenario("loss", p, [n], losses, updates)


def _spread_scenario(
    name: str, p: Params, sweep: list[int], losses: list[float], updates: int
) -> Result:
    config = p.make_config()
    rows = []
    hashes = []
    plot_series: dict[str, list[tuple[float, float]]] = {}
    all_spreads: list[Spread] = []
    fp_rows: list[dict[str, object]] = []
    for loss_p in losses:
        for n in sweep:
            h, spreads = _spread_run(p, n, updates, loss_p, p.seed)
            hashes.append(h)
            all_spreads += spreads
            summary = _spread_summary(spreads)
            row: dict[str, object] = {"n": n, "loss": loss_p, "updates": len(spreads), **summary}
            for q, label in ((0.5, "50"), (0.99, "99"), (0.9999, "99_99")):
                model = serf_model_s(n, q, loss_p, config.gossip_interval_ms, config.gossip_nodes)
                row[f"serf_model_t{label}_s"] = model
                measured = summary[f"t{label}_s"]
                row[f"measured_over_model_t{label}"] = (
                    None if measured is None else measured / model
                )
            rows.append(row)
            for key in ("t50_s", "t99_s", "t100_s"):
                value = summary[key]
                if value is not None:
                    plot_series.setdefault(f"{key} loss={loss_p}", []).append((n, value))
    result = Result(name, p.seed, combine_hashes(hashes), {**p.describe(), "sweep": sweep})
    result.summary.update({k: v for k, v in rows[-1].items() if k != "updates"})
    result.tables["spread"] = rows
    result.tables["updates"] = [s.row() for s in all_spreads]
    result.tables["false_positives"] = fp_rows
    if len(sweep) > 1:
        result.plots.append(
            Plot(
                "vs_n",
                "time to reach members (mean over updates); log n axis",
                "n",
                "seconds",
                plot_series,
                logx=True,
            )
        )
    result.plots.append(_spread_plot("curves", "update reaching the members", all_spreads))
    result.notes.append(
        "serf_model_* is Serf's convergence simulator (docs/design.md §5.8), a lower bound."
    )
    return result


@scenario("scale")
def scale(p: Params) -> Result:
    n = p.n(10_000, 200)
    duration = p.duration_ms(60, 5)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    wall0 = time.perf_counter()
    sim = build(p, n, loss=p.loss or 0.0, settle_ms=0)
    world = sim.world
    built_s = time.perf_counter() - wall0
    rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert sim.checker is not None  # a SWIM world
    sim.checker.full_every = 0
    start = world.now_ms
    world.at(start + duration // 3, world.crash, world.rng.randrange(n))
    world.at(start + duration // 2, _inject, sim.metrics, world.rng.randrange(n))
    events0 = world.events_processed
    wall1 = time.perf_counter()
    timeline: list[tuple[float, float, int]] = []

    def record(w: World) -> None:
        timeline.append((w.now_ms / 1000, time.perf_counter() - wall1, w.events_processed))
        if p.progress is not None:
            p.progress(w)

    drive(world, start + duration, record)
    run_s = time.perf_counter() - wall1
    # after the start-up transient (every node gossips its own alive once at start)
    warm = next((x for x in timeline if x[0] >= min(5.0, duration / 2000)), timeline[0])
    steady_events = world.events_processed - warm[2]
    steady_wall = run_s - warm[1]
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    events = world.events_processed - events0
    result = Result("scale", p.seed, world.trace_hash(), {**p.describe(), "nodes": n})
    crash_rows = sim.metrics.crash_rows()
    result.summary.update(
        {
            "bootstrapped": sim.bootstrapped,
            "build_wall_s": built_s,
            "run_wall_s": run_s,
            "sim_s": duration / 1000,
            "events": events,
            "events_per_wall_s": events / run_s if run_s else None,
            "steady_events_per_wall_s": steady_events / steady_wall if steady_wall > 0 else None,
            "steady_from_sim_s": warm[0],
            "sim_speed_x": (duration / 1000) / run_s if run_s else None,
            "rss_max_mib": rss_after / 1024,
            "rss_per_node_kib_built": (rss_built - rss_before) / n,
            "rss_per_node_kib": (rss_after - rss_before) / n,
            "member_events": world.member_events,
        }
    )
    if crash_rows:
        result.summary.update({f"crash_{k}": v for k, v in crash_rows[0].items()})
    if sim.metrics.spreads:
        result.summary.update({f"update_{k}": v for k, v in sim.metrics.spreads[0].row().items()})
    _fp_summary(result, sim.metrics.fp_counts())
    result.tables["detection"] = crash_rows
    result.tables["updates"] = [s.row() for s in sim.metrics.spreads]
    result.notes.append("RSS is ru_maxrss (peak), so per-node figures are upper bounds.")
    result.tables["timeline"] = [{"sim_s": t, "wall_s": w, "events": e} for t, w, e in timeline]
    result.plots.append(
        Plot(
            "speed",
            "simulated vs wall time",
            "wall (s)",
            "simulated (s)",
            {"run": [(w, t) for t, w, _ in timeline]},
        )
    )
    return result


__all__ = ["REGISTRY", "run", "scenarios_faults", "serf_model_s"]
