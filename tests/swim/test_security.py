"""Tests for swim.security: memberlist security.go, keyring.go and net.go framing.

Known-answer vectors were produced by real Go (go1.19.8, crypto/aes + crypto/cipher
GCM) with a throwaway program in /tmp that copies memberlist security.go
``encryptPayload``/``pkcs7encode`` verbatim except that the nonce is injected instead
of read from crypto/rand, and net.go ``encryptLocalState`` for the stream frames.
Keys are bytes 0..n-1 (n = 16, 24, 32); the nonce is bytes 0..11.
"""

from __future__ import annotations

import base64
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swim.security import (
    BLOCK_SIZE,
    ENCRYPT_MSG_TYPE,
    MAX_KEYS,
    NONCE_SIZE,
    STREAM_HEADER_SIZE,
    TAG_SIZE,
    VERSION_SIZE,
    DecryptError,
    Keyring,
    KeyringError,
    decrypt_payload,
    decrypt_stream_body,
    encrypt_overhead,
    encrypt_payload,
    encrypt_stream,
    encrypted_length,
    stream_body_length,
    validate_key,
)

NONCE = bytes(range(12))
KEY16 = bytes(range(16))
KEY24 = bytes(range(24))
KEY32 = bytes(range(32))
KEYS = [KEY16, KEY24, KEY32]


def key_of(n: int) -> bytes:
    return bytes(range(n))


