"""The bytes of a formation: the offer, a rank's claim and the plan, in one compact format.

Every rank of a formation decodes the leader's offer (its layout lists every node) and its
plan (which may list every other rank as a receiver); the leader decodes every rank's
claim. Those decodes are per-rank work on the path of every formation, so the records are
packed integers, not JSON objects: a 64-node layout or a plan naming 511 receivers decodes
with a few ``struct`` calls, a utf-8 decode and one tuple of ``Node`` s, not hundreds of
Python objects checked one at a time.

Format (little-endian ``struct``, then standard base64, so a record is ASCII text that
fits the stores' ``str`` values and never collides with the plan's ``retry`` and
``error: `` markers, which contain characters outside the base64 alphabet):

- every record starts with a two-byte tag: its kind (``O`` offer, ``C`` claim, ``P``
  plan) and ``VERSION``; another version is refused with a message saying that every node
  must run the same torchhook;
- text (a name, a token, a fingerprint): u16 length in bytes, then utf-8;
- a layout: u16 node count ``n``, ``n`` × i64 ``registered_ms``, ``n`` × u16 local ranks,
  then the names in utf-8, each ended by a NUL (one decode, one split; a name that is
  empty or holds a NUL is refused when encoding);
- a rank list: u32 count, then that many u32 ranks;
- offer: u16 port, text fingerprint, text token, layout;
- claim (``RankInfo``): text group, i64 step, u8 flags (1: has state, 2: a layout
  follows), text applied_in, text pending_in, [layout];
- plan: u8 action (index in ``strategy.ACTIONS``), u8 restore (``strategy.RESTORES``),
  i64 step, u32 source, then the rank lists exclude, providers, receivers, roll_forward.

Decoding checks the tag, every length against the bytes present and against the bounds
below, and that nothing trails the record: hostile, truncated or foreign bytes raise
``WireError`` (a ``ValueError``) naming the record, never ``struct.error`` or an
``IndexError``, and never allocate more than the bytes received allow.

Sources: the documentation of Python's ``struct`` and ``binascii`` (``a2b_base64`` with
``strict_mode``).
"""

from __future__ import annotations

import base64
import binascii
import struct
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from torchhook.strategy import ACTIONS, RESTORES, Layout, Node, Plan, RankInfo

__all__ = [
    "MAX_RECORD_CHARS",
    "MAX_TEXT_BYTES",
    "NAME_END",
    "VERSION",
    "Offer",
    "WireError",
    "WireVersionError",
    "decode_claim",
    "decode_claims",
    "decode_offer",
    "decode_plan",
    "encode_claim",
    "encode_offer",
    "encode_plan",
]

VERSION = 1
MAX_TEXT_BYTES = 1024
"""A node name, token or fingerprint: node names are a few dozen bytes, tokens 16."""
NAME_END = "\x00"
"""Ends each of a layout's node names (a name holding one cannot be encoded)."""
MAX_RECORD_CHARS = 16 << 20
"""The longest record decoded, in base64 characters; a longer value is refused before it is
decoded. Far above any job: a 4,096-node layout with 64-byte names is ~400 KB, and a plan
for 65,536 ranks that names each of them twice ~700 KB."""

_TAG = struct.Struct("<cB")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_OFFER_HEAD = struct.Struct("<H")
_CLAIM_MID = struct.Struct("<qB")
_PLAN_HEAD = struct.Struct("<BBqI")
_SIZES = {"q": 8, "H": 2, "I": 4}
_HAS_STATE, _HAS_LAYOUT = 1, 2
_OFFER, _CLAIM, _PLAN = b"O", b"C", b"P"
_KINDS = {_OFFER: "offer", _CLAIM: "claim", _PLAN: "plan"}


class WireError(ValueError):
    """Bytes that are not the formation record they should be (truncated, corrupted, from
    another torchhook version, or not a record at all)."""


class WireVersionError(WireError):
    """A record of another wire version: a job whose nodes run different torchhooks."""


@dataclass(frozen=True, slots=True)
class Offer:
    """What the leader offers in its directory: where the formation's store is, the token
    in it, and the layout every rank forms on."""

    fingerprint: str
    port: int
    token: str
    layout: Layout


