"""agent.metrics: values read from a real swim.Node, bounded phi cardinality, promtool's
lint, and the trio HTTP server over real TCP sockets (timeouts on trio's virtual clock)."""

from __future__ import annotations

import http.client
import math
import random
import shutil
import socket
import struct
import subprocess
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from functools import partial

import prometheus_client
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

import swim
from agent.member_metrics import member_label
from agent.metrics import (
    CONTENT_TYPE_LATEST,
    DEFAULT_MAX_PHI_MEMBERS,
    MAX_UNHEALTHY_MEMBERS,
    PROBE_RTT_BUCKETS_S,
    AgentMetrics,
)
from agent.metrics_http import CONNECTION_TIMEOUT_S, MAX_CONNECTIONS, serve_metrics
from swim import (
    Alive,
    Dead,
    DropReason,
    Message,
    NodeStateType,
    Ping,
    Suspect,
    encode_message,
    encode_packet,
)

LOCAL = swim.Address("127.0.0.1", 7946)
PEER = swim.Address("127.0.0.2", 7946)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def make_node() -> swim.Node:
    return swim.Node("a", LOCAL, rng=random.Random(1), now_ms=0)


def no_phi() -> Mapping[str, float]:
    return {}


def packet(*messages: Message) -> bytes:
    parts = [encode_message(m) for m in messages]
    return encode_packet(parts, compress=False, crc=False, crypto=None)


def samples(metrics: AgentMetrics) -> Samples:
    found: Samples = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def value(found: Samples, name: str, **labels: str) -> float:
    return found[(name, tuple(sorted(labels.items())))]


def series(found: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in found.items() if n == name}


# --- values ---------------------------------------------------------------------------------


def test_fresh_node() -> None:
    node = make_node()
    found = samples(AgentMetrics(node, no_phi))
    assert value(found, "swim_members", state="alive") == 1
    for state in ("suspect", "dead", "left"):
        assert value(found, "swim_members", state=state) == 0
    assert value(found, "swim_member_table_size") == 1
    assert value(found, "swim_incarnation") == node.incarnation
    assert value(found, "swim_health_score") == node.health_score
    assert value(found, "swim_broadcast_queue_depth") == node.broadcast_queue_depth
    # every drop reason is exported from the start, at zero
    dropped = series(found, "swim_dropped_inputs_total")
    assert {dict(labels)["reason"] for labels in dropped} == {r.value for r in DropReason}
    assert set(dropped.values()) == {0}
    assert value(found, "swim_member_phi_max") == 0
    assert series(found, "swim_member_phi") == {}


def test_ping_is_counted_and_answered() -> None:
    node = make_node()
    metrics = AgentMetrics(node, no_phi)
    data = packet(Ping(1, "a"))
    out = node.handle_datagram(PEER, data, now_ms=1)
    assert out.packets  # the ack
    found = samples(metrics)
    assert value(found, "swim_messages_received_total", type="ping") == 1
    assert value(found, "swim_packets_received_total") == 1
    assert value(found, "swim_received_bytes_total") == len(data)
    assert value(found, "swim_messages_sent_total", type="ack") == 1
    assert value(found, "swim_packets_sent_total") == len(out.packets)
    assert value(found, "swim_sent_bytes_total") == sum(len(p.data) for p in out.packets)
    assert set(series(found, "swim_dropped_inputs_total").values()) == {0}


def test_garbage_is_counted_by_reason() -> None:
    node = make_node()
    metrics = AgentMetrics(node, no_phi)
    node.handle_datagram(PEER, b"\xfe garbage", now_ms=1)
    node.handle_datagram(PEER, b"", now_ms=2)
    found = samples(metrics)
    assert node.stats.dropped, "the node counted nothing; the test premise is wrong"
    for reason, count in node.stats.dropped.items():
        assert value(found, "swim_dropped_inputs_total", reason=reason) == count
    assert sum(series(found, "swim_dropped_inputs_total").values()) == 2
    assert value(found, "swim_packets_received_total") == 2