# (version, key length, plaintext, aad, Go's encryptPayload output as hex)
GO_PAYLOAD_VECTORS: list[tuple[int, int, bytes, bytes, str]] = [
    (
        0,
        16,
        b"",
        b"",
        "00000102030405060708090a0b837cb7de760be7445bc2719a26b360185df905c30723fd"
        "655ad75f1035af7cbd",
    ),
    (
        0,
        16,
        b"",
        b"label",
        "00000102030405060708090a0b837cb7de760be7445bc2719a26b360182d356e90cbf235"
        "e3191be1da043629fc",
    ),
    (
        0,
        16,
        b"this is a plain text message",
        b"",
        "00000102030405060708090a0be704cebd467284742af211e657ca1e28c7436292738098"
        "85954096481040a668d7470baa7b77278b8287fbe7be58403e",
    ),
    (
        0,
        16,
        b"this is a plain text message",
        b"label",
        "00000102030405060708090a0be704cebd467284742af211e657ca1e28c7436292738098"
        "85954096481040a6680c88fcf93f20291e1bc673064b5f3074",
    ),
    (
        0,
        16,
        b"0123456789abcdef",
        b"",
        "00000102030405060708090a0ba35d95fd522ec16373eb00e855c7156ea3360af643fded"
        "e6f631e13d0454b27c73ff57c5c1003e2a21e979cbeea234ad",
    ),
    (
        0,
        16,
        b"0123456789abcdef",
        b"label",
        "00000102030405060708090a0ba35d95fd522ec16373eb00e855c7156ea3360af643fded"
        "e6f631e13d0454b27ca830a096855730bfb8a8f12a1ba544e7",
    ),
    (
        0,
        24,
        b"",
        b"",
        "00000102030405060708090a0bf6e9328b89a9d91ec023cc92efb9cc606872f9dae637cf"
        "474756d208c7407a3d",
    ),
    (
        0,
        24,
        b"",
        b"label",
        "00000102030405060708090a0bf6e9328b89a9d91ec023cc92efb9cc60b1b224188d688a"
        "11b9ea300c6dc44e95",
    ),
    (
        0,
        24,
        b"this is a plain text message",
        b"",
        "00000102030405060708090a0b92914be8b9d0ba2eb113acee9ec0b2507afa4b7f18cc33"
        "cd0c3e0c5dc99225583e14574398bdfd32111fd726c1516cb5",
    ),
    (
        0,
        24,
        b"this is a plain text message",
        b"label",
        "00000102030405060708090a0b92914be8b9d0ba2eb113acee9ec0b2507afa4b7f18cc33"
        "cd0c3e0c5dc9922558171f1529aac6a317228d8e47154776a7",
    ),
    (
        0,
        24,
        b"0123456789abcdef",
        b"",
        "00000102030405060708090a0bd6c810a8ad8cff39e80abde09ccdb9161e8f231b28b146"
        "ae6f4f7b28dd86314c1b572d9573f089b2d8ebdc40e493ed7d",
    ),
    (
        0,
        24,
        b"0123456789abcdef",
        b"label",
        "00000102030405060708090a0bd6c810a8ad8cff39e80abde09ccdb9161e8f231b28b146"
        "ae6f4f7b28dd86314c325c6fff418bd797eb7985213085f76f",
    ),
    (
        0,
        32,
        b"",
        b"",
        "00000102030405060708090a0b5712c60bd5f5d20b9d51879ba1f9687d84378254617398"
        "5a0286bc1106f97e5b",
    ),
    (
        0,
        32,
        b"",
        b"label",
        "00000102030405060708090a0b5712c60bd5f5d20b9d51879ba1f9687d9f166a74dcbbde"
        "9f23607057e8179de1",
    ),
    (
        0,
        32,
        b"this is a plain text message",
        b"",
        "00000102030405060708090a0b336abf68e58cb13bec61e7e7d080164df7b3ff40d0163a"
        "0f4b0682e0196d04b67f8d46e63e9d56fce64d06ef1a569576",
    ),
    (
        0,
        32,
        b"this is a plain text message",
        b"label",
        "00000102030405060708090a0b336abf68e58cb13bec61e7e7d080164df7b3ff40d0163a"
        "0f4b0682e0196d04b6373d7b39e2ba43c2f51bd3b5477f4471",
    ),
    (
        0,
        32,
        b"0123456789abcdef",
        b"",
        "00000102030405060708090a0b7733e428f1d0f42cb578f6e9d28d1d0b93c69724e06b4f"
        "6c2877f5950d7910a2dfe54c7d5885ed416d720f7e92dfcf3e",
    ),
    (
        0,
        32,
        b"0123456789abcdef",
        b"label",
        "00000102030405060708090a0b7733e428f1d0f42cb578f6e9d28d1d0b93c69724e06b4f"
        "6c2877f5950d7910a2975571a284a2f87f7e24da24cff61e39",
    ),
    (1, 16, b"", b"", "01000102030405060708090a0b435b9ba12d75a4be8a977ea3cd011890"),
    (1, 16, b"", b"label", "01000102030405060708090a0b51c29ca9ba1658e80852678926cb0e44"),
    (
        1,
        16,
        b"this is a plain text message",
        b"",
        "01000102030405060708090a0be704cebd467284742af211e657ca1e28c7436292738098"
        "85954096489047d84675c17bfb118e66203ff84f73",
    ),
    (
        1,
        16,
        b"this is a plain text message",
        b"label",
        "01000102030405060708090a0be704cebd467284742af211e657ca1e28c7436292738098"
        "85954096484b882f153196756e88cfeec1caff3f39",
    ),
    (
        1,
        16,
        b"0123456789abcdef",
        b"",
        "01000102030405060708090a0ba35d95fd522ec16373eb00e855c7156eb862e236115dca"
        "c60771e595fd6465c8",
    ),
    (
        1,
        16,
        b"0123456789abcdef",
        b"label",
        "01000102030405060708090a0ba35d95fd522ec16373eb00e855c7156ec8ae8965dd8c02"
        "4044bd5b5fccfd3089",
    ),
    (1, 24, b"", b"", "01000102030405060708090a0b950edcb5356be966303c24cbd11a10d8"),
    (1, 24, b"", b"label", "01000102030405060708090a0b6fbcea30ccdfe7ef5f67ff3e50a98bfd"),
    (
        1,
        24,
        b"this is a plain text message",
        b"",
        "01000102030405060708090a0b92914be8b9d0ba2eb113acee9ec0b2507afa4b7f18cc33"
        "cd0c3e0c5d988582807003533db6b79467f58f23da",
    ),
    (
        1,
        24,
        b"this is a plain text message",
        b"label",
        "01000102030405060708090a0b92914be8b9d0ba2eb113acee9ec0b2507afa4b7f18cc33"
        "cd0c3e0c5db18ec0ea42780d188525cd06219939c8",
    ),
    (
        1,
        24,
        b"0123456789abcdef",
        b"",
        "01000102030405060708090a0bd6c810a8ad8cff39e80abde09ccdb91690efd1972d861b"
        "5339d3c79b13883502",
    ),
    (
        1,
        24,
        b"0123456789abcdef",
        b"label",
        "01000102030405060708090a0bd6c810a8ad8cff39e80abde09ccdb916492f0c5546d95e"
        "05c76f259fb90c01aa",
    ),
    (1, 32, b"", b"", "01000102030405060708090a0bf4c2db1dc38805a37b92171c5d0a81cc"),
    (1, 32, b"", b"label", "01000102030405060708090a0b723f008d7491d701cb6e8bf4cf50445c"),
    (
        1,
        32,
        b"this is a plain text message",
        b"",
        "01000102030405060708090a0b336abf68e58cb13bec61e7e7d080164df7b3ff40d0163a"
        "0f4b0682e00b0334573a63e92d4e345b140dfc4b1c",
    ),
    (
        1,
        32,
        b"this is a plain text message",
        b"label",
        "01000102030405060708090a0b336abf68e58cb13bec61e7e7d080164df7b3ff40d0163a"
        "0f4b0682e043b30988e644fc135d628e4e50d59a1b",
    ),
    (
        1,
        32,
        b"0123456789abcdef",
        b"",
        "01000102030405060708090a0b7733e428f1d0f42cb578f6e9d28d1d0bbfa297f9980798"
        "be61bca48c196a827a",
    ),
    (
        1,
        32,
        b"0123456789abcdef",
        b"label",
        "01000102030405060708090a0b7733e428f1d0f42cb578f6e9d28d1d0ba4837fd925cfde"
        "7b405a68caf78461c0",
    ),
]

