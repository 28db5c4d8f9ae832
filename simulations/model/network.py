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
  honour reachability; by default not loss (TCP retransmits; memberlist's TCP fallback ping
  exists because UDP can be lost while TCP gets through: memberlist state.go ``probeNode``).
- Lossy TCP (``tcp_loss = True``; off by default, which keeps every pinned trace): a stream
  is a chain of segments, each crossing its link like a datagram. A lost segment is sent
  again after a fixed RTO of ``TCP_RTO_MS`` = 200 ms (Linux's minimum RTO,
  ``TCP_RTO_MIN`` in include/net/tcp.h; real TCP doubles it on each further loss, so this is
  the optimistic end), at most ``TCP_MAX_SENDS`` times per segment. Opening costs 3
  segments (SYN →, SYN-ACK ←, request →) plus ``tcp_extra_ms``; the reply 1 more. With
  one-way delay L, loss p and a budget B (deadline − now) the k segments all get through
  in time iff their retransmissions F_1..F_k (each geometric: P(F = j) = (1 − p)·p^j) have
  kL + extra + RTO·ΣF ≤ B, so P(success) = Σ_{j=0..m} C(j+k−1, j)(1 − p)^k p^j with
  m = ⌊(B − kL − extra)/RTO⌋ (negative binomial; ``stream_success_probability``).
  A stream that cannot finish in time is ``TIMED_OUT``: the opener's error is "timeout"
  at its deadline. A link's p is its independent loss combined with the burst model's
  stationary loss (1 − (1 − p)(1 − p_burst)); ACKs and the burst chain's state are not
  modelled. Draws per segment, in order: one ``random()`` per send (none at p = 0), one
  latency sample for the send that arrives. Partitions and blocked pairs cut a stream:
  lossy TCP needs both directions for the handshake; the lossless model checks src → dst
  to open and dst → src for the reply (so a one-way block lets the request through).
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

TCP_RTO_MS = 200
TCP_MAX_SENDS = 16
UNREACHABLE = -1
TIMED_OUT = -2


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
        self.tcp_loss = False
        """Streams lose and retransmit segments (module docstring); False: lossless TCP."""
        self.tcp_extra_ms = 0
        """Lossy TCP only: added to every stream's opening (e.g. a slow accept)."""

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

    def link_loss_probability(self, src: int, dst: int) -> float:
        """The chance a segment src → dst is lost: independent and mean burst loss."""
        p = self.link_loss.get((src, dst), self.loss) if self.link_loss else self.loss
        if self.burst is not None:
            p = 1 - (1 - p) * (1 - self.burst.mean_loss())
        return p

    def segments(self, hops: list[tuple[int, int]], budget_ms: int) -> int:
        """Milliseconds for segments to cross ``hops`` in order with retransmission,
        ``UNREACHABLE`` or ``TIMED_OUT`` (past ``budget_ms``)."""
        rng = self.rng
        total = 0
        for src, dst in hops:
            if not self._fast and not self.reachable(src, dst):
                return UNREACHABLE
            p = self.link_loss_probability(src, dst)
            sends = 1
            while p and rng.random() < p:
                total += TCP_RTO_MS
                sends += 1
                if sends > TCP_MAX_SENDS or total > budget_ms:
                    return TIMED_OUT
            lat = self.link_latency.get((src, dst), self.latency) if self.link_latency else None
            total += (lat or self.latency).sample(rng)
            if total > budget_ms:
                return TIMED_OUT
        return total

    def stream_open(self, src: int, dst: int, budget_ms: int) -> tuple[int, int]:
        """(milliseconds until ``dst`` reads the request, a one-way delay for an answer
        without a reply) or (``UNREACHABLE``/``TIMED_OUT``, 0). Lossless: 3 × one draw."""
        if not self.tcp_loss:
            d = self.stream_delay(src, dst)
            return (UNREACHABLE, 0) if d < 0 else (3 * d, d)
        t = self.segments([(src, dst), (dst, src), (src, dst)], budget_ms - self.tcp_extra_ms)
        return (t, 0) if t < 0 else (t + self.tcp_extra_ms, max(1, t // 3))

    def stream_reply(self, src: int, dst: int, budget_ms: int) -> int:
        """Milliseconds for ``src``'s reply to reach ``dst``, or a negative code."""
        if not self.tcp_loss:
            return self.stream_delay(src, dst)
        return self.segments([(src, dst)], budget_ms)

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


def stream_success_probability(
    loss: float, segments: int, one_way_ms: int, budget_ms: int, extra_ms: int = 0
) -> float:
    """The closed form of the module docstring: P(``segments`` segments over a link with
    constant delay ``one_way_ms`` and loss ``loss`` all arrive within ``budget_ms``)."""
    slack = budget_ms - segments * one_way_ms - extra_ms
    if slack < 0:
        return 0.0
    # each segment is sent at most TCP_MAX_SENDS times: m counts retransmissions in all
    m = slack // TCP_RTO_MS
    if m >= TCP_MAX_SENDS and loss > 0:
        raise ValueError("budget long enough for the send cap to matter: no closed form here")
    q = 1 - loss
    return sum(math.comb(j + segments - 1, j) * q**segments * loss**j for j in range(m + 1))
