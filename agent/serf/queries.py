"""Serf queries as a member answers them (serf.go ``handleQuery``, internal_query.go).

Rules (pure: no trio, no sockets; agent/serf/delegate.py applies them and the agent sends
what they build):
- A query is news only once per (LTime, ID), remembered in ``QUERY_BUFFER_SIZE`` slots by
  LTime; a query older than the buffer is dropped (serf.go ``handleQuery``).
- News is re-gossiped unless it carries ``queryFlagNoBroadcast``: Serf relies on every
  member passing queries on, as it does intents.
- Filters: a node filter (type 0, a list of names) or a tag filter (type 1, a tag and a
  Go regexp, matched unanchored as ``regexp.MatchString``); an unknown filter or a regexp
  Python cannot compile means "not for us" (serf.go ``shouldProcessQuery``).
- The key-management queries (``_serf_install-key``, ``_serf_use-key``,
  ``_serf_remove-key``, ``_serf_list-keys``) change or list the keyring and answer with
  ``messageKeyResponse`` ``{Result, Message, Keys, PrimaryKey}`` inside a
  ``messageQueryResponse`` sent to the query's address, so ``serf keys`` rotates keys on
  our agents as on Serf's. Responses are not relayed (``RelayFactor`` is ignored).
"""

from __future__ import annotations

import base64
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from agent.serf.constants import QUERY_BUFFER_SIZE, QUERY_FLAG_ACK, SerfMessageType
from agent.serf.messages import Query, QueryResponse, encode_query_response

FILTER_NODE = 0
FILTER_TAG = 1
KEY_QUERIES = ("install-key", "use-key", "remove-key", "list-keys")


@dataclass
class QuerySeen:
    """serf.go ``queryBuffer``: which (LTime, ID) pairs were handled, bounded."""

    size: int = QUERY_BUFFER_SIZE
    _slots: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    latest: int = 0

    def is_news(self, ltime: int, query_id: int) -> bool:
        self.latest = max(self.latest, ltime)
        if self.latest > self.size and ltime < self.latest - self.size:
            return False  # older than the buffer remembers
        idx = ltime % self.size
        slot = self._slots.get(idx)
        if slot is not None and slot[0] == ltime:
            if query_id in slot[1]:
                return False
            slot[1].append(query_id)
            return True
        self._slots[idx] = (ltime, [query_id])
        return True


def for_us(filters: tuple[bytes, ...], node: str, tags: Mapping[str, str]) -> bool:
    for raw in filters:
        if not raw:
            return False
        try:
            body = msgpack.unpackb(raw[1:], raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException):
            return False
        if raw[0] == FILTER_NODE:
            if not isinstance(body, list) or node not in body:
                return False
        elif raw[0] == FILTER_TAG:
            if not isinstance(body, dict):
                return False
            tag, expr = body.get("Tag"), body.get("Expr")
            if not isinstance(tag, str) or not isinstance(expr, str):
                return False
            try:
                if re.search(expr, tags.get(tag, "")) is None:
                    return False
            except re.error:
                return False
        else:
            return False
    return True


def response_address(query: Query) -> tuple[str, int]:
    """Where the response goes: the query's ``Addr`` (a Go ``net.IP``) and ``Port``."""
    ip = ipaddress.ip_address(query.addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), query.port


def key_request(payload: bytes) -> bytes:
    """The key of a ``messageKeyRequest`` payload; ValueError when malformed."""
    if not payload or payload[0] != SerfMessageType.KEY_REQUEST:
        raise ValueError("not a key request")
    try:
        body = msgpack.unpackb(payload[1:], raw=True, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"bad key request: {exc}") from None
    key = body.get(b"Key") if isinstance(body, dict) else None
    if not isinstance(key, bytes):
        raise ValueError("key request without a key")
    return key


def key_response(ok: bool, message: str, keys: list[bytes], primary: bytes | None) -> bytes:
    """``messageKeyResponse``: go-msgpack writes struct fields as a map sorted by name."""
    encoded = [base64.b64encode(k) for k in keys]
    body: dict[bytes, Any] = {
        b"Keys": encoded or None,
        b"Message": message.encode(),
        b"PrimaryKey": base64.b64encode(primary) if primary else b"",
        b"Result": ok,
    }
    packed: bytes = msgpack.packb(body, use_bin_type=False)
    return bytes([SerfMessageType.KEY_RESPONSE]) + packed


def response(query: Query, node: str, payload: bytes, *, ack: bool = False) -> bytes:
    return encode_query_response(
        QueryResponse(
            ltime=query.ltime,
            id=query.id,
            from_node=node,
            flags=QUERY_FLAG_ACK if ack else 0,
            payload=payload,
        )
    )
