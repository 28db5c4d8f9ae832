"""An incremental, sans-IO stream decoder: bytes go in as they arrive, one message comes out.
Part of ``swim.wire`` (its docstring has the rules).

``parse_stream`` answers for a whole buffer; a reader that calls it again after every chunk
re-decodes the stream from its start each time, so its work grows with the square of the
stream's length. ``StreamDecoder`` keeps its place and gives the same answers (same
message, same ``DropReason``) for the same bytes fed in any pieces:

- Work is proportional to the bytes fed: each byte is handed to msgpack once
  (``work_bytes`` counts them), plus one pass over a plaintext that is whole (a decrypted
  frame, a decompressed blob). msgpack's ``Unpacker`` keeps an object that is not complete
  yet: its C implementation keeps its place inside it (``tell()`` moves on), its
  pure-Python fallback re-reads that one object from its start when more bytes come;
  neither reads the objects before it again. Push-pull node states are separate objects,
  so the one under way is one node state.
- Limits are checked as early as the bytes allow: more than ``max_bytes + 5`` bytes fed is
  OVERSIZED at once; an encrypted frame that announces a body over ``max_bytes`` is refused
  at its fifth byte; a push-pull header that announces too many nodes or too much user
  state, or a user-message header too long a payload, as soon as that header is complete;
  a msgpack string or binary over ``max_bytes`` (a compressed blob) at its own header if
  it lies within the first object's first ``HEAD_SCAN_BYTES`` (``check_declared_lengths``;
  msgpack's own ``max_bin_len`` waits for the bytes), and ``parse_stream`` says the same
  for the same bytes. Never more node states are read than announced.
- Encrypted streams are collected whole (5 + announced bytes, in a ``bytearray``), then
  decrypted and parsed one-shot with the same steps as ``parse_stream``. A compressed stream's
  ``{Algo, Buf}`` map is read incrementally, then decompressed and parsed one-shot.
- Validation is not repeated here: the steps come from ``swim.wire.codec`` and
  ``swim.wire.framing`` (``decode_push_pull_header``, ``decode_push_state``...), which the
  one-shot parsers use too.
- After a message completes, further bytes are ignored (the stream carries one message).
  After a ``WireError`` the decoder stays failed: each later ``feed`` raises it again.

Sources: hashicorp/memberlist @ 1b4c746 net.go (``readStream``, ``readRemoteState``,
``readUserMsg``), security.go (``decryptRemoteState``).
"""

from __future__ import annotations

from typing import Any

import msgpack

from swim.messages import MsgType, PushNodeState, PushPull, UserMsg
from swim.wire.codec import (
    UNPACK_ERRORS,
    StreamLimits,
    StreamMessage,
    buffer_full,
    decode_push_pull_header,
    decode_push_state,
    decode_small_stream,
    decode_user_header,
    decompress_stream,
    stream_kind,
)
from swim.wire.errors import DropReason, WireError
from swim.wire.fields import HEAD_SCAN_BYTES, check_declared_lengths, new_unpacker
from swim.wire.framing import (
    Crypto,
    check_stream_start,
    decrypt_stream_message,
    encrypted_stream_length,
)

__all__ = ["StreamDecoder"]

_ENCRYPT_HEADER = 5
"""``[10][uint32 BE length]`` before an encrypted stream's body (security.go)."""

# Phases of a decoder.
_START = 0  # no byte yet
_ENCRYPTED = 1  # collecting an encrypted frame
_OBJECT = 2  # reading a msgpack object: a header, a small message, a compressed map
_STATES = 3  # reading push-pull node states
_RAW = 4  # collecting raw bytes: push-pull user state, user-message payload
_DONE = 5
_FAILED = 6


