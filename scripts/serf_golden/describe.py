"""Describing a captured packet or stream: decryption with the known keys, Go's LZW,
msgpack shapes and field formats, and one summary line per message.
"""

from __future__ import annotations

import struct
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from serf_golden.config import (
    MSG_NAMES,
    NODE_STATES,
    SERF_MSG_NAMES,
)


def lzw_decompress(data: bytes) -> bytes:
    """Go's compress/lzw reader, LSB bit order, 8-bit literals (memberlist's lzwAlgo)."""
    clear, eof, max_width = 256, 257, 12
    width, hi, overflow = 9, eof, 1 << 9
    last: int | None = None
    table: dict[int, bytes] = {}
    out = bytearray()
    bits = nbits = pos = 0
    while True:
        while nbits < width:
            if pos >= len(data):
                raise ValueError("lzw: unexpected end of data")
            bits |= data[pos] << nbits
            pos += 1
            nbits += 8
        code = bits & ((1 << width) - 1)
        bits >>= width
        nbits -= width
        if code < clear:
            cur = bytes((code,))
        elif code == clear:
            width, hi, overflow, last = 9, eof, 1 << 9, None
            table.clear()
            continue
        elif code == eof:
            return bytes(out)
        elif code <= hi:
            if code == hi and last is not None:
                prev = table[last] if last > eof else bytes((last,))
                cur = prev + prev[:1]
            elif code in table:
                cur = table[code]
            else:
                raise ValueError(f"lzw: undefined code {code}")
        else:
            raise ValueError(f"lzw: invalid code {code}")
        if last is not None:
            prev = table[last] if last > eof else bytes((last,))
            table[hi] = prev + cur[:1]
        out += cur
        last, hi = code, hi + 1
        if hi >= overflow:
            if width == max_width:
                last = None
                hi -= 1
            else:
                width += 1
                overflow <<= 1


_FIXED_FORMATS: dict[int, str] = {
    0xC0: "nil",
    0xC2: "false",
    0xC3: "true",
    0xC4: "bin8",
    0xC5: "bin16",
    0xC6: "bin32",
    0xC7: "ext8",
    0xC8: "ext16",
    0xC9: "ext32",
    0xCA: "float32",
    0xCB: "float64",
    0xCC: "uint8",
    0xCD: "uint16",
    0xCE: "uint32",
    0xCF: "uint64",
    0xD0: "int8",
    0xD1: "int16",
    0xD2: "int32",
    0xD3: "int64",
    0xD4: "fixext1",
    0xD5: "fixext2",
    0xD6: "fixext4",
    0xD7: "fixext8",
    0xD8: "fixext16",
    0xD9: "str8",
    0xDA: "str16",
    0xDB: "str32",
    0xDC: "array16",
    0xDD: "array32",
    0xDE: "map16",
    0xDF: "map32",
}


def mp_format(b: int) -> str:
    if b <= 0x7F:
        return "posfixint"
    if b <= 0x8F:
        return "fixmap"
    if b <= 0x9F:
        return "fixarray"
    if b <= 0xBF:
        return "fixstr"
    if b >= 0xE0:
        return "negfixint"
    return _FIXED_FORMATS.get(b, f"0x{b:02x}")


def mp_skip(buf: bytes, pos: int) -> int:
    """Offset just past the msgpack object that starts at ``pos``."""
    b = buf[pos]
    fmt = mp_format(b)
    sizes = {
        "uint8": 1,
        "int8": 1,
        "uint16": 2,
        "int16": 2,
        "uint32": 4,
        "int32": 4,
        "float32": 4,
        "uint64": 8,
        "int64": 8,
        "float64": 8,
    }
    if fmt in ("posfixint", "negfixint", "nil", "true", "false"):
        return pos + 1
    if fmt in sizes:
        return pos + 1 + sizes[fmt]
    if fmt == "fixstr":
        return pos + 1 + (b & 0x1F)
    lenfmt = {"str8": "B", "bin8": "B", "str16": "H", "bin16": "H", "str32": "I", "bin32": "I"}
    if fmt in lenfmt:
        n: int = struct.unpack_from("!" + lenfmt[fmt], buf, pos + 1)[0]
        return pos + 1 + struct.calcsize(lenfmt[fmt]) + n
    if fmt.startswith("fixext"):
        return pos + 2 + {"1": 1, "2": 2, "4": 4, "8": 8, "16": 16}[fmt[6:]]
    if fmt in ("ext8", "ext16", "ext32"):
        lf = {"ext8": "B", "ext16": "H", "ext32": "I"}[fmt]
        n = int(struct.unpack_from("!" + lf, buf, pos + 1)[0])
        return pos + 2 + struct.calcsize(lf) + n
    if fmt in ("fixarray", "array16", "array32", "fixmap", "map16", "map32"):
        if fmt.startswith("fix"):
            n, p = b & 0x0F, pos + 1
        else:
            lf = "H" if fmt.endswith("16") else "I"
            n, p = struct.unpack_from("!" + lf, buf, pos + 1)[0], pos + 1 + struct.calcsize(lf)
        for _ in range(n * (2 if "map" in fmt else 1)):
            p = mp_skip(buf, p)
        return p
    raise ValueError(f"msgpack: unknown type byte 0x{b:02x}")


