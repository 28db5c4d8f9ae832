"""From captured scenarios to the corpus: every packet described (``analyse``), a few
examples per summary chosen (``select``), coverage of the required kinds, and the files,
``manifest.json`` and ``README.md`` written (``write_corpus``).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import platform
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serf_golden.capture import (
    NodeSpec,
    ScenarioRun,
    serf_package,
)
from serf_golden.config import (
    KEYS,
    REQUIRED_KINDS,
    USER_EVENT_NAME,
    USER_EVENT_PAYLOAD,
)
from serf_golden.describe import Decoded, Describer
from serf_golden.pcap import read_pcap, reassemble


@dataclass
class Item:
    scenario: str
    transport: str
    ts: float
    src: str
    dst: str
    src_port: int
    dst_port: int
    data: bytes
    decoded: Decoded
    conn: int | None = None
    direction: str | None = None
    gap: bool = False


def phase_at(run: ScenarioRun, ts: float) -> str:
    current = "pre"
    for t, name in run.phases:
        if t <= ts:
            current = name
    return current


def analyse(run: ScenarioRun, nodes: list[NodeSpec], desc: Describer) -> list[Item]:
    by_port = {n.gossip_port: n.name for n in nodes}
    by_tos = {n.tos: n.name for n in nodes}
    frames = list(read_pcap(run.pcap))
    items: list[Item] = []
    for f in frames:
        if f.proto != 17 or not f.payload:
            continue
        src = by_port.get(f.sport, "?")
        if by_tos.get(f.tos, src) != src:
            run.notes.append(f"udp {f.sport}->{f.dport}: TOS says {by_tos[f.tos]}, port {src}")
        items.append(
            Item(
                run.name,
                "udp",
                f.ts,
                src,
                by_port.get(f.dport, "?"),
                f.sport,
                f.dport,
                f.payload,
                desc.describe(f.payload, False, run.encrypted),
            )
        )
    for conn in reassemble(frames, set(by_port)):
        client = by_tos.get(conn.client_tos, "?")
        server = by_port.get(conn.server[1], "?")
        for direction, (src, dst, sp, dp) in (
            ("initiator", (client, server, conn.client[1], conn.server[1])),
            ("responder", (server, client, conn.server[1], conn.client[1])),
        ):
            data, ts, gap = conn.stream("c2s" if direction == "initiator" else "s2c")
            if not data or ts is None:
                continue
            items.append(
                Item(
                    run.name,
                    "tcp",
                    ts,
                    src,
                    dst,
                    sp,
                    dp,
                    data,
                    desc.describe(data, True, run.encrypted),
                    conn.cid,
                    direction,
                    gap,
                )
            )
    items.sort(key=lambda it: it.ts)
    return items


def spread(seq: Sequence[Any], k: int) -> list[Any]:
    """Up to ``k`` elements spread evenly over ``seq`` (first and last included)."""
    if len(seq) <= k:
        return list(seq)
    if k == 1:
        return [seq[0]]
    idx = sorted({round(i * (len(seq) - 1) / (k - 1)) for i in range(k)})
    return [seq[i] for i in idx]


def select(items: list[Item], per_summary: int) -> tuple[list[Item], Counter[tuple[str, ...]]]:
    """Dedupe: UDP by (scenario, summary); TCP by connection (both directions' summaries)."""
    observed: Counter[tuple[str, ...]] = Counter()
    udp_groups: dict[tuple[str, str], list[Item]] = defaultdict(list)
    conns: dict[tuple[str, int], list[Item]] = defaultdict(list)
    for it in items:
        observed[(it.scenario, it.transport, it.decoded.summary)] += 1
        if it.transport == "udp":
            udp_groups[(it.scenario, it.decoded.summary)].append(it)
        else:
            assert it.conn is not None
            conns[(it.scenario, it.conn)].append(it)
    tcp_groups: dict[tuple[str, str], list[list[Item]]] = defaultdict(list)
    for (scenario, _cid), parts in conns.items():
        parts.sort(key=lambda it: it.direction != "initiator")
        key = " || ".join(f"{p.direction}:{p.decoded.summary}" for p in parts)
        tcp_groups[(scenario, key)].append(parts)
    chosen: list[Item] = []
    for group in udp_groups.values():
        chosen += spread(group, per_summary)
    for cgroup in tcp_groups.values():
        for parts in spread(cgroup, per_summary):
            chosen += parts
    chosen.sort(key=lambda it: (it.scenario != "plain", it.ts))
    return chosen, observed


def coverage(entries: list[dict[str, Any]]) -> dict[str, list[str]]:
    cov: dict[str, list[str]] = {}
    for kind, (transport, pattern) in REQUIRED_KINDS.items():
        cov[kind] = [
            e["file"]
            for e in entries
            if (transport is None or e["transport"] == transport)
            and re.search(pattern, e["summary"])
        ]
    rotated = [e["file"] for e in entries if e.get("key") == "k2"]
    cov["encrypted under rotated key k2"] = rotated
    fallback = {
        (e["scenario"], e["conn"])
        for e in entries
        if e["transport"] == "tcp"
        and e["direction"] == "initiator"
        and re.search(REQUIRED_KINDS["tcp ping"][1], e["summary"])
    }
    cov["tcp fallback ping+ack (same connection)"] = [
        e["file"]
        for e in entries
        if e["transport"] == "tcp"
        and (e["scenario"], e["conn"]) in fallback
        and e["direction"] == "responder"
        and re.search(r"\back\b", e["summary"])
    ]
    return cov


def write_corpus(
    out: Path,
    runs: list[ScenarioRun],
    chosen: list[Item],
    observed: Counter[tuple[str, ...]],
    desc: Describer,
    nodes: list[NodeSpec],
    serf_version: str,
) -> dict[str, Any]:
    for sub in ("plain", "encrypted"):
        d = out / sub
        if d.is_dir():
            for old in d.glob("*.bin"):
                old.unlink()
        d.mkdir(parents=True, exist_ok=True)
    runs_by_name = {r.name: r for r in runs}
    counters: Counter[tuple[str, str]] = Counter()
    entries: list[dict[str, Any]] = []
    conn_ids: dict[tuple[str, int], int] = {}
    for it in chosen:
        run = runs_by_name[it.scenario]
        if it.transport == "udp":
            counters[(it.scenario, "udp")] += 1
            fname = f"{it.scenario}/udp-{counters[(it.scenario, 'udp')]:04d}.bin"
        else:
            assert it.conn is not None
            ckey = (it.scenario, it.conn)
            if ckey not in conn_ids:
                counters[(it.scenario, "tcp")] += 1
                conn_ids[ckey] = counters[(it.scenario, "tcp")]
            fname = f"{it.scenario}/tcp-{conn_ids[ckey]:04d}-{it.direction}.bin"
        (out / fname).write_bytes(it.data)
        entry: dict[str, Any] = {
            "file": fname,
            "transport": it.transport,
            "scenario": it.scenario,
            "src": it.src,
            "dst": it.dst,
            "src_port": it.src_port,
            "dst_port": it.dst_port,
            "first_byte": it.data[0],
            "length": len(it.data),
            "sha256": hashlib.sha256(it.data).hexdigest(),
            "summary": it.decoded.summary,
            "t": round(it.ts - run.t0, 3),
            "phase": phase_at(run, it.ts),
        }
        if it.transport == "tcp":
            entry["conn"] = conn_ids[(it.scenario, it.conn)] if it.conn is not None else None
            entry["direction"] = it.direction
            if it.gap:
                entry["gap"] = True
        if it.decoded.key is not None:
            entry["key"] = it.decoded.key
            entry["encryption_version"] = it.decoded.enc_version
        entries.append(entry)

    cov = coverage(entries)
    manifest: dict[str, Any] = {
        "description": (
            "Golden memberlist/Serf packets captured from real serf agents on loopback; "
            "see README.md"
        ),
        "generator": "scripts/capture_serf_golden.py",
        "reproduce": ".venv/bin/python scripts/capture_serf_golden.py --out tests/golden/serf",
        "captured_at": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        "serf_version": serf_version.splitlines()[0] if serf_version else "",
        "serf_version_output": serf_version,
        "serf_package": serf_package(),
        "host": {"kernel": platform.release(), "python": platform.python_version()},
        "nodes": [
            {
                "name": n.name,
                "address": "127.0.0.1",
                "gossip_port": n.gossip_port,
                "rpc_addr": n.rpc_addr,
                "tags": n.tags,
                "gid": n.gid,
                "dscp": n.dscp,
            }
            for n in nodes
        ],
        "keys": {
            name: {"base64": b64, "bytes": len(base64.b64decode(b64))} for name, b64 in KEYS.items()
        },
        "key_usage": (
            "encrypted scenario starts with k1 as the only key; k2 is installed with "
            "`serf keys -install` and made primary with `serf keys -use` (phase key-use); "
            "each encrypted entry's `key` names the key that decrypts it"
        ),
        "user_event": {"name": USER_EVENT_NAME, "payload": USER_EVENT_PAYLOAD},
        "scenarios": {
            r.name: {
                "encrypted": r.encrypted,
                "phases": [{"t": round(t - r.t0, 2), "name": name} for t, name in r.phases],
                "commands": r.commands,
                "tcpdump": r.tcpdump_stats,
                "notes": r.notes,
            }
            for r in runs
        },
        "summary_grammar": (
            "layers outer>inner: 'encrypted vN' (AES-GCM, version byte N), 'crc' (type 12, "
            "CRC32 verified), 'compress' (type 9, LZW undone); 'compound[a, b]' lists parts; "
            "'user(serf:X)' is a memberlist user message carrying Serf message X; "
            "'pushPull(join=..,nodes=N,states=..)+state(serf:pushPull)' a push/pull listing N "
            "nodes in those memberlist states, with Serf's state appended; "
            "'dead(left)' a dead message with From == Node; '+trailing(n)' unexpected bytes"
        ),
        "observed_counts": [
            {"scenario": s, "transport": t, "summary": summ, "count": n}
            for (s, t, summ), n in sorted(observed.items())
        ],
        "msgpack_formats": {
            msg: {f: sorted(c) for f, c in sorted(fields.items())}
            for msg, fields in sorted(desc.formats.items())
        },
        "msgpack_key_orders": {
            msg: [list(order) for order in orders]
            for msg, orders in sorted(desc.key_orders.items())
        },
        "coverage": cov,
        "missing": [k for k, files in cov.items() if not files],
        "entries": entries,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "README.md").write_text(render_readme(manifest))
    return manifest


WIRE_NOTES = [
    "## Wire-format observations (Debian's serf 0.9.4 build)",
    "",
    "* Go structs are msgpack **maps** keyed by the field name (fixstr), and the keys",
    "  come **sorted by name**, not in Go declaration order (e.g. ping is",
    "  Node, SeqNo, SourceAddr, SourceNode, SourcePort; alive is Addr, Incarnation,",
    "  Meta, Node, Port, Vsn). `omitempty` fields are absent when empty.",
    "* Strings **and `[]byte`** use the old msgpack raw family only: fixstr (0xa0-0xbf)",
    "  and str16 (0xda) even for 32..255 bytes (presumably str32 0xdb past 64 KiB); never",
    "  str8 (0xd9) and never bin8/16/32 (0xc4-0xc6). That covers Addr (4-byte IPv4),",
    "  Meta (serf tags: 0xff then a msgpack map), Vsn (`[]uint8`, a 6-byte raw string",
    "  pmin,pmax,pcur,dmin,dmax,dcur = 01 05 02 02 05 05), ack Payload, the compress",
    "  Buf and serf payloads. A nil `[]byte` is nil (0xc0).",
    "* Integers take the smallest **unsigned** format whatever the Go type (also for",
    "  `int` fields such as UserStateLen = 0xcd uint16, and State): positive fixint,",
    "  uint16 (0xcd) for ports, uint32 (0xce) for serf query IDs and timeouts.",
    "  No value in 128..255 and no negative integer occurs in this capture, so",
    "  uint8 (0xcc) and the signed formats are not exercised here.",
    "  Booleans are 0xc2/0xc3; serf's coordinates are float64 (0xcb).",
    "* Compression (type 9, LZW LSB/8) is used on UDP only when it makes the packet",
    "  smaller, but always on TCP streams. The CRC header (type 12) is only added",
    "  when memberlist is handed the destination node (gossip, and the probe's",
    "  ping+suspect compound), so plain pings/acks/nacks carry no CRC. Layering is",
    "  encrypt(crc(compress(msg))).",
    "* With encryption every UDP packet starts with the version byte 1 (AES-GCM,",
    "  12-byte nonce, no padding, empty AAD); TCP streams are 10, 4-byte BE length,",
    "  then the same, with those first five bytes as AAD.",
    "",
]


def render_readme(m: dict[str, Any]) -> str:
    lines = [
        "# Golden Serf/memberlist packets",
        "",
        "Raw UDP payloads and reassembled TCP byte streams captured from **real `serf` agents**",
        "talking to each other on loopback. The codec tests decode every file and check that",
        "our encoder produces the same layout. Generated by `scripts/capture_serf_golden.py`;",
        "do not edit by hand.",
        "",
        f"* captured: {m['captured_at']} (kernel {m['host']['kernel']})",
        f"* serf: `serf version` says `{m['serf_version']}`; {m['serf_package']}",
        "* three agents `a`, `b`, `c` on 127.0.0.1, `-profile=local`, compression on (default):",
        "",
        "| node | gossip | rpc | tags |",
        "|---|---|---|---|",
    ]
    for n in m["nodes"]:
        tags = ", ".join(f"{k}={v}" for k, v in n["tags"].items())
        lines.append(f"| {n['name']} | 127.0.0.1:{n['gossip_port']} | {n['rpc_addr']} | {tags} |")
    lines += [
        "",
        "## Reproduce",
        "",
        "Needs root (tcpdump, iptables, setgid), `serf` and `tcpdump`:",
        "",
        "```",
        m["reproduce"],
        "```",
        "",
        "Two runs, each its own tcpdump capture (`tcpdump -i lo -n -U -s 0 -w X.pcap` with a",
        "BPF filter on the three gossip ports): `plain` and `encrypted` (`-encrypt` with key",
        "k1, later `serf keys -install k2` and `serf keys -use k2`). Each run: join (b and c",
        "join a), steady state, `serf event` from b, a periodic push/pull, an iptables DROP of",
        "UDP to c's port (TCP fallback pings, indirect pings, nacks), SIGSTOP of c until a",
        "declares it failed (suspect, dead), SIGCONT (refutation: alive with a higher",
        "incarnation), `serf leave` on c (dead with From == Node). The exact commands with",
        "their time offsets are in `manifest.json` (`scenarios.*.commands`).",
        "",
        "Senders of TCP streams are identified by running each agent under its own gid and",
        "marking its packets with a per-node DSCP value (iptables mangle/OUTPUT owner match);",
        "the parser maps the IPv4 TOS byte back to the node.",
        "",
        "## Layout",
        "",
        "* `plain/udp-NNNN.bin`, `encrypted/udp-NNNN.bin`: one UDP payload each.",
        "* `*/tcp-NNNN-initiator.bin` / `tcp-NNNN-responder.bin`: the two directions of one",
        "  TCP connection, reassembled (retransmissions dropped).",
        "* `manifest.json`: one entry per file (`file`, `transport`, `scenario`, `src`, `dst`,",
        "  ports, `first_byte`, `length`, `sha256`, `summary`, `t`, `phase`, plus `conn` and",
        "  `direction` for TCP and `key`/`encryption_version` for encrypted data), the keys",
        "  (base64), the nodes, the commands, every summary observed with its count",
        "  (`observed_counts`), the msgpack formats seen per message field",
        "  (`msgpack_formats`), and `coverage`/`missing`.",
        "",
        f"Summary notation: {m['summary_grammar']}.",
        "",
        "Keys: "
        + ", ".join(f"`{k}` = `{v['base64']}` ({v['bytes']} bytes)" for k, v in m["keys"].items()),
        "",
        "## Inventory",
        "",
        "| scenario | transport | summary | kept | observed |",
        "|---|---|---|---|---|",
    ]
    kept: Counter[tuple[str, str, str]] = Counter(
        (e["scenario"], e["transport"], e["summary"]) for e in m["entries"]
    )
    for row in m["observed_counts"]:
        k = (row["scenario"], row["transport"], row["summary"])
        summ = row["summary"].replace("|", "\\|")
        lines.append(f"| {k[0]} | {k[1]} | `{summ}` | {kept.get(k, 0)} | {row['count']} |")
    lines += ["", "## Coverage", ""]
    for kind, files in m["coverage"].items():
        shown = ", ".join(f"`{f}`" for f in files[:3]) + (" …" if len(files) > 3 else "")
        lines.append(
            f"* {kind}: {len(files)} file(s) {shown}" if files else f"* {kind}: **missing**"
        )
    lines += [
        "",
        "## msgpack formats used by serf (go-codec `MsgpackHandle`)",
        "",
        "Per message and field: `key format:value format` as seen on the wire.",
        "",
    ]
    for msg, fields in m["msgpack_formats"].items():
        lines.append(
            f"* **{msg}**: " + "; ".join(f"{f} = {', '.join(v)}" for f, v in fields.items())
        )
    lines += ["", "Field order on the wire (`msgpack_key_orders`):", ""]
    for msg, orders in m["msgpack_key_orders"].items():
        lines.append(f"* **{msg}**: " + " / ".join(", ".join(o) for o in orders))
    lines += ["", *WIRE_NOTES]
    notes = [(s, n) for s, r in m["scenarios"].items() for n in r["notes"]]
    if notes:
        lines += ["", "## Capture notes", ""] + [f"* {s}: {n}" for s, n in notes]
    return "\n".join(lines) + "\n"
