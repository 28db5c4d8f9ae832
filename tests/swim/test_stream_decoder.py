"""``StreamDecoder`` (swim/wire/decoder.py) against ``parse_stream``: the same message or the
same ``DropReason`` for the same bytes fed whole or in any pieces; limits refused as early
as the bytes allow; work proportional to the bytes fed (counted, not timed).
"""

from __future__ import annotations

import random
import struct
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swim import Keyring, StreamDecoder, wire
from swim.messages import (
    Ack,
    ErrResp,
    MsgType,
    NodeStateType,
    Ping,
    PushNodeState,
    PushPull,
    UserMsg,
)
from swim.wire import DropReason, WireError
from tests.swim.node_harness import make_peer
from tests.swim.test_fuzz import CRYPTO as FUZZ_CRYPTO
from tests.swim.test_fuzz import LIMITS as FUZZ_LIMITS
from tests.swim.test_fuzz import TCP_SEEDS, mutate

CRYPTO = wire.Crypto(Keyring([bytes(range(16))]), nonce=lambda n: bytes(n))
LIMITS = wire.StreamLimits(max_bytes=1024 * 1024, max_nodes=4096, max_user_bytes=1024 * 1024)
VSN = bytes((1, 5, 2, 0, 0, 0))


def _state(index: int, meta: bytes = b"") -> PushNodeState:
    return PushNodeState(
        f"node-{index}",
        bytes((10, 0, index >> 8 & 0xFF, index & 0xFF)),
        7946,
        meta,
        index + 1,
        NodeStateType(index % 4),
        VSN,
    )


STATES = tuple(_state(i, b"role=x" if i % 3 else b"") for i in range(40))


def _expected(data: bytes, crypto: wire.Crypto | None, limits: wire.StreamLimits) -> object:
    """``parse_stream`` on the whole buffer: (message, used), a DropReason, or None."""
    try:
        return wire.parse_stream(data, crypto, limits)
    except WireError as exc:
        return exc.reason


def _decode(
    data: bytes, crypto: wire.Crypto | None, limits: wire.StreamLimits, sizes: list[int]
) -> object:
    """Feed ``data`` in pieces of ``sizes`` (cycled); the same shape as ``_expected``."""
    decoder = StreamDecoder(crypto, limits)
    got: object = None
    offset = index = 0
    while offset < len(data) or index == 0:
        size = sizes[index % len(sizes)]
        piece = data[offset : offset + size]
        offset += size
        index += 1
        try:
            message = decoder.feed(piece)
        except WireError as exc:
            with pytest.raises(WireError) as again:  # a failed decoder stays failed
                decoder.feed(b"x")
            assert again.value.reason is exc.reason
            return exc.reason
        if message is not None:
            assert got is None, "a decoder returns its message once"
            got = (message, decoder.used_bytes)
        assert decoder.received_bytes == min(offset, len(data))
        assert 0 <= decoder.buffered_bytes <= decoder.received_bytes
    return got


