"""LZW codec byte-compatible with Go's ``compress/lzw`` (order LSB, literal width 8).

memberlist compresses packets and push/pull state with
``lzw.NewWriter(&buf, lzw.LSB, lzwLitWidth)`` where ``lzwLitWidth = 8`` (memberlist
``util.go``: ``compressPayload`` / ``decompressBuffer``). This module reimplements
the Go standard library's ``src/compress/lzw/writer.go`` (``Writer.Write``,
``Writer.incHi``, ``Writer.Close``, ``Writer.writeLSB``) and ``reader.go``
(``Reader.decode``, ``Reader.readLSB``) for exactly that configuration.

Format rules (GIF flavour of LZW):

* Codes 0..255 are literals, 256 is CLEAR, 257 is EOF; codes 258.. are table entries.
* Codes start 9 bits wide and are packed least-significant-bit first. The width grows
  by one bit when the next code to be assigned reaches ``1 << width``; 12 bits is the
  maximum.
* The writer emits a CLEAR code first (Go 1.19 and the current Go tree do; older
  releases did not, and their streams decode here too), and emits CLEAR again, at the current
  width, as soon as the next table entry would be 4095. So the writer never assigns
  code 4095, but the reader accepts it (and a full table with no CLEAR, a "deferred
  clear"), as Go's reader does.
* ``Close`` writes the pending code (which may itself trigger a CLEAR), then EOF,
  then any partial final byte.

``compress`` reproduces Go's output byte for byte: memberlist-compatible agents
re-encode packets and compare them to captures from real Serf agents. Go keeps its
dictionary in a custom hash table; the bytes on the wire depend only on the LZW
dictionary contents, so a Python ``dict`` gives identical output.

``decompress`` follows Go's reader: bytes after the EOF code are ignored; a stream
that ends before its EOF code is an error (Go returns ``io.ErrUnexpectedEOF``, which
memberlist's ``io.CopyN`` treats as a failure); a code above the next assignable code
is an error ("lzw: invalid code"). memberlist bounds output with
``maxDecompressedBytes`` (net.go); here the bound is the caller's argument, and it is
checked before each decoded code is appended, so a hostile stream cannot make us
allocate past it. All failures raise ``LZWError`` (a ``ValueError``).

Pure stdlib, no I/O.
"""

from __future__ import annotations

__all__ = ["BytesLike", "LZWError", "LZWOutputLimitError", "compress", "decompress"]

# Packets are often sliced out of larger receive buffers; accept them without a copy.
BytesLike = bytes | bytearray | memoryview

_LIT_WIDTH = 8
_CLEAR = 1 << _LIT_WIDTH
_EOF = _CLEAR + 1
_START_WIDTH = _LIT_WIDTH + 1
_MAX_WIDTH = 12
# Go's writer.go maxCode: the writer resets (CLEAR) when hi reaches it.
_WRITER_MAX_CODE = (1 << _MAX_WIDTH) - 1


_INITIAL_TABLE: list[bytes] = [bytes((i,)) for i in range(_CLEAR)] + [b""] * (
    (1 << _MAX_WIDTH) - _CLEAR
)
"""Literal codes expand to themselves; the rest are filled in as codes are defined."""


class LZWError(ValueError):
    """The compressed stream is corrupt, truncated or otherwise undecodable."""


class LZWOutputLimitError(LZWError):
    """Decompressing would produce more than the caller's output bound."""


