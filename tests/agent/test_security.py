"""Security with a keyring: input that fails authentication is dropped and counted
by reason and never changes membership; no plaintext fallback unless
``encrypt_verify_incoming = false``; keys rotate (install, use, remove) across a running
mixed cluster without a false suspicion; the control socket serves only its owner and its
group (mode 0660 and, on Linux, SO_PEERCRED; the groups in tests/agent/test_access.py); no
key material in logs, metrics, ``info`` or monitor events.

In-process agents (trio, loopback) for most checks; the rotation runs real processes (ours
and serf) and is marked slow. Every process is stopped by pid."""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from agent.config import AgentConfigError, build, load
from agent.control import ControlClient, FrameDecoder
from agent.metrics import AgentMetrics
from agent.procs import free_port
from agent.procs import until as wait_until
from agent.procs import until_async as until
from agent.runtime import Agent
from bench.procs import SERF, LocalAgent, LocalSerf, SerfError
from swim import (
    Alive,
    Crypto,
    Keyring,
    NodeStateType,
    Ping,
    PushNodeState,
    PushPull,
    StreamLimits,
    WireError,
    decode_message,
    decode_packet,
    encode_message,
    encode_packet,
    encode_push_pull,
    encode_stream,
    packet_overhead,
    parse_stream,
)
from tests.agent.test_agent import KEY, all_alive, cluster

ROOT = Path(__file__).resolve().parents[2]
KEY_RAW = base64.b64decode(KEY)
OTHER_RAW = bytes(range(100, 116))
NEW_RAW = bytes(range(200, 232))
NEW = base64.b64encode(NEW_RAW).decode()
LOOPBACK = bytes([127, 0, 0, 1])


def _crypto(raw: bytes, **kw: Any) -> Crypto:
    return Crypto(Keyring([raw]), os.urandom, **kw)


def _intruder_alive(port: int) -> bytes:
    return encode_message(Alive(1, "intruder", LOOPBACK, port, b"", bytes([1, 5, 2, 2, 5, 4])))


def _intruder_push_pull(port: int) -> bytes:
    state = PushNodeState(
        "intruder", LOOPBACK, port, b"", 1, NodeStateType.ALIVE, bytes([1, 5, 2, 2, 5, 4])
    )
    return encode_push_pull(PushPull(True, (state,)))


def _agent(tmp_path: Path, name: str, **extra: object) -> Agent:
    return Agent(
        load(
            None,
            {
                "node": name,
                "bind": f"127.0.0.1:{free_port()}",
                "profile": "local",
                "control": str(tmp_path / f"{name}.sock"),
                **extra,
            },
        )
    )


async def _send_stream(port: int, payload: bytes) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(payload)
        with trio.move_on_after(2):
            await stream.receive_some(100)  # the agent closes it


# --- (a) authentication failures: dropped, counted by reason, membership unchanged ---------


