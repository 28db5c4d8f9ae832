"""Fuzzing the codec and the Node with mutated real serf packets (tests/golden/serf).

Seeds are the golden UDP packets and TCP streams captured from serf 0.9.4 agents. Mutations
work on raw bytes (bit flips, interesting bytes, truncation, insertion, deletion, splices of
two seeds, msgpack length fields set to huge values, compound headers that lie) and on
structure: the layers are peeled (AES-GCM, CRC, LZW, compound), one leaf message has a
msgpack value replaced by one of another type (type confusion), and the layers are put back
with valid checksums and a valid key, so the mutation reaches the decoder behind them.

Properties, for every input:
- ``wire.decode_packet`` and ``wire.parse_stream`` raise nothing but ``WireError``; a parsed
  stream never claims more bytes than it was given.
- ``Node.handle_datagram``, ``Node.parse_stream`` (documented to raise ``WireError`` only)
  and ``Node.handle_stream`` never raise.
- A datagram that does not decode to any message is counted in ``stats.dropped`` and leaves
  the member table (names, states, incarnations, addresses, meta) and the node's own
  incarnation unchanged.
- State stays bounded: the gossip decode memo, the broadcast queue and the timers never
  exceed their bounds however many inputs arrive.

The CI run is bounded (``FUZZ_ITERATIONS`` seeded inputs plus hypothesis examples, a few
seconds). Longer runs: ``python scripts/fuzz.py --minutes N`` (the same engine with fresh
seeds, reporting inputs/s and any failing input), or ``SWIM_FUZZ_EXAMPLES=20000 pytest
tests/swim/test_fuzz.py`` to scale the hypothesis tests.
"""

from __future__ import annotations

import base64
import json
import os
import random
import struct
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swim import Address, Node, NodeStateType, wire
from swim.messages import MsgType, PushNodeState, PushPull
from swim.security import Keyring, decrypt_payload, encrypt_payload

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "serf"
MANIFEST: dict[str, Any] = json.loads((GOLDEN / "manifest.json").read_text())
KEYS = [base64.b64decode(MANIFEST["keys"][k]["base64"]) for k in ("k2", "k1")]
KEYRING = Keyring(KEYS)
CRYPTO = wire.Crypto(KEYRING, nonce=random.Random(3).randbytes)
LIMITS = wire.StreamLimits(max_bytes=1024 * 1024, max_nodes=4096, max_user_bytes=1024 * 1024)
FUZZ_ITERATIONS = int(os.environ.get("SWIM_FUZZ_ITERATIONS", "6000"))
HYPOTHESIS_EXAMPLES = int(os.environ.get("SWIM_FUZZ_EXAMPLES", "300"))
VSN = bytes([1, 5, 2, 2, 5, 4])
PEERS = {n: Address(f"10.0.0.{i + 2}", 7946) for i, n in enumerate(("b", "c", "d"))}
HOSTILE = Address("10.9.9.9", 7946)


@dataclass(frozen=True)
class Seed:
    data: bytes
    encrypted: bool
    udp: bool


def _seeds() -> list[Seed]:
    out = []
    for entry in MANIFEST["entries"]:
        data = (GOLDEN / entry["file"]).read_bytes()
        if not data:
            continue
        out.append(Seed(data, entry["scenario"] == "encrypted", entry["transport"] == "udp"))
    return out


SEEDS = _seeds()
UDP_SEEDS = [s for s in SEEDS if s.udp]
TCP_SEEDS = [s for s in SEEDS if not s.udp]


# --- mutators -----------------------------------------------------------------------------

INTERESTING = bytes.fromhex("0001 0709 0c7f 80ff c0c1 c2c3 c4c5 c6c7 cacb cfd3 d9da dbdc ddde dfe0")
# msgpack markers followed by a big-endian length: (marker, length width)
LENGTH_MARKERS = {
    0xC4: 1,
    0xC5: 2,
    0xC6: 4,
    0xD9: 1,
    0xDA: 2,
    0xDB: 4,
    0xDC: 2,
    0xDD: 4,
    0xDE: 2,
    0xDF: 4,
}
CONFUSED: list[Any] = [
    None,
    True,
    -1,
    -(2**63),
    2**64 - 1,
    2**32,
    1.5,
    b"",
    b"\xff" * 300,
    "str",
    [],
    [1, 2, 3],
    {},
    {b"Node": b"x"},
    msgpack.ExtType(1, b"x"),
]


def _flip(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
    return bytes(buf)


def _interesting(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        buf[rng.randrange(len(buf))] = rng.choice(INTERESTING)
    return bytes(buf)


def _truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))]