def mp_shape(buf: bytes, pos: int) -> str:
    """The msgpack format of the object at ``pos``, with element formats for arrays."""
    fmt = mp_format(buf[pos])
    if fmt in ("fixarray", "array16", "array32"):
        n = buf[pos] & 0x0F if fmt == "fixarray" else 0
        p = pos + 1 if fmt == "fixarray" else pos + (3 if fmt == "array16" else 5)
        if fmt != "fixarray":
            n = struct.unpack_from("!H" if fmt == "array16" else "!I", buf, pos + 1)[0]
        inner: set[str] = set()
        for _ in range(n):
            inner.add(mp_format(buf[p]))
            p = mp_skip(buf, p)
        return f"{fmt}[{'|'.join(sorted(inner))}]" if inner else fmt
    return fmt


def mp_map_fields(buf: bytes, pos: int) -> dict[str, str]:
    """Field name -> value format for the msgpack map at ``pos`` (Go structs are maps)."""
    fmt = mp_format(buf[pos])
    if fmt == "fixmap":
        n, p = buf[pos] & 0x0F, pos + 1
    elif fmt == "map16":
        n, p = struct.unpack_from("!H", buf, pos + 1)[0], pos + 3
    elif fmt == "map32":
        n, p = struct.unpack_from("!I", buf, pos + 1)[0], pos + 5
    else:
        return {"<top>": fmt}
    out: dict[str, str] = {}
    for _ in range(n):
        kend = mp_skip(buf, p)
        try:
            key = msgpack.unpackb(buf[p:kend], raw=True)
            kname = key.decode() if isinstance(key, bytes) else str(key)
        except Exception:
            kname = "?"
        out[kname] = f"{mp_format(buf[p])}:{mp_shape(buf, kend)}"
        p = mp_skip(buf, kend)
    return out


def unpack_one(buf: bytes) -> tuple[Any, int]:
    """First msgpack object of ``buf`` (raw=True) and the number of bytes it used."""
    unp = msgpack.Unpacker(raw=True, strict_map_key=False)
    unp.feed(buf)
    obj = unp.unpack()
    return obj, unp.tell()


def fget(obj: Any, name: str) -> Any:
    return obj.get(name.encode()) if isinstance(obj, dict) else None


@dataclass
class Decoded:
    summary: str
    key: str | None = None
    enc_version: int | None = None