def test_members_by_state_and_suspicion() -> None:
    node = make_node()
    metrics = AgentMetrics(node, no_phi)
    node.handle_datagram(PEER, packet(Alive(1, "b", PEER.ip_bytes, PEER.port)), now_ms=1)
    found = samples(metrics)
    assert value(found, "swim_members", state="alive") == 2
    assert value(found, "swim_member_table_size") == 2
    node.handle_datagram(PEER, packet(Suspect(1, "b", "c")), now_ms=2)
    found = samples(metrics)
    assert value(found, "swim_members", state="alive") == 1
    assert value(found, "swim_members", state="suspect") == 1
    # a suspicion of ourselves is refuted with a new incarnation
    before = node.incarnation
    node.handle_datagram(PEER, packet(Suspect(node.incarnation, "a", "b")), now_ms=3)
    found = samples(metrics)
    assert node.incarnation > before
    assert value(found, "swim_incarnation") == node.incarnation
    assert value(found, "swim_refutations_total") == node.stats.refutations >= 1
    assert value(found, "swim_broadcast_queue_depth") == node.broadcast_queue_depth > 0


def test_every_scalar_stat_is_exported() -> None:
    node = make_node()
    stats = node.stats
    names = {
        "probes_sent": "swim_probes_sent_total",
        "probes_failed": "swim_probes_failed_total",
        "indirect_probes_sent": "swim_indirect_probes_sent_total",
        "tcp_fallback_probes": "swim_tcp_fallback_probes_total",
        "tcp_fallback_rescues": "swim_tcp_fallback_rescues_total",
        "nacks_received": "swim_nacks_received_total",
        "suspicions_raised": "swim_suspicions_raised_total",
        "suspicions_refuted_by_others": "swim_suspicions_refuted_total",
        "refutations": "swim_refutations_total",
        "deaths_declared": "swim_deaths_declared_total",
        "address_conflicts": "swim_address_conflicts_total",
        "suspicion_timeouts_degraded": "swim_suspicion_timeouts_degraded_total",
        "urgent_probes_failed": "swim_urgent_probes_failed_total",
        "suspicion_verifications": "swim_suspicion_verifications_total",
        "suspicions_held_starved": "swim_suspicions_held_starved_total",
        "cross_check_probes": "swim_cross_check_probes_total",
        "cross_check_probes_failed": "swim_cross_check_probes_failed_total",
        "streams_opened": "swim_streams_opened_total",
        "streams_failed": "swim_streams_failed_total",
        "push_pulls": "swim_push_pulls_total",
        "packets_in": "swim_packets_received_total",
        "packets_out": "swim_packets_sent_total",
        "bytes_in": "swim_received_bytes_total",
        "bytes_out": "swim_sent_bytes_total",
    }
    # distinct values so that a mix-up between two counters shows
    for i, attr in enumerate(names, start=1):
        setattr(stats, attr, 100 + i)
    found = samples(AgentMetrics(node, no_phi))
    for i, (attr, metric) in enumerate(names.items(), start=1):
        assert value(found, metric) == 100 + i, attr


def test_urgent_probes_by_outcome_zeros_included() -> None:
    node = make_node()
    metrics = AgentMetrics(node, no_phi)
    found = samples(metrics)
    outcomes = {o.value for o in swim.UrgentProbeOutcome}
    assert {dict(labels)["outcome"] for labels in series(found, "swim_urgent_probes_total")} == (
        outcomes
    )
    assert set(series(found, "swim_urgent_probes_total").values()) == {0}
    node.handle_datagram(PEER, packet(Alive(1, "b", PEER.ip_bytes, PEER.port)), now_ms=1)
    for name in ("b", "b", "ghost", "a"):
        node.probe_now(name, now_ms=2)
    found = samples(metrics)
    urgent = partial(value, found, "swim_urgent_probes_total")
    assert (urgent(outcome="started"), urgent(outcome="probing")) == (1, 1)
    assert (urgent(outcome="unknown"), urgent(outcome="self")) == (1, 1)
    assert urgent(outcome="too_many") == 0


def test_probe_rtt_histogram() -> None:
    metrics = AgentMetrics(make_node(), no_phi)
    for rtt_ms in (0, 1, 3, 3, 40, 3000, -5):
        metrics.observe_probe_rtt_ms(rtt_ms)
    found = samples(metrics)
    assert value(found, "swim_probe_rtt_seconds_count") == 7
    assert value(found, "swim_probe_rtt_seconds_sum") == pytest.approx(3.047)
    bucket = partial(value, found, "swim_probe_rtt_seconds_bucket")
    assert bucket(le="0.0005") == 2  # 0 ms and the clamped negative
    assert bucket(le="0.001") == 3
    assert bucket(le="0.005") == 5
    assert bucket(le="0.05") == 6
    assert bucket(le="2.5") == 6
    assert bucket(le="+Inf") == 7
    assert PROBE_RTT_BUCKETS_S[0] == 0.0005 and PROBE_RTT_BUCKETS_S[-1] == 2.5