# net.go encryptLocalState with the 32-byte key and plaintext STREAM_PLAINTEXT:
# (version, stream label, Go output as hex)
STREAM_PLAINTEXT = b"\x06push-pull state bytes"
GO_STREAM_VECTORS: list[tuple[int, bytes, str]] = [
    (
        0,
        b"",
        "0a0000003d00000102030405060708090a0b4172a368adc8b26ee12db7f8c5880c08a3b4"
        "fe4095085576326def8f17630ab8182e2e9e30109f002925fefc1b45264b",
    ),
    (
        0,
        b"serf-lan",
        "0a0000003d00000102030405060708090a0b4172a368adc8b26ee12db7f8c5880c08a3b4"
        "fe4095085576326def8f17630ab8074dfc82a5b3c545ee024a5e6834a82d",
    ),
    (
        1,
        b"",
        "0a0000003301000102030405060708090a0b4172a368adc8b26ee12db7f8c5880c08a3b4"
        "fe4095084267ada4eadebb03ca7120370b24142c",
    ),
    (
        1,
        b"serf-lan",
        "0a0000003301000102030405060708090a0b4172a368adc8b26ee12db7f8c5880c08a3b4"
        "fe4095085d047fb87f7de1460d56949578559a4a",
    ),
]


# --- constants and sizes (security.go encryptOverhead / encryptedLength) -----------


def test_constants_match_memberlist() -> None:
    assert (VERSION_SIZE, NONCE_SIZE, TAG_SIZE, BLOCK_SIZE) == (1, 12, 16, 16)
    # net.go: messageType iota, encryptMsg is the 11th entry.
    assert ENCRYPT_MSG_TYPE == 10
    assert STREAM_HEADER_SIZE == 5


@pytest.mark.parametrize(("version", "overhead"), [(0, 45), (1, 29)])
def test_encrypt_overhead(version: int, overhead: int) -> None:
    assert encrypt_overhead(version) == overhead


@pytest.mark.parametrize("version", [-1, 2, 255])
def test_unsupported_versions_rejected_by_size_helpers(version: int) -> None:
    with pytest.raises(ValueError, match="unsupported encryption version"):
        encrypt_overhead(version)
    with pytest.raises(ValueError, match="unsupported encryption version"):
        encrypted_length(version, 10)


@pytest.mark.parametrize(
    ("version", "length", "expected"),
    [
        (0, 0, 45),  # an empty message still gets a full block of padding
        (0, 1, 45),
        (0, 15, 45),
        (0, 16, 61),
        (0, 17, 61),
        (1, 0, 29),
        (1, 1, 30),
        (1, 16, 45),
        (1, 1000, 1029),
    ],
)
def test_encrypted_length(version: int, length: int, expected: int) -> None:
    assert encrypted_length(version, length) == expected


def test_encrypted_length_rejects_negative() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        encrypted_length(1, -1)


@pytest.mark.parametrize("version", [0, 1])
def test_encrypted_length_is_exact_and_within_overhead(version: int) -> None:
    for n in range(70):
        out = encrypt_payload(version, KEY16, bytes(n), b"", NONCE)
        assert len(out) == encrypted_length(version, n)
        assert 0 < len(out) - n <= encrypt_overhead(version)