def compress(data: BytesLike) -> bytes:
    """Compress ``data`` exactly as Go's ``lzw.NewWriter(w, lzw.LSB, 8)`` + Write + Close.

    The result is byte-identical to Go's (a single ``Write`` followed by ``Close``;
    Go's output does not depend on how the input is split across ``Write`` calls).
    """
    out = bytearray()
    bits = 0
    n_bits = 0
    width = _START_WIDTH
    hi = _EOF
    overflow = 1 << _START_WIDTH

    # The GIF spec asks encoders to start with CLEAR; Go does so unconditionally, even
    # for empty input (Close writes it when Write never ran).
    bits |= _CLEAR << n_bits
    n_bits += width
    while n_bits >= 8:
        out.append(bits & 0xFF)
        bits >>= 8
        n_bits -= 8

    if data:
        table: dict[int, int] = {}
        table_get = table.get
        code = data[0]
        for x in memoryview(data)[1:]:
            key = (code << 8) | x
            nxt = table_get(key)
            if nxt is not None:
                code = nxt
                continue
            bits |= code << n_bits
            n_bits += width
            while n_bits >= 8:
                out.append(bits & 0xFF)
                bits >>= 8
                n_bits -= 8
            code = x
            # Go's incHi: the width grows before the out-of-codes check, so the CLEAR
            # that follows is written at 12 bits.
            hi += 1
            if hi == overflow:
                width += 1
                overflow <<= 1
            if hi == _WRITER_MAX_CODE:
                bits |= _CLEAR << n_bits
                n_bits += width
                while n_bits >= 8:
                    out.append(bits & 0xFF)
                    bits >>= 8
                    n_bits -= 8
                width = _START_WIDTH
                hi = _EOF
                overflow = 1 << _START_WIDTH
                table.clear()
                continue
            table[key] = hi

        # Close: flush the pending code; its incHi can still grow the width or force a
        # CLEAR, which changes how the EOF code below is packed.
        bits |= code << n_bits
        n_bits += width
        while n_bits >= 8:
            out.append(bits & 0xFF)
            bits >>= 8
            n_bits -= 8
        hi += 1
        if hi == overflow:
            width += 1
            overflow <<= 1
        if hi == _WRITER_MAX_CODE:
            bits |= _CLEAR << n_bits
            n_bits += width
            while n_bits >= 8:
                out.append(bits & 0xFF)
                bits >>= 8
                n_bits -= 8
            width = _START_WIDTH

    bits |= _EOF << n_bits
    n_bits += width
    while n_bits >= 8:
        out.append(bits & 0xFF)
        bits >>= 8
        n_bits -= 8
    if n_bits > 0:
        out.append(bits & 0xFF)
    return bytes(out)


def decompress(data: BytesLike, max_output_bytes: int) -> bytes:
    """Decompress a Go ``compress/lzw`` (LSB, literal width 8) stream.

    Returns at most ``max_output_bytes`` bytes. Raises ``LZWOutputLimitError`` as soon
    as the output would exceed the bound (before allocating it), and ``LZWError`` for
    invalid codes or a stream that ends before its EOF code.
    """
    if max_output_bytes < 0:
        raise ValueError(f"max_output_bytes must be >= 0, got {max_output_bytes}")

    # Each entry holds the full expansion of its code. Entries in [258, hi) are always
    # rewritten after a CLEAR before they can be referenced, so stale ones are harmless.
    # Their total size is bounded by the output already produced, hence by the limit.
    table = _INITIAL_TABLE.copy()

    out = bytearray()
    size = len(data)
    pos = 0
    bits = 0
    n_bits = 0
    width = _START_WIDTH
    mask = (1 << width) - 1
    hi = _EOF
    overflow = 1 << width
    have_last = False
    prev = b""

    while True:
        while n_bits < width:
            if pos >= size:
                raise LZWError(f"lzw: unexpected end of input after {size} bytes (no EOF code)")
            bits |= data[pos] << n_bits
            pos += 1
            n_bits += 8
        code = bits & mask
        bits >>= width
        n_bits -= width

        if code < _CLEAR:
            entry = table[code]
            if have_last:
                table[hi] = prev + entry
        elif code == _CLEAR:
            width = _START_WIDTH
            mask = (1 << width) - 1
            hi = _EOF
            overflow = 1 << width
            have_last = False
            continue
        elif code == _EOF:
            return bytes(out)
        elif code <= hi:
            # The KwKwK case: the code being defined is used immediately; it expands to
            # the previous expansion plus that expansion's first byte.
            entry = prev + prev[:1] if code == hi and have_last else table[code]
            if have_last:
                table[hi] = prev + entry[:1]
        else:
            raise LZWError(f"lzw: invalid code {code} (next assignable code is {hi})")

        if len(out) + len(entry) > max_output_bytes:
            raise LZWOutputLimitError(
                f"lzw: decompressed data exceeds the limit of {max_output_bytes} bytes"
            )
        out += entry
        prev = entry
        have_last = True
        hi += 1
        if hi >= overflow:
            if width == _MAX_WIDTH:
                # Table full without a CLEAR (a "deferred clear"): like Go, keep
                # decoding with the existing table and stop assigning codes.
                have_last = False
                hi -= 1
            else:
                width += 1
                mask = (1 << width) - 1
                overflow <<= 1