class Describer:
    """Turns raw packets / streams into summaries, collecting msgpack format statistics."""

    def __init__(self, keys: dict[str, bytes]) -> None:
        self.keys = keys
        self.formats: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
        self.key_orders: dict[str, Counter[tuple[str, ...]]] = defaultdict(Counter)
        self._key: str | None = None
        self._vsn: int | None = None

    def note(self, what: str, buf: bytes, pos: int = 0) -> None:
        """Record the msgpack format of every field, and the field order, of a map."""
        try:
            fields = mp_map_fields(buf, pos)
        except (IndexError, ValueError, struct.error):
            self.formats[what]["<undecodable>"]["?"] += 1
            return
        for fname, fmt in fields.items():
            self.formats[what][fname][fmt] += 1
        self.key_orders[what][tuple(fields)] += 1

    def _decrypt(self, payload: bytes, aad: bytes) -> bytes | None:
        if len(payload) < 1 + 12 + 16 or payload[0] not in (0, 1):
            return None
        for kname, key in self.keys.items():
            try:
                plain = AESGCM(key).decrypt(payload[1:13], payload[13:], aad or None)
            except InvalidTag:
                continue
            if payload[0] == 0 and plain:  # version 0 adds PKCS#7 padding
                plain = plain[: -plain[-1]]
            self._key, self._vsn = kname, payload[0]
            return plain
        return None

    def describe(self, buf: bytes, stream: bool, encrypted: bool) -> Decoded:
        self._key = self._vsn = None
        try:
            summary = self._outer(buf, stream, encrypted)
        except Exception as exc:
            summary = f"undecodable({type(exc).__name__}: {exc})"
        return Decoded(summary, self._key, self._vsn)

    def _outer(self, buf: bytes, stream: bool, encrypted: bool) -> str:
        if not buf:
            return "empty"
        if encrypted and not stream:
            plain = self._decrypt(buf, b"")
            if plain is not None:
                return f"encrypted v{self._vsn}>{self._msg(plain, stream=False)}"
        return self._msg(buf, stream)

    def _msg(self, buf: bytes, stream: bool) -> str:
        if not buf:
            return "empty"
        t, body = buf[0], buf[1:]
        name = MSG_NAMES.get(t, f"type{t}")
        if t == 10 and stream:
            length = struct.unpack_from("!I", body)[0]
            plain = self._decrypt(body[4 : 4 + length], buf[:5])
            if plain is None:
                return "encrypted(no key)"
            rest = self._trailing(len(body) - 4 - length)
            return f"encrypted v{self._vsn}>{self._msg(plain, stream=True)}{rest}"
        if t == 12:
            crc = struct.unpack_from("!I", body)[0]
            ok = zlib.crc32(body[4:]) == crc
            return ("crc>" if ok else "crc(BAD)>") + self._msg(body[4:], stream)
        if t == 9:
            obj, used = unpack_one(body)
            self.note("compress", body)
            algo, data = fget(obj, "Algo"), fget(obj, "Buf")
            if algo != 0 or not isinstance(data, bytes):
                return f"compress(algo={algo})"
            return (
                "compress>"
                + self._msg(lzw_decompress(data), stream)
                + self._trailing(len(body) - used)
            )
        if t == 7:
            n = body[0]
            lens = struct.unpack_from(f"!{n}H", body, 1)
            p = 1 + 2 * n
            parts = []
            for ln in lens:
                if p + ln > len(body):
                    parts.append("truncated")
                    break
                parts.append(self._msg(body[p : p + ln], stream=False))
                p += ln
            return f"compound[{', '.join(parts)}]" + self._trailing(len(body) - p)
        if t == 6:
            return self._push_pull(body)
        if t == 8:
            if stream:
                _hdr, used = unpack_one(body)
                self.note("userMsgHeader", body)
                return "user>" + self._serf(body[used:])
            return f"user({self._serf(body)})"
        obj, used = unpack_one(body)
        self.note(name, body)
        label = name
        if t == 5 and fget(obj, "From") == fget(obj, "Node"):
            label = "dead(left)"
        elif t == 1 and fget(obj, "Nack"):
            label = "indirectPing(nack)"
        elif t == 2 and fget(obj, "Payload"):
            label = "ack(payload)"
        if t in (4, 6):
            meta = fget(obj, "Meta")
            if isinstance(meta, bytes) and meta[:1] == b"\xff":
                self.note("serf:tags", meta, 1)
        return label + self._trailing(len(body) - used)

    @staticmethod
    def _trailing(n: int) -> str:
        return f"+trailing({n})" if n > 0 else ""

    def _push_pull(self, body: bytes) -> str:
        hdr, p = unpack_one(body)
        self.note("pushPullHeader", body)
        nodes = fget(hdr, "Nodes") or 0
        states: set[str] = set()
        for _ in range(nodes):
            self.note("pushNodeState", body, p)
            node, used = unpack_one(body[p:])
            meta = fget(node, "Meta")
            if isinstance(meta, bytes) and meta[:1] == b"\xff":
                self.note("serf:tags", meta, 1)
            states.add(NODE_STATES.get(fget(node, "State"), str(fget(node, "State"))))
            p += used
        ulen = fget(hdr, "UserStateLen") or 0
        user = body[p : p + ulen]
        join = "true" if fget(hdr, "Join") else "false"
        desc = f"pushPull(join={join},nodes={nodes},states={'+'.join(sorted(states))})"
        if user:
            desc += f"+state({self._serf(user)})"
        return desc + self._trailing(len(body) - p - ulen)

    def _serf(self, buf: bytes) -> str:
        if not buf:
            return "empty"
        t = buf[0]
        name = SERF_MSG_NAMES.get(t, f"type{t}")
        if t == 9:  # relay: header then the relayed message
            _hdr, used = unpack_one(buf[1:])
            self.note("serf:relay", buf, 1)
            return f"serf:relay>{self._serf(buf[1 + used :])}"
        obj, used = unpack_one(buf[1:])
        self.note(f"serf:{name}", buf, 1)
        label = f"serf:{name}"
        if t == 4:
            qname = fget(obj, "Name")
            if isinstance(qname, bytes) and qname.startswith(b"_serf_"):
                label += f":{qname.decode(errors='replace')}"
        elif t == 5 and isinstance(fget(obj, "Flags"), int) and fget(obj, "Flags") & 1:
            label += "(ack)"
        return label + self._trailing(len(buf) - 1 - used)