def _insert(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data) + 1)
    return data[:i] + rng.randbytes(rng.randint(1, 32)) + data[i:]


def _delete(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data))
    return data[:i] + data[i + rng.randint(1, 16) :]


def _splice(data: bytes, rng: random.Random) -> bytes:
    other = rng.choice(SEEDS).data
    return data[: rng.randrange(len(data) + 1)] + other[rng.randrange(len(other)) :]


def _length_field(data: bytes, rng: random.Random) -> bytes:
    """Set the length after a msgpack marker (or the first bytes) to a huge or off value."""
    spots = [i for i, b in enumerate(data) if b in LENGTH_MARKERS]
    buf = bytearray(data)
    if not spots:
        i, width = 0, min(4, len(buf))
    else:
        i = rng.choice(spots)
        width = LENGTH_MARKERS[buf[i]]
        i += 1
    value = rng.choice([0, 1, 2**31, 2 ** (8 * width) - 1, rng.getrandbits(8 * width)])
    value &= 2 ** (8 * width) - 1
    buf[i : i + width] = value.to_bytes(width, "big")
    return bytes(buf)


def _compound_bomb(data: bytes, rng: random.Random) -> bytes:
    """A compound header that claims many parts and lengths past the end."""
    count = rng.choice([0, 1, 255, rng.randint(2, 254)])
    lengths = [rng.choice([0, 1, 0xFFFF, rng.randrange(0x10000)]) for _ in range(count)]
    if rng.random() < 0.5:
        lengths = lengths[: rng.randrange(count + 1)]  # table shorter than claimed
    return bytes([MsgType.COMPOUND, count]) + struct.pack(f">{len(lengths)}H", *lengths) + data


BYTE_MUTATORS = (
    _flip,
    _interesting,
    _truncate,
    _insert,
    _delete,
    _splice,
    _length_field,
    _compound_bomb,
)


def _confuse(obj: Any, rng: random.Random) -> Any:
    """Replace one value (or key) of a decoded msgpack map with one of another type."""
    if isinstance(obj, dict) and obj:
        key = rng.choice(list(obj))
        choice = rng.random()
        if choice < 0.6:
            obj[key] = rng.choice(CONFUSED)
        elif choice < 0.8:
            obj[rng.choice([b"Incarnation", b"Node", b"Addr", b"State", b"Vsn", 7])] = rng.choice(
                CONFUSED
            )
        else:
            del obj[key]
        return obj
    return rng.choice(CONFUSED)


def _structured(data: bytes, rng: random.Random, depth: int = 0) -> bytes:
    """Peel CRC/compress/compound layers, confuse a leaf's msgpack body, and rewrap."""
    if not data or depth > 5:
        return data
    kind = data[0]
    try:
        if kind == MsgType.HAS_CRC and len(data) >= 5:
            inner = _structured(data[5:], rng, depth + 1)
            return wire.add_crc(inner) if rng.random() < 0.9 else data[:5] + inner
        if kind == MsgType.COMPRESS:
            inner = wire.decompress_body(data[1:])
            return wire.compress_message(_structured(inner, rng, depth + 1))
        if kind == MsgType.COMPOUND:
            parts, _ = wire.split_compound(data[1:])
            if not parts:
                return data
            i = rng.randrange(len(parts))
            parts[i] = _structured(parts[i], rng, depth + 1)
            if rng.random() < 0.2:
                parts.append(rng.choice(UDP_SEEDS).data[:300])
            return wire.make_compound(parts)
    except (wire.WireError, ValueError):
        return data
    # a leaf: [type][msgpack ...]; streams may hold several objects (push-pull states)
    unpacker = msgpack.Unpacker(raw=True, strict_map_key=False)
    unpacker.feed(data[1:])
    objs: list[Any] = []
    try:
        for obj in unpacker:
            objs.append(obj)
            if len(objs) > 64:
                break
    except (ValueError, TypeError, msgpack.UnpackException):
        pass
    if not objs:
        return _flip(data, rng)
    i = rng.randrange(len(objs))
    objs[i] = _confuse(objs[i], rng)
    if rng.random() < 0.1:
        kinds = [k for k in MsgType if k not in (MsgType.COMPOUND, MsgType.COMPRESS)]
        kind = rng.choice(kinds)
    try:
        return bytes([kind]) + b"".join(msgpack.packb(o, use_bin_type=False) for o in objs)
    except (ValueError, TypeError, OverflowError):
        return data


