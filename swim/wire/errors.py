"""Why wire input is dropped: ``DropReason`` (counted by the node, per reason) and
``WireError``, the one exception the codec raises. Part of ``swim.wire``."""

from __future__ import annotations

from enum import Enum

__all__ = ["DropReason", "WireError"]


class DropReason(Enum):
    """Why an input was dropped; the node counts each one."""

    EMPTY = "empty"
    DECRYPT_FAILED = "decrypt_failed"
    NOT_ENCRYPTED = "not_encrypted"
    BAD_CRC = "bad_crc"
    MALFORMED = "malformed"
    UNKNOWN_TYPE = "unknown_type"
    TRUNCATED_COMPOUND = "truncated_compound"
    DECOMPRESS_FAILED = "decompress_failed"
    TOO_DEEP = "too_deep"
    OVERSIZED = "oversized"
    UNEXPECTED_TYPE = "unexpected_type"
    WRONG_NODE = "wrong_node"
    INVALID_VERSION = "invalid_version"
    REJECTED = "rejected"
    QUEUE_FULL = "queue_full"
    LIMIT = "limit"
    STREAM_TIMEOUT = "stream_timeout"
    """An inbound stream not whole by its deadline (``tcp_timeout_ms``), cut by the agent."""
    BUFFER_FULL = "buffer_full"
    """An inbound stream that would push the agent's bytes held for all streams past its bound."""


class WireError(ValueError):
    """Input that cannot be decoded; ``reason`` says why."""

    def __init__(self, reason: DropReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