# ---------------------------------------------------------------- encoding


def encode_offer(offer: Offer) -> str:
    out = bytearray(_TAG.pack(_OFFER, VERSION))
    out += _checked(_OFFER_HEAD, "offer port", offer.port)
    _put_text(out, offer.fingerprint)
    _put_text(out, offer.token)
    _put_layout(out, offer.layout)
    return _ascii(out)


def encode_claim(info: RankInfo) -> str:
    out = bytearray(_TAG.pack(_CLAIM, VERSION))
    _put_text(out, info.group)
    flags = (_HAS_STATE if info.has_state else 0) | (0 if info.layout is None else _HAS_LAYOUT)
    out += _checked(_CLAIM_MID, "claim step", info.step, flags)
    _put_text(out, info.applied_in)
    _put_text(out, info.pending_in)
    if info.layout is not None:
        _put_layout(out, info.layout)
    return _ascii(out)


def encode_plan(plan: Plan) -> str:
    out = bytearray(_TAG.pack(_PLAN, VERSION))
    action, restore = ACTIONS.index(plan.action), RESTORES.index(plan.restore)
    out += _checked(_PLAN_HEAD, "plan header", action, restore, plan.step, plan.source)
    for ranks in (plan.exclude, plan.providers, plan.receivers, plan.roll_forward):
        out += _checked(_U32, "rank count", len(ranks))
        out += _checked(struct.Struct(f"<{len(ranks)}I"), "ranks", *ranks)
    return _ascii(out)


def _ascii(out: bytearray) -> str:
    return base64.b64encode(out).decode("ascii")


def _checked(fmt: struct.Struct, what: str, *values: int) -> bytes:
    try:
        return fmt.pack(*values)
    except struct.error:
        raise WireError(f"{what} {values} does not fit the formation record") from None


def _put_text(out: bytearray, text: str) -> None:
    raw = text.encode()
    if len(raw) > MAX_TEXT_BYTES:
        raise WireError(f"{text[:40]!r}...: longer than {MAX_TEXT_BYTES} bytes")
    out += _U16.pack(len(raw))
    out += raw


def _put_layout(out: bytearray, layout: Layout) -> None:
    nodes = layout.nodes
    n = len(nodes)
    names = [node.name for node in nodes]
    for name in names:
        if not name or "\x00" in name or len(name.encode()) > MAX_TEXT_BYTES:
            raise WireError(
                f"node name {name[:40]!r}: empty, with a NUL, or over {MAX_TEXT_BYTES} bytes"
            )
    out += _checked(_U16, "node count", n)
    out += _checked(struct.Struct(f"<{n}q"), "registered_ms", *(x.registered_ms for x in nodes))
    out += _checked(struct.Struct(f"<{n}H"), "local ranks", *(x.ranks for x in nodes))
    out += "".join(name + NAME_END for name in names).encode()


# ---------------------------------------------------------------- decoding


