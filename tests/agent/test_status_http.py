"""The status page's HTTP side (agent/metrics_http.py, agent/status.py): real agents in one
process on loopback serve ``/``, ``/v1/*`` and ``/healthz`` over real TCP; the schemas,
escaping of attacker-controlled names and tags, the read-only rules (404, 405, HEAD), the
jobs section (views, local ranks, steps, a hung rank), and that an encrypted agent serves
no key material. The events ring and ``/healthz``'s bound run on trio's virtual clock.
The page in a real browser: tests/agent/test_status_page.py."""

from __future__ import annotations

import base64
import http.client
import json
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from agent.api import AgentAPI
from agent.events import Events
from agent.jobs import Registration
from agent.status import HEALTHZ_TIMEOUT_S, StatusEndpoints, json_body, json_body_in_slices
from agent.status_events import RESUBSCRIBE_PAUSE_S, RecentEvents
from agent.status_page import PAGE
from tests.agent.test_agent import KEY, all_alive, cluster

pytestmark = pytest.mark.trio
EVIL = '<img src=x onerror="document.title=1">&amp;"\'</script>'
MEMBER_KEYS = {
    "name",
    "addr",
    "port",
    "status",
    "incarnation",
    "phi",
    "tags",
    "protocol",
    "since_ms",
    "rtt_ms",
}