# --- known answers from Go ----------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "key_len", "msg", "aad", "go_hex"),
    GO_PAYLOAD_VECTORS,
    ids=[f"v{v[0]}-aes{v[1] * 8}-len{len(v[2])}-aad{len(v[3])}" for v in GO_PAYLOAD_VECTORS],
)
def test_encrypt_payload_matches_go(
    version: int, key_len: int, msg: bytes, aad: bytes, go_hex: str
) -> None:
    key = key_of(key_len)
    expected = bytes.fromhex(go_hex)
    assert encrypt_payload(version, key, msg, aad, NONCE) == expected
    assert decrypt_payload([key], expected, aad) == msg


@pytest.mark.parametrize(
    ("version", "label", "go_hex"),
    GO_STREAM_VECTORS,
    ids=[f"v{v[0]}-label{len(v[1])}" for v in GO_STREAM_VECTORS],
)
def test_encrypt_stream_matches_go(version: int, label: bytes, go_hex: str) -> None:
    expected = bytes.fromhex(go_hex)
    assert encrypt_stream(version, KEY32, STREAM_PLAINTEXT, label, NONCE) == expected
    header, body = expected[:STREAM_HEADER_SIZE], expected[STREAM_HEADER_SIZE:]
    assert stream_body_length(header) == len(body)
    assert decrypt_stream_body([KEY32], header, body, label) == STREAM_PLAINTEXT


def test_pkcs7_padding_matches_go_pkcs7encode() -> None:
    # security_test.go TestPKCS7: buffers of 0..255 bytes survive pad + unpad. Version 0
    # pads to the next multiple of 16, adding 1..16 bytes (a full block when aligned).
    for n in range(256):
        msg = bytes([n % 256]) * n
        out = encrypt_payload(0, KEY16, msg, b"", NONCE)
        padded_len = len(out) - VERSION_SIZE - NONCE_SIZE - TAG_SIZE
        assert padded_len % BLOCK_SIZE == 0
        assert 1 <= padded_len - n <= BLOCK_SIZE
        assert decrypt_payload([KEY16], out, b"") == msg


# --- round trips --------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("key", KEYS, ids=["aes128", "aes192", "aes256"])
@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 31, 32, 33, 1400, 65_536])
def test_round_trip(version: int, key: bytes, length: int) -> None:
    # security_test.go encryptDecryptVersioned, over every key size and padding edge.
    msg = os.urandom(length)
    aad = b"serf-lan"
    out = encrypt_payload(version, key, msg, aad, os.urandom(NONCE_SIZE))
    assert out[0] == version
    assert decrypt_payload([key], out, aad) == msg


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([0, 1]),
    st.sampled_from(KEYS),
    st.binary(max_size=300),
    st.binary(max_size=40),
    st.binary(min_size=NONCE_SIZE, max_size=NONCE_SIZE),
)
def test_round_trip_property(version, key, msg, aad, nonce) -> None:
    assert decrypt_payload([key], encrypt_payload(version, key, msg, aad, nonce), aad) == msg


def test_encrypt_accepts_bytes_like_inputs() -> None:
    key, msg, aad = bytearray(KEY16), bytearray(b"msg"), bytearray(b"l")
    out = encrypt_payload(1, key, msg, aad, NONCE)  # type: ignore[arg-type]
    assert out == encrypt_payload(1, KEY16, b"msg", b"l", NONCE)


# --- decrypt failures (security.go decryptPayload) -----------------------------------