# --- phi --------------------------------------------------------------------------------------


def test_phi_cardinality_is_bounded() -> None:
    phis = {f"node-{i:04d}": i / 10 for i in range(1000)}
    calls = 0

    def phi() -> Mapping[str, float]:
        nonlocal calls
        calls += 1
        return phis

    metrics = AgentMetrics(make_node(), phi)
    assert calls == 0  # registering does not read the phi source
    found = samples(metrics)
    assert calls == 1
    per_member = series(found, "swim_member_phi")
    assert len(per_member) == DEFAULT_MAX_PHI_MEMBERS
    exported = {dict(labels)["member"] for labels in per_member}
    assert exported == {f"node-{i:04d}" for i in range(1000 - DEFAULT_MAX_PHI_MEMBERS, 1000)}
    assert value(found, "swim_member_phi", member="node-0999") == pytest.approx(99.9)
    assert value(found, "swim_member_phi_max") == pytest.approx(99.9)
    assert value(found, "swim_member_phi_omitted") == 1000 - DEFAULT_MAX_PHI_MEMBERS


@pytest.mark.parametrize("bound", [0, 1, 10])
def test_phi_custom_bound_and_special_values(bound: int) -> None:
    phis = {"nan": math.nan, "inf": math.inf, "low": 0.5, "mid": 3.0, "tie-b": 1.0, "tie-a": 1.0}
    found = samples(AgentMetrics(make_node(), lambda: phis, max_phi_members=bound))
    per_member = {
        dict(labels)["member"]: v for labels, v in series(found, "swim_member_phi").items()
    }
    ranked = ["inf", "mid", "tie-a", "tie-b", "low", "nan"]  # NaN (no data) ranks last
    assert list(per_member) == ranked[:bound]
    assert value(found, "swim_member_phi_max") == math.inf
    assert value(found, "swim_member_phi_omitted") == len(phis) - min(bound, len(phis))


def test_negative_bound_is_rejected() -> None:
    with pytest.raises(ValueError):
        AgentMetrics(make_node(), no_phi, max_phi_members=-1)


# --- unhealthy members by name -----------------------------------------------------------------

HOSTILE_NAMES = (
    'gpu-07"} 1\nswim_fake 1 # "',  # quotes, a newline and a fake sample after it
    "back\\slash\\",
    "gpu-\udcff\udcfe",  # bytes that are not UTF-8, as the wire decodes them
    "gpu-\\xff\\xfe",  # ... and the name they are written as: one series for both
    "\x00\t\u2028\U0001f525 \u00e9",
)


def unhealthy(found: Samples) -> dict[tuple[str, str], float]:
    """(member, status) -> value of swim_member_unhealthy."""
    return {
        (dict(labels)["member"], dict(labels)["status"]): v
        for labels, v in series(found, "swim_member_unhealthy").items()
    }


def since(found: Samples) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["member"], dict(labels)["status"]): v
        for labels, v in series(found, "swim_member_unhealthy_since_seconds").items()
    }


def fake_member(name: str, state: NodeStateType, changed_ms: int) -> swim.Member:
    return swim.Member(name, PEER, b"", 1, state, changed_ms, (1, 5, 2, 0, 0, 0))


def test_unhealthy_members_by_name_and_status() -> None:
    node = make_node()
    clock = [0]
    metrics = AgentMetrics(node, no_phi, now_ms=lambda: clock[0])
    for i, name in enumerate(("b", "c", "d", "e")):
        peer = swim.Address(f"127.0.0.{i + 2}", 7946)
        node.handle_datagram(peer, packet(Alive(1, name, peer.ip_bytes, peer.port)), now_ms=1)
    found = samples(metrics)
    assert unhealthy(found) == {}  # alive members have no per-member series
    assert set(series(found, "swim_member_unhealthy_omitted").values()) == {0}
    node.handle_datagram(PEER, packet(Suspect(1, "b", "c")), now_ms=1000)
    node.handle_datagram(PEER, packet(Dead(1, "c", "b")), now_ms=2500)
    node.handle_datagram(PEER, packet(Dead(1, "d", "d")), now_ms=3000)  # its own: it left
    clock[0] = 4000
    found = samples(metrics)
    assert unhealthy(found) == {("b", "suspect"): 1, ("c", "dead"): 1, ("d", "left"): 1}
    assert since(found) == {("b", "suspect"): 3.0, ("c", "dead"): 1.5, ("d", "left"): 1.0}
    omitted = series(found, "swim_member_unhealthy_omitted")
    assert {dict(k)["status"]: v for k, v in omitted.items()} == {
        "suspect": 0,
        "dead": 0,
        "left": 0,
    }
    # the suspect refutes: its series goes
    node.handle_datagram(PEER, packet(Alive(2, "b", PEER.ip_bytes, PEER.port)), now_ms=4100)
    assert set(unhealthy(samples(metrics))) == {("c", "dead"), ("d", "left")}
    # without a clock there are no ages, the rest is the same
    found = samples(AgentMetrics(node, no_phi))
    assert set(unhealthy(found)) == {("c", "dead"), ("d", "left")}
    assert since(found) == {}


