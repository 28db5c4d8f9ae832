"""Lifeguard's LHA-Suspicion: one timer per suspected member, shortened by independent
confirmations.

Rules (hashicorp/memberlist @ 1b4c746 suspicion.go, state.go ``suspectNode``; Lifeguard,
arXiv:1707.00788 §IV-B; docs/design.md §5.3):
- A suspicion opened among n members runs for ``max_ms`` and expects ``k`` confirmations
  (``suspicion_window_ms``). Each accuser not heard before is one confirmation; with c of k
  the timer is re-armed for ``formulas.remaining_suspicion_time_ms`` (log-decay from max
  towards min), counted from when the suspicion began. With k = 0 the timer runs for min.
- Confirmations stop counting at k; a repeated accuser never counts twice.
- With ``confirmed_suspicion_safety_mult`` (ours) the k-th confirmation may end
  the window below min, at ``confirmed_window_ms``: k + 1 members that each failed to
  reach the suspect directly, through helpers and over TCP are stronger evidence than one,
  so the window need only cover the refutation's own travel (safety 1), not a margin on
  it. Fewer than k confirmations keep Lifeguard's decay and its min.
- With ``small_group_confirmations`` (ours) a group with fewer members than k needs
  (memberlist's k = 0) expects a confirmation from each of the n − 2 members that could
  give one; its timer starts at min as before (no decay from max, which would lengthen a
  suspicion nobody can confirm), and all n − 2 end it at ``confirmed_window_ms``.
- A member has at most one open suspicion; the timer carries the member's
  ``state_change_ms``, so the timer of an earlier suspicion of the same member is stale.
- Starvation (ours, ``starved_lag_ms``): a suspicion whose timer runs out while this node
  was itself starved since the suspicion began (``Awareness.starved_since``, from one probe
  interval before it) is held once, to Lifeguard's maximum window counted from its start,
  and then goes to the last-chance ping whatever its confirmations: a refutation that a
  starved box delays, and confirmations from members starved alike, decide nothing.
- A member that recovered lately (ours, ``recovered_hold_ms``): a suspicion of a member
  that was suspect, dead or left in our view and came back alive, or came back at a
  higher incarnation with the same metadata (``recovered``: it refuted an accusation, or
  restarted) less than that long ago is held from the start,
  the same way. Such a member has just shown that it is slow, not gone; before a false
  death on a saturated box it had refuted an earlier accusation in 1,713 of 1,714 cases
  (docs/design.md §5.7). A first join is no such evidence and keeps the usual windows.
  Recovery times are kept per name, at most ``max_members`` of them, expired ones first.
- What happens when the timer fires (a last-chance ping, or death) is ``swim.node``'s and
  ``swim.membership``'s; this module only keeps the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swim import formulas
from swim.config import Config
from swim.context import Context
from swim.timers import SuspicionTimeout

__all__ = ["Suspicion", "Suspicions", "confirmed_window_ms", "suspicion_window_ms"]


def suspicion_window_ms(config: Config, n: int, typical_rtt_ms: int) -> tuple[int, int, int]:
    """(min, max, k) of a suspicion opened among ``n`` members (state.go ``suspectNode``).

    min is memberlist's α·log10(n)·interval, or with ``derived_suspicion`` the window a
    refutation needs (``_derived_ms``). Without dynamic suspicion, max = min and k = 0.
    """
    if config.derived_suspicion:
        min_ms = _derived_ms(config, n, typical_rtt_ms, config.suspicion_safety_mult)
    else:
        min_ms = formulas.suspicion_timeout_ms(config.suspicion_mult, n, config.probe_interval_ms)
    if not config.lifeguard_dynamic_suspicion:
        return min_ms, min_ms, 0
    k = formulas.suspicion_confirmations(config.suspicion_mult, n)
    return min_ms, config.suspicion_max_timeout_mult * min_ms, k


def confirmed_window_ms(config: Config, n: int, typical_rtt_ms: int) -> int:
    """Where a suspicion with all k confirmations ends, counted from its start: the derived
    window at ``confirmed_suspicion_safety_mult``, or min when that is 0 (Lifeguard)."""
    min_ms = suspicion_window_ms(config, n, typical_rtt_ms)[0]
    return _confirmed_ms(config, n, typical_rtt_ms, min_ms)


def _derived_ms(config: Config, n: int, typical_rtt_ms: int, safety_mult: int) -> int:
    """``formulas.derived_suspicion_timeout_ms`` with the RTT bounded by
    ``probe_timeout_max_ms``, since a stalled member's RTTs include its own pauses."""
    return formulas.derived_suspicion_timeout_ms(
        n,
        config.gossip_interval_ms,
        config.gossip_nodes,
        min(typical_rtt_ms, config.probe_timeout_max_ms),
        safety_mult,
    )


def _confirmed_ms(config: Config, n: int, typical_rtt_ms: int, min_ms: int) -> int:
    """``confirmed_window_ms`` given the unconfirmed ``min_ms`` already computed."""
    if not config.confirmed_suspicion_safety_mult:
        return min_ms
    return min(
        min_ms, _derived_ms(config, n, typical_rtt_ms, config.confirmed_suspicion_safety_mult)
    )


@dataclass(slots=True)
class Suspicion:
    """One open suspicion (suspicion.go ``suspicion``)."""

    k: int
    min_ms: int
    max_ms: int
    start_ms: int
    timer_id: int
    confirmed_min_ms: int
    """Where the window ends once all k confirmations are in (``confirmed_window_ms``)."""
    confirmers: set[str] = field(default_factory=set)
    confirmations: int = 0
    small: bool = False
    """A small group's k (``small_group_confirmations``): until all k are in, the window is
    min, not Lifeguard's decay from max."""
    held: bool = False
    """Held to max, unshortened by confirmations, then verified: the member recovered from
    an accusation lately (``recovered_hold_ms``) or this node was starved meanwhile
    (``hold_if_starved``)."""

    @property
    def unconfirmed(self) -> bool:
        """Fewer than k confirmations (or k is 0): nobody else has backed the accusation."""
        return self.k == 0 or self.confirmations < self.k


