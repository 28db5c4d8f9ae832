"""Demo: a cluster of real ``swim.Node`` state machines on a virtual clock.

Runs the shipped protocol core (real encoded packets, push-pull, Lifeguard) in the
deterministic in-memory network: nodes join, one crashes, one is partitioned away briefly
and refutes its suspicion, one leaves gracefully. Prints the membership table and a
timeline with the time each event was seen, and the detection times the formulas predict.

    python -m simulations.demo [--nodes 16] [--seed 1] [--profile lan|local|wan] [--loss 0.0]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

from simulations.cluster import Cluster
from swim import Config, EventKind, MemberEvent, NodeStateType, config
from swim import formulas as f

PROFILES = {name: functools.partial(Config.profile, name) for name in config.PROFILES}


def _table(c: Cluster, observer: str) -> str:
    node = c.nodes[observer]
    lines = [f"membership as seen by {observer} (t={c.now_ms / 1000:.1f}s):"]
    lines.append(f"  {'name':<10} {'address':<16} {'state':<8} {'incarnation':>11}")
    for m in node.members():
        lines.append(
            f"  {m.name:<10} {m.address!s:<16} {m.state.name.lower():<8} {m.incarnation:>11}"
        )
    return "\n".join(lines)


def _timeline(c: Cluster, target: str, since_ms: int, kinds: Sequence[EventKind]) -> list[str]:
    """When the other members first and last saw each kind of event about ``target``."""
    seen: dict[EventKind, dict[str, int]] = {}
    for observer, event in c.events:
        if observer == target or event.member.name != target or event.at_ms < since_ms:
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
    c = Cluster(args.nodes, seed=args.seed, config=config, loss=args.loss)
    names = list(c.nodes)
    printed: list[tuple[str, MemberEvent]] = []
    c.hooks.append(lambda o, e: printed.append((o, e)))

    print(f"== {args.nodes} nodes, profile {args.profile}, seed {args.seed}, loss {args.loss}")
    c.join_all()
    joined = c.run_until_true(c.converged, 60_000)
    print(f"all {args.nodes} members see each other alive after {joined / 1000:.2f}s")
    c.run_for(5_000)
    print(_table(c, names[0]))

    n = args.nodes
    min_ms = f.suspicion_timeout_ms(config.suspicion_mult, n, config.probe_interval_ms)
    max_ms = config.suspicion_max_timeout_mult * min_ms
    victim, flaky, leaver = names[-1], names[-2], names[-3]

    print(f"\n== crash {victim} (SIGKILL-like: it just stops)")
    print(
        f"   predicted: first detection ~{f.swim_expected_first_detection_periods():.2f} "
        f"probe periods + a failed probe, then suspicion {min_ms / 1000:.1f}s (with "
        f"{f.suspicion_confirmations(config.suspicion_mult, n)} confirmations) .. "
        f"{max_ms / 1000:.1f}s"
    )
    crash_at = c.now_ms
    c.crash(victim)
    done = c.run_until_true(
        lambda: c.all_see(victim, [NodeStateType.DEAD]), 2 * max_ms + 30_000, 10
    )
    print("\n".join(_timeline(c, victim, crash_at, [EventKind.SUSPECT, EventKind.DEAD])))
    print(f"   every survivor sees {victim} dead after {(done - crash_at) / 1000:.2f}s")

    print(f"\n== cut {flaky} off the network for 2.5s, then heal")
    cut_at = c.now_ms
    before = c.nodes[flaky].incarnation
    c.partition([flaky], [x for x in names if x != flaky])
    c.run_for(2_500)
    c.heal()
    c.run_until_true(lambda: c.all_see(flaky, [NodeStateType.ALIVE]), 30_000, 10)
    c.run_for(5_000)
    print("\n".join(_timeline(c, flaky, cut_at, [EventKind.SUSPECT, EventKind.ALIVE])))
    died = any(e.kind == EventKind.DEAD and e.member.name == flaky for _, e in c.events)
    print(
        f"   {flaky} refuted (incarnation {before} -> {c.nodes[flaky].incarnation}); "
        f"declared dead anywhere: {'yes' if died else 'no'}"
    )

    print(f"\n== {leaver} leaves gracefully")
    leave_at = c.now_ms
    c.leave(leaver)
    c.run_until_true(lambda: c.all_see(leaver, [NodeStateType.LEFT]), 10_000, 10)
    print("\n".join(_timeline(c, leaver, leave_at, [EventKind.LEFT, EventKind.DEAD])))
    c.crash(leaver)
    c.run_for(2_000)

    print()
    print(_table(c, names[0]))
    total_out = sum(node.stats.packets_out for node in c.nodes.values())
    seconds = c.now_ms / 1000
    print(
        f"\n{c.stats.packets_sent} packets ({c.stats.bytes_sent / 1e6:.2f} MB) in "
        f"{seconds:.0f}s of virtual time: {total_out / args.nodes / seconds:.1f} packets/s "
        f"per member; {c.stats.streams} TCP streams; {len(printed)} membership events"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
