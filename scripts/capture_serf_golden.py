#!/usr/bin/env python3
"""Capture golden memberlist/Serf packets from real ``serf`` agents on loopback.

The tool starts three ``serf agent`` processes on 127.0.0.1 (distinct gossip and
RPC ports), drives them through a scripted life cycle (join, steady state, a user
event, a UDP black-hole that forces TCP fallback pings, SIGSTOP until the node is
declared dead, SIGCONT and refutation, a graceful leave) while ``tcpdump`` records
the loopback traffic of the gossip ports, once in plaintext and once with
encryption (including a key rotation).  It then parses the pcap files in pure
Python, reassembles the TCP streams, decodes every packet far enough to describe
it (decrypting with the known keys and undoing Go's LZW compression), and writes
a small deduplicated corpus plus ``manifest.json`` and ``README.md``.

Which agent sent a TCP segment cannot be told from the ephemeral source port, so
every agent runs with its own group id and an iptables ``mangle/OUTPUT`` rule
stamps its packets with a distinct DSCP value; the pcap parser maps the IPv4 TOS
byte back to the node name.

The parts live in scripts/serf_golden/ (config, capture, pcap, describe, corpus); this file
is the command line. Needs root (tcpdump, iptables, setgid), ``serf`` and ``tcpdump`` on
PATH. Every process, iptables rule and pcap file the tool creates is removed again, also
on failure. Reproduce with::

    .venv/bin/python scripts/capture_serf_golden.py --out tests/golden/serf
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from serf_golden.capture import (
    Resources,
    Scenario,
    ScenarioRun,
    make_nodes,
    port_is_free,
)
from serf_golden.config import (
    GOSSIP_BASE_PORT,
    KEYS,
    RPC_BASE_PORT,
)
from serf_golden.corpus import Item, analyse, select, write_corpus
from serf_golden.describe import Describer


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=Path("tests/golden/serf"))
    ap.add_argument("--serf", default=shutil.which("serf") or "serf")
    ap.add_argument("--gossip-port", type=int, default=GOSSIP_BASE_PORT)
    ap.add_argument("--rpc-port", type=int, default=RPC_BASE_PORT)
    ap.add_argument("--per-summary", type=int, default=3, help="examples kept per summary")
    ap.add_argument("--scenarios", default="plain,encrypted")
    ap.add_argument(
        "--keep-work", type=Path, default=None, help="copy pcaps and agent logs here (debugging)"
    )
    args = ap.parse_args(argv)

    if os.geteuid() != 0:
        print("needs root (tcpdump, iptables, setgid)", file=sys.stderr)
        return 2
    for tool in (args.serf, "tcpdump", "iptables"):
        if shutil.which(tool) is None:
            print(f"missing tool: {tool}", file=sys.stderr)
            return 2
    nodes = make_nodes(args.gossip_port, args.rpc_port)
    busy = [p for n in nodes for p in (n.gossip_port, n.rpc_port) if not port_is_free(p)]
    if busy:
        print(f"ports in use: {busy}", file=sys.stderr)
        return 2
    serf_version = subprocess.run(
        [args.serf, "version"], capture_output=True, text=True, timeout=10
    ).stdout.strip()

    def on_term(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)

    res = Resources()
    runs: list[ScenarioRun] = []
    keys = {name: base64.b64decode(b64) for name, b64 in KEYS.items()}
    desc = Describer(keys)
    items: list[Item] = []
    with tempfile.TemporaryDirectory(prefix="serf-golden-") as tmp:
        work = Path(tmp)
        try:
            for name in args.scenarios.split(","):
                scen = Scenario(name, name == "encrypted", nodes, args.serf, work, res)
                try:
                    runs.append(scen.execute())
                finally:
                    res.close()
                    if args.keep_work is not None:
                        args.keep_work.mkdir(parents=True, exist_ok=True)
                        for f in work.iterdir():
                            shutil.copy(f, args.keep_work / f.name)
                items += analyse(runs[-1], nodes, desc)
        finally:
            res.close()
    chosen, observed = select(items, args.per_summary)
    manifest = write_corpus(args.out, runs, chosen, observed, desc, nodes, serf_version)
    total = sum(e["length"] for e in manifest["entries"])
    print(f"wrote {len(manifest['entries'])} files ({total} bytes) to {args.out}")
    if manifest["missing"]:
        print("missing kinds: " + ", ".join(manifest["missing"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
