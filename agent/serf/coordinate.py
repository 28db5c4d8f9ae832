"""Network coordinates in serf's ping ack payload (serf/ping_delegate.go
``AckPayload``/``NotifyPingComplete``, coordinate/coordinate.go, coordinate/config.go).

Rules: the payload is ``[PING_VERSION][msgpack Coordinate]``; an empty payload carries no
coordinate (serf ignores it silently); a coordinate with NaN/Inf or another dimensionality
is rejected by serf's Vivaldi client, so send either nothing or a real one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent.serf.constants import PING_VERSION
from agent.serf.gomsgpack import (
    SerfCodecError,
    as_float,
    check_bytes,
    get_list,
    go_struct,
    pack,
    unpack,
)

# --- network coordinates (serf/ping_delegate.go, coordinate/) -------------------------------


@dataclass(frozen=True, slots=True)
class Coordinate:
    """coordinate.go ``Coordinate`` (seconds): Euclidean ``vec``, dimensionless ``error``,
    ``adjustment`` and non-Euclidean ``height``."""

    vec: tuple[float, ...]
    error: float
    adjustment: float
    height: float

    def is_valid(self) -> bool:
        """coordinate.go ``IsValid``: no NaN or infinity anywhere."""
        values = (*self.vec, self.error, self.adjustment, self.height)
        return all(math.isfinite(v) for v in values)

    def is_compatible_with(self, other: Coordinate) -> bool:
        """coordinate.go ``IsCompatibleWith``: same dimensionality."""
        return len(self.vec) == len(other.vec)


DEFAULT_DIMENSIONALITY = 8
"""coordinate/config.go ``DefaultConfig().Dimensionality``."""
VIVALDI_ERROR_MAX = 1.5
"""coordinate/config.go ``DefaultConfig().VivaldiErrorMax``."""
HEIGHT_MIN = 10.0e-6
"""coordinate/config.go ``DefaultConfig().HeightMin``."""
DEFAULT_COORDINATE = Coordinate(
    vec=(0.0,) * DEFAULT_DIMENSIONALITY, error=VIVALDI_ERROR_MAX, adjustment=0.0, height=HEIGHT_MIN
)
"""``coordinate.NewCoordinate(coordinate.DefaultConfig())``: what a fresh serf node acks."""


def encode_ping_payload(coordinate: Coordinate = DEFAULT_COORDINATE) -> bytes:
    """The ack payload serf's ``AckPayload`` produces: ``PING_VERSION`` then the msgpack
    ``Coordinate`` (fields Adjustment, Error, Height, Vec; float64 throughout)."""
    vec = [as_float(v, "Vec") for v in coordinate.vec]
    body = {
        b"Adjustment": as_float(coordinate.adjustment, "Adjustment"),
        b"Error": as_float(coordinate.error, "Error"),
        b"Height": as_float(coordinate.height, "Height"),
        b"Vec": vec,
    }
    return bytes([PING_VERSION]) + pack(body)


def decode_ping_payload(payload: bytes) -> Coordinate:
    """The coordinate in an ack payload, as ``NotifyPingComplete`` reads it.

    Raises ``SerfCodecError`` (a ``ValueError``) for an empty payload (serf ignores it
    silently), another version byte (serf: "Unsupported ping version") or a body that does
    not decode (serf: "Failed to decode coordinate from ping"). The coordinate is returned
    even when ``is_valid()`` is false; serf's Vivaldi client rejects such ones.
    """
    try:
        data = check_bytes(payload, "payload")
        if not data:
            raise SerfCodecError("empty ping payload")
        if data[0] != PING_VERSION:
            raise SerfCodecError(f"unsupported ping version: {data[0]}")
        obj = go_struct(unpack(data[1:]), "Coordinate")
        vec = tuple(as_float(v, "Vec") for v in get_list(obj, "Vec"))
        return Coordinate(
            vec=vec,
            error=as_float(obj.get(b"Error"), "Error"),
            adjustment=as_float(obj.get(b"Adjustment"), "Adjustment"),
            height=as_float(obj.get(b"Height"), "Height"),
        )
    except SerfCodecError:
        raise
    except (ValueError, TypeError, RecursionError) as exc:
        raise SerfCodecError(f"malformed coordinate: {exc}") from exc
