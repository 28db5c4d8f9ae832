"""Per-message encoders and decoders generated from the field tables (``swim.wire.fields``).

Rules: a generated function computes exactly what the generic ``encode_fields`` /
``decode_fields`` loop computes for its table, in the same order, with the same checks
and the same fallback (``decode_value``) for anything but a well-formed value; only the
interpretation of the table moves from run time to import time. The table stays the one
source of truth: the functions are built from it, and tests/swim/test_wire_compiled.py
compares them with the generic loop on valid, odd and hostile input.

Why: a lone ping or ack costs two table walks (attribute loads per field, a dict of
values, a keyword call), which were a fifth of the time a 10,000-node simulation spent
decoding and encoding. ``dataclasses`` builds ``__init__`` the same way (``exec`` of
generated source).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields as dataclass_fields
from typing import Any

from swim.wire.errors import DropReason, WireError
from swim.wire.fields import UNSIGNED_MAX, Field, decode_value, encoding_plan, pack

_STR_ERRORS = '"utf-8", "surrogateescape"'


def compile_encoder(table: Sequence[Field]) -> Callable[[Any], bytes]:
    """``lambda msg: encode_fields(table, msg.__getattribute__)``, without the walk."""
    lines = ["def encode(msg):", "    out = {}"]
    for go, attr, is_str, omitempty, nil_if_empty in encoding_plan(table):
        lines.append(f"    v = msg.{attr}")
        if is_str:
            lines.append(f"    v = v.encode({_STR_ERRORS})")
        if omitempty:
            lines.append(f"    if v: out[{go!r}] = v")
            continue
        if nil_if_empty:
            lines.append("    if not v: v = None")
        lines.append(f"    out[{go!r}] = v")
    lines.append("    return pack(out)")
    return _build(lines, "encode", {"pack": pack})


def compile_decoder(table: Sequence[Field], cls: Callable[..., Any]) -> Callable[[Any], Any]:
    """``lambda obj: cls(**decode_fields(table, obj))``, without the walk; ``cls`` is
    called positionally when the table names every field of its ``__init__`` (a
    dataclass), by keyword otherwise."""
    env: dict[str, Any] = {
        "cls": cls,
        "WireError": WireError,
        "MALFORMED": DropReason.MALFORMED,
        "decode_value": decode_value,
    }
    lines = [
        "def decode(obj):",
        "    if not isinstance(obj, dict):",
        '        raise WireError(MALFORMED, "message body is not a map")',
        "    get = obj.get",
    ]
    for i, field in enumerate(table):
        env[f"F{i}"] = field
        lines.append(f"    v = get({field.key!r})")
        # the generic loop's fast paths, then its careful way (``decode_value``)
        if field.kind == "str":
            lines.append(f"    a{i} = v.decode({_STR_ERRORS}) if type(v) is bytes else None")
            lines.append(f"    if a{i} is None: a{i} = decode_value(F{i}, v)")
        elif field.kind == "bytes":
            lines.append(f"    a{i} = v if type(v) is bytes else decode_value(F{i}, v)")
        elif field.kind in UNSIGNED_MAX:
            high = UNSIGNED_MAX[field.kind]
            lines.append(
                f"    a{i} = v if type(v) is int and 0 <= v <= {high} else decode_value(F{i}, v)"
            )
        else:
            lines.append(f"    a{i} = decode_value(F{i}, v)")
    lines.append(f"    return cls({_arguments(table, cls)})")
    return _build(lines, "decode", env)


def _arguments(table: Sequence[Field], cls: Callable[..., Any]) -> str:
    by_attr = {field.attr: i for i, field in enumerate(table)}
    try:
        params = [f.name for f in dataclass_fields(cls)]  # type: ignore[arg-type]
    except TypeError:
        params = []
    if params and sorted(params) == sorted(by_attr) and len(by_attr) == len(table):
        return ", ".join(f"a{by_attr[name]}" for name in params)
    return ", ".join(f"{field.attr}=a{i}" for i, field in enumerate(table))


def _build(lines: list[str], name: str, env: dict[str, Any]) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), env, namespace)
    function: Callable[..., Any] = namespace[name]
    return function