class _Reader:
    """One record's bytes and a position; every read is checked against the end."""

    __slots__ = ("at", "buf", "what")

    def __init__(self, raw: bytes | str, kind: bytes) -> None:
        self.what = _KINDS[kind]
        if len(raw) > MAX_RECORD_CHARS:
            raise WireError(
                f"formation {self.what}: {len(raw)} characters, over {MAX_RECORD_CHARS}"
            )
        try:
            self.buf = binascii.a2b_base64(raw, strict_mode=True)
        except (binascii.Error, ValueError):
            raise WireError(f"formation {self.what}: not a formation record") from None
        self.at = 0
        tag, version = self.take(_TAG)
        if tag != kind:
            raise WireError(f"formation {self.what}: a record of kind {tag!r}")
        if version != VERSION:
            raise WireVersionError(
                f"formation {self.what} of wire version {version}; this torchhook reads "
                f"{VERSION}: every node of a job must run the same torchhook"
            )

    def take(self, fmt: struct.Struct) -> tuple[Any, ...]:
        try:
            values: tuple[Any, ...] = fmt.unpack_from(self.buf, self.at)
        except struct.error:
            raise WireError(f"formation {self.what}: truncated at byte {self.at}") from None
        self.at += fmt.size
        return values

    def ints(self, code: str, n: int) -> tuple[int, ...]:
        """``n`` integers of ``struct`` type ``code``; ``n`` is checked against the bytes
        left before anything is allocated."""
        size = n * _SIZES[code]
        if size > len(self.buf) - self.at:
            raise WireError(f"formation {self.what}: {n} values, truncated at byte {self.at}")
        values: tuple[int, ...] = struct.unpack_from(f"<{n}{code}", self.buf, self.at)
        self.at += size
        return values

    def raw(self, n: int) -> bytes:
        end = self.at + n
        if end > len(self.buf):
            raise WireError(f"formation {self.what}: truncated at byte {self.at}")
        chunk = self.buf[self.at : end]
        self.at = end
        return chunk

    def text(self) -> str:
        (n,) = self.take(_U16)
        if n > MAX_TEXT_BYTES:
            raise WireError(f"formation {self.what}: a text of {n} bytes")
        return self._utf8(self.raw(n))

    def _utf8(self, raw: bytes) -> str:
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise WireError(f"formation {self.what}: text is not utf-8") from None

    def layout(self) -> Layout:
        """A layout, which ends every record that holds one: its names are the rest."""
        (n,) = self.take(_U16)
        regs = self.ints("q", n)
        ranks = self.ints("H", n)
        if n and min(ranks) < 1:
            raise WireError(f"formation {self.what}: a node with no local ranks")
        rest = self._utf8(self.raw(len(self.buf) - self.at))
        # one split in C: this runs once per rank and formation for every node of the job
        names = rest.split(NAME_END)
        if len(names) != n + 1 or names.pop() or not all(names) or len(rest) > n * MAX_TEXT_BYTES:
            raise WireError(f"formation {self.what}: {n} node names expected, got {rest[:80]!r}")
        return Layout(tuple(map(tuple.__new__, repeat(Node), zip(names, regs, ranks, strict=True))))

    def end(self) -> None:
        if self.at != len(self.buf):
            raise WireError(f"formation {self.what}: {len(self.buf) - self.at} bytes trail it")


def decode_offer(raw: bytes | str) -> Offer:
    r = _Reader(raw, _OFFER)
    (port,) = r.take(_OFFER_HEAD)
    fingerprint = r.text()
    token = r.text()
    layout = r.layout()
    r.end()
    return Offer(fingerprint, port, token, layout)


def decode_claim(raw: bytes | str, layouts: dict[bytes, Layout] | None = None) -> RankInfo:
    """``layouts``: layouts already decoded in this batch of claims, by their bytes (every
    rank that holds the same group sends the same layout)."""
    r = _Reader(raw, _CLAIM)
    group = r.text()
    step, flags = r.take(_CLAIM_MID)
    applied_in = r.text()
    pending_in = r.text()
    layout = None
    if flags & _HAS_LAYOUT:
        tail = r.buf[r.at :]
        layout = None if layouts is None else layouts.get(tail)
        if layout is None:
            layout = r.layout()
            if layouts is not None:
                layouts[tail] = layout
        else:
            r.at = len(r.buf)
    r.end()
    return RankInfo(group, layout, step, bool(flags & _HAS_STATE), applied_in, pending_in)


def decode_claims(raws: list[bytes]) -> list[RankInfo]:
    """Every claim of a formation, as the leader reads them (one ``multi_get``)."""
    layouts: dict[bytes, Layout] = {}
    return [decode_claim(raw, layouts) for raw in raws]


def decode_plan(raw: bytes | str) -> Plan:
    r = _Reader(raw, _PLAN)
    action, restore, step, source = r.take(_PLAN_HEAD)
    if action >= len(ACTIONS) or restore >= len(RESTORES):
        raise WireError(f"formation plan: unknown action {action} or restore {restore}")
    lists = []
    for _ in range(4):
        (n,) = r.take(_U32)
        lists.append(r.ints("I", n))
    r.end()
    exclude, providers, receivers, roll_forward = lists
    return Plan(
        ACTIONS[action],
        exclude,
        step,
        RESTORES[restore],
        source,
        providers=providers,
        receivers=receivers,
        roll_forward=roll_forward,
    )
