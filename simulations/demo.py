"""Demo: a cluster of real ``swim.Node`` state machines on a virtual clock.

Runs the shipped protocol core (real encoded packets, push-pull, Lifeguard) in the
simulated world (``simulations.model.world``): nodes join, one crashes, one is partitioned
away briefly and refutes its suspicion, one leaves gracefully. Prints the membership table
and a timeline with the time each event was seen, and the detection times the formulas
predict.

    python -m simulations.demo [--nodes 16] [--seed 1] [--profile lan|local|wan] [--loss 0.0]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

from simulations.model.network import Uniform
from simulations.model.views import EventLog, all_see, converged
from simulations.model.world import World
from swim import PROFILES as PROFILE_NAMES
from swim import (
    Config,
    EventKind,
    NodeStateType,
    suspicion_confirmations,
    suspicion_timeout_ms,
    swim_expected_first_detection_periods,
)

PROFILES = {name: functools.partial(Config.profile, name) for name in PROFILE_NAMES}


def _table(world: World, observer: int) -> str:
    node = world.nodes[observer]
    lines = [f"membership as seen by {node.name} (t={world.now_ms / 1000:.1f}s):"]
    lines.append(f"  {'name':<10} {'address':<16} {'state':<8} {'incarnation':>11}")
    for m in node.members():
        lines.append(
            f"  {m.name:<10} {m.address!s:<16} {m.state.name.lower():<8} {m.incarnation:>11}"
        )
    return "\n".join(lines)


def _timeline(
    world: World, log: EventLog, target: int, since_ms: int, kinds: Sequence[EventKind]
) -> list[str]:
    """When the other members first and last saw each kind of event about ``target``."""
    seen: dict[EventKind, dict[int, int]] = {}
    name = world.names[target]
    for observer, event in log.events:
        if observer == target or event.member.name != name or event.at_ms < since_ms:
            continue
        if event.kind in kinds:
            seen.setdefault(event.kind, {}).setdefault(observer, event.at_ms)
    lines = []
    for kind, by_observer in sorted(seen.items(), key=lambda kv: min(kv[1].values())):
        times = sorted(by_observer.values())
        lines.append(
            f"    {kind.value:<8} first seen after {(times[0] - since_ms) / 1000:6.2f}s, "
            f"by {len(times)} member(s), the last after {(times[-1] - since_ms) / 1000:6.2f}s"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="lan")
    parser.add_argument("--loss", type=float, default=0.0, help="packet loss probability")
    args = parser.parse_args(argv)
    if args.nodes < 4:
        parser.error("--nodes must be at least 4")
    config = PROFILES[args.profile]()
    # one-way delay 1-5 ms, as the cluster model this demo first ran on
    world = World(args.nodes, seed=args.seed, config=config, latency=Uniform(1, 5))
    world.network.loss = args.loss
    log = EventLog(world)
    names = world.names

    print(f"== {args.nodes} nodes, profile {args.profile}, seed {args.seed}, loss {args.loss}")
    world.start_all(bootstrap=False)
    joined = world.run_until_true(lambda: converged(world), 60_000)
    print(f"all {args.nodes} members see each other alive after {joined / 1000:.2f}s")
    world.run_for(5_000)
    print(_table(world, 0))

    n = args.nodes
    min_ms = suspicion_timeout_ms(config.suspicion_mult, n, config.probe_interval_ms)
    max_ms = config.suspicion_max_timeout_mult * min_ms
    victim, flaky, leaver = n - 1, n - 2, n - 3

    print(f"\n== crash {names[victim]} (SIGKILL-like: it just stops)")
    print(
        f"   predicted: first detection ~{swim_expected_first_detection_periods():.2f} "
        f"probe periods + a failed probe, then suspicion {min_ms / 1000:.1f}s (with "
        f"{suspicion_confirmations(config.suspicion_mult, n)} confirmations) .. "
        f"{max_ms / 1000:.1f}s"
    )
    crash_at = world.now_ms
    world.crash(victim)
    done = world.run_until_true(
        lambda: all_see(world, victim, [NodeStateType.DEAD]), 2 * max_ms + 30_000, 10
    )
    kinds = [EventKind.SUSPECT, EventKind.DEAD]
    print("\n".join(_timeline(world, log, victim, crash_at, kinds)))
    print(f"   every survivor sees {names[victim]} dead after {(done - crash_at) / 1000:.2f}s")

    print(f"\n== cut {names[flaky]} off the network for 2.5s, then heal")
    cut_at = world.now_ms
    before = world.nodes[flaky].incarnation
    world.network.partition([[flaky]])
    world.run_for(2_500)
    world.network.heal()
    world.run_until_true(lambda: all_see(world, flaky, [NodeStateType.ALIVE]), 30_000, 10)
    world.run_for(5_000)
    kinds = [EventKind.SUSPECT, EventKind.ALIVE]
    print("\n".join(_timeline(world, log, flaky, cut_at, kinds)))
    died = bool(log.times(EventKind.DEAD, names[flaky]))
    print(
        f"   {names[flaky]} refuted (incarnation {before} -> {world.nodes[flaky].incarnation}); "
        f"declared dead anywhere: {'yes' if died else 'no'}"
    )

    print(f"\n== {names[leaver]} leaves gracefully")
    leave_at = world.now_ms
    world.leave(leaver)  # the process exits a second later (serf LeavePropagateDelay)
    world.run_until_true(lambda: all_see(world, leaver, [NodeStateType.LEFT]), 10_000, 10)
    kinds = [EventKind.LEFT, EventKind.DEAD]
    print("\n".join(_timeline(world, log, leaver, leave_at, kinds)))
    world.run_for(2_000)

    print()
    print(_table(world, 0))
    traffic = world.traffic
    seconds = world.now_ms / 1000
    sent = sum(traffic.pkts_out)
    print(
        f"\n{sent} packets ({sum(traffic.bytes_out) / 1e6:.2f} MB) in "
        f"{seconds:.0f}s of virtual time: {sent / n / seconds:.1f} packets/s "
        f"per member; {sum(traffic.streams_out)} TCP streams; {len(log.events)} membership events"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
