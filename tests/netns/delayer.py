"""Real latency and jitter on real packets: a userspace delayer over nfnetlink_queue.

``tc netem`` needs the ``sch_netem`` qdisc, which some kernels lack; NFQUEUE does the same
job one layer up. An iptables rule (``-j NFQUEUE --queue-num Q --queue-bypass``) hands each
matching packet to queue Q of its network namespace; the packet stays in the kernel while
this process, bound to Q, holds its id; a verdict ``NF_ACCEPT`` sent ``delay`` ms later lets
it continue. Every packet draws its own delay, so jitter larger than the spacing between
packets reorders them, as on a real path.

Protocol (Linux ``include/uapi/linux/netfilter/nfnetlink_queue.h`` and
``nfnetlink.h``; the same messages libnetfilter_queue sends), pure stdlib:

- an ``AF_NETLINK`` / ``NETLINK_NETFILTER`` socket; every message is ``nlmsghdr`` (native
  byte order) + ``nfgenmsg`` (family, version 0, queue number big-endian) + attributes
  (``nlattr``: u16 length, u16 type, padded to 4 bytes; values big-endian);
- ``NFQNL_MSG_CONFIG`` with ``NFQA_CFG_CMD`` = ``NFQNL_CFG_CMD_BIND`` (PF_INET), then
  ``NFQA_CFG_PARAMS`` = copy mode ``NFQNL_COPY_META`` (no payload: the delay does not look
  at it), ``NFQA_CFG_QUEUE_MAXLEN`` and ``NFQA_CFG_FLAGS`` = ``NFQA_CFG_F_FAIL_OPEN``, each
  acknowledged (``NLM_F_ACK``; an error answer raises);
- the kernel sends one ``NFQNL_MSG_PACKET`` per queued packet, whose ``NFQA_PACKET_HDR``
  carries the packet id; we answer ``NFQNL_MSG_VERDICT`` with ``NFQA_VERDICT_HDR``
  (``NF_ACCEPT``, id). Verdicts may come in any order (the kernel looks the id up).

Bounds and failure modes (all fail open: a broken delayer adds no delay, never loss):

- the kernel holds at most ``maxlen`` packets of the queue (``NFQA_CFG_QUEUE_MAXLEN``);
  past that, ``NFQA_CFG_F_FAIL_OPEN`` accepts the packet undelayed (counted by the kernel
  in ``/proc/net/netfilter/nfnetlink_queue``, not here);
- a message the socket buffer cannot take is accepted undelayed by the same flag
  (``NETLINK_NO_ENOBUFS`` keeps the socket usable);
- no process bound to the queue (not started yet, or exited): ``--queue-bypass`` on the rule
  lets packets through undelayed;
- each receive reads at most one buffer and each wake-up sends the verdicts now due, so the
  work per packet is constant.

Delays: ``uniform`` draws from [mean - jitter, mean + jitter], ``normal`` from
N(mean, jitter) clipped to [0, mean + 4 jitter]; both from ``random.Random(seed)``.

Run as its own process inside a namespace (the harness does this, ``Testbed.delay``)::

    ip netns exec NS python -m tests.netns.delayer --queue 100 --mean-ms 30 --jitter-ms 5

It prints ``ready queue=Q`` once bound, and on SIGTERM/SIGINT a last line
``stats {json}`` (packets, verdicts, drawn delays) before unbinding and exiting.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import heapq
import json
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.procs import stop, until

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5

NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER

NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2

NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_PAYLOAD = 10

NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQA_CFG_F_FAIL_OPEN = 0x1

NFQNL_CFG_CMD_BIND = 1
NFQNL_CFG_CMD_UNBIND = 2
NFQNL_COPY_META = 1

NF_DROP = 0
NF_ACCEPT = 1

MAX_QUEUE = 65535
MAX_MAXLEN = 65536
MAX_DELAY_MS = 10_000.0
RECV_BYTES = 65536

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid: host byte order
_NFGENMSG = struct.Struct("!BBH")  # family, version, res_id (queue number, big-endian)
_NLATTR = struct.Struct("=HH")


def _align4(n: int) -> int:
    return (n + 3) & ~3


def msg_type(msg: int) -> int:
    return (NFNL_SUBSYS_QUEUE << 8) | msg


def nlattr(kind: int, value: bytes) -> bytes:
    body = _NLATTR.pack(_NLATTR.size + len(value), kind) + value
    return body + b"\0" * (_align4(len(body)) - len(body))


def nlmsg(kind: int, flags: int, seq: int, payload: bytes) -> bytes:
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(payload), kind, flags, seq, 0) + payload


def config_msg(queue: int, seq: int, *attrs: bytes, family: int = socket.AF_INET) -> bytes:
    """One acknowledged ``NFQNL_MSG_CONFIG`` for ``queue`` carrying ``attrs``."""
    payload = _NFGENMSG.pack(family, 0, queue) + b"".join(attrs)
    return nlmsg(msg_type(NFQNL_MSG_CONFIG), NLM_F_REQUEST | NLM_F_ACK, seq, payload)


def cfg_cmd(command: int, pf: int = socket.AF_INET) -> bytes:
    return nlattr(NFQA_CFG_CMD, struct.pack("!BxH", command, pf))


def cfg_params(copy_mode: int, copy_range: int = 0) -> bytes:
    return nlattr(NFQA_CFG_PARAMS, struct.pack("!IB", copy_range, copy_mode))


def cfg_maxlen(maxlen: int) -> bytes:
    return nlattr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen))


def cfg_flags(flags: int, mask: int) -> bytes:
    return nlattr(NFQA_CFG_FLAGS, struct.pack("!I", flags)) + nlattr(
        NFQA_CFG_MASK, struct.pack("!I", mask)
    )


def verdict_msg(queue: int, packet_id: int, verdict: int = NF_ACCEPT, seq: int = 0) -> bytes:
    payload = _NFGENMSG.pack(socket.AF_UNSPEC, 0, queue) + nlattr(
        NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet_id)
    )
    return nlmsg(msg_type(NFQNL_MSG_VERDICT), NLM_F_REQUEST, seq, payload)


@dataclass(frozen=True, slots=True)
class NlMessage:
    kind: int
    flags: int
    seq: int
    payload: bytes


def parse_messages(buf: bytes) -> Iterator[NlMessage]:
    """The netlink messages in one datagram; stops at the first malformed header."""
    off = 0
    while off + _NLMSGHDR.size <= len(buf):
        length, kind, flags, seq, _pid = _NLMSGHDR.unpack_from(buf, off)
        if length < _NLMSGHDR.size or off + length > len(buf):
            return
        yield NlMessage(kind, flags, seq, buf[off + _NLMSGHDR.size : off + length])
        off += _align4(length)


def parse_attrs(data: bytes) -> dict[int, bytes]:
    """Type (flags masked off) -> value; stops at the first malformed attribute."""
    attrs: dict[int, bytes] = {}
    off = 0
    while off + _NLATTR.size <= len(data):
        length, kind = _NLATTR.unpack_from(data, off)
        if length < _NLATTR.size or off + length > len(data):
            break
        attrs[kind & NLA_TYPE_MASK] = data[off + _NLATTR.size : off + length]
        off += _align4(length)
    return attrs


@dataclass(frozen=True, slots=True)
class QueuedPacket:
    queue: int
    packet_id: int
    hw_protocol: int
    hook: int


def parse_packet(msg: NlMessage) -> QueuedPacket | None:
    """The queued packet an ``NFQNL_MSG_PACKET`` announces, or None for any other message."""
    if msg.kind != msg_type(NFQNL_MSG_PACKET) or len(msg.payload) < _NFGENMSG.size:
        return None
    _family, _version, queue = _NFGENMSG.unpack_from(msg.payload)
    hdr = parse_attrs(msg.payload[_NFGENMSG.size :]).get(NFQA_PACKET_HDR)
    if hdr is None or len(hdr) < 7:
        return None
    packet_id, hw_protocol, hook = struct.unpack_from("!IHB", hdr)
    return QueuedPacket(queue, packet_id, hw_protocol, hook)


def parse_error(msg: NlMessage) -> int | None:
    """The (positive) errno of an ``NLMSG_ERROR`` answer: 0 is an acknowledgement."""
    if msg.kind != NLMSG_ERROR or len(msg.payload) < 4:
        return None
    (code,) = struct.unpack_from("=i", msg.payload)
    return -int(code)


@dataclass(frozen=True, slots=True)
class DelaySpec:
    """Delay of one packet: ``mean_ms`` ± ``jitter_ms`` by ``dist`` (uniform | normal)."""

    mean_ms: float
    jitter_ms: float = 0.0
    dist: str = "uniform"

    def __post_init__(self) -> None:
        if not 0.0 <= self.mean_ms <= MAX_DELAY_MS:
            raise ValueError(f"mean_ms must be in [0, {MAX_DELAY_MS:g}], got {self.mean_ms}")
        if not 0.0 <= self.jitter_ms <= self.mean_ms:
            raise ValueError(f"jitter_ms must be in [0, mean_ms], got {self.jitter_ms}")
        if self.dist not in ("uniform", "normal"):
            raise ValueError(f"dist must be uniform or normal, got {self.dist!r}")

    def draw_ms(self, rng: random.Random) -> float:
        if self.jitter_ms == 0.0:
            return self.mean_ms
        if self.dist == "uniform":
            return rng.uniform(self.mean_ms - self.jitter_ms, self.mean_ms + self.jitter_ms)
        d = rng.gauss(self.mean_ms, self.jitter_ms)
        return min(max(d, 0.0), self.mean_ms + 4 * self.jitter_ms)


@dataclass(slots=True)
class Stats:
    packets: int = 0  # NFQNL_MSG_PACKET received
    verdicts: int = 0  # NF_ACCEPT sent
    verdict_errors: int = 0
    max_held: int = 0
    delay_sum_ms: float = 0.0
    delay_min_ms: float = float("inf")
    delay_max_ms: float = 0.0
    late_sum_ms: float = 0.0  # verdict sent after its due time, summed
    late_max_ms: float = 0.0
    other: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        n = max(self.verdicts, 1)
        return {
            "packets": self.packets,
            "verdicts": self.verdicts,
            "verdict_errors": self.verdict_errors,
            "max_held": self.max_held,
            "delay_mean_ms": round(self.delay_sum_ms / max(self.packets, 1), 3),
            "delay_min_ms": round(self.delay_min_ms, 3) if self.packets else None,
            "delay_max_ms": round(self.delay_max_ms, 3),
            "late_mean_ms": round(self.late_sum_ms / n, 3),
            "late_max_ms": round(self.late_max_ms, 3),
            **self.other,
        }


class Delayer:
    """Bound to one queue of the current network namespace; every packet is accepted
    ``spec.draw_ms()`` after it arrived."""

    def __init__(self, queue: int, spec: DelaySpec, seed: int, maxlen: int = 1024) -> None:
        if not 0 <= queue <= MAX_QUEUE:
            raise ValueError(f"queue must be 0..{MAX_QUEUE}")
        if not 1 <= maxlen <= MAX_MAXLEN:
            raise ValueError(f"maxlen must be 1..{MAX_MAXLEN}")
        self.queue = queue
        self.spec = spec
        self.maxlen = maxlen
        self.rng = random.Random(seed)
        self.stats = Stats()
        self._held: list[tuple[int, int, int]] = []  # (due ns, packet id, arrival order)
        self._seq = 0
        self._order = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        with contextlib.suppress(OSError):
            self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)

    def _request(self, *attrs: bytes) -> None:
        self._seq += 1
        self.sock.send(config_msg(self.queue, self._seq, *attrs))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.sock], [], [], 0.5)
            if not ready:
                continue
            for msg in parse_messages(self.sock.recv(RECV_BYTES)):
                code = parse_error(msg)
                if code is None:  # a packet queued meanwhile: held like any other
                    self.on_message(msg, time.monotonic_ns())
                elif msg.seq == self._seq:
                    if code:
                        raise OSError(code, f"nfqueue config of queue {self.queue}")
                    return
        raise TimeoutError(f"no answer to nfqueue config of queue {self.queue}")

    def bind(self) -> None:
        self._request(cfg_cmd(NFQNL_CFG_CMD_BIND))
        self._request(cfg_params(NFQNL_COPY_META))
        self._request(cfg_maxlen(self.maxlen))
        self._request(cfg_flags(NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_FAIL_OPEN))

    def unbind(self) -> None:
        """Accept everything still held, then unbind (the kernel would drop them)."""
        while self._held:
            _due, packet_id, _ = heapq.heappop(self._held)
            self._accept(packet_id, 0.0)
        with contextlib.suppress(OSError, TimeoutError):
            self._request(cfg_cmd(NFQNL_CFG_CMD_UNBIND))

    def _accept(self, packet_id: int, late_ms: float) -> None:
        try:
            self.sock.send(verdict_msg(self.queue, packet_id))
        except OSError:
            self.stats.verdict_errors += 1
            return
        self.stats.verdicts += 1
        self.stats.late_sum_ms += late_ms
        self.stats.late_max_ms = max(self.stats.late_max_ms, late_ms)

    def on_message(self, msg: NlMessage, now_ns: int) -> None:
        pkt = parse_packet(msg)
        if pkt is None:
            key = f"ignored_type_{msg.kind}"
            self.stats.other[key] = self.stats.other.get(key, 0) + 1
            return
        self.stats.packets += 1
        if len(self._held) >= self.maxlen:  # cannot happen while the kernel bounds the queue
            self._accept(pkt.packet_id, 0.0)
            return
        d = self.spec.draw_ms(self.rng)
        s = self.stats
        s.delay_sum_ms += d
        s.delay_min_ms = min(s.delay_min_ms, d)
        s.delay_max_ms = max(s.delay_max_ms, d)
        self._order += 1
        heapq.heappush(self._held, (now_ns + int(d * 1e6), pkt.packet_id, self._order))
        s.max_held = max(s.max_held, len(self._held))

    def release_due(self, now_ns: int) -> None:
        while self._held and self._held[0][0] <= now_ns:
            due, packet_id, _ = heapq.heappop(self._held)
            self._accept(packet_id, (now_ns - due) / 1e6)

    def run(self, stopping: list[bool]) -> None:
        """Until ``stopping[0]``: receive packets, send verdicts when due."""
        while not stopping[0]:
            now = time.monotonic_ns()
            self.release_due(now)
            timeout_s = 0.2
            if self._held:
                timeout_s = min(timeout_s, max(0.0, (self._held[0][0] - now) / 1e9))
            try:
                ready, _, _ = select.select([self.sock], [], [], timeout_s)
            except InterruptedError:
                continue
            if not ready:
                continue
            try:
                buf = self.sock.recv(RECV_BYTES)
            except OSError as exc:
                if exc.errno in (errno.ENOBUFS, errno.EINTR, errno.EAGAIN):
                    self.stats.other["recv_errors"] = self.stats.other.get("recv_errors", 0) + 1
                    continue
                raise
            now = time.monotonic_ns()
            for msg in parse_messages(buf):
                self.on_message(msg, now)

    def close(self) -> None:
        self.sock.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.netns.delayer", description=__doc__)
    p.add_argument("--queue", type=int, required=True)
    p.add_argument("--mean-ms", type=float, required=True)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--dist", choices=["uniform", "normal"], default="uniform")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--maxlen", type=int, default=1024)
    args = p.parse_args(argv)
    spec = DelaySpec(args.mean_ms, args.jitter_ms, args.dist)
    stopping = [False]

    def on_signal(_signum: int, _frame: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    d = Delayer(args.queue, spec, args.seed, args.maxlen)
    try:
        d.bind()
        print(f"ready queue={args.queue}", flush=True)
        d.run(stopping)
    finally:
        d.unbind()
        d.close()
        print("stats " + json.dumps({"queue": args.queue, **d.stats.as_dict()}), flush=True)
    return 0


# --- the process, as the harness runs it ----------------------------------------------------


class DelayerProcess:
    """One ``python -m tests.netns.delayer`` inside namespace ``ns``; ``stop()`` it."""

    def __init__(
        self, ns: str, queue: int, spec: DelaySpec, seed: int, log_path: Path, maxlen: int = 1024
    ) -> None:
        self.ns = ns
        self.queue = queue
        self.spec = spec
        self.log_path = log_path
        self._log = log_path.open("ab")
        cmd = [
            "ip", "netns", "exec", ns, sys.executable, "-m", "tests.netns.delayer",
            "--queue", str(queue), "--mean-ms", str(spec.mean_ms),
            "--jitter-ms", str(spec.jitter_ms), "--dist", spec.dist, "--seed", str(seed),
            "--maxlen", str(maxlen),
        ]  # fmt: skip
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=root)

    def _text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"delayer in {self.ns} exited: {self._text()[-1000:]}")
        return f"ready queue={self.queue}" in self._text()

    def wait_ready(self, timeout_s: float = 10) -> None:
        until(self.ready, timeout_s, f"delayer queue {self.queue} in {self.ns}", poll_s=0.02)

    def stop(self) -> dict[str, Any]:
        """SIGTERM (held packets are accepted first), wait; its stats line, if it wrote one."""
        stop(self.proc, sig=signal.SIGTERM, timeout_s=5)
        if not self._log.closed:
            self._log.close()
        for line in reversed(self._text().splitlines()):
            if line.startswith("stats "):
                result: dict[str, Any] = json.loads(line[len("stats ") :])
                return result
        return {}


if __name__ == "__main__":
    if os.geteuid() != 0:
        print("the delayer needs root (CAP_NET_ADMIN)", file=sys.stderr)
    sys.exit(main())
