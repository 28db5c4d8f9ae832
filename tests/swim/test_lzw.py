"""Tests for swim.lzw against Go's compress/lzw (LSB, literal width 8).

memberlist uses this codec in util.go ``compressPayload`` / ``decompressBuffer``.

Reference vectors below were produced by real Go (go1.19.8 linux/amd64, whose
compress/lzw writer matches the current Go tree) with a throwaway program in /tmp:
``w := lzw.NewWriter(&buf, lzw.LSB, 8); w.Write(input); w.Close()``; each output was
also checked to round-trip through Go's ``lzw.NewReader``. Small outputs are stored
as hex; large ones as (length, sha256) of Go's output, with the input rebuilt here
by the same deterministic generators the Go program used. The hostile-input vector
was decoded by Go's reader through ``io.CopyN`` as in ``decompressBuffer``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swim.lzw import LZWError, LZWOutputLimitError, compress, decompress

# memberlist net.go: maxDecompressedBytes = 2 * maxPushStateBytes (20 MiB).
MAX_DECOMPRESSED = 2 * 20 * 1024 * 1024


def xorshift(n: int, seed: int) -> bytes:
    """xorshift32; the low byte of each state, as in the Go generator."""
    s = seed
    out = bytearray()
    for _ in range(n):
        s ^= (s << 13) & 0xFFFFFFFF
        s ^= s >> 17
        s ^= (s << 5) & 0xFFFFFFFF
        out.append(s & 0xFF)
    return bytes(out)


def textish(n: int, seed: int) -> bytes:
    """Low-entropy text over 'abcd' (xorshift32 state mod 4), as in the Go generator."""
    s = seed
    out = bytearray()
    for _ in range(n):
        s ^= (s << 13) & 0xFFFFFFFF
        s ^= s >> 17
        s ^= (s << 5) & 0xFFFFFFFF
        out.append(97 + s % 4)
    return bytes(out)


ALL_BYTES = bytes(range(256))

# (name, input, Go output as hex)
GO_SMALL_VECTORS = [
    # Go writes CLEAR (256) then EOF (257), both 9 bits wide, even for empty input.
    ("empty", b"", "000302"),
    ("one byte", b"a", "00c30404"),
    ("two bytes", b"ab", "00c3880908"),
    ("tobeornot", b"TOBEORNOTTOBEORTOBEORNOT", "00a93c1152e48914274fa80824687061c183090302"),
    (
        "a x 1000",
        b"a" * 1000,
        "00c3081c48b0a0c18308132a5cc8b0a1c38710234a9c48b1a2c58b18336adcc8b1a3c78f20438a1c"
        "49b2a4c9932853aa5cc9526140",
    ),
    (
        "all 256 byte values",
        ALL_BYTES,
        "00010410308040010307102450b0804103070f204490308142050b173064d0b08143070f1f408410"
        "31824409132750a450b182450b172f60c4903183460d1b3770e4d0b183470f1f3f80041132844811"
        "2347902451b2844913274fa0449132854a152b57b064d1b2854b172f5fc0841133864c193367d0a4"
        "51b3864d1b376fe0c49133874e1d3b77f0e4d1b3874f1f3f7f000512348850214387102552b48851"
        "23478f204592348952254b973065d2b48953274f9f408512358a542953a750a552b58a552b57af60"
        "c592358b562d5bb770e5d2b58b572f5fbf800513368c583163c7902553b68c593367cfa04593368d"
        "5a356bd7b065d3b68d5b376fdfc08513378e5c3973e7d0a553b78e5d3b77efe0c593378f5e3d7bf7"
        "f0e5d3b78f5f3f7fff0404",
    ),
    (
        "repeated phrase",
        b"hello memberlist " * 8,
        "00d19461c3e60d883665da882923874d9a39744008246810a142860e214a1c58f060c2850d1f469c"
        "d8d122c88c233956fc8851e4468a1e2f86d44872a54c942f4bb29c193120",
    ),
]

RAND_SEED = 2463534242
TEXT_SEED = 88172645

# (name, input factory, len(Go output), sha256(Go output)). The prefix lengths were
# chosen so that Close() hits the interesting paths: 255 and 721 make the final
# incHi widen codes to 10 bits before EOF; 3960, 7896 and 18152 make it emit a CLEAR
# just before EOF; 20000 and 60000 cross several mid-stream CLEARs (> 4096 codes).
GO_LARGE_VECTORS = [
    (
        "all 256 x 20",
        lambda: ALL_BYTES * 20,
        1929,
        "e6aa8a558ef88cf1477f577d3c0561c696ea6f8901d46edc4fb0e3751bd256ca",
    ),
    (
        "zeros 100000",
        lambda: bytes(100_000),
        530,
        "7a2b74e419500a3be5ff7cda6b8829a1eb730ccfee1d9e062be7a8ef00a0f6bf",
    ),
    (
        "random 255",
        lambda: xorshift(255, RAND_SEED),
        290,
        "fb9e919b220a5aca7f050e19e4cd2f717689b65ebcf801d36803d7e263907317",
    ),
    (
        "random 256",
        lambda: xorshift(256, RAND_SEED),
        291,
        "8611cd41591ab5934acbcec28b04501e7a016268990a01e2826cf91e28f05c9c",
    ),
    (
        "random 3960",
        lambda: xorshift(3960, RAND_SEED),
        5410,
        "43a6ce8506b77edb475801cc701e84bf8bb1ed6b291b645cdcef91c5cfe21ed3",
    ),
    (
        "random 3961",
        lambda: xorshift(3961, RAND_SEED),
        5411,
        "1636318a0402b2b2fc3ff524066fbaa68f7b1288304dc1a0902bcb6bf205bea9",
    ),
    (
        "random 7896",
        lambda: xorshift(7896, RAND_SEED),
        10816,
        "10dbaa267c18e49c225c42fd43cd2681f3b3623559cb3e332a5f44a0aed23c37",
    ),
    (
        "random 7897",
        lambda: xorshift(7897, RAND_SEED),
        10816,
        "ece208e9dc884eb35b2b390fe536328d46e49cf32d0adc8cc1eafbe8b8f47320",
    ),
    (
        "random 20000",
        lambda: xorshift(20000, RAND_SEED),
        27308,
        "83f81a0b7f7d3b2a9257e46875b79d4329dbccb222feddcde0c251a45665e94f",
    ),
    (
        "text 721",
        lambda: textish(721, TEXT_SEED),
        290,
        "f73e0f90c92caea6de53f48b688fbda13f6d674239246fa196bdbeeff65cadd7",
    ),
    (
        "text 2752",
        lambda: textish(2752, TEXT_SEED),
        930,
        "06cf8a39eb2e22e469cf7cb194ac6151f340e9e665e18635e49427aa1829af14",
    ),
    (
        "text 18152",
        lambda: textish(18152, TEXT_SEED),
        5410,
        "fe72a7a4dea581b8f213a15c0da24965f8827dcff835200736d808788113ddfd",
    ),
    (
        "text 18153",
        lambda: textish(18153, TEXT_SEED),
        5410,
        "525aa4de1657f5eef2117812afdb307ebae94b8bda2e929b9e8087bbf7c66db2",
    ),
    (
        "text 60000",
        lambda: textish(60000, TEXT_SEED),
        17992,
        "263e23a551f5c2fac2becafe620cf240670106e1eb3cb93697d3013e071fe069",
    ),
]


def pack_codes(codes: list[int], *, eof: bool = True) -> bytes:
    """Pack codes LSB-first, tracking the decoder's width rules (Go reader.go ``decode``).

    Used to build streams Go's writer never produces (deferred clear, bad codes).
    """
    bits = n_bits = 0
    width, hi = 9, 257
    out = bytearray()

    def put(code: int) -> None:
        nonlocal bits, n_bits
        bits |= code << n_bits
        n_bits += width
        while n_bits >= 8:
            out.append(bits & 0xFF)
            bits >>= 8
            n_bits -= 8

    for code in codes:
        put(code)
        if code == 256:
            width, hi = 9, 257
            continue
        hi += 1
        if hi >= 1 << width:
            if width == 12:
                hi -= 1
            else:
                width += 1
    if eof:
        put(257)
    if n_bits:
        out.append(bits & 0xFF)
    return bytes(out)


# --- compress: byte-for-byte against Go -------------------------------------------


@pytest.mark.parametrize(("name", "data", "go_hex"), GO_SMALL_VECTORS, ids=lambda x: str(x)[:20])
def test_compress_matches_go_small(name: str, data: bytes, go_hex: str) -> None:
    assert compress(data).hex() == go_hex, name
    assert decompress(bytes.fromhex(go_hex), MAX_DECOMPRESSED) == data


@pytest.mark.parametrize(
    ("name", "factory", "go_len", "go_sha256"),
    GO_LARGE_VECTORS,
    ids=[v[0] for v in GO_LARGE_VECTORS],
)
def test_compress_matches_go_large(name, factory, go_len: int, go_sha256: str) -> None:
    data = factory()
    out = compress(data)
    assert len(out) == go_len, name
    assert hashlib.sha256(out).hexdigest() == go_sha256, name
    assert decompress(out, MAX_DECOMPRESSED) == data


def test_compress_accepts_bytearray_and_memoryview_inputs() -> None:
    data = b"TOBEORNOTTOBEORTOBEORNOT"
    assert compress(bytearray(data)) == compress(data)
    assert compress(memoryview(data)) == compress(data)
    framed = b"\x09" + compress(data)  # e.g. a compress message sliced out of a packet
    assert decompress(memoryview(framed)[1:], 100) == data


# --- round trips ------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00",
        b"\xff",
        b"ab" * 5000,
        bytes(70_000),
        ALL_BYTES,
        ALL_BYTES * 64,
        bytes(reversed(ALL_BYTES)) * 3,
        xorshift(1, 7),
        xorshift(100, 7),
        xorshift(5000, 7),  # > 4096 codes: mid-stream CLEAR
        xorshift(50_000, 7),
        textish(200_000, 9),
    ],
    ids=lambda d: f"len{len(d)}",
)
def test_round_trip(data: bytes) -> None:
    assert decompress(compress(data), len(data)) == data


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3000))
def test_round_trip_property(data: bytes) -> None:
    assert decompress(compress(data), len(data)) == data


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([b"a", b"b", b"ab", b"ba", b"\x00"]), max_size=4000))
def test_round_trip_low_entropy_property(parts: list[bytes]) -> None:
    data = b"".join(parts)
    assert decompress(compress(data), len(data)) == data


# --- decoder edge cases Go's reader accepts ----------------------------------------


def test_decompress_without_leading_clear() -> None:
    # Older Go releases did not start with CLEAR; their streams must still decode.
    assert decompress(pack_codes([ord("h"), ord("i")]), 10) == b"hi"


def test_decompress_ignores_bytes_after_eof() -> None:
    # Go's reader stops at EOF and never reads further.
    assert decompress(compress(b"payload") + b"\xde\xad\xbe\xef", 100) == b"payload"


def test_decompress_kwkwk_case() -> None:
    # Code 258 used as soon as it is defined expands to prev + prev[0].
    assert decompress(pack_codes([256, ord("a"), 258]), 10) == b"aaa"


def test_decompress_deferred_clear_matches_go() -> None:
    # Fill the table to 4096 codes without a CLEAR, then reference codes 4095 and 300.
    # Go's reader keeps the full table and decodes; Go produced this sha256 of the
    # output for the very same stream (7155 bytes, built by pack_codes).
    stream = pack_codes([97] + [i % 256 for i in range(5000)] + [4095, 300])
    assert len(stream) == 7155
    out = decompress(stream, 1 << 20)
    assert len(out) == 5005
    assert (
        hashlib.sha256(out).hexdigest()
        == "d5e210edb25a7ff0abe5c389310223e65a44ca81f2af17e708ab935614da691f"
    )


# --- hostile input ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stream", "match"),
    [
        (b"", "unexpected end"),
        (b"\x00", "unexpected end"),
        (pack_codes([ord("a")], eof=False), "unexpected end"),
        (pack_codes([256, 258]), "invalid code 258"),  # first code can't reference the table
        (pack_codes([256, ord("a"), 300]), "invalid code 300"),
        (pack_codes([ord("a"), 511]), "invalid code 511"),
    ],
    ids=["empty", "one byte", "no eof", "ref before define", "beyond hi", "max 9-bit"],
)
def test_decompress_rejects_corrupt_streams(stream: bytes, match: str) -> None:
    with pytest.raises(LZWError, match=match):
        decompress(stream, 1 << 20)


@pytest.mark.parametrize("n", [1, 100, 5000])
def test_decompress_rejects_every_truncation(n: int) -> None:
    # Go returns io.ErrUnexpectedEOF for a stream cut before EOF; memberlist's
    # decompressBuffer turns that into an error, so every strict prefix must fail.
    data = xorshift(n, 11)
    stream = compress(data)
    # Every cut for short streams; a spread plus the last few bytes for long ones.
    cuts = set(range(0, len(stream), max(1, len(stream) // 60)))
    cuts.update(range(max(0, len(stream) - 4), len(stream)))
    for cut in sorted(cuts):
        with pytest.raises(LZWError):
            decompress(stream[:cut], len(data))


def test_decompress_random_bytes_never_crash() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        blob = rng.randbytes(rng.randrange(0, 300))
        try:
            out = decompress(blob, 1 << 16)
        except LZWError:
            continue
        assert isinstance(out, bytes)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2000))
def test_decompress_arbitrary_bytes_raises_only_lzw_error(blob: bytes) -> None:
    try:
        out = decompress(blob, 1 << 16)
    except LZWError:
        return
    assert isinstance(out, bytes)
    assert len(out) <= 1 << 16


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=2000), st.data())
def test_decompress_bit_flipped_streams_raise_only_lzw_error(data: bytes, draw) -> None:
    stream = bytearray(compress(data))
    pos = draw.draw(st.integers(0, len(stream) - 1))
    stream[pos] ^= 1 << draw.draw(st.integers(0, 7))
    with contextlib.suppress(LZWError):
        decompress(bytes(stream), 1 << 16)


# --- output bound -------------------------------------------------------------------


def test_output_bound_is_inclusive() -> None:
    # memberlist accepts exactly maxDecompressedBytes and rejects anything larger.
    data = bytes(10_000)
    stream = compress(data)
    assert decompress(stream, 10_000) == data
    with pytest.raises(LZWOutputLimitError, match="9999"):
        decompress(stream, 9_999)
    with pytest.raises(LZWOutputLimitError):
        decompress(compress(b"x"), 0)
    assert decompress(compress(b""), 0) == b""


def test_output_bound_stops_a_decompression_bomb_early() -> None:
    # Grow one run of zeros to a 3839-byte code (KwKwK codes 258..4095), then repeat
    # that code without CLEAR: ~9 KB of input that expands to ~15 MB. Decoding must
    # stop at the bound instead of expanding the bomb; time is the proxy for that.
    bomb = pack_codes([0, *range(258, 4096), *([4095] * 4_000)])
    assert len(bomb) < 12_000
    start = time.perf_counter()
    with pytest.raises(LZWOutputLimitError):
        decompress(bomb, 1 << 16)
    assert time.perf_counter() - start < 0.5
    # The same stream is valid: with a large enough bound it decodes completely.
    assert len(decompress(bomb, 1 << 25)) == sum(range(1, 3840)) + 3839 * 4_000


def test_output_limit_error_is_an_lzw_and_value_error() -> None:
    assert issubclass(LZWOutputLimitError, LZWError)
    assert issubclass(LZWError, ValueError)


def test_negative_bound_rejected() -> None:
    with pytest.raises(ValueError, match="max_output_bytes"):
        decompress(compress(b"a"), -1)


# --- speed --------------------------------------------------------------------------


def test_100kb_is_fast() -> None:
    # Generous bound (measured ~30 ms each on a dev box) to stay stable on slow CI.
    data = os.urandom(100_000)
    start = time.perf_counter()
    stream = compress(data)
    assert decompress(stream, len(data)) == data
    assert time.perf_counter() - start < 2.0
