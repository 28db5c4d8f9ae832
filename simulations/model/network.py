"""The simulated network: latency distributions, loss, duplication, reordering, partitions.

Rules:
- Every random draw comes from the one ``random.Random`` the world hands in (derived from
  the run's seed), so a run is a function of its seed.
- Latency is an integer of milliseconds ≥ 0 drawn per packet from the link's distribution
  (a per-link override, else the default). Jitter reorders packets naturally; explicit
  reordering adds an extra uniform delay to a fraction of packets so they overtake.
- Loss is independent (Bernoulli p per packet, optionally per link) and/or bursty: the
  Gilbert–Elliott two-state Markov chain (good/bad, a loss probability in each, transition
  probabilities per packet), kept per directed link, per receiver or per sender.
- Reachability: partitions assign nodes to groups and block directed group pairs
  (symmetric = both directions, asymmetric = one); partial reachability blocks individual
  directed node pairs (serf#185: a node reachable only from some peers). Streams (TCP)
  honour reachability but not loss (TCP retransmits; memberlist's TCP fallback ping exists
  because UDP can be lost while TCP gets through: memberlist state.go ``probeNode``).
- Duplication: a delivered packet is delivered again with probability ``duplicate``, with
  its own latency draw.

Sources: SWIM §5 (receiver-side loss experiments), docs/design.md §5.8 (Serf's convergence
model), Gilbert (1960) / Elliott (1963) burst-noise channel.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass


class Latency:
    """A one-way delay distribution in integer milliseconds."""

    def sample(self, rng: random.Random) -> int:
        raise NotImplementedError

    def mean_ms(self) -> float:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Constant(Latency):
    ms: int

    def sample(self, rng: random.Random) -> int:
        return self.ms

    def mean_ms(self) -> float:
        return float(self.ms)


@dataclass(frozen=True, slots=True)
class Uniform(Latency):
    """Uniform over the integers low..high inclusive."""

    low_ms: int
    high_ms: int

    def sample(self, rng: random.Random) -> int:
        return self.low_ms + int(rng.random() * (self.high_ms - self.low_ms + 1))

    def mean_ms(self) -> float:
        return (self.low_ms + self.high_ms) / 2


@dataclass(frozen=True, slots=True)
class LogNormal(Latency):
    """Log-normal with the given median and log-space sigma, never below ``floor_ms``."""

    median_ms: float
    sigma: float
    floor_ms: int = 0

    def sample(self, rng: random.Random) -> int:
        return max(self.floor_ms, round(rng.lognormvariate(math.log(self.median_ms), self.sigma)))

    def mean_ms(self) -> float:
        return max(float(self.floor_ms), self.median_ms * math.exp(self.sigma**2 / 2))


@dataclass(frozen=True, slots=True)
class Normal(Latency):
    """Normal with mean and standard deviation, clipped at ``floor_ms``."""

    mean: float
    sd: float
    floor_ms: int = 0

    def sample(self, rng: random.Random) -> int:
        return max(self.floor_ms, round(rng.gauss(self.mean, self.sd)))

    def mean_ms(self) -> float:
        return max(float(self.floor_ms), self.mean)


def parse_latency(spec: str) -> Latency:
    """Parse ``const:2``, ``uniform:1:5``, ``lognormal:MEDIAN:SIGMA[:FLOOR]`` or
    ``normal:MEAN:SD[:FLOOR]``."""
    kind, *args = spec.split(":")
    try:
        if kind == "const":
            return Constant(int(args[0]))
        if kind == "uniform":
            return Uniform(int(args[0]), int(args[1]))
        if kind == "lognormal":
            floor = int(args[2]) if len(args) > 2 else 0
            return LogNormal(float(args[0]), float(args[1]), floor)
        if kind == "normal":
            floor = int(args[2]) if len(args) > 2 else 0
            return Normal(float(args[0]), float(args[1]), floor)
    except (IndexError, ValueError) as exc:
        raise ValueError(f"bad latency spec {spec!r}: {exc}") from exc
    raise ValueError(f"unknown latency kind {kind!r} (const, uniform, lognormal, normal)")


@dataclass(slots=True)
class GilbertElliott:
    """Two-state bursty loss: per packet, move good→bad with ``p_good_bad`` and bad→good
    with ``p_bad_good``, then lose it with the current state's loss probability.
    Mean burst length is 1/p_bad_good packets; stationary P(bad) = p_gb/(p_gb+p_bg)."""

    p_good_bad: float
    p_bad_good: float
    loss_good: float = 0.0
    loss_bad: float = 1.0
    scope: str = "link"
    """``link`` (per directed pair), ``receiver`` or ``sender``."""

    def mean_loss(self) -> float:
        total = self.p_good_bad + self.p_bad_good
        bad = self.p_good_bad / total if total else 0.0
        return bad * self.loss_bad + (1 - bad) * self.loss_good


class Network:
    """Decides, per packet, whether it arrives and after how many milliseconds."""

    def __init__(
        self,
        rng: random.Random,
        latency: Latency | None = None,
        loss: float = 0.0,
    ) -> None:
        self.rng = rng
        self.latency: Latency = latency if latency is not None else Uniform(1, 5)
        self.loss = loss
        self.duplicate = 0.0
        self.reorder = 0.0
        self.reorder_extra_ms = 0
        self.burst: GilbertElliott | None = None
        self.link_latency: dict[tuple[int, int], Latency] = {}
        self.link_loss: dict[tuple[int, int], float] = {}
        self._groups: dict[int, int] = {}
        self._blocked_groups: set[tuple[int, int]] = set()
        self._blocked_pairs: set[tuple[int, int]] = set()
        self._burst_bad: dict[object, bool] = {}
        self._fast = True

    # --- configuration ------------------------------------------------------------------

    def _refresh(self) -> None:
        self._fast = not (
            self.link_latency
            or self.link_loss
            or self._blocked_groups
            or self._blocked_pairs
            or self.burst is not None
            or self.reorder > 0
        )

    def set_burst(self, model: GilbertElliott | None) -> None:
        self.burst = model
        self._burst_bad.clear()
        self._refresh()

    def set_reorder(self, probability: float, extra_ms: int) -> None:
        """A fraction of packets is held back an extra uniform 0..extra_ms."""
        self.reorder, self.reorder_extra_ms = probability, extra_ms
        self._refresh()

    def set_link(
        self, src: int, dst: int, *, latency: Latency | None = None, loss: float | None = None
    ) -> None:
        if latency is not None:
            self.link_latency[(src, dst)] = latency
        if loss is not None:
            self.link_loss[(src, dst)] = loss
        self._refresh()

    def partition(self, groups: Iterable[Iterable[int]], *, symmetric: bool = True) -> None:
        """Put each listed group in its own island (unlisted nodes stay in group 0).

        Symmetric: no traffic between different groups. Asymmetric: a later group's packets
        to an earlier group (group 0 = the unlisted nodes) are dropped, while the reverse
        direction still works, which models a one-way firewall rule.
        """
        self._groups.clear()
        self._blocked_groups.clear()
        ids: list[int] = []
        for number, group in enumerate(groups, start=1):
            ids.append(number)
            for node in group:
                self._groups[node] = number
        everyone = [0, *ids]
        for a in everyone:
            for b in everyone:
                if a == b:
                    continue
                if symmetric or a > b:
                    self._blocked_groups.add((a, b))
        self._refresh()

    def block(self, src: int, dst: int) -> None:
        """Block the directed pair src → dst."""
        self._blocked_pairs.add((src, dst))
        self._refresh()

    def reachable_only_from(self, node: int, peers: Iterable[int], everyone: Iterable[int]) -> None:
        """``node`` exchanges traffic (both ways) only with ``peers``."""
        allowed = set(peers)
        for other in everyone:
            if other != node and other not in allowed:
                self._blocked_pairs.add((other, node))
                self._blocked_pairs.add((node, other))
        self._refresh()

    def heal(self) -> None:
        """Remove every partition and blocked pair (latency and loss settings stay)."""
        self._groups.clear()
        self._blocked_groups.clear()
        self._blocked_pairs.clear()
        self._refresh()

    # --- per packet ---------------------------------------------------------------------

    def reachable(self, src: int, dst: int) -> bool:
        if self._blocked_pairs and (src, dst) in self._blocked_pairs:
            return False
        if self._blocked_groups:
            g = self._groups
            return (g.get(src, 0), g.get(dst, 0)) not in self._blocked_groups
        return True

    def stream_delay(self, src: int, dst: int) -> int:
        """One-way delay for stream traffic, or -1 if the pair cannot reach each other."""
        if not self._fast and not self.reachable(src, dst):
            return -1
        lat = self.link_latency.get((src, dst), self.latency) if self.link_latency else None
        return (lat or self.latency).sample(self.rng)

    def delay(self, src: int, dst: int) -> int:
        """Milliseconds until a datagram src → dst arrives, or -1 if it is lost."""
        rng = self.rng
        if self._fast:
            if self.loss and rng.random() < self.loss:
                return -1
            return self.latency.sample(rng)
        if not self.reachable(src, dst):
            return -1
        loss = self.link_loss.get((src, dst), self.loss) if self.link_loss else self.loss
        if loss and rng.random() < loss:
            return -1
        burst = self.burst
        if burst is not None:
            key: object = (
                (src, dst) if burst.scope == "link" else dst if burst.scope == "receiver" else src
            )
            bad = self._burst_bad.get(key, False)
            bad = rng.random() >= burst.p_bad_good if bad else rng.random() < burst.p_good_bad
            self._burst_bad[key] = bad
            p = burst.loss_bad if bad else burst.loss_good
            if p and rng.random() < p:
                return -1
        lat = self.link_latency.get((src, dst), self.latency) if self.link_latency else None
        d = (lat or self.latency).sample(rng)
        if self.reorder and rng.random() < self.reorder:
            d += int(rng.random() * (self.reorder_extra_ms + 1))
        return d
