"""Shared machinery for scenarios: parameters, building a checked and measured world,
driving it with progress reports, Lifeguard ablation switches, periodic samplers.

Rules: a scenario is a function ``Params -> Result``; it builds its world(s) with
``build``, so every run has the invariant checker and the metrics attached, starts from a
converged membership (bootstrapped from a ``swim.MembershipSnapshot`` when the core has
one and ``--set bootstrap=0`` is not given, else joined through a seed and run until
everyone sees everyone), and advances time
only through ``drive`` (which calls the progress hook between chunks; wall-clock time is
read by the caller, never inside the world).

Lifeguard ablation (arXiv 1707.00788 §IV/§V; docs/design.md §5.3, §5.4, §5.8): ``swim`` turns every
Lifeguard mechanism off (fixed suspicion timeout = min, no local health, no nacks, no
buddy); ``lha-probe`` = local health multiplier with nacks; ``lha-suspicion`` = dynamic
suspicion timeouts with confirmations; ``buddy`` = buddy system only; ``full`` = all.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from simulations.experiments.result import Result
from simulations.model.invariants import InvariantChecker
from simulations.model.metrics import Metrics
from simulations.model.network import GilbertElliott, parse_latency
from simulations.model.world import World
from swim import PROFILES, Config, Node

PRESETS: dict[str, Callable[..., Config]] = {
    name: functools.partial(Config.profile, name) for name in PROFILES
}

_OFF = {
    "lifeguard_lhm": False,
    "lifeguard_dynamic_suspicion": False,
    "lifeguard_nacks": False,
    "lifeguard_buddy": False,
}
LIFEGUARD: dict[str, dict[str, bool]] = {
    "full": {},
    "swim": dict(_OFF),
    "lha-probe": {**_OFF, "lifeguard_lhm": True, "lifeguard_nacks": True},
    "lha-suspicion": {**_OFF, "lifeguard_dynamic_suspicion": True},
    "buddy": {**_OFF, "lifeguard_buddy": True},
}

Progress = Callable[[World], None]


@dataclass(slots=True)
class Params:
    nodes: int | None = None
    """None: the scenario's default."""
    seed: int = 1
    duration_s: float | None = None
    config: str = "lan"
    lifeguard: str = "full"
    slow: int | None = None
    loss: float | None = None
    latency: str = "uniform:1:5"
    full_checks: bool = False
    ci: bool = False
    """Small and short: the variant the test-suite runs."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Scenario-specific knobs (``--set key=value`` on the command line); ``cfg.FIELD``
    keys override ``swim.Config`` fields (e.g. ``cfg.suspicion_mult=2``)."""
    progress: Progress | None = None

    def n(self, default: int, ci_default: int) -> int:
        if self.nodes is not None:
            return self.nodes
        return ci_default if self.ci else default

    def duration_ms(self, default_s: float, ci_default_s: float) -> int:
        if self.duration_s is not None:
            return int(self.duration_s * 1000)
        return int((ci_default_s if self.ci else default_s) * 1000)

    def get(self, key: str, default: Any) -> Any:
        value = self.extra.get(key, default)
        return type(default)(value) if default is not None and value is not None else value

    def make_config(self, lifeguard: str | None = None) -> Config:
        mode = lifeguard or self.lifeguard
        if mode not in LIFEGUARD:
            raise ValueError(f"unknown lifeguard mode {mode!r} ({', '.join(LIFEGUARD)})")
        if self.config not in PRESETS:
            raise ValueError(f"unknown config {self.config!r} ({', '.join(PRESETS)})")
        overrides: dict[str, Any] = dict(LIFEGUARD[mode])
        for key, value in self.extra.items():
            if key.startswith("cfg."):
                overrides[key[4:]] = _config_value(key[4:], value)
        return PRESETS[self.config](**overrides)

    def describe(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "config": self.config,
            "lifeguard": self.lifeguard,
            "latency": self.latency,
            "loss": self.loss,
            "slow": self.slow,
            "duration_s": self.duration_s,
            "ci": self.ci,
            **{f"set.{k}": v for k, v in sorted(self.extra.items())},
        }


def _config_value(field_name: str, value: Any) -> Any:
    """``--set cfg.suspicion_mult=5``: a Config field, typed like its default."""
    default = getattr(Config(), field_name, None)
    if default is None:
        raise ValueError(f"Config has no field {field_name!r}")
    if isinstance(default, bool):
        return str(value).lower() in ("1", "true", "yes", "on")
    return int(value)