class StreamDecoder:
    """Feed a stream's bytes as they arrive; ``feed`` returns its message once whole.

    ``feed`` returns None while more bytes are needed (and after the message was
    returned), or raises ``WireError`` as soon as the bytes cannot become a valid message.
    """

    __slots__ = (
        "_buffer",
        "_crypto",
        "_error",
        "_head",
        "_join",
        "_kind",
        "_limits",
        "_mark",
        "_need",
        "_phase",
        "_received",
        "_remaining",
        "_states",
        "_unpacker",
        "_unpacker_fed",
        "_used",
        "_user_state_len",
        "_work",
    )

    def __init__(self, crypto: Crypto | None, limits: StreamLimits) -> None:
        self._crypto = crypto
        self._limits = limits
        self._phase = _START
        self._received = 0
        self._work = 0
        self._used = 0
        self._error: WireError | None = None
        self._kind = MsgType.PING
        self._buffer = bytearray()
        self._head = bytearray()  # the first object's first HEAD_SCAN_BYTES
        self._need = 0
        self._unpacker: Any = None
        self._unpacker_fed = 0
        self._mark = 0
        self._remaining = 0
        self._states: list[PushNodeState] = []
        self._join = False
        self._user_state_len = 0

    @property
    def received_bytes(self) -> int:
        """Bytes fed so far, including any ignored after the message."""
        return self._received

    @property
    def buffered_bytes(self) -> int:
        """Bytes held right now, waiting to become part of a message (for a memory budget):
        those of the msgpack object under way (from its first byte, though msgpack may have
        parsed some of them already) and raw bytes collected; decoded node states are not
        counted."""
        if self._phase in (_OBJECT, _STATES):
            return self._unpacker_fed - self._mark
        if self._phase in (_ENCRYPTED, _RAW):
            return len(self._buffer)
        return 0

    @property
    def work_bytes(self) -> int:
        """Bytes handed to msgpack so far (the one-shot plaintext passes included)."""
        return self._work

    @property
    def used_bytes(self) -> int:
        """Stream bytes the message used, once it is complete (``parse_stream``'s count)."""
        return self._used

    @property
    def done(self) -> bool:
        """Whether the message was returned."""
        return self._phase == _DONE

    def feed(self, data: bytes) -> StreamMessage | None:
        """Take the next bytes of the stream; the message once it is whole, else None."""
        if self._error is not None:
            raise self._error
        if self._phase == _DONE:
            self._received += len(data)
            return None
        try:
            self._received += len(data)
            if self._received > self._limits.max_bytes + _ENCRYPT_HEADER:
                raise WireError(
                    DropReason.OVERSIZED, f"stream exceeds {self._limits.max_bytes} bytes"
                )
            message = self._feed(memoryview(data))
        except WireError as exc:
            self._fail(exc)
            raise
        if message is not None:
            self._finish()
        return message

    # --- phases -------------------------------------------------------------------------

    def _feed(self, data: memoryview) -> StreamMessage | None:
        if not data:
            return None
        if self._phase == _START:
            self._used = 1
            if check_stream_start(data[0], self._crypto):
                self._phase = _ENCRYPTED
                self._need = _ENCRYPT_HEADER
                return self._feed_encrypted(data)
            self._kind = stream_kind(data[0], allow_compress=True)
            self._phase = _OBJECT
            self._unpacker = new_unpacker(self._limits.max_bytes)
            data = data[1:]
        if self._phase == _ENCRYPTED:
            return self._feed_encrypted(data)
        if self._phase == _RAW:
            return self._collect(data)
        self._give(data)
        if self._phase == _OBJECT:
            grew = len(self._head) < HEAD_SCAN_BYTES
            if grew:
                self._head += data[: HEAD_SCAN_BYTES - len(self._head)]
            obj = self._next_object()
            if obj is _MORE:
                if grew:  # at most HEAD_SCAN_BYTES feeds grow it: bounded work
                    check_declared_lengths(self._head, self._limits.max_bytes)
                return None
            message = self._on_object(obj)
            if message is not None or self._phase != _STATES:
                return message
        return self._read_states()

    def _feed_encrypted(self, data: memoryview) -> StreamMessage | None:
        take = min(len(data), self._need - len(self._buffer))
        self._buffer += data[:take]
        if len(self._buffer) < self._need:
            return None
        if self._need == _ENCRYPT_HEADER:
            self._need += encrypted_stream_length(bytes(self._buffer), self._limits)
            return self._feed_encrypted(data[take:])
        crypto = self._crypto
        assert crypto is not None  # check_stream_start refused an encrypted stream without
        frame = bytes(self._buffer)
        self._work += len(frame) - _ENCRYPT_HEADER
        self._used = len(frame)
        header, body = frame[:_ENCRYPT_HEADER], frame[_ENCRYPT_HEADER:]
        return decrypt_stream_message(header, body, crypto, self._limits)

    def _give(self, data: memoryview) -> None:
        if not data:
            return
        try:
            self._unpacker.feed(data)
        except msgpack.BufferFull as exc:  # more than max_bytes held: at most 4 bytes early
            raise buffer_full(exc) from exc
        self._unpacker_fed += len(data)
        self._work += len(data)

    def _next_object(self) -> Any:
        try:
            return self._unpacker.unpack()
        except msgpack.OutOfData:
            return _MORE
        except UNPACK_ERRORS as exc:
            raise WireError(DropReason.MALFORMED, f"bad msgpack: {exc}") from exc

    def _on_object(self, obj: Any) -> StreamMessage | None:
        """The first msgpack object after the type byte is complete."""
        kind = self._kind
        self._mark = int(self._unpacker.tell())
        self._used = 1 + self._mark
        if kind == MsgType.COMPRESS:
            # The whole stream is this one map: decompress and parse the plaintext one-shot.
            message = decompress_stream(obj, self._limits)
            return message
        if kind == MsgType.PUSH_PULL:
            nodes, self._user_state_len, self._join = decode_push_pull_header(obj, self._limits)
            self._remaining = nodes
            self._phase = _STATES
            return None
        if kind == MsgType.USER:
            self._need = decode_user_header(obj, self._limits)
            return self._to_raw()
        return decode_small_stream(kind, obj)

    def _read_states(self) -> StreamMessage | None:
        while self._remaining:
            try:
                raw = self._unpacker.unpack()
            except msgpack.OutOfData:
                return None
            except UNPACK_ERRORS as exc:
                raise WireError(DropReason.MALFORMED, f"bad node state: {exc}") from exc
            self._states.append(decode_push_state(raw))
            self._remaining -= 1
            self._mark = int(self._unpacker.tell())
        self._used = 1 + int(self._unpacker.tell())
        self._need = self._user_state_len
        return self._to_raw()

    def _to_raw(self) -> StreamMessage | None:
        """The msgpack part is over: move the bytes msgpack holds past it to the raw buffer."""
        held = self._unpacker_fed - int(self._unpacker.tell())
        rest = self._unpacker.read_bytes(min(held, self._need))
        self._unpacker = None
        self._phase = _RAW
        return self._collect(memoryview(rest))

    def _collect(self, data: memoryview) -> StreamMessage | None:
        take = min(len(data), self._need - len(self._buffer))
        self._buffer += data[:take]
        if len(self._buffer) < self._need:
            return None
        self._used += self._need
        raw = bytes(self._buffer)
        if self._kind == MsgType.USER:
            return UserMsg(raw)
        return PushPull(join=self._join, nodes=tuple(self._states), user_state=raw)

    def _finish(self) -> None:
        self._phase = _DONE
        self._buffer = bytearray()
        self._unpacker = None
        self._states = []

    def _fail(self, error: WireError) -> None:
        self._finish()
        self._phase = _FAILED
        self._error = error


_MORE = object()
