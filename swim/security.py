"""AES-GCM message encryption and the keyring, wire-compatible with memberlist.

Sources (hashicorp/memberlist @ 1b4c746):

* ``security.go``: ``encryptOverhead``, ``encryptedLength``, ``encryptPayload``,
  ``decryptMessage``, ``decryptPayload``, ``pkcs7encode``, ``pkcs7decode``.
* ``keyring.go``: ``NewKeyring``, ``ValidateKey``, ``AddKey``, ``UseKey``,
  ``RemoveKey``, ``installKeysLocked``, ``GetKeys``, ``GetPrimaryKey``.
* ``net.go``: ``encryptLocalState`` / ``decryptRemoteState`` (stream framing) and the
  ``encryptMsg`` message type (10).

Wire format of an encrypted payload::

    [version: 1 byte][nonce: 12 bytes][AES-GCM ciphertext || 16-byte tag]

* Version 0: the plaintext is PKCS#7-padded to a multiple of 16 bytes before sealing
  (always 1..16 bytes of padding). Version 1: no padding. Anything else is rejected.
* The key size selects AES-128/192/256 (16, 24 or 32 bytes).
* The version byte is not covered by the GCM tag (a property of memberlist's format,
  kept for compatibility): a version 0 payload relabelled as 1 decrypts to its padded
  plaintext; the reverse fails padding validation.
* Packets authenticate the packet label as additional data (empty without a label).
  Streams authenticate ``[type=10][uint32 BE length]`` followed by the stream label.

Rules for this module: no I/O and no randomness. The caller supplies nonces (its
default source is ``os.urandom``) so that tests are deterministic. Every problem with
untrusted input raises ``DecryptError`` (a ``ValueError``); the caller counts these as
dropped packets. Unlike Go's ``pkcs7decode``, which only reads the last byte (and
panics on an empty buffer), the padding is fully validated, so a packet can never
crash the process or yield a silently truncated plaintext.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Sequence

# ``cryptography`` (and the OpenSSL it loads, ~7 MB resident) is imported on first use, so
# an agent without encryption never pays for it.

__all__ = [
    "BLOCK_SIZE",
    "ENCRYPT_MSG_TYPE",
    "MAX_ENCRYPTION_VERSION",
    "MAX_KEYS",
    "MAX_PAD_OVERHEAD",
    "MIN_ENCRYPTION_VERSION",
    "NONCE_SIZE",
    "STREAM_HEADER_SIZE",
    "TAG_SIZE",
    "VALID_KEY_SIZES",
    "VERSION_SIZE",
    "DecryptError",
    "Keyring",
    "KeyringError",
    "decrypt_payload",
    "decrypt_stream_body",
    "encrypt_overhead",
    "encrypt_payload",
    "encrypt_stream",
    "encrypted_length",
    "stream_body_length",
    "validate_key",
]

VERSION_SIZE = 1
NONCE_SIZE = 12
TAG_SIZE = 16
MAX_PAD_OVERHEAD = 16
BLOCK_SIZE = 16
MIN_ENCRYPTION_VERSION = 0
MAX_ENCRYPTION_VERSION = 1
VALID_KEY_SIZES = (16, 24, 32)

# net.go messageType iota: ping=0 ... compress=9, encrypt=10.
ENCRYPT_MSG_TYPE = 10
# [type byte][uint32 big-endian length of the encrypted payload]
STREAM_HEADER_SIZE = 5

# Every installed key is tried against every packet that fails to decrypt, so the key
# count multiplies the AES-GCM work an attacker can cause per hostile packet. Rotation
# needs only two or three keys at once; 32 leaves plenty of room for operators while
# bounding that cost (memberlist itself has no limit).
MAX_KEYS = 32


class DecryptError(ValueError):
    """An encrypted payload could not be authenticated, decrypted or unpadded."""


class KeyringError(ValueError):
    """A key or keyring operation is invalid (bad size, unknown key, primary removal)."""


def validate_key(key: bytes) -> None:
    """Raise ``KeyringError`` unless ``key`` is a valid AES key (keyring.go ``ValidateKey``)."""
    if len(key) not in VALID_KEY_SIZES:
        raise KeyringError(f"key size must be 16, 24 or 32 bytes, got {len(key)} bytes")


def _check_version(version: int) -> None:
    if not MIN_ENCRYPTION_VERSION <= version <= MAX_ENCRYPTION_VERSION:
        raise ValueError(
            f"unsupported encryption version {version} "
            f"(supported: {MIN_ENCRYPTION_VERSION}..{MAX_ENCRYPTION_VERSION})"
        )


def encrypt_overhead(version: int) -> int:
    """Maximum bytes encryption adds to a message (security.go ``encryptOverhead``)."""
    _check_version(version)
    if version == 0:
        return VERSION_SIZE + NONCE_SIZE + MAX_PAD_OVERHEAD + TAG_SIZE  # 45
    return VERSION_SIZE + NONCE_SIZE + TAG_SIZE  # 29


def encrypted_length(version: int, length: int) -> int:
    """Exact size of an encrypted payload for a plaintext of ``length`` bytes.

    security.go ``encryptedLength``. Version 0 always pads (a full block when the
    length is already a multiple of 16).
    """
    _check_version(version)
    if length < 0:
        raise ValueError(f"plaintext length must be >= 0, got {length}")
    if version >= 1:
        return VERSION_SIZE + NONCE_SIZE + length + TAG_SIZE
    padding = BLOCK_SIZE - (length % BLOCK_SIZE)
    return VERSION_SIZE + NONCE_SIZE + length + padding + TAG_SIZE


def _pkcs7_pad(msg: bytes) -> bytes:
    more = BLOCK_SIZE - (len(msg) % BLOCK_SIZE)
    return msg + bytes((more,)) * more


def _pkcs7_unpad(plain: bytes) -> bytes:
    # The GCM tag already proved the sender holds the key, but a buggy or hostile
    # key holder could still send bad padding; reject it rather than truncate.
    if not plain or len(plain) % BLOCK_SIZE:
        raise DecryptError(
            f"invalid PKCS7 padding: plaintext length {len(plain)} "
            f"is not a positive multiple of {BLOCK_SIZE}"
        )
    pad = plain[-1]
    if not 1 <= pad <= BLOCK_SIZE or plain[-pad:] != bytes((pad,)) * pad:
        raise DecryptError("invalid PKCS7 padding")
    return plain[:-pad]


def encrypt_payload(version: int, key: bytes, msg: bytes, aad: bytes, nonce: bytes) -> bytes:
    """Encrypt ``msg`` as memberlist's ``encryptPayload`` does, with a caller-chosen nonce.

    Returns ``[version][nonce][ciphertext || tag]``, exactly
    ``encrypted_length(version, len(msg))`` bytes. A nonce must never be reused with
    the same key; the caller's default nonce source is ``os.urandom(NONCE_SIZE)``.
    """
    _check_version(version)
    validate_key(key)
    if len(nonce) != NONCE_SIZE:
        raise ValueError(f"nonce must be {NONCE_SIZE} bytes, got {len(nonce)}")
    plain = _pkcs7_pad(msg) if version == 0 else msg
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    sealed = AESGCM(bytes(key)).encrypt(bytes(nonce), bytes(plain), bytes(aad))
    return bytes((version,)) + bytes(nonce) + sealed


def decrypt_payload(keys: Sequence[bytes], msg: bytes, aad: bytes) -> bytes:
    """Decrypt a payload with the first key that authenticates it (security.go ``decryptPayload``).

    ``keys`` are tried in order, so pass the primary key first (``Keyring.keys``). Keys
    of an invalid size are skipped, as Go's ``decryptMessage`` error is ignored there.
    Raises ``DecryptError`` for an empty or short payload, an unsupported version,
    bad padding, or when no key works.
    """
    if not msg:
        raise DecryptError("cannot decrypt empty payload")
    version = msg[0]
    if version > MAX_ENCRYPTION_VERSION:
        raise DecryptError(f"unsupported encryption version {version}")
    if len(msg) < encrypted_length(version, 0):
        raise DecryptError(f"payload is too small to decrypt: {len(msg)}")

    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    data = bytes(msg)
    nonce = data[VERSION_SIZE : VERSION_SIZE + NONCE_SIZE]
    sealed = data[VERSION_SIZE + NONCE_SIZE :]
    associated = bytes(aad)
    for key in keys:
        if len(key) not in VALID_KEY_SIZES:
            continue
        try:
            plain = AESGCM(bytes(key)).decrypt(nonce, sealed, associated)
        except InvalidTag:
            continue
        return _pkcs7_unpad(plain) if version == 0 else plain
    raise DecryptError("no installed keys could decrypt the message")


def _stream_header(length: int) -> bytes:
    return bytes((ENCRYPT_MSG_TYPE,)) + length.to_bytes(4, "big")


def encrypt_stream(version: int, key: bytes, plaintext: bytes, label: bytes, nonce: bytes) -> bytes:
    """Frame and encrypt stream state like net.go ``encryptLocalState``.

    Returns ``[10][uint32 BE payload length][encrypted payload]``. The 5-byte header
    followed by ``label`` is the additional data, so the length cannot be altered.
    """
    length = encrypted_length(version, len(plaintext))
    if length > 0xFFFFFFFF:
        raise ValueError(f"stream plaintext too large to frame: {len(plaintext)} bytes")
    header = _stream_header(length)
    return header + encrypt_payload(version, key, plaintext, header + bytes(label), nonce)


def stream_body_length(header5: bytes) -> int:
    """Validate a 5-byte stream header and return the encrypted body length it declares.

    The caller reads the header, checks this length against its own limit (memberlist:
    ``maxPushStateBytes``) before reading the body, then calls ``decrypt_stream_body``.
    """
    if len(header5) != STREAM_HEADER_SIZE:
        raise DecryptError(f"stream header must be {STREAM_HEADER_SIZE} bytes, got {len(header5)}")
    if header5[0] != ENCRYPT_MSG_TYPE:
        raise DecryptError(
            f"stream header type is {header5[0]}, expected encryptMsg ({ENCRYPT_MSG_TYPE})"
        )
    return int.from_bytes(header5[1:5], "big")


def decrypt_stream_body(keys: Sequence[bytes], header5: bytes, body: bytes, label: bytes) -> bytes:
    """Decrypt a framed stream body like net.go ``decryptRemoteState``.

    ``header5`` is the ``[10][uint32 BE length]`` header as received; it is
    authenticated together with ``label``.
    """
    declared = stream_body_length(header5)
    if declared != len(body):
        raise DecryptError(
            f"stream header declares {declared} encrypted bytes but {len(body)} were given"
        )
    return decrypt_payload(keys, body, bytes(header5) + bytes(label))


class Keyring:
    """The set of AES keys in use, with one primary key (memberlist keyring.go).

    The primary key encrypts outgoing messages and is tried first on incoming ones;
    the other keys are only used to decrypt, which is what allows rotation: install
    the new key everywhere, ``use`` it everywhere, then ``remove`` the old one.

    Ordering follows Go's ``installKeysLocked``: the primary is first, the others keep
    their previous relative order (a demoted primary stays right after the new one).
    This object does no I/O; the agent reads and writes keyring files. It is not
    thread-safe (the caller serialises access, e.g. from a single event loop).
    """

    __slots__ = ("_keys",)

    def __init__(self, keys: Sequence[bytes], primary: bytes | None = None) -> None:
        if isinstance(keys, bytes | bytearray | memoryview):
            # A lone key would otherwise be iterated as a sequence of ints.
            raise TypeError("keys must be a sequence of keys, not a single key")
        if primary is None:
            if not keys:
                raise KeyringError("a keyring needs at least one key")
            primary = keys[0]
        self._keys: list[bytes] = []
        # NewKeyring: the primary is added first, then every key in order.
        self.install(primary)
        for key in keys:
            self.install(key)

    @classmethod
    def from_base64(cls, encoded: Sequence[str], primary: str | None = None) -> Keyring:
        """Build a keyring from Serf-style base64 key strings (standard alphabet, padded).

        ``primary`` defaults to the first entry. Errors name the entry's position, never
        its contents, so they can be logged without leaking key material.
        """
        if isinstance(encoded, str):
            raise TypeError("encoded must be a sequence of base64 strings, not a single string")
        keys = [_decode_base64_key(text, f"key #{i}") for i, text in enumerate(encoded)]
        primary_key = None if primary is None else _decode_base64_key(primary, "primary key")
        return cls(keys, primary_key)

    @property
    def keys(self) -> tuple[bytes, ...]:
        """All keys, primary first (keyring.go ``GetKeys``); pass to ``decrypt_payload``."""
        return tuple(self._keys)

    @property
    def primary_key(self) -> bytes:
        """The key used to encrypt outgoing messages (keyring.go ``GetPrimaryKey``)."""
        return self._keys[0]

    def install(self, key: bytes) -> None:
        """Add ``key`` for decryption; a no-op if already installed (keyring.go ``AddKey``)."""
        validate_key(key)
        key = bytes(key)
        if key in self._keys:
            return
        if len(self._keys) >= MAX_KEYS:
            raise KeyringError(f"keyring is full: at most {MAX_KEYS} keys may be installed")
        self._keys.append(key)

    def use(self, key: bytes) -> None:
        """Make an installed key the primary (keyring.go ``UseKey``)."""
        key = bytes(key)
        if key not in self._keys:
            raise KeyringError("requested key is not in the keyring")
        self._keys.remove(key)
        self._keys.insert(0, key)

    def remove(self, key: bytes) -> None:
        """Drop a secondary key; a no-op if it is not installed (keyring.go ``RemoveKey``).

        The primary cannot be removed: ``use`` another key first.
        """
        key = bytes(key)
        if key == self._keys[0]:
            raise KeyringError(
                "removing the primary key is not allowed; make another key primary first"
            )
        if key in self._keys:
            self._keys.remove(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes | bytearray | memoryview) and bytes(key) in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[bytes]:
        return iter(tuple(self._keys))

    def __repr__(self) -> str:
        # Never print key material: reprs end up in logs and tracebacks.
        return f"Keyring(<{len(self._keys)} key(s)>)"


def _decode_base64_key(text: str, what: str) -> bytes:
    # Go's base64.StdEncoding (used by Serf) skips CR and LF anywhere in the input.
    cleaned = text.replace("\r", "").replace("\n", "")
    try:
        key = base64.b64decode(cleaned.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error):
        raise KeyringError(f"{what} is not valid base64") from None
    if len(key) not in VALID_KEY_SIZES:
        raise KeyringError(
            f"{what} decodes to {len(key)} bytes; key size must be 16, 24 or 32 bytes"
        )
    return key