@pytest.mark.trio
async def test_auth_failures_are_dropped_counted_and_harmless(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2, encrypt=KEY) as agents:
        await all_alive(agents, {"n0", "n1"})
        target = agents[0]
        port = target.agent.bound_port
        stats = target.node.stats
        before = [(m.name, m.state, m.incarnation) for m in target.node.members()]
        dropped = dict(stats.dropped)
        alive = _intruder_alive(port + 1)
        ping = encode_message(Ping(1, "n0", LOOPBACK, port + 1, "intruder"))
        good = encode_packet([alive], compress=False, crc=True, crypto=_crypto(KEY_RAW))
        tampered = bytearray(good)
        tampered[-1] ^= 1  # last byte of the GCM tag
        packets = {
            "plaintext alive": encode_packet([alive], compress=False, crc=True, crypto=None),
            "plaintext ping": encode_packet([ping], compress=False, crc=False, crypto=None),
            "unknown key": encode_packet(
                [alive], compress=False, crc=True, crypto=_crypto(OTHER_RAW)
            ),
            "tampered tag": bytes(tampered),
            "unknown version": bytes([7]) + good[1:],
        }
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            for data in packets.values():
                udp.sendto(data, ("127.0.0.1", port))
        push_pull = _intruder_push_pull(port + 1)
        streams = {
            "plaintext push-pull": encode_stream(push_pull, compress=False, crypto=None),
            "unknown key push-pull": encode_stream(
                push_pull, compress=False, crypto=_crypto(OTHER_RAW)
            ),
        }
        for data in streams.values():
            await _send_stream(port, data)

        def delta(reason: str) -> int:
            return int(stats.dropped.get(reason, 0) - dropped.get(reason, 0))

        # 5 packets + the stream with an unknown key; the plaintext stream is "not_encrypted"
        await until(lambda: delta("decrypt_failed") >= 6 and delta("not_encrypted") >= 1, 5)
        await trio.sleep(0.5)  # nothing else (e.g. the legitimate peer) may be counted
        assert delta("decrypt_failed") == 6
        assert delta("not_encrypted") == 1
        assert target.node.member("intruder") is None
        assert agents[1].node.member("intruder") is None
        assert [(m.name, m.state, m.incarnation) for m in target.node.members()] == before
        # the same counters, by reason, in /metrics and `swimctl info`
        text = AgentMetrics(target.node, target.agent.phi_values).render().decode()
        count = stats.dropped["decrypt_failed"]
        assert f'swim_dropped_inputs_total{{reason="decrypt_failed"}} {count}.0' in text
        info = await trio.to_thread.run_sync(ControlClient(tmp_path / "n0.sock").request, "info")
        assert info["stats"]["dropped"]["decrypt_failed"] == stats.dropped["decrypt_failed"]
        assert info["stats"]["dropped"]["not_encrypted"] == stats.dropped["not_encrypted"]


# --- (b) no plaintext fallback unless explicitly configured --------------------------------


@pytest.mark.trio
async def test_plaintext_agent_cannot_join_an_encrypted_one(tmp_path: Path) -> None:
    async with cluster(tmp_path, 1, encrypt=KEY) as agents:
        target = agents[0]
        plain = _agent(tmp_path, "plain")
        async with trio.open_nursery() as nursery:
            await nursery.start(plain.run)
            result = await plain.join([f"127.0.0.1:{target.agent.bound_port}"])
            assert result["joined"] == 0
            await trio.sleep(1.5)  # a few probe rounds: the plain agent's pings are dropped too
            assert target.node.member("plain") is None
            assert plain.node is not None and plain.node.member("n0") is None
            assert target.node.stats.dropped["not_encrypted"] >= 1
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_verify_incoming_off_accepts_plaintext_for_a_rollout(tmp_path: Path) -> None:
    """memberlist GossipVerifyIncoming/Outgoing = false on the keyed agent: a plaintext
    member joins and both stay alive (the first step of rolling out encryption)."""
    async with cluster(
        tmp_path, 1, encrypt=KEY, encrypt_verify_incoming=False, encrypt_verify_outgoing=False
    ) as agents:
        keyed = agents[0]
        plain = _agent(tmp_path, "plain")
        async with trio.open_nursery() as nursery:
            await nursery.start(plain.run)
            result = await plain.join([f"127.0.0.1:{keyed.agent.bound_port}"])
            assert result["joined"] == 1
            assert plain.node is not None

            def both_alive() -> bool:
                k, p = keyed.node.member("plain"), plain.node.member("n0")  # type: ignore[union-attr]
                return bool(k and p and k.state == p.state == NodeStateType.ALIVE)

            await until(both_alive, 10)
            await trio.sleep(2)  # probes both ways: nobody is suspected
            assert both_alive()
            assert keyed.node.stats.suspicions_raised == 0
            assert plain.node.stats.suspicions_raised == 0
            # an encrypted packet is still authenticated and read
            assert keyed.node.stats.dropped.get("decrypt_failed", 0) == 0
            nursery.cancel_scope.cancel()