def _request(port: int, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


async def request(port: int, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    return await trio.to_thread.run_sync(_request, port, method, path)


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    """Poll an async ``check`` (an HTTP request) until true, within ``timeout_s``."""
    with trio.move_on_after(timeout_s):
        while not await check():
            await trio.sleep(0.1)
        return
    raise TimeoutError(f"{what}: not within {timeout_s:g} s")


async def get_json(port: int, path: str) -> Any:
    status, headers, body = await request(port, "GET", path)
    assert status == 200, (path, status, body)
    assert headers["content-type"] == "application/json"
    assert b"<" not in body and b">" not in body  # never markup, whatever a peer sent
    return json.loads(body)


async def test_endpoints_schemas_escaping_and_read_only(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2, metrics_addr="127.0.0.1:0") as (n0, n1):
        await n1.agent.update_tags({"evil": EVIL}, [])
        await all_alive([n0, n1], {"n0", "n1"})
        port = n0.agent.metrics_port
        assert port > 0

        async def n1_seen() -> bool:
            found = await get_json(port, "/v1/members")
            row = next(m for m in found["members"] if m["name"] == "n1")
            return row["tags"] == {"evil": EVIL} and row["rtt_ms"] is not None

        await until(n1_seen, 20, "n1's tags and a probe's RTT on n0's page")
        members = await get_json(port, "/v1/members")
        assert members["node"] == "n0"
        assert {m["name"] for m in members["members"]} == {"n0", "n1"}
        assert all(set(m) == MEMBER_KEYS for m in members["members"])
        assert [m["name"] for m in (await get_json(port, "/v1/members?status=alive"))["members"]]
        assert (await get_json(port, "/v1/members?status=dead"))["members"] == []
        status, _, body = await request(port, "GET", "/v1/members?status=nope")
        assert status == 400 and b"unknown status" in body

        info = await get_json(port, "/v1/info")
        assert info["node"] == "n0" and info["members"]["alive"] == 2
        assert info["encrypted"] is False and "health_score" in info and "stats" in info
        process = info["process"]
        assert process["cpu_s"] > 0 and process["rss_bytes"] > 1_000_000
        assert abs(info["time_ms"] - time.time() * 1000) < 60_000

        events = (await get_json(port, "/v1/events"))["events"]
        assert any(e["type"] == "joined" and e["node"] == "n1" for e in events)
        seqs = [e["seq"] for e in events]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert await get_json(port, "/healthz") == {"ok": True, "node": "n0"}

        # read-only and nothing else: 404, 405, HEAD
        status, headers, body = await request(port, "GET", "/v1/keys")
        assert status == 404
        for method in ("POST", "PUT", "DELETE"):
            status, headers, _ = await request(port, method, "/v1/members")
            assert status == 405 and headers["allow"] == "GET, HEAD"
        status, headers, body = await request(port, "HEAD", "/v1/members")
        assert status == 200 and body == b"" and int(headers["content-length"]) > 0
        status, headers, body = await request(port, "GET", "/")
        assert status == 200 and body == PAGE
        assert headers["content-type"] == "text/html; charset=utf-8"
        csp = headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp
        assert "'unsafe-inline'" not in csp and headers["x-content-type-options"] == "nosniff"
        assert b"innerHTML" not in PAGE and b"http://" not in PAGE and b"https://" not in PAGE
        status, headers, body = await request(port, "HEAD", "/")
        assert status == 200 and body == b""
        status, _, body = await request(port, "GET", "/v1/members?" + "&".join(["a=1"] * 9))
        assert status == 400 and b"query parameters" in body
        # the JSON escapes mean the same strings; JSON has no infinity
        assert json.loads(json_body({"s": EVIL})) == {"s": EVIL}
        assert json.loads(json_body({"phi": [math.inf, 1.5]})) == {"phi": [None, 1.5]}


async def test_jobs_show_views_local_ranks_steps_and_a_hung_rank(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2, metrics_addr="127.0.0.1:0") as (n0, n1):
        await all_alive([n0, n1], {"n0", "n1"})
        now_ms = int(trio.current_time() * 1000)
        wall_ms = int(time.time() * 1000)
        # n1: one rank in job "train"; n0: two local ranks, and rank 1 stopped stepping
        steady = Registration.create("train")
        n1.agent.jobs.add(steady, wall_ms)
        await n1.agent.jobs.sync_tag("train")
        beating = Registration.create("train", local_rank=0, local_world_size=2)
        stopped = Registration.create(
            "train", local_rank=1, local_world_size=2, heartbeat_pause_ms=0,
            first_heartbeat_estimate_ms=100, heartbeat_threshold=1.0,
        )  # fmt: skip
        for reg in (beating, stopped):
            n0.agent.jobs.add(reg, wall_ms)
        for i in range(5):
            beating.heartbeat(40 + i, now_ms)
            stopped.heartbeat(40 + i, now_ms - 1000 + i * 100)  # last one 600 ms ago
        await n0.agent.jobs.sync_tag("train")
        port = n0.agent.metrics_port

        async def listed() -> dict[str, Any]:
            jobs = (await get_json(port, "/v1/jobs"))["jobs"]
            return jobs[0] if jobs else {}

        async def both_nodes() -> bool:
            return {n["name"] for n in (await listed()).get("nodes", [])} == {"n0", "n1"}

        await until(both_nodes, 20, "n1's registration gossiped to n0")
        job = await listed()
        assert job["job"] == "train" and job["formations"] >= 1 and job["formed_ms"] > 0
        assert job["hung_nodes"] == ["n0"]  # rank 1 stopped: the whole node is out
        nodes = {n["name"]: n for n in job["nodes"]}
        assert nodes["n1"]["in_view"] and nodes["n1"]["ranks"] == 1
        assert not nodes["n0"]["in_view"] and nodes["n0"]["health"] == "hung"
        assert nodes["n0"]["ranks"] == 2 and job["ranks"] == 1
        assert {n["role"] for n in job["nodes"]} == {"training"}
        assert (job["training"], job["spares"]) == (1, 0)
        assert job["local"] == {
            "local_world_size": 2,
            "registered": [0, 1],
            "complete": True,
            "steps": {"0": 44, "1": 44},
            "hung_ranks": [1],
            "paused": [],
            "slow": {},
            "target": None,
        }
        # on n1 the same job, without n0's local detail
        n1_job = (await get_json(n1.agent.metrics_port, "/v1/jobs"))["jobs"][0]
        assert n1_job["local"]["hung_ranks"] == [] and n1_job["local"]["steps"] == {"0": -1}


async def test_an_encrypted_agent_serves_no_key_material(tmp_path: Path) -> None:
    raw = base64.b64decode(KEY)
    forms = [KEY.encode(), raw.hex().encode(), base64.b64encode(raw).rstrip(b"=")]
    async with cluster(tmp_path, 2, metrics_addr="127.0.0.1:0", encrypt=KEY) as (n0, n1):
        await all_alive([n0, n1], {"n0", "n1"})
        port = n0.agent.metrics_port
        assert (await get_json(port, "/v1/info"))["encrypted"] is True
        for path in ("/", "/metrics", "/healthz", "/v1/members", "/v1/events", "/v1/info"):
            status, _, body = await request(port, "GET", path)
            assert status == 200, path
            for form in forms:
                assert form not in body, f"{path} shows the key"
            assert raw not in body


class _Stuck:
    """An agent whose node task never answers (pure: only what /healthz uses)."""

    name = "stuck"

    async def ping(self) -> int:
        await trio.sleep_forever()
        raise AssertionError("not reached")


async def test_healthz_answers_503_when_the_node_task_hangs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    endpoints = StatusEndpoints(cast(AgentAPI, _Stuck()))
    start = trio.current_time()
    reply = await endpoints.answer(b"/healthz", b"")
    assert reply is not None and reply.status == 503
    assert json.loads(reply.body)["ok"] is False
    assert trio.current_time() - start == pytest.approx(HEALTHZ_TIMEOUT_S)
    assert await endpoints.answer(b"/v1/nothing", b"") is None


async def test_the_events_ring_is_bounded_and_survives_being_cut_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events = Events()
    ring = RecentEvents(capacity=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(ring.follow, lambda: events.subscribe(2), lambda: 7)
        events.publish({"type": "user_event", "name": "deploy", "payload": b"\x00" * 9})
        await trio.testing.wait_all_tasks_blocked()
        first = ring.as_json()["events"]
        assert first == [
            {"type": "user_event", "name": "deploy", "payload_bytes": 9, "seq": 1, "time_ms": 7}
        ]
        # a burst beyond the subscription's queue cuts the ring off: counted, resubscribed
        for i in range(5):
            events.publish({"type": "joined", "node": f"m{i}"})
        await trio.sleep(RESUBSCRIBE_PAUSE_S * 2)
        assert ring.missed == 1 and events.subscribers == 1
        events.publish({"type": "dead", "node": "m0"})
        await trio.testing.wait_all_tasks_blocked()
        kept = ring.as_json()
        assert kept["capacity"] == 3 and kept["missed"] == 1
        # the waiting reader took m0, its queue m1 and m2; m3 and m4 were lost; the ring
        # keeps the newest three
        assert [(e["type"], e["node"]) for e in kept["events"]] == [
            ("joined", "m1"),
            ("joined", "m2"),
            ("dead", "m0"),
        ]
        assert [e["seq"] for e in kept["events"]] == [3, 4, 5]
        nursery.cancel_scope.cancel()
    with pytest.raises(ValueError, match="capacity"):
        RecentEvents(capacity=0)


async def test_json_in_slices_is_the_same_bytes() -> None:
    rows = [{"name": f"m{i}<&>", "phi": 0.5 if i % 7 else math.inf} for i in range(3 * 200 + 1)]
    value = {"node": "n0", "members": rows, "jobs": [{"nodes": rows, "n": 1}], "none": []}
    assert json_body_in_slices(value) == json_body(value)
    assert json.loads(json_body_in_slices(value))["members"][0]["phi"] is None
    # a name that is not UTF-8 (memberlist carries any bytes) is served, as JSON escapes
    assert json.loads(json_body({"name": "bad-\udcff"})) == {"name": "bad-\udcff"}