@dataclass(slots=True)
class Sim:
    world: World
    metrics: Metrics
    checker: InvariantChecker | None
    """None for a baseline protocol (``build(node_factory=...)``)."""
    bootstrapped: bool
    settled_ms: int


def build(
    p: Params,
    n: int,
    *,
    seed: int | None = None,
    config: Config | None = None,
    loss: float = 0.0,
    settle_ms: int = 2_000,
    node_factory: Callable[..., Node] | None = None,
) -> Sim:
    """A started, converged world of ``n`` nodes with checks and metrics attached.

    ``node_factory`` builds a baseline protocol instead of ``swim.Node``
    (``simulations.experiments.heartbeat``); the SWIM invariant checker is then left off (it reads
    SWIM state), and the world must bootstrap."""
    world = World(
        n,
        seed=p.seed if seed is None else seed,
        config=config if config is not None else p.make_config(),
        latency=parse_latency(p.latency),
        loss=0.0,
        node_factory=node_factory,
    )
    checker = None
    if node_factory is None:
        checker = InvariantChecker(
            world,
            full=p.full_checks,
            full_every=0 if n > 200 else 997,
            own_every=1 if n <= 1000 else 7,
        )
    metrics = Metrics(world)
    bootstrapped = world.start_all(bootstrap=bool(p.get("bootstrap", 1)))
    if not bootstrapped:
        limit = 60_000 + 100 * n
        converged = world.run_until_true(
            lambda: all(node.num_members() == n for node in world.nodes), limit, step_ms=100
        )
        if converged < 0:
            raise RuntimeError(f"{n} nodes did not converge within {limit} ms of joining")
    net = world.network
    net.loss = loss
    net.duplicate = p.get("duplicate", 0.0)
    net.tcp_loss = bool(p.get("lossy_tcp", 0))
    if p.get("reorder", 0.0):
        net.set_reorder(p.get("reorder", 0.0), p.get("reorder_ms", 20))
    burst = p.get("burst", "")
    if burst:
        values = [float(x) for x in burst.split(":")]
        loss_bad = values[2] if len(values) > 2 else 1.0
        net.set_burst(
            GilbertElliott(values[0], values[1], 0.0, loss_bad, p.get("burst_scope", "link"))
        )
    drive(world, world.now_ms + settle_ms, p.progress)
    return Sim(world, metrics, checker, bootstrapped, world.now_ms)


def drive(world: World, until_ms: int, progress: Progress | None, chunk_ms: int = 1000) -> None:
    """Advance to ``until_ms`` in chunks, reporting progress between them."""
    while world.now_ms < until_ms:
        world.run_until(min(until_ms, world.now_ms + chunk_ms))
        if progress is not None:
            progress(world)


Scenario = Callable[["Params"], Result]
REGISTRY: dict[str, Scenario] = {}


def scenario(name: str) -> Callable[[Scenario], Scenario]:
    """Register a scenario function under ``name``."""

    def register(fn: Scenario) -> Scenario:
        REGISTRY[name] = fn
        return fn

    return register


def combine_hashes(hashes: list[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for x in hashes:
        h.update(x.encode())
    return h.hexdigest()


class RateSampler:
    """Cluster-wide packets sent per live member per second, sampled each second."""

    def __init__(self, world: World, period_ms: int = 1000) -> None:
        self.world = world
        self.period_ms = period_ms
        self.points: list[tuple[float, float]] = []
        self._last = sum(world.traffic.pkts_out)
        world.at(world.now_ms + period_ms, self._tick)

    def _tick(self) -> None:
        world = self.world
        total = sum(world.traffic.pkts_out)
        live = max(1, len(world.live_indices()))
        rate = (total - self._last) / live / (self.period_ms / 1000)
        self.points.append((world.now_ms / 1000, rate))
        self._last = total
        world.at(world.now_ms + self.period_ms, self._tick)


def pauses(
    world: World, start_ms: int, end_ms: int, pause_ms: int, every_ms: int
) -> tuple[tuple[int, int], ...]:
    """A slow member's stops: ``pause_ms`` long every ``every_ms`` from a phase drawn with
    the world's RNG, between ``start_ms`` and ``end_ms`` (none if either is 0)."""
    if pause_ms <= 0 or every_ms <= 0:
        return ()
    out = []
    t = start_ms + world.rng.randrange(every_ms)
    while t < end_ms:
        out.append((t, t + pause_ms))
        t += max(every_ms, pause_ms + 1)
    return tuple(out)


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