def _plaintext(seed: Seed) -> bytes:
    if not seed.encrypted:
        return seed.data
    if seed.udp:
        return decrypt_payload(KEYS, seed.data, b"")
    # stream: [0x0a][u32 len][encrypted payload] (security.go encryptPayload framing)
    (length,) = struct.unpack_from(">I", seed.data, 1)
    from swim.security import decrypt_stream_body

    return decrypt_stream_body(KEYS, seed.data[:5], seed.data[5 : 5 + length], b"")


def _reencrypt(seed: Seed, plain: bytes, rng: random.Random) -> bytes:
    if seed.udp:
        return encrypt_payload(1, rng.choice(KEYS), plain, b"", rng.randbytes(12))
    from swim.security import encrypt_stream

    return encrypt_stream(1, rng.choice(KEYS), plain, b"", rng.randbytes(12))


PLAINTEXTS = {id(s): _plaintext(s) for s in SEEDS}


def mutate(seed: Seed, rng: random.Random) -> bytes:
    """One hostile input derived from ``seed`` (or pure random bytes)."""
    roll = rng.random()
    if roll < 0.05:
        return rng.randbytes(rng.choice([0, 1, 2, 5, 17, 100, 1400, 65_000]))
    inner = PLAINTEXTS[id(seed)]
    rounds = rng.randint(1, 3)
    for _ in range(rounds):
        if not inner:
            break
        if rng.random() < 0.35:
            inner = _structured(inner, rng)
        else:
            inner = rng.choice(BYTE_MUTATORS)(inner, rng)
    if seed.encrypted:
        if rng.random() < 0.8:  # behind a valid key: reaches the decoder
            return _reencrypt(seed, inner, rng)
        return _flip(seed.data, rng)  # the ciphertext itself, GCM must reject it
    return inner


# --- property checks ----------------------------------------------------------------------


@dataclass
class Tally:
    inputs: int = 0
    packets: int = 0
    streams: int = 0
    undecodable: int = 0
    decoded_messages: int = 0
    parse_results: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)


def new_node(encrypted: bool) -> Node:
    node = Node(
        "a",
        Address("10.0.0.1", 7946),
        rng=random.Random(5),
        now_ms=0,
        keyring=Keyring(KEYS) if encrypted else None,
        nonce_source=random.Random(6).randbytes,
    )
    node.start(0)
    states = tuple(
        PushNodeState(n, addr.ip_bytes, addr.port, b"", 3, NodeStateType.ALIVE, VSN)
        for n, addr in PEERS.items()
    )
    node.handle_stream(PEERS["b"], PushPull(True, states), 1)
    return node


def snapshot(node: Node) -> tuple[Any, ...]:
    members = tuple(
        sorted((m.name, m.state, m.incarnation, m.address, m.meta) for m in node.members())
    )
    return node.incarnation, members


def _decodes(data: bytes, crypto: wire.Crypto | None) -> bool:
    try:
        return bool(wire.decode_packet(data, crypto).messages)
    except wire.WireError:
        return False


def check_packet(node: Node, data: bytes, encrypted: bool, now: int, tally: Tally) -> None:
    crypto = CRYPTO if encrypted else None
    valid = _decodes(data, crypto)  # raises anything but WireError → the test fails
    before = snapshot(node)
    dropped = sum(node.stats.dropped.values())
    node.handle_datagram(HOSTILE, data, now)
    tally.inputs += 1
    tally.packets += 1
    if valid:
        tally.decoded_messages += 1
        return
    tally.undecodable += 1
    assert snapshot(node) == before, f"undecodable packet changed state: {data.hex()}"
    assert sum(node.stats.dropped.values()) > dropped, f"drop not counted: {data.hex()}"


def check_stream(node: Node, data: bytes, encrypted: bool, now: int, tally: Tally) -> None:
    crypto = CRYPTO if encrypted else None
    tally.inputs += 1
    tally.streams += 1
    try:
        parsed = wire.parse_stream(data, crypto, LIMITS)
    except wire.WireError as exc:
        tally.parse_results[exc.reason.value] += 1
    else:
        tally.parse_results["need_more" if parsed is None else "ok"] += 1
        if parsed is not None:
            assert 0 < parsed[1] <= len(data)
    before = snapshot(node)
    try:
        mine = node.parse_stream(data)
    except wire.WireError as exc:
        node.record_drop(exc.reason)
        assert snapshot(node) == before
        return
    if mine is not None:
        node.handle_stream(HOSTILE, mine[0], now)


def check_bounds(node: Node) -> None:
    assert wire.gossip_cache_len() <= wire.GOSSIP_CACHE_ENTRIES
    assert node.broadcast_queue_depth <= 2 * node.config.max_broadcast_queue
    assert node.live_timers <= 16 + 4 * node.num_members()