def test_unhealthy_members_come_from_the_given_list() -> None:
    """The agent passes its listed members: departed ones (reaped by the core) included."""
    node = make_node()
    gone = [fake_member("gone", NodeStateType.DEAD, 10), fake_member("ok", NodeStateType.ALIVE, 1)]
    found = samples(AgentMetrics(node, no_phi, members=lambda: gone, now_ms=lambda: 70))
    assert unhealthy(found) == {("gone", "dead"): 1}
    assert since(found) == {("gone", "dead"): pytest.approx(0.06)}
    assert value(found, "swim_members", state="dead") == 0  # still the core's table


def test_unhealthy_series_are_bounded_failures_first_then_most_recent() -> None:
    states = (NodeStateType.SUSPECT, NodeStateType.DEAD, NodeStateType.LEFT)
    listed = [fake_member(f"n{i:04d}", states[i % 3], i // 2) for i in range(1500)]
    listed += [fake_member(f"a{i:04d}", NodeStateType.ALIVE, 10_000) for i in range(100)]
    calls = 0

    def members() -> list[swim.Member]:
        nonlocal calls
        calls += 1
        return listed

    def omitted(found: Samples) -> dict[str, float]:
        return {
            dict(k)["status"]: v for k, v in series(found, "swim_member_unhealthy_omitted").items()
        }

    metrics = AgentMetrics(make_node(), no_phi, members=members, now_ms=lambda: 1000)
    assert calls == 0  # registering reads nothing
    found = samples(metrics)
    assert calls == 1
    flags = unhealthy(found)
    assert len(flags) == len(since(found)) == MAX_UNHEALTHY_MEMBERS == 500
    assert len(flags) + len(since(found)) == 1000  # per-member series on one page
    # suspect and dead members before left ones, the most recently changed first, equal
    # times by name (n1494 before n1495, both changed at 747)
    expected = sorted(
        listed[:1500],
        key=lambda m: (m.state == NodeStateType.LEFT, -m.state_change_ms, m.name),
    )[:500]
    assert {name for name, _ in flags} == {m.name for m in expected}
    assert {status for _, status in flags} == {"suspect", "dead"}
    assert ("n1498", "dead") in flags and ("n1499", "left") not in flags
    assert omitted(found) == {"suspect": 250, "dead": 250, "left": 500}
    # a smaller bound, and 0: only the counts
    found = samples(AgentMetrics(make_node(), no_phi, members=members, max_unhealthy_members=3))
    assert set(unhealthy(found)) == {("n1498", "dead"), ("n1497", "suspect"), ("n1494", "suspect")}
    found = samples(AgentMetrics(make_node(), no_phi, members=members, max_unhealthy_members=0))
    assert unhealthy(found) == {}
    assert omitted(found) == {"suspect": 500, "dead": 500, "left": 500}
    # left members fill what failures leave free
    found = samples(AgentMetrics(make_node(), no_phi, members=lambda: listed[:300]))
    assert len(unhealthy(found)) == 300
    assert set(omitted(found).values()) == {0}
    with pytest.raises(ValueError, match="max_unhealthy_members"):
        AgentMetrics(make_node(), no_phi, max_unhealthy_members=-1)


def test_member_label_keeps_valid_names_and_spells_out_bad_bytes() -> None:
    assert member_label("gpu-07") == "gpu-07"
    assert member_label('a"b\nc') == 'a"b\nc'  # escaped by the exposition, not here
    assert member_label("gpu-\udcff") == "gpu-\\xff"
    assert member_label(b"\xe2\x82".decode("utf-8", "surrogateescape") + "x") == "\\xe2\\x82x"


def test_hostile_names_keep_the_page_valid() -> None:
    """Names a peer chose: the page stays valid UTF-8, parses back to the same labels and
    passes promtool; the two names that spell the same label are one series."""
    listed = [fake_member(n, NodeStateType.DEAD, i) for i, n in enumerate(HOSTILE_NAMES)]
    phis = {name: float(i) for i, name in enumerate(HOSTILE_NAMES)}
    metrics = AgentMetrics(make_node(), lambda: phis, members=lambda: listed, now_ms=lambda: 10)
    page = metrics.render()
    page.decode("utf-8")  # strict
    found = samples(metrics)
    labels = {member_label(n) for n in HOSTILE_NAMES}
    assert len(labels) == len(HOSTILE_NAMES) - 1
    assert {name for name, _ in unhealthy(found)} == labels
    assert {dict(k)["member"] for k in series(found, "swim_member_phi")} == labels
    assert value(found, "swim_member_unhealthy_omitted", status="dead") == 1
    assert value(found, "swim_member_phi_omitted") == 1
    assert not any(name == "swim_fake" for name, _ in found)
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'; scripts/setup.sh)")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=page, capture_output=True, timeout=60, check=False
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode(errors="replace")


# --- exposition -------------------------------------------------------------------------------


def test_own_registry() -> None:
    a = AgentMetrics(make_node(), no_phi)
    b = AgentMetrics(swim.Node("b", PEER, rng=random.Random(2), now_ms=0), no_phi)
    assert a.registry is not b.registry
    assert b"swim_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)


def test_every_metric_has_help_and_type() -> None:
    node = make_node()
    node.handle_datagram(PEER, packet(Ping(1, "a")), now_ms=1)
    metrics = AgentMetrics(node, lambda: {"b": 1.0})
    metrics.observe_probe_rtt_ms(2)
    text = metrics.render().decode()
    helps = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")}
    types = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert helps == types
    assert all(name.startswith("swim_") for name in helps)
    for family in text_string_to_metric_families(text):
        assert family.documentation, family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)


def test_promtool_check_metrics() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'; scripts/setup.sh)")
    node = make_node()
    node.handle_datagram(PEER, packet(Ping(1, "a")), now_ms=1)
    node.handle_datagram(PEER, b"\xfe garbage", now_ms=2)
    metrics = AgentMetrics(node, lambda: {f"n{i}": float(i) for i in range(300)})
    metrics.observe_probe_rtt_ms(1)
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=metrics.render(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    report = (result.stdout + result.stderr).decode(errors="replace")
    assert result.returncode == 0, report
    assert report.strip() == "", report


# --- HTTP -------------------------------------------------------------------------------------


@asynccontextmanager
async def running(
    metrics: AgentMetrics,
    *,
    timeout_s: float = CONNECTION_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> AsyncIterator[int]:
    """serve_metrics on 127.0.0.1, an ephemeral port, for the body of the ``async with``."""
    serve = partial(
        serve_metrics,
        metrics,
        "127.0.0.1",
        0,
        timeout_s=timeout_s,
        max_connections=max_connections,
    )
    async with trio.open_nursery() as nursery:
        port: int = await nursery.start(serve)
        yield port
        nursery.cancel_scope.cancel()


async def exchange(port: int, request: bytes, *, eof: bool = False) -> bytes:
    """Send ``request`` over a real TCP connection (then half-close if ``eof``) and read
    until the server closes."""
    with trio.fail_after(30):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(request)
            if eof:
                await stream.send_eof()
            chunks = []
            while chunk := await stream.receive_some(65536):
                chunks.append(chunk)
    return b"".join(chunks)


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def header(response: bytes, name: str) -> str | None:
    head = response.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    for line in head.split("\r\n")[1:]:
        key, _, val = line.partition(":")
        if key.strip().lower() == name.lower():
            return val.strip()
    return None


def http_get(port: int, path: str) -> tuple[int, str | None, str | None, bytes]:
    """A real HTTP client (the standard library's), run in a thread."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, resp.getheader("Content-Type"), resp.getheader("Connection"), body
    finally:
        conn.close()


@pytest.mark.trio
async def test_http_get_metrics() -> None:
    node = make_node()
    node.handle_datagram(PEER, packet(Ping(1, "a")), now_ms=1)
    metrics = AgentMetrics(node, no_phi)
    async with running(metrics) as port:
        assert port > 0
        status, ctype, connection, body = await trio.to_thread.run_sync(http_get, port, "/metrics")
        assert status == 200
        assert ctype == CONTENT_TYPE_LATEST
        assert connection == "close"
        assert b'swim_messages_received_total{type="ping"} 1.0' in body
        assert b"# HELP swim_probe_rtt_seconds " in body
        # the values are read at scrape time
        node.handle_datagram(PEER, packet(Ping(2, "a")), now_ms=2)
        _, _, _, body = await trio.to_thread.run_sync(http_get, port, "/metrics?x=1")
        assert b'swim_messages_received_total{type="ping"} 2.0' in body
        status, ctype, _, body = await trio.to_thread.run_sync(http_get, port, "/")
        assert status == 200 and ctype is not None and ctype.startswith("text/html")
        assert b'href="/metrics"' in body


@pytest.mark.trio
async def test_http_errors_and_head() -> None:
    metrics = AgentMetrics(make_node(), no_phi)
    async with running(metrics) as port:
        response = await exchange(port, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(response) == 404
        assert header(response, "Connection") == "close"
        response = await exchange(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi")
        assert status_of(response) == 405
        assert header(response, "Allow") == "GET, HEAD"
        response = await exchange(port, b"garbage\r\n\r\n")
        assert status_of(response) == 400
        response = await exchange(port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
        assert status_of(response) == 200
        _, _, body = response.partition(b"\r\n\r\n")
        assert body == b""
        assert int(header(response, "Content-Length") or 0) > 0
        # an oversized request head is refused, not buffered
        big = b"GET /metrics HTTP/1.1\r\nX-Junk: " + b"a" * 20_000 + b"\r\n\r\n"
        assert status_of(await exchange(port, big)) == 431
        # a client that closes without (a complete) request gets nothing and does no harm
        assert await exchange(port, b"", eof=True) == b""
        assert await exchange(port, b"GET /metrics HTTP/1.1\r\n", eof=True) == b""
        # and after all that the server still answers
        assert status_of(await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")) == 200


@pytest.mark.trio
async def test_render_failure_is_500_and_the_server_survives() -> None:
    fail = True

    def phi() -> Mapping[str, float]:
        if fail:
            raise RuntimeError("phi registry broke")
        return {}

    async with running(AgentMetrics(make_node(), phi)) as port:
        assert status_of(await exchange(port, b"GET /metrics HTTP/1.0\r\n\r\n")) == 500
        fail = False
        assert status_of(await exchange(port, b"GET /metrics HTTP/1.0\r\n\r\n")) == 200


@pytest.mark.trio
async def test_connection_reset_does_not_stop_the_server() -> None:
    async with running(AgentMetrics(make_node(), no_phi)) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET /met")
        # SO_LINGER 0: close() sends RST
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert status_of(await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")) == 200


@pytest.mark.trio
async def test_slow_client_is_disconnected(autojump_clock: trio.testing.MockClock) -> None:
    """A client that sends part of a request and then nothing is cut off after the timeout
    (5 s of trio's virtual clock), and others are served meanwhile."""
    async with running(AgentMetrics(make_node(), no_phi)) as port:
        with trio.fail_after(60):
            slow = await trio.open_tcp_stream("127.0.0.1", port)
            await slow.send_all(b"GET /metrics HTTP/1.1\r\n")
            start = trio.current_time()
            assert status_of(await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")) == 200
            assert await slow.receive_some(1024) == b""  # closed without a response
            elapsed = trio.current_time() - start
            await slow.aclose()
        assert 5.0 <= elapsed < 6.0
        assert status_of(await exchange(port, b"GET / HTTP/1.1\r\n\r\n")) == 200


@pytest.mark.trio
async def test_custom_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async with running(AgentMetrics(make_node(), no_phi), timeout_s=0.5) as port:
        slow = await trio.open_tcp_stream("127.0.0.1", port)
        start = trio.current_time()
        with trio.fail_after(60):
            assert await slow.receive_some(1024) == b""
        assert 0.5 <= trio.current_time() - start < 1.0
        await slow.aclose()


@pytest.mark.trio
async def test_connection_limit() -> None:
    async with running(AgentMetrics(make_node(), no_phi), max_connections=1) as port:
        holder = await trio.open_tcp_stream("127.0.0.1", port)
        await holder.send_all(b"GET /metrics HTTP/1.1\r\n")
        await trio.testing.wait_all_tasks_blocked()
        assert await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n") == b""  # refused
        await holder.send_all(b"\r\n")
        with trio.fail_after(30):
            response = b""
            while chunk := await holder.receive_some(65536):
                response += chunk
        await holder.aclose()
        assert status_of(response) == 200
        await trio.testing.wait_all_tasks_blocked()
        assert status_of(await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")) == 200