def sealed(version: int, plaintext: bytes, key: bytes = KEY16, aad: bytes = b"") -> bytes:
    """A payload whose GCM tag is valid for ``plaintext`` as given (no padding added)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return bytes([version]) + NONCE + AESGCM(key).encrypt(NONCE, plaintext, aad)


@pytest.mark.parametrize("version", [0, 1])
def test_wrong_key(version: int) -> None:
    out = encrypt_payload(version, KEY16, b"secret", b"", NONCE)
    with pytest.raises(DecryptError, match="no installed keys could decrypt the message"):
        decrypt_payload([bytes(16), KEY32], out, b"")


def test_no_keys() -> None:
    out = encrypt_payload(1, KEY16, b"secret", b"", NONCE)
    with pytest.raises(DecryptError, match="no installed keys"):
        decrypt_payload([], out, b"")


def test_keys_tried_in_order_and_bad_sizes_skipped() -> None:
    # Go's decryptPayload ignores decryptMessage errors (such as a bad key size) and
    # moves on to the next key.
    out = encrypt_payload(1, KEY24, b"secret", b"", NONCE)
    assert decrypt_payload([b"short", KEY16, KEY24], out, b"") == b"secret"


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize(
    ("sent", "received"),
    [(b"", b"label"), (b"label", b""), (b"label", b"Label"), (b"a", b"ab")],
)
def test_aad_mismatch(version: int, sent: bytes, received: bytes) -> None:
    # Labels are authenticated as additional data (label.go / net.go).
    out = encrypt_payload(version, KEY16, b"secret", sent, NONCE)
    with pytest.raises(DecryptError, match="no installed keys"):
        decrypt_payload([KEY16], out, received)


@pytest.mark.parametrize("version", [0, 1])
def test_every_tampered_byte_after_the_version_is_rejected(version: int) -> None:
    out = encrypt_payload(version, KEY16, b"a message of some length", b"aad", NONCE)
    for pos in range(VERSION_SIZE, len(out)):
        for bit in (0x01, 0x80):
            tampered = bytearray(out)
            tampered[pos] ^= bit
            with pytest.raises(DecryptError):
                decrypt_payload([KEY16], bytes(tampered), b"aad")


def test_version_byte_is_not_authenticated() -> None:
    # A property of memberlist's format: the version byte is outside the GCM input.
    # Relabelling v0 as v1 yields the still-padded plaintext; relabelling v1 as v0
    # makes us unpad a plaintext that was never padded, which validation rejects.
    padded_msg = b"0123456789abcdef" + bytes([16]) * 16
    v0 = encrypt_payload(0, KEY16, b"0123456789abcdef", b"", NONCE)
    assert decrypt_payload([KEY16], b"\x01" + v0[1:], b"") == padded_msg
    v1 = encrypt_payload(1, KEY16, b"0123456789abcdef", b"", NONCE)
    with pytest.raises(DecryptError, match="invalid PKCS7 padding"):
        decrypt_payload([KEY16], b"\x00" + v1[1:], b"")


@pytest.mark.parametrize("version", [2, 3, 0x7F, 0xFF])
def test_bad_version(version: int) -> None:
    out = bytearray(encrypt_payload(1, KEY16, b"secret", b"", NONCE))
    out[0] = version
    with pytest.raises(DecryptError, match=f"unsupported encryption version {version}"):
        decrypt_payload([KEY16], bytes(out), b"")


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"", "cannot decrypt empty payload"),
        (b"\x01", "too small to decrypt: 1"),
        (b"\x01" + bytes(27), "too small to decrypt: 28"),  # v1 minimum is 29
        (b"\x00" + bytes(28), "too small to decrypt: 29"),  # v0 minimum is 45
        (b"\x00" + bytes(43), "too small to decrypt: 44"),
        (b"\x01" + bytes(28), "no installed keys"),  # long enough, but garbage
        (b"\x00" + bytes(44), "no installed keys"),
    ],
)
def test_short_or_garbage_payloads(payload: bytes, match: str) -> None:
    with pytest.raises(DecryptError, match=match):
        decrypt_payload([KEY16], payload, b"")


@pytest.mark.parametrize("version", [0, 1])
def test_truncated_payloads(version: int) -> None:
    out = encrypt_payload(version, KEY16, b"x" * 40, b"", NONCE)
    for cut in range(len(out)):
        with pytest.raises(DecryptError):
            decrypt_payload([KEY16], out[:cut], b"")


@pytest.mark.parametrize(
    "plaintext",
    [
        b"0123456789abcde\x00",  # pad byte 0 (Go would return the buffer untouched)
        b"0123456789abcde\x11",  # pad 17 > block size (Go would slice out of range: panic)
        b"0123456789abcdef" * 2 + b"\xff" * 15 + b"\x20",  # 32 > block size
        b"0123456789abcd\x03\x02",  # pad 2, but the byte before it is 0x03
        b"0123456789abcdef" + b"\x05" * 15 + b"\x10",  # pad 16 with inconsistent bytes
        b"0123456789abcdef\x01",  # not a multiple of the block size
    ],
    ids=["zero", "seventeen", "thirty-two", "inconsistent-2", "inconsistent-16", "unaligned"],
)
def test_bad_pkcs7_padding_raises(plaintext: bytes) -> None:
    # security.go pkcs7decode trusts the last byte; a hostile key holder must not be
    # able to crash or confuse us, so version 0 padding is fully validated.
    with pytest.raises(DecryptError, match="invalid PKCS7 padding"):
        decrypt_payload([KEY16], sealed(0, plaintext), b"")


def test_decrypt_error_is_a_value_error() -> None:
    assert issubclass(DecryptError, ValueError)
    assert issubclass(KeyringError, ValueError)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=10))
def test_arbitrary_payloads_raise_only_decrypt_error(payload: bytes, aad: bytes) -> None:
    try:
        decrypt_payload([KEY16, KEY32], payload, aad)
    except DecryptError:
        return
    pytest.fail("random bytes decrypted")  # 2**-128 chance


# --- encrypt argument validation ------------------------------------------------------


@pytest.mark.parametrize("length", [0, 1, 15, 17, 31, 33, 64])
def test_encrypt_rejects_bad_key_sizes(length: int) -> None:
    with pytest.raises(KeyringError, match=f"got {length} bytes"):
        encrypt_payload(1, bytes(length), b"m", b"", NONCE)


@pytest.mark.parametrize("length", [0, 8, 11, 13, 16])
def test_encrypt_rejects_bad_nonce_sizes(length: int) -> None:
    with pytest.raises(ValueError, match=f"nonce must be 12 bytes, got {length}"):
        encrypt_payload(1, KEY16, b"m", b"", bytes(length))


def test_encrypt_rejects_bad_version() -> None:
    with pytest.raises(ValueError, match="unsupported encryption version 2"):
        encrypt_payload(2, KEY16, b"m", b"", NONCE)


# --- key rotation (keyring_test.go TestKeyRing_MultiKeyEncryptDecrypt) ---------------

TEST_KEYS = [
    bytes(range(16)),
    bytes(reversed(range(16))),
    bytes([8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7]),
]


def test_multi_key_encrypt_decrypt() -> None:
    keyring = Keyring(TEST_KEYS, TEST_KEYS[0])
    out = encrypt_payload(1, TEST_KEYS[0], b"this is a plain text message", b"random data", NONCE)
    assert decrypt_payload(keyring.keys, out, b"random data") == b"this is a plain text message"

    out = encrypt_payload(1, TEST_KEYS[2], b"this is a plain text message", b"random data", NONCE)
    assert decrypt_payload(keyring.keys, out, b"random data") == b"this is a plain text message"

    keyring.remove(TEST_KEYS[2])
    with pytest.raises(DecryptError, match="no installed keys"):
        decrypt_payload(keyring.keys, out, b"random data")


def test_rotation_workflow() -> None:
    old, new = KEY16, KEY32
    keyring = Keyring([old])
    from_old = encrypt_payload(0, keyring.primary_key, b"before", b"", NONCE)

    keyring.install(new)  # step 1: every node learns the new key
    assert keyring.primary_key == old
    keyring.use(new)  # step 2: every node switches to it
    from_new = encrypt_payload(0, keyring.primary_key, b"after", b"", NONCE)
    assert decrypt_payload(keyring.keys, from_old, b"") == b"before"  # in-flight traffic
    assert decrypt_payload(keyring.keys, from_new, b"") == b"after"

    keyring.remove(old)  # step 3: retire the old key
    assert keyring.keys == (new,)
    with pytest.raises(DecryptError):
        decrypt_payload(keyring.keys, from_old, b"")
    assert decrypt_payload(keyring.keys, from_new, b"") == b"after"


# --- Keyring (keyring.go) -----------------------------------------------------------


def test_keyring_primary_defaults_to_first_key() -> None:
    keyring = Keyring(TEST_KEYS)
    assert keyring.primary_key == TEST_KEYS[0]
    assert keyring.keys == tuple(TEST_KEYS)
    assert isinstance(keyring.keys, tuple)  # a snapshot: callers cannot mutate the ring
    assert len(keyring) == 3
    assert TEST_KEYS[1] in keyring
    assert KEY32 not in keyring
    assert list(keyring) == TEST_KEYS


def test_keyring_primary_only() -> None:
    # keyring_test.go TestKeyring_PrimaryOnly: a primary alone is installed.
    keyring = Keyring([], TEST_KEYS[0])
    assert keyring.keys == (TEST_KEYS[0],)


def test_keyring_explicit_primary_goes_first() -> None:
    # NewKeyring adds the primary first, then the keys in order (duplicates ignored).
    keyring = Keyring(TEST_KEYS, TEST_KEYS[2])
    assert keyring.keys == (TEST_KEYS[2], TEST_KEYS[0], TEST_KEYS[1])
    keyring = Keyring(TEST_KEYS[:2], KEY32)
    assert keyring.keys == (KEY32, TEST_KEYS[0], TEST_KEYS[1])


def test_keyring_add_remove_use() -> None:
    # keyring_test.go TestKeyring_AddRemoveUse.
    keyring = Keyring([], TEST_KEYS[1])
    with pytest.raises(KeyringError, match="not in the keyring"):
        keyring.use(TEST_KEYS[2])
    keyring.install(TEST_KEYS[2])
    assert keyring.keys == (TEST_KEYS[1], TEST_KEYS[2])
    keyring.use(TEST_KEYS[2])
    assert keyring.primary_key == TEST_KEYS[2]
    with pytest.raises(KeyringError, match="removing the primary key is not allowed"):
        keyring.remove(TEST_KEYS[2])
    keyring.remove(TEST_KEYS[1])
    assert list(keyring.keys) == [TEST_KEYS[2]]


def test_keyring_use_keeps_go_order() -> None:
    # installKeysLocked: new primary first, the rest in their previous order.
    keyring = Keyring(TEST_KEYS)
    keyring.use(TEST_KEYS[2])
    assert keyring.keys == (TEST_KEYS[2], TEST_KEYS[0], TEST_KEYS[1])
    keyring.use(TEST_KEYS[1])
    assert keyring.keys == (TEST_KEYS[1], TEST_KEYS[2], TEST_KEYS[0])


def test_keyring_install_is_idempotent_and_remove_unknown_is_noop() -> None:
    keyring = Keyring(TEST_KEYS[:2])
    keyring.install(TEST_KEYS[1])
    keyring.install(bytearray(TEST_KEYS[0]))  # type: ignore[arg-type]
    assert keyring.keys == tuple(TEST_KEYS[:2])
    keyring.remove(KEY32)  # keyring.go RemoveKey ignores keys that are not installed
    assert keyring.keys == tuple(TEST_KEYS[:2])


def test_keyring_copies_keys() -> None:
    key = bytearray(KEY16)
    keyring = Keyring([key])  # type: ignore[list-item]
    key[0] ^= 0xFF
    assert keyring.primary_key == KEY16
    assert isinstance(keyring.primary_key, bytes)


@pytest.mark.parametrize("length", [0, 1, 15, 17, 20, 31, 33, 64])
def test_keyring_rejects_bad_key_sizes(length: int) -> None:
    with pytest.raises(KeyringError, match=f"got {length} bytes"):
        Keyring([bytes(length)])
    with pytest.raises(KeyringError, match=f"got {length} bytes"):
        Keyring([KEY16]).install(bytes(length))
    with pytest.raises(KeyringError, match=f"got {length} bytes"):
        validate_key(bytes(length))


def test_keyring_needs_a_key() -> None:
    with pytest.raises(KeyringError, match="at least one key"):
        Keyring([])


def test_keyring_rejects_a_single_key_instead_of_a_list() -> None:
    with pytest.raises(TypeError, match="sequence of keys"):
        Keyring(KEY16)  # type: ignore[arg-type]


def test_keyring_is_bounded() -> None:
    keys = [i.to_bytes(2, "big") * 8 for i in range(MAX_KEYS)]
    keyring = Keyring(keys)
    assert len(keyring) == MAX_KEYS
    keyring.install(keys[5])  # already installed: still fine when full
    with pytest.raises(KeyringError, match=f"at most {MAX_KEYS} keys"):
        keyring.install(KEY32)
    keyring.remove(keys[1])
    keyring.install(KEY32)
    with pytest.raises(KeyringError, match="at most"):
        Keyring([*keys, KEY32])


def test_keyring_repr_hides_key_material() -> None:
    keyring = Keyring([KEY16, KEY32])
    text = repr(keyring)
    assert "2 key" in text
    assert KEY16.hex() not in text
    assert repr(KEY16) not in text


# --- Keyring.from_base64 (Serf keyring files / -encrypt flag) ------------------------


def test_from_base64() -> None:
    encoded = [base64.b64encode(k).decode() for k in (KEY16, KEY24, KEY32)]
    keyring = Keyring.from_base64(encoded)
    assert keyring.keys == (KEY16, KEY24, KEY32)
    keyring = Keyring.from_base64(encoded, primary=encoded[2])
    assert keyring.primary_key == KEY32
    # Go's base64.StdEncoding skips CR/LF, so keys pasted with a newline still work.
    assert Keyring.from_base64([encoded[0] + "\n"]).primary_key == KEY16


def test_from_base64_serf_style_key() -> None:
    # `serf keygen` prints 32 random bytes in standard padded base64.
    key = os.urandom(32)
    assert Keyring.from_base64([base64.b64encode(key).decode()]).primary_key == key


@pytest.mark.parametrize(
    ("encoded", "match"),
    [
        (["not base64!"], "key #0 is not valid base64"),
        ([base64.b64encode(KEY16).decode(), "AAAA*AAA"], "key #1 is not valid base64"),
        (["AAA"], "key #0 is not valid base64"),  # bad padding
        (["kéy="], "key #0 is not valid base64"),
        ([base64.b64encode(bytes(20)).decode()], "key #0 decodes to 20 bytes"),
        ([""], "key #0 decodes to 0 bytes"),
        ([], "at least one key"),
    ],
)
def test_from_base64_errors(encoded: list[str], match: str) -> None:
    with pytest.raises(KeyringError, match=match):
        Keyring.from_base64(encoded)


def test_from_base64_bad_primary_and_no_secret_in_errors() -> None:
    secret = base64.b64encode(bytes(range(20))).decode()
    with pytest.raises(KeyringError, match="primary key decodes to 20 bytes") as info:
        Keyring.from_base64([base64.b64encode(KEY16).decode()], primary=secret)
    assert secret not in str(info.value)


def test_from_base64_rejects_a_single_string() -> None:
    with pytest.raises(TypeError, match="sequence of base64 strings"):
        Keyring.from_base64(base64.b64encode(KEY16).decode())


# --- stream framing (net.go encryptLocalState / decryptRemoteState) ------------------


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("label", [b"", b"serf-lan"])
def test_stream_round_trip(version: int, label: bytes) -> None:
    plaintext = b"\x06" + os.urandom(3000)
    frame = encrypt_stream(version, KEY16, plaintext, label, NONCE)
    assert frame[0] == ENCRYPT_MSG_TYPE
    header, body = frame[:STREAM_HEADER_SIZE], frame[STREAM_HEADER_SIZE:]
    assert stream_body_length(header) == len(body) == encrypted_length(version, len(plaintext))
    assert decrypt_stream_body([KEY32, KEY16], header, body, label) == plaintext


@pytest.mark.parametrize("version", [0, 1])
def test_stream_header_is_authenticated(version: int) -> None:
    frame = encrypt_stream(version, KEY16, b"\x06state", b"", NONCE)
    body = frame[STREAM_HEADER_SIZE:]
    # Lengthening the declared size (and padding the body to match) breaks the tag,
    # because the header is part of the additional data.
    longer = bytes([ENCRYPT_MSG_TYPE]) + (len(body) + 1).to_bytes(4, "big")
    with pytest.raises(DecryptError, match="no installed keys"):
        decrypt_stream_body([KEY16], longer, body + b"\x00", b"")
    # The same body verified as a packet (AAD = label only) fails too.
    with pytest.raises(DecryptError, match="no installed keys"):
        decrypt_payload([KEY16], body, b"")


def test_stream_label_is_authenticated() -> None:
    frame = encrypt_stream(1, KEY16, b"\x06state", b"serf-lan", NONCE)
    header, body = frame[:STREAM_HEADER_SIZE], frame[STREAM_HEADER_SIZE:]
    for label in (b"", b"serf-wan", b"serf-lan\x00"):
        with pytest.raises(DecryptError, match="no installed keys"):
            decrypt_stream_body([KEY16], header, body, label)


@pytest.mark.parametrize(
    ("header", "body", "match"),
    [
        (b"\x0a\x00\x00\x00", b"", "must be 5 bytes, got 4"),
        (b"\x0a\x00\x00\x00\x1d\x00", b"", "must be 5 bytes, got 6"),
        (b"\x09\x00\x00\x00\x1d", bytes(29), "type is 9, expected encryptMsg"),
        (b"\x0a\x00\x00\x00\x1e", bytes(29), "declares 30 encrypted bytes but 29"),
        (b"\x0a\x00\x00\x00\x1d", b"\x01" + bytes(28), "no installed keys"),
        (b"\x0a\x00\x00\x00\x00", b"", "cannot decrypt empty payload"),
    ],
    ids=["short", "long", "wrong type", "length mismatch", "garbage body", "empty body"],
)
def test_stream_header_errors(header: bytes, body: bytes, match: str) -> None:
    with pytest.raises(DecryptError, match=match):
        decrypt_stream_body([KEY16], header, body, b"")


def test_stream_body_length_reads_big_endian() -> None:
    assert stream_body_length(b"\x0a\x01\x02\x03\x04") == 0x01020304
    assert stream_body_length(b"\x0a\xff\xff\xff\xff") == 0xFFFFFFFF