class Suspicions:
    """The open suspicions of one node, by member name."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._open: dict[str, Suspicion] = {}
        self._recovered_ms: dict[str, int] = {}
        """When each member last recovered, for ``recovered_hold_ms`` (bounded: ``recovered``)."""

    def recovered(self, name: str) -> None:
        """``name``, which we held suspect, dead or left, is alive now, or alive at a higher
        incarnation with the same metadata (it refuted an accusation, perhaps one we never
        saw, or it restarted): evidence that it is slow rather than gone."""
        ctx = self._ctx
        hold_ms = ctx.config.recovered_hold_ms
        if not hold_ms:
            return
        if len(self._recovered_ms) >= ctx.config.max_members:  # the bound: expired first
            self._recovered_ms = {
                n: t for n, t in self._recovered_ms.items() if ctx.now_ms - t < hold_ms
            }
            if len(self._recovered_ms) >= ctx.config.max_members:
                return
        self._recovered_ms.pop(name, None)
        self._recovered_ms[name] = ctx.now_ms

    def _recovering(self, name: str) -> bool:
        recovered_ms = self._recovered_ms.get(name)
        hold_ms = self._ctx.config.recovered_hold_ms
        return recovered_ms is not None and self._ctx.now_ms - recovered_ms < hold_ms

    def get(self, name: str) -> Suspicion | None:
        return self._open.get(name)

    def start(self, name: str, state_change_ms: int, accuser: str, n: int) -> None:
        """Open the suspicion of ``name`` (now suspect since ``state_change_ms``)."""
        ctx = self._ctx
        rtt_ms = ctx.rtt.typical_ms
        min_ms, max_ms, k = suspicion_window_ms(ctx.config, n, rtt_ms)
        small = _small_group(ctx.config, n, k)
        if small:
            k = n - 2
        held = self._recovering(name)
        timeout_ms = max_ms if held or (k >= 1 and not small) else min_ms
        timer_id = ctx.set_timer(SuspicionTimeout, timeout_ms, name, state_change_ms)
        confirmed_ms = _confirmed_ms(ctx.config, n, rtt_ms, min_ms) if k else min_ms
        suspicion = Suspicion(
            k, min_ms, max_ms, ctx.now_ms, timer_id, confirmed_ms, held=held, small=small
        )
        suspicion.confirmers.add(accuser)
        self._open[name] = suspicion

    def confirm(self, name: str, state_change_ms: int, accuser: str) -> bool:
        """suspicion.go ``Confirm``: True if ``accuser`` is a new, counted confirmation (the
        timer is then shortened); False if there is no suspicion or it does not count."""
        s = self._open.get(name)
        if s is None or s.confirmations >= s.k or accuser in s.confirmers:
            return False
        ctx = self._ctx
        s.confirmers.add(accuser)
        s.confirmations += 1
        if s.held:  # held to max: confirmations from a starved box do not shorten it
            return True
        remaining = _remaining_ms(s, ctx.now_ms - s.start_ms)
        ctx.cancel_timer(s.timer_id)
        s.timer_id = ctx.set_timer(SuspicionTimeout, max(remaining, 0), name, state_change_ms)
        return True

    def hold_if_starved(self, name: str, s: Suspicion, state_change_ms: int) -> bool:
        """If this node was starved since one probe interval before ``s`` began and it has
        not been held yet, re-arm its timer for ``start + max`` (at least one probe
        interval from now) and mark it held; True if it was held."""
        ctx = self._ctx
        since_ms = s.start_ms - ctx.config.probe_interval_ms
        if s.held or not ctx.awareness.starved_since(since_ms):
            return False
        s.held = True
        wait_ms = max(s.start_ms + s.max_ms - ctx.now_ms, ctx.config.probe_interval_ms)
        s.timer_id = ctx.set_timer(SuspicionTimeout, wait_ms, name, state_change_ms)
        ctx.stats.suspicions_held_starved += 1
        return True

    def cancel(self, name: str) -> None:
        s = self._open.pop(name, None)
        if s is not None:
            self._ctx.cancel_timer(s.timer_id)

    def deadline_ms(self, name: str) -> int | None:
        """When the suspicion of ``name`` runs out as things stand, or None if none is open."""
        s = self._open.get(name)
        if s is None:
            return None
        if s.held:
            return s.start_ms + s.max_ms  # no earlier than its timer (``hold_if_starved``)
        if s.k < 1:
            return s.start_ms + s.min_ms
        return s.start_ms + _remaining_ms(s, 0)


def _small_group(config: Config, n: int, k: int) -> bool:
    """The group is too small for Lifeguard's k and ``small_group_confirmations`` asks the
    n − 2 members that could confirm instead."""
    return (
        config.small_group_confirmations
        and config.lifeguard_dynamic_suspicion
        and k == 0
        and n - 2 >= 1
        and config.suspicion_mult - 2 > n - 2
    )


def _remaining_ms(s: Suspicion, elapsed_ms: int) -> int:
    """Time left ``elapsed_ms`` after the start: Lifeguard's decay, or the confirmed window
    once all k confirmations are in (a small group's: min until then)."""
    if s.confirmations >= s.k:
        return s.confirmed_min_ms - elapsed_ms
    if s.small:
        return s.min_ms - elapsed_ms
    return formulas.remaining_suspicion_time_ms(
        s.confirmations, s.k, elapsed_ms, s.min_ms, s.max_ms
    )
