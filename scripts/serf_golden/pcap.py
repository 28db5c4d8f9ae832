"""Reading a pcap file (Ethernet, Linux cooked, raw IPv4) and reassembling the TCP streams
between the agents.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Frame:
    ts: float
    proto: int
    tos: int
    src: str
    sport: int
    dst: str
    dport: int
    payload: bytes
    seq: int = 0
    flags: int = 0


TCP_FIN, TCP_SYN, TCP_RST, TCP_ACK = 0x01, 0x02, 0x04, 0x10


def _link_payload(linktype: int, rec: bytes) -> bytes | None:
    if linktype == 1:  # DLT_EN10MB
        off, ethertype = 14, struct.unpack_from("!H", rec, 12)[0]
        while ethertype in (0x8100, 0x88A8) and len(rec) >= off + 4:
            ethertype = struct.unpack_from("!H", rec, off + 2)[0]
            off += 4
        return rec[off:] if ethertype == 0x0800 else None
    if linktype == 113:  # DLT_LINUX_SLL
        return rec[16:] if struct.unpack_from("!H", rec, 14)[0] == 0x0800 else None
    if linktype == 276:  # DLT_LINUX_SLL2
        return rec[20:] if struct.unpack_from("!H", rec, 0)[0] == 0x0800 else None
    if linktype in (0, 108):  # DLT_NULL (host order) / DLT_LOOP (network order)
        fam_le, fam_be = struct.unpack_from("<I", rec)[0], struct.unpack_from(">I", rec)[0]
        return rec[4:] if 2 in (fam_le, fam_be) else None
    if linktype in (12, 101, 228):  # raw IP
        return rec if rec and rec[0] >> 4 == 4 else None
    raise ValueError(f"unsupported pcap link type {linktype}")


def read_pcap(path: Path) -> Iterator[Frame]:
    data = path.read_bytes()
    magics = {
        b"\xd4\xc3\xb2\xa1": ("<", 1e6),
        b"\xa1\xb2\xc3\xd4": (">", 1e6),
        b"\x4d\x3c\xb2\xa1": ("<", 1e9),
        b"\xa1\xb2\x3c\x4d": (">", 1e9),
    }
    if data[:4] not in magics:
        raise ValueError(f"{path}: not a pcap file (pcapng is not supported)")
    endian, frac_div = magics[data[:4]]
    linktype = struct.unpack_from(endian + "I", data, 20)[0] & 0xFFFF
    pos = 24
    while pos + 16 <= len(data):
        sec, frac, incl, _orig = struct.unpack_from(endian + "IIII", data, pos)
        rec = data[pos + 16 : pos + 16 + incl]
        pos += 16 + incl
        ip = _link_payload(linktype, rec)
        if ip is None or len(ip) < 20 or ip[0] >> 4 != 4:
            continue
        ihl = (ip[0] & 0x0F) * 4
        total = struct.unpack_from("!H", ip, 2)[0]
        if struct.unpack_from("!H", ip, 6)[0] & 0x3FFF:
            continue  # IP fragment: never happens on lo (MTU 64 KiB)
        seg = ip[ihl:total]
        src, dst = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
        ts = sec + frac / frac_div
        if ip[9] == 17 and len(seg) >= 8:
            sport, dport, ulen = struct.unpack_from("!HHH", seg)
            yield Frame(ts, 17, ip[1], src, sport, dst, dport, bytes(seg[8:ulen]))
        elif ip[9] == 6 and len(seg) >= 20:
            sport, dport, seq = struct.unpack_from("!HHI", seg)
            doff = (seg[12] >> 4) * 4
            yield Frame(ts, 6, ip[1], src, sport, dst, dport, bytes(seg[doff:]), seq, seg[13])


@dataclass
class TcpConn:
    cid: int
    client: tuple[str, int]
    server: tuple[str, int]
    t_start: float
    client_tos: int = 0
    isn: dict[str, int] = field(default_factory=dict)  # "c2s"/"s2c" -> first data seq
    segs: dict[str, list[tuple[int, bytes, float]]] = field(
        default_factory=lambda: {"c2s": [], "s2c": []}
    )

    def stream(self, direction: str) -> tuple[bytes, float | None, bool]:
        """The reassembled bytes of one direction, its first data time, gap flag."""
        segs = self.segs[direction]
        if not segs:
            return b"", None, False
        base = self.isn.get(direction, min(s for s, _, _ in segs))
        out = bytearray()
        first_ts: float | None = None
        gap = False
        for seq, data, ts in sorted(segs, key=lambda s: ((s[0] - base) % 2**32, s[2])):
            rel = (seq - base) % 2**32
            if rel > len(out):
                gap = True
                break
            if rel + len(data) <= len(out):
                continue  # retransmission / duplicate
            if first_ts is None:
                first_ts = ts
            out += data[len(out) - rel :]
        return bytes(out), first_ts, gap


def reassemble(frames: Sequence[Frame], server_ports: set[int]) -> list[TcpConn]:
    conns: list[TcpConn] = []
    open_: dict[tuple[tuple[str, int], tuple[str, int]], TcpConn] = {}
    for f in frames:
        if f.proto != 6:
            continue
        a, b = (f.src, f.sport), (f.dst, f.dport)
        syn_only = f.flags & TCP_SYN and not f.flags & TCP_ACK
        key = (a, b) if (a, b) in open_ else (b, a)
        conn = open_.get(key)
        if syn_only or conn is None:
            if syn_only or f.dport in server_ports:
                client, server = a, b
            else:
                client, server = b, a
            conn = TcpConn(len(conns) + 1, client, server, f.ts)
            conns.append(conn)
            open_[(client, server)] = conn
            open_.pop((server, client), None)
        direction = "c2s" if a == conn.client else "s2c"
        if direction == "c2s" and f.tos and not conn.client_tos:
            conn.client_tos = f.tos
        if f.flags & TCP_SYN:
            conn.isn[direction] = (f.seq + 1) % 2**32
        if f.payload:
            conn.segs[direction].append((f.seq, f.payload, f.ts))
    return conns