def run(rng: random.Random, iterations: int, deadline: float | None = None) -> Tally:
    """The fuzz loop shared with scripts/fuzz.py: fresh nodes every 500 inputs."""
    tally = Tally()
    nodes = {False: new_node(False), True: new_node(True)}
    for i in range(iterations):
        if deadline is not None and time.monotonic() > deadline:
            break
        if i % 500 == 499:
            for enc, node in nodes.items():
                tally.dropped.update(node.stats.dropped)
                check_bounds(node)
                nodes[enc] = new_node(enc)
        seed = rng.choice(SEEDS)
        data = mutate(seed, rng)
        node = nodes[seed.encrypted]
        now = 10 + i
        if seed.udp:
            check_packet(node, data, seed.encrypted, now, tally)
        else:
            check_stream(node, data, seed.encrypted, now, tally)
    for node in nodes.values():
        tally.dropped.update(node.stats.dropped)
        check_bounds(node)
    return tally


# --- tests --------------------------------------------------------------------------------


def test_seeds_are_valid_before_mutation() -> None:
    assert len(UDP_SEEDS) >= 100 and len(TCP_SEEDS) >= 30
    for seed in UDP_SEEDS:
        assert _decodes(seed.data, CRYPTO if seed.encrypted else None)


def test_mutated_golden_inputs_never_escape_and_garbage_changes_nothing() -> None:
    tally = run(random.Random(20261203), FUZZ_ITERATIONS)
    assert tally.inputs == FUZZ_ITERATIONS
    # the mutators must reach past the outer layers, not only be rejected at the door
    assert tally.undecodable > FUZZ_ITERATIONS // 10
    assert tally.decoded_messages > FUZZ_ITERATIONS // 20
    assert {"malformed", "decompress_failed", "bad_crc", "decrypt_failed"} <= set(tally.dropped)
    assert tally.parse_results["ok"] > 0


@settings(
    max_examples=HYPOTHESIS_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.integers(0, 2**32 - 1), st.sampled_from(range(len(SEEDS))))
def test_hypothesis_mutations(rng_seed: int, index: int) -> None:
    seed = SEEDS[index]
    rng = random.Random(rng_seed)
    node = new_node(seed.encrypted)
    tally = Tally()
    for i in range(5):
        data = mutate(seed, rng)
        if seed.udp:
            check_packet(node, data, seed.encrypted, 10 + i, tally)
        else:
            check_stream(node, data, seed.encrypted, 10 + i, tally)
    check_bounds(node)


@settings(
    max_examples=HYPOTHESIS_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.binary(max_size=2048), st.booleans())
def test_hypothesis_random_bytes(data: bytes, encrypted: bool) -> None:
    node = new_node(encrypted)
    tally = Tally()
    check_packet(node, data, encrypted, 10, tally)
    check_stream(node, data, encrypted, 11, tally)
    # the same bytes framed as each layer the decoder peels
    for prefix in (b"\x07", b"\x09", b"\x0c" + zlib.crc32(data).to_bytes(4, "big"), b"\x06"):
        check_packet(node, prefix + data, False, 12, tally)
        check_stream(node, prefix + data, False, 13, tally)


def test_compressed_bombs_stay_bounded() -> None:
    """LZW that expands past the packet bound, and nested compound/compress layers."""
    node = new_node(False)
    tally = Tally()
    big = wire.compress_message(b"\x00" * (200 * 1024))
    check_packet(node, big, False, 10, tally)
    assert node.stats.dropped["decompress_failed"] >= 1
    plain = next(s for s in UDP_SEEDS if not s.encrypted)
    nested = wire.encode_message(wire.decode_packet(plain.data, None).messages[0])
    for _ in range(8):
        nested = wire.compress_message(wire.make_compound([nested, nested]))
    check_packet(node, nested, False, 11, tally)
    assert node.stats.dropped["too_deep"] >= 1
    check_bounds(node)


def test_an_authentic_empty_encrypted_stream_is_a_wire_error() -> None:
    """Regression (found by this fuzzer): an encrypted stream frame whose plaintext is empty
    raised IndexError out of ``parse_stream``; in the agent that escaped the per-connection
    handler (it catches WireError and socket errors only) and took the TCP server down."""
    from swim.security import encrypt_stream

    data = encrypt_stream(1, KEYS[0], b"", b"", bytes(12))
    try:
        wire.parse_stream(data, CRYPTO, LIMITS)
    except wire.WireError as exc:
        assert exc.reason == wire.DropReason.EMPTY
    else:
        raise AssertionError("an empty encrypted stream parsed")
    node = new_node(True)
    tally = Tally()
    check_stream(node, data, True, 10, tally)
    assert tally.parse_results == Counter({"empty": 1})