def test_verify_settings_wire_semantics() -> None:
    alive = _intruder_alive(7946)
    strict = _crypto(KEY_RAW)
    lax = _crypto(KEY_RAW, verify_incoming=False)
    plain_out = _crypto(KEY_RAW, verify_outgoing=False)
    plain = encode_packet([alive], compress=False, crc=True, crypto=None)
    sealed = encode_packet([alive], compress=False, crc=True, crypto=strict)
    with pytest.raises(WireError, match="decrypt_failed"):
        decode_packet(plain, strict)
    assert decode_packet(plain, lax).messages == (decode_message(alive),)
    assert decode_packet(sealed, lax).messages == (decode_message(alive),)
    # outgoing off: the packet is plaintext and its overhead excludes encryption
    assert encode_packet([alive], compress=False, crc=True, crypto=plain_out) == plain
    assert packet_overhead(plain_out) == packet_overhead(None)
    pp = _intruder_push_pull(7946)
    limits = StreamLimits()
    with pytest.raises(WireError, match="not_encrypted"):
        parse_stream(encode_stream(pp, compress=False, crypto=None), strict, limits)
    got = parse_stream(encode_stream(pp, compress=False, crypto=None), lax, limits)
    assert got is not None and isinstance(got[0], PushPull)
    assert encode_stream(pp, compress=False, crypto=plain_out) == pp
    # a stream with an unknown key is dropped even with verify_incoming off (memberlist too)
    with pytest.raises(WireError, match="decrypt_failed"):
        parse_stream(encode_stream(pp, compress=False, crypto=_crypto(OTHER_RAW)), lax, limits)


def test_verify_settings_config(tmp_path: Path) -> None:
    assert load(None, {"encrypt": KEY}).swim_config().gossip_verify_incoming is True
    assert load(None, {"encrypt": KEY}).swim_config().gossip_verify_outgoing is True
    path = tmp_path / "agent.toml"
    path.write_text(
        f'encrypt = "{KEY}"\nencrypt_verify_incoming = false\nencrypt_verify_outgoing = false\n'
    )
    swim = load(path).swim_config()
    assert swim.gossip_verify_incoming is False and swim.gossip_verify_outgoing is False
    with pytest.raises(AgentConfigError, match="encrypt_verify_incoming must be true or false"):
        build({"encrypt_verify_incoming": "no"})


# --- (d) the control socket ----------------------------------------------------------------

NOBODY = 65534
# the child runs as nobody, who cannot reach our interpreter under /root; it needs only the
# standard library
SYSTEM_PYTHON = "/usr/bin/python3"
_CHILD = """
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("connect:" + type(exc).__name__)
    sys.exit(0)
try:
    s.sendall(bytes.fromhex(sys.argv[2]))
except OSError:
    pass  # refused before the request went out: the reply is still there to read
data = b""
while True:
    try:
        chunk = s.recv(65536)
    except OSError as exc:
        print("recv:" + type(exc).__name__ + ":" + data.hex())
        sys.exit(0)
    if not chunk:
        break
    data += chunk
print("reply:" + data.hex())
"""


def _as_uid(uid: int, path: Path, frame: bytes) -> str:
    out = subprocess.run(
        [SYSTEM_PYTHON, "-c", _CHILD, str(path), frame.hex()],
        user=uid,
        group=uid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
        check=True,
    )
    return out.stdout.strip()


@pytest.mark.trio
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
@pytest.mark.skipif(not hasattr(socket, "SO_PEERCRED"), reason="no SO_PEERCRED")
@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason=f"no {SYSTEM_PYTHON}")
async def test_control_socket_refuses_other_users(caplog: pytest.LogCaptureFixture) -> None:
    from agent.control import encode_frame, make_request

    # a directory others may traverse (pytest's tmp_path is 0700), so only the socket's own
    # mode and the peer check stand in the way
    work = Path(tempfile.mkdtemp(prefix="swim-sec-"))
    work.chmod(0o755)
    try:
        async with cluster(work, 1, encrypt=KEY) as agents:
            sock = work / "n0.sock"
            st = sock.stat()
            assert st.st_mode & 0o777 == 0o660 and st.st_uid == os.geteuid()
            assert st.st_gid == agents[0].agent.access.gid  # type: ignore[union-attr]
            frame = encode_frame(make_request("info"))
            got = await trio.to_thread.run_sync(_as_uid, NOBODY, sock, frame)
            assert got == "connect:PermissionError"  # the file mode stops it
            sock.chmod(0o666)  # widened by mistake: SO_PEERCRED still refuses
            got = await trio.to_thread.run_sync(_as_uid, NOBODY, sock, frame)
            # the reply, then the close (a reset, as the request was left unread)
            assert got.startswith(("reply:", "recv:ConnectionResetError:")), got
            replies = FrameDecoder().feed(bytes.fromhex(got.rpartition(":")[2]))
            assert len(replies) == 1 and replies[0]["ok"] is False
            assert f"peer uid {NOBODY}" in replies[0]["error"]
            assert "refused: peer uid 65534" in caplog.text
            # root (the agent's user here) is still served, over the same widened socket
            info = await trio.to_thread.run_sync(ControlClient(sock).request, "info")
            assert info["node"] == "n0"
            assert agents[0].node.name == "n0"
    finally:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()