def _chunkings(length: int, rng: random.Random) -> list[list[int]]:
    whole = [max(length, 1)]
    ones = [1]
    small = [rng.randint(1, 7) for _ in range(50)]
    large = [rng.randint(1, max(1, length // 3)) for _ in range(20)]
    return [whole, ones, small, large] if length <= 4096 else [whole, small, large]


def _check(data: bytes, crypto: wire.Crypto | None, limits: wire.StreamLimits, seed: int) -> object:
    # Beyond max_bytes + 1 parse_stream refuses the whole buffer, pieces may complete first.
    assert len(data) <= limits.max_bytes + 1
    expected = _expected(data, crypto, limits)
    rng = random.Random(seed)
    for sizes in _chunkings(len(data), rng):
        got = _decode(data, crypto, limits, sizes)
        assert got == expected, (sizes[:5], data[:64].hex())
    return expected


# --- valid streams ------------------------------------------------------------------------


def _raw(message: object) -> bytes:
    if isinstance(message, PushPull):
        return wire.encode_push_pull(message)
    if isinstance(message, UserMsg):
        return wire.encode_user_stream(message.payload)
    assert isinstance(message, Ping | Ack | ErrResp)
    return wire.encode_message(message)


VALID = [
    PushPull(True, STATES, b"user-state" * 30),
    PushPull(False, STATES[:1], b""),
    PushPull(False, ()),
    UserMsg(b"hello"),
    UserMsg(b""),
    UserMsg(bytes(range(256)) * 8),
    Ping(4, "target"),
    Ack(9, b"payload"),
    ErrResp("no such thing"),
]


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "compressed"])
@pytest.mark.parametrize("crypto", [None, CRYPTO], ids=["plain", "encrypted"])
@pytest.mark.parametrize("message", VALID, ids=lambda m: type(m).__name__)
def test_valid_streams_decode_like_parse_stream(
    message: object, compress: bool, crypto: wire.Crypto | None
) -> None:
    data = wire.encode_stream(_raw(message), compress=compress, crypto=crypto)
    for tail in (b"", b"trailing bytes are ignored"):
        expected = _check(data + tail, crypto, LIMITS, len(data))
        assert expected == (message, len(data))
        for cut in range(0, len(data), max(1, len(data) // 40)):
            assert _check(data[:cut], crypto, LIMITS, cut) is None


def test_node_stream_decoder_uses_the_nodes_crypto_and_limits() -> None:
    keyring = Keyring([bytes(range(16))])
    a, b = make_peer("a", 1, keyring=keyring), make_peer("b", 2, keyring=keyring)
    out = a.take(a.node.join([b.address], 100))
    [request] = out.streams
    decoder = b.node.stream_decoder()
    message = None
    for i in range(len(request.data)):
        message = decoder.feed(request.data[i : i + 1]) or message
    expected = b.node.parse_stream(request.data)
    assert expected is not None and message == expected[0] and isinstance(message, PushPull)
    assert decoder.used_bytes == expected[1] == len(request.data)
    # A plain node refuses the encrypted stream as parse_stream does.
    plain = make_peer("c", 3)
    with pytest.raises(WireError) as err:
        plain.node.stream_decoder().feed(request.data[:1])
    assert err.value.reason is DropReason.DECRYPT_FAILED


def test_node_stream_decoder_without_encryption() -> None:
    a, b = make_peer("a", 1), make_peer("b", 2)
    [request] = a.take(a.node.join([b.address], 100)).streams
    expected = b.node.parse_stream(request.data)
    decoder = b.node.stream_decoder()
    assert decoder.feed(request.data) == (expected[0] if expected else None)
    assert decoder.done and decoder.buffered_bytes == 0


# --- hostile streams (the fuzz corpus) ----------------------------------------------------


def test_fuzz_corpus_decodes_like_parse_stream() -> None:
    rng = random.Random(16)
    outcomes: dict[str, int] = {}
    inputs = [(s.data, s.encrypted) for s in TCP_SEEDS]
    for _ in range(600):
        seed = rng.choice(TCP_SEEDS)
        inputs.append((mutate(seed, rng), seed.encrypted))
    for index, (data, encrypted) in enumerate(inputs):
        crypto = FUZZ_CRYPTO if encrypted else None
        expected = _check(data, crypto, FUZZ_LIMITS, index)
        key = expected.value if isinstance(expected, DropReason) else type(expected).__name__
        outcomes[key] = outcomes.get(key, 0) + 1
    print("fuzz outcomes:", dict(sorted(outcomes.items())))
    assert outcomes.get("tuple", 0) >= len(TCP_SEEDS)  # the seeds themselves decode
    assert len(outcomes) >= 4  # and the mutants reach several refusals


@settings(max_examples=200, deadline=None)
@given(
    st.binary(max_size=2048),
    st.lists(st.integers(1, 300), min_size=1, max_size=20),
    st.sampled_from([b"", bytes([MsgType.PUSH_PULL]), bytes([MsgType.USER]), b"\x09"]),
)
def test_arbitrary_bytes_in_arbitrary_pieces_decode_like_parse_stream(
    data: bytes, sizes: list[int], prefix: bytes
) -> None:
    data = prefix + data
    for crypto in (None, CRYPTO):
        assert _decode(data, crypto, LIMITS, sizes) == _expected(data, crypto, LIMITS)


# --- limits, as early as the bytes allow --------------------------------------------------


def _push_pull_header(nodes: int, user_state_len: int) -> bytes:
    fields = {"Join": False, "Nodes": nodes, "UserStateLen": user_state_len}
    packed: bytes = msgpack.packb(fields)
    return bytes([MsgType.PUSH_PULL]) + packed


EARLY = {
    "encrypted frame over max_bytes": (
        bytes([MsgType.ENCRYPT]) + struct.pack(">I", LIMITS.max_bytes + 1),
        CRYPTO,
        DropReason.OVERSIZED,
    ),
    "encrypted stream, encryption off": (bytes([MsgType.ENCRYPT]), None, DropReason.DECRYPT_FAILED),
    "plain stream, encryption on": (bytes([MsgType.PUSH_PULL]), CRYPTO, DropReason.NOT_ENCRYPTED),
    "type not valid on a stream": (bytes([MsgType.ALIVE]), None, DropReason.UNEXPECTED_TYPE),
    "push-pull over max_nodes": (
        _push_pull_header(LIMITS.max_nodes + 1, 0),
        None,
        DropReason.OVERSIZED,
    ),
    "push-pull user state over the limit": (
        _push_pull_header(0, LIMITS.max_user_bytes + 1),
        None,
        DropReason.OVERSIZED,
    ),
    "user message over the limit": (
        bytes([MsgType.USER]) + msgpack.packb({"UserMsgLen": LIMITS.max_user_bytes + 1}),
        None,
        DropReason.OVERSIZED,
    ),
}


@pytest.mark.parametrize("case", list(EARLY))
def test_oversized_announcements_are_refused_by_the_end_of_their_header(case: str) -> None:
    header, crypto, reason = EARLY[case]
    assert _expected(header, crypto, LIMITS) is reason
    decoder = StreamDecoder(crypto, LIMITS)
    for i in range(len(header) - 1):  # nothing is refused before the header is whole
        assert decoder.feed(header[i : i + 1]) is None
    with pytest.raises(WireError) as err:
        decoder.feed(header[-1:])
    assert err.value.reason is reason
    assert decoder.received_bytes == len(header)


def test_more_bytes_than_the_total_bound_are_refused_at_once() -> None:
    limits = wire.StreamLimits(max_bytes=1000, max_nodes=10, max_user_bytes=10_000)
    decoder = StreamDecoder(None, limits)
    assert decoder.feed(_push_pull_header(0, 5000)) is None  # within max_user_bytes
    assert decoder.feed(b"u" * (1000 + 5 - decoder.received_bytes)) is None
    with pytest.raises(WireError) as err:
        decoder.feed(b"u")
    assert err.value.reason is DropReason.OVERSIZED
    whole = _push_pull_header(0, 5000) + b"u" * 5000
    assert _expected(whole, None, limits) is DropReason.OVERSIZED
    assert _decode(whole, None, limits, [len(whole)]) is DropReason.OVERSIZED


@pytest.mark.parametrize("marker", [b"\xc6", b"\xdb"], ids=["bin32", "str32"])
def test_an_oversized_compressed_blob_is_refused_at_its_length(marker: bytes) -> None:
    """msgpack checks ``max_bin_len``/``max_str_len`` only once the blob's bytes are all
    there; ``check_declared_lengths`` reads the length as it arrives, so a blob announced
    over ``max_bytes`` is refused at the last byte of its length, by both parsers, and
    never buffered (a peer trickling it held its stream until the deadline before)."""
    limits = wire.StreamLimits(max_bytes=4096, max_nodes=10, max_user_bytes=4096)
    head = bytes([MsgType.COMPRESS]) + b"\x82\xa4Algo\x00\xa3Buf" + marker
    head += struct.pack(">I", limits.max_bytes + 1)
    assert _check(head[:-1], None, limits, 7) is None  # the length is not whole yet
    assert _check(head, None, limits, 7) is DropReason.OVERSIZED
    decoder = StreamDecoder(None, limits)
    for i in range(len(head) - 1):
        assert decoder.feed(head[i : i + 1]) is None
    with pytest.raises(WireError) as err:
        decoder.feed(head[-1:])
    assert err.value.reason is DropReason.OVERSIZED
    assert decoder.received_bytes == len(head)
    # a blob within the limit is still read to its end
    fits = bytes([MsgType.COMPRESS]) + b"\x82\xa4Algo\x00\xa3Buf" + marker
    fits += struct.pack(">I", limits.max_bytes - 20)
    assert _check(fits, None, limits, 7) is None
    assert StreamDecoder(None, limits).feed(fits) is None


def test_declared_lengths_are_read_only_from_the_head() -> None:
    """Past the first ``HEAD_SCAN_BYTES`` of the first object nothing is scanned (work
    stays bounded per stream); msgpack's own limits and the total bound cover the rest."""
    limits = wire.StreamLimits(max_bytes=4096, max_nodes=10, max_user_bytes=4096)
    pad = msgpack.packb("p" * 80)  # a str8 of 80 bytes: the length sits past the head
    late = bytes([MsgType.COMPRESS]) + b"\x83\xa3Pad" + pad + b"\xa3Buf\xc6"
    late += struct.pack(">I", limits.max_bytes + 1)
    assert _check(late, None, limits, 7) is None
    assert StreamDecoder(None, limits).feed(late) is None


def test_streams_just_over_max_bytes_are_oversized_not_buffer_full() -> None:
    """parse_stream let msgpack.BufferFull escape for a plain stream of max_bytes + 2..5
    bytes (the total bound leaves room for an encryption header); now both say OVERSIZED."""
    limits = wire.StreamLimits(max_bytes=1000, max_nodes=10, max_user_bytes=2000)
    for data in (
        _push_pull_header(0, 1500) + b"u" * 1500,
        bytes([MsgType.PING]) + b"\x00" * 1002,
        bytes([MsgType.USER]) + msgpack.packb({"UserMsgLen": 1500}) + b"u" * 1500,
    ):
        for extra in range(4):
            cut = data[: limits.max_bytes + 2 + extra]
            assert _expected(cut, None, limits) is DropReason.OVERSIZED
            assert _decode(cut, None, limits, [len(cut)]) is DropReason.OVERSIZED


def test_no_more_node_states_are_read_than_announced() -> None:
    one = wire.encode_push_pull(PushPull(False, STATES[:1], b""))
    extra = one + wire.encode_push_state(STATES[1]) + b"\xc1garbage"
    expected = _check(extra, None, LIMITS, 1)
    assert expected == (PushPull(False, STATES[:1], b""), len(one))


# --- work in proportion to the bytes --------------------------------------------------------


def _big_push_pull(count: int, meta: bytes = b"") -> bytes:
    states = [wire.encode_push_state(_state(i, meta)) for i in range(count)]
    return wire.encode_push_pull_parts(True, count, states, b"user state")


def test_work_is_linear_in_the_stream_length() -> None:
    """A 65,536-state push-pull fed in 1 B..1 KiB pieces: msgpack is handed each byte once
    (a decoder that re-fed its buffer per chunk, as parse_stream per chunk does, would hand
    it ~chunks/2 times the stream)."""
    count = 65_536
    data = _big_push_pull(count)
    limits = wire.StreamLimits(max_bytes=len(data), max_nodes=count, max_user_bytes=1024)
    rng = random.Random(65_536)
    decoder = StreamDecoder(None, limits)
    message = None
    offset = feeds = held = 0
    while offset < len(data):
        size = rng.randint(1, 1024)
        message = decoder.feed(data[offset : offset + size]) or message
        held = max(held, decoder.buffered_bytes)
        offset += size
        feeds += 1
    assert isinstance(message, PushPull) and len(message.nodes) == count
    assert message.nodes[-1] == _state(count - 1)
    print(
        f"{len(data)} bytes in {feeds} feeds: msgpack handed {decoder.work_bytes} bytes,"
        f" at most {held} bytes held"
    )
    assert decoder.work_bytes <= 2 * len(data)
    # what it holds is the node state under way and the last piece, not the stream
    state_bytes = len(wire.encode_push_state(_state(count - 1)))
    assert held <= 2 * state_bytes + 1024


def test_compressed_and_encrypted_work_is_linear() -> None:
    raw = _big_push_pull(2000)
    for compress, crypto in ((True, None), (False, CRYPTO), (True, CRYPTO)):
        data = wire.encode_stream(raw, compress=compress, crypto=crypto)
        decoder = StreamDecoder(crypto, LIMITS)
        message = None
        for offset in range(0, len(data), 100):
            message = decoder.feed(data[offset : offset + 100]) or message
        assert isinstance(message, PushPull) and len(message.nodes) == 2000
        # the frame or blob once, then the whole plaintext once
        assert decoder.work_bytes <= len(data) + 2 * len(raw)


def test_print_time_for_a_20_mib_push_pull() -> None:
    """Printed, not asserted: 20 MiB in 4 KiB pieces against one parse_stream call."""
    data = _big_push_pull(65_536, meta=b"m" * 250)
    limits = wire.StreamLimits(max_bytes=len(data), max_nodes=65_536, max_user_bytes=1024)
    start = time.perf_counter()
    decoder = StreamDecoder(None, limits)
    message = None
    for offset in range(0, len(data), 4096):
        message = decoder.feed(data[offset : offset + 4096]) or message
    fed_s = time.perf_counter() - start
    start = time.perf_counter()
    parsed = wire.parse_stream(data, None, limits)
    once_s = time.perf_counter() - start
    assert parsed is not None and message == parsed[0]
    print(
        f"{len(data) / 2**20:.1f} MiB push-pull: decoder in 4 KiB feeds {fed_s * 1000:.0f} ms,"
        f" parse_stream once {once_s * 1000:.0f} ms"
    )