def test_peer_check_is_skipped_without_peer_credentials() -> None:
    from agent.access import Access, peer_of

    class NoCreds:
        def getsockopt(self, *args: object) -> bytes:
            raise OSError("not supported")

    assert peer_of(NoCreds()) is None
    access = Access()
    assert access.connection_refusal(None) is None
    assert access.request_refusal("force_leave", None) is None


# --- (e) no key material in logs, metrics, info or monitor events --------------------------


def _key_forms(raw: bytes) -> list[str]:
    return [
        base64.b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode(),
        base64.b64encode(raw).decode().rstrip("="),
        raw.hex(),
        raw.hex().upper(),
        repr(raw)[2:-1],
    ]


def _assert_no_key(text: str, keys: list[bytes], where: str) -> None:
    for raw in keys:
        for form in _key_forms(raw):
            assert form not in text, f"key material ({form!r}) in {where}"


@pytest.mark.trio
async def test_no_secret_in_logs_metrics_info_or_events(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    keys = [KEY_RAW, NEW_RAW, OTHER_RAW]
    async with cluster(tmp_path, 2, encrypt=KEY, log_level="debug") as agents:
        events: list[dict[str, Any]] = []
        subscription = agents[0].agent.subscribe()

        async def collect() -> None:
            async with subscription:
                async for event in subscription:
                    events.append(event)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect)
            await all_alive(agents, {"n0", "n1"})
            stranger = _agent(tmp_path, "x", encrypt=base64.b64encode(OTHER_RAW).decode())
            async with trio.open_nursery() as inner:
                await inner.start(stranger.run)
                await stranger.join([f"127.0.0.1:{agents[0].agent.bound_port}"])
                inner.cancel_scope.cancel()
            for a in agents:
                client = ControlClient(tmp_path / f"{a.agent.config.node}.sock")
                for action, key in (("install", NEW), ("use", NEW), ("remove", KEY)):
                    await trio.to_thread.run_sync(
                        functools.partial(client.request, "keys", action=action, key=key)
                    )
            await trio.sleep(1.5)
            assert {m.state for m in agents[1].node.members()} == {NodeStateType.ALIVE}
            client = ControlClient(tmp_path / "n0.sock")
            info = await trio.to_thread.run_sync(client.request, "info")
            metrics = AgentMetrics(agents[0].node, agents[0].agent.phi_values).render().decode()
            nursery.cancel_scope.cancel()
    assert info["encrypted"] is True
    assert caplog.records, "debug logging was captured"
    _assert_no_key(caplog.text, keys, "logs")
    _assert_no_key(json.dumps(info), keys, "info")
    _assert_no_key(metrics, keys, "metrics")
    _assert_no_key(json.dumps(events, default=str), keys, "monitor events")


# --- (c) key rotation across a running mixed cluster ---------------------------------------


def _serf_keys(serf: LocalSerf, *args: str) -> subprocess.CompletedProcess[str]:
    assert SERF is not None
    return subprocess.run(
        [SERF, "keys", *args, f"-rpc-addr={serf.rpc}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# memberlist/serf log lines of a suspicion or a failure; ours: the stats counters
SERF_FALSE_POSITIVE = ("Suspect", "Marking", "EventMemberFailed", "failed, suspect")


@pytest.mark.slow
@pytest.mark.skipif(SERF is None, reason="serf not installed")
def test_key_rotation_across_a_mixed_cluster(tmp_path: Path) -> None:
    names = {"s0", "s1", "w0", "w1", "w2"}
    serfs: list[LocalSerf] = []
    swims: list[LocalAgent] = []

    def everyone() -> list[LocalSerf | LocalAgent]:
        return [*serfs, *swims]

    extra = ["--encrypt", KEY, "--log-level", "debug"]
    try:
        # lan, not local: local's retransmit limit is 2 at n = 5, so a gossiped query can
        # miss a member (seen: 4/5 answered), in serf-only clusters as well
        serfs.append(LocalSerf("s0", tmp_path, "lan", encrypt=KEY))
        serfs[0].wait_ready()
        serfs.append(LocalSerf("s1", tmp_path, "lan", join=serfs[0].port, encrypt=KEY))
        for i in range(3):
            swims.append(LocalAgent(f"w{i}", tmp_path, "lan", serfs[0].port, extra))
        serfs[1].wait_ready()
        for w in swims:
            w.wait_ready(20)

        def everyone_alive() -> bool:
            views = [
                {n for n, m in x.members().items() if m["status"] == "alive"} for x in everyone()
            ]
            return all(v == names for v in views)

        wait_until(everyone_alive, 40, "everyone alive before the rotation", ignore=(SerfError,))
        before = {w.name: w.client.request("info")["stats"] for w in swims}
        seen_bad: list[str] = []

        def check_views() -> None:
            for x in everyone():
                for n, m in x.members().items():
                    if m["status"] != "alive":
                        seen_bad.append(f"{x.name} sees {n} {m['status']}")

        start = time.monotonic()
        results: list[tuple[str, str, int]] = []  # serf agent, action, members that answered
        for action, key in (("install", NEW), ("use", NEW), ("remove", KEY)):
            # one `serf keys` against one serf agent: the query is gossiped to every member
            # (ours pass it on too) and every member answers it (ours too), so the whole
            # mixed cluster rotates from Serf's own CLI
            out = _serf_keys(serfs[0], f"-{action}={key}")
            text = out.stdout + out.stderr
            # serf prints "N/5 nodes reported success" and exits 1 unless every member
            # (ours included) answered with success
            assert out.returncode == 0 and "Successfully" in text, (action, text)
            results.append((serfs[0].name, action, 5))
            check_views()
            time.sleep(1.5)  # probes and gossip with the new keyring state, both sides
            check_views()
        rotation_s = time.monotonic() - start
        assert all(n == 5 for _, _, n in results), results
        for w in swims:
            got = w.client.request("keys", action="list")
            assert got["keys"] == [NEW] and got["primary"] == NEW, got
        listing = _serf_keys(serfs[1], "-list")
        assert listing.returncode == 0 and NEW in listing.stdout and KEY not in listing.stdout, (
            listing.stdout + listing.stderr
        )
        time.sleep(3)  # a few more probe rounds on the new key only
        check_views()
        assert seen_bad == []
        for w in swims:
            after = w.client.request("info")["stats"]
            assert after["suspicions_raised"] == before[w.name]["suspicions_raised"], w.name
            assert after["deaths_declared"] == before[w.name]["deaths_declared"], w.name
        for s in serfs:
            log_text = s.log_path.read_text()
            bad = [ln for ln in log_text.splitlines() if any(b in ln for b in SERF_FALSE_POSITIVE)]
            assert bad == [], bad
        # a node holding only the old key cannot join (ours, then serf)
        drops_before = swims[0].client.request("info")["stats"]["dropped"].get("decrypt_failed", 0)
        stale = LocalAgent("old", tmp_path, "local", swims[0].port, ["--encrypt", KEY])
        swims.append(stale)
        stale.wait_ready(20)
        stale_serf = LocalSerf("sold", tmp_path, join=swims[0].port, encrypt=KEY)
        serfs.append(stale_serf)
        time.sleep(4)
        observers: list[LocalSerf | LocalAgent] = [*serfs[:2], *swims[:3]]
        for x in observers:
            assert "old" not in x.members() and "sold" not in x.members(), x.name
        drops = swims[0].client.request("info")["stats"]["dropped"].get("decrypt_failed", 0)
        assert drops > drops_before
        # no key material in our agents' debug logs
        for w in swims[:3]:
            _assert_no_key(w.log_path.read_text(), [KEY_RAW, NEW_RAW], f"{w.name} log")
        print(
            f"rotation (install, use, remove on 2 serf + 3 swim): {rotation_s:.1f}s, "
            f"serf keys answers {results}"
        )
    finally:
        for s in serfs:
            s.stop(signal.SIGKILL)
        for w in swims:
            w.stop(signal.SIGKILL)
