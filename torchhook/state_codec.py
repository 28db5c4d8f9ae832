"""Training state as a small metadata record plus flat tensors: the format, pure (no
process group). ``torchhook.transfer`` sends it over a group.

A *state* is a nested structure of dicts (str or int keys), lists and tuples whose leaves
are tensors or plain scalars (``None``, bool, int, float, str): a module's
``state_dict()``, an optimizer's ``state_dict()`` (per-parameter dicts of tensors and
scalars, ``param_groups`` with their hyperparameters), a step counter, or a dict of those.
DTensors are refused: pass their local shards (``transfer.local_state``).

Rules:

- :func:`encode` walks the state depth-first; each tensor becomes a record (its dtype and
  shape) and its elements belong, in walk order, to the one flat buffer of its dtype
  (:func:`pack` builds those buffers). The tree and the records are encoded with msgpack
  (``METADATA_VERSION``); containers are tagged, so tuples stay tuples and int keys stay
  ints: an unpacked ``optimizer.state_dict()`` compares equal to the original.
- :func:`decode` validates before anything is allocated: the record's size, its
  decoding, every bound below, that the shapes add up to the buffer sizes, and that the
  tree uses each tensor exactly once; anything else is a :class:`TransferError`.
  :func:`targets` checks the tensors given in ``into`` (a structure like the state, e.g.
  ``model.state_dict()``) against the record before any of them is written.

Bounds (docs/design.md §8.3): metadata ``MAX_METADATA_BYTES``, tensors ``MAX_TENSORS``,
nesting ``MAX_DEPTH``, a receiver's new allocation ``max_bytes`` (default
``MAX_STATE_BYTES``); each constant's comment says why. torch.distributed.checkpoint's
planner makes the same split of small metadata and bulk tensor bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "MAX_DEPTH",
    "MAX_METADATA_BYTES",
    "MAX_STATE_BYTES",
    "MAX_TENSORS",
    "METADATA_VERSION",
    "Packed",
    "Record",
    "TransferError",
    "build",
    "decode",
    "encode",
    "pack",
    "targets",
    "unpack",
]

METADATA_VERSION = 1
MAX_METADATA_BYTES = 16 * 1024 * 1024
"""A tensor's record is ~20 bytes, a parameter's Adam state ~100: 16 MiB holds the
records of ``MAX_TENSORS`` with room for long parameter names, and a corrupted length
cannot make a receiver allocate more."""
MAX_TENSORS = 200_000
"""A 70B-parameter transformer has ~1,000 parameter tensors, ~3,000 with Adam's moments
and step counters; 200,000 is 60 times that and keeps the walk and the records small."""
MAX_DEPTH = 32
"""An optimizer state dict nests 4 deep; a bound keeps a hostile record from exhausting
the stack of the recursive walk."""
MAX_STATE_BYTES = 256 * 1024**3
"""Default bound on what a receiver allocates for one state: more than one accelerator's
memory (141 GB on an H200), which is where one rank's shard and optimizer state live;
a corrupted record cannot ask for more. Raise it with ``max_bytes``."""

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}
_SCALARS = (type(None), bool, int, float, str)
_DICT, _LIST, _TUPLE, _TENSOR = "d", "l", "u", "t"


class TransferError(ValueError):
    """A state that cannot be packed (a leaf of another type, a bound passed), metadata
    that does not decode or passes a bound, or received tensors that do not match the
    tensors they are to fill. Nothing the receiver holds is changed when it is raised."""


@dataclass(frozen=True)
class Packed:
    """A packed state: the metadata record and one flat buffer per dtype, in the order of
    the record's dtype list."""

    metadata: bytes
    buffers: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Record:
    """A decoded (or freshly encoded) metadata record: the tree, each tensor's dtype and
    shape in walk order, and the dtypes with their buffer sizes in elements."""

    tree: Any
    tensors: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    dtypes: tuple[torch.dtype, ...]
    numels: tuple[int, ...]


# --- packing --------------------------------------------------------------------------


def encode(state: Any) -> tuple[bytes, Record, list[torch.Tensor]]:
    """The metadata of ``state``, its record and its tensors in walk order (not copied)."""
    tensors: list[torch.Tensor] = []
    tree = _encode(state, tensors, 0)
    dtypes = tuple(dict.fromkeys(t.dtype for t in tensors))
    for dtype in dtypes:
        if dtype not in _DTYPES.values():
            raise TransferError(f"transfer: dtype {dtype} is not supported")
    numels = tuple(sum(t.numel() for t in tensors if t.dtype == d) for d in dtypes)
    index = {d: i for i, d in enumerate(dtypes)}
    raw = {
        "v": METADATA_VERSION,
        "tree": tree,
        "tensors": [[index[t.dtype], list(t.shape)] for t in tensors],
        "dtypes": [_name(d) for d in dtypes],
        "numels": list(numels),
    }
    metadata = msgpack.packb(raw, use_bin_type=True)
    if len(metadata) > MAX_METADATA_BYTES:
        raise TransferError(
            f"transfer: metadata of {len(metadata)} bytes passes MAX_METADATA_BYTES "
            f"({MAX_METADATA_BYTES})"
        )
    specs = tuple((t.dtype, tuple(t.shape)) for t in tensors)
    return metadata, Record(tree, specs, dtypes, numels), tensors


def pack(state: Any, *, device: torch.device | str | None = None) -> Packed:
    """Metadata and flat buffers of ``state`` (on ``device``; default: the first tensor's
    device, else CPU). The buffers are copies: ``state`` may change afterwards."""
    metadata, record, tensors = encode(state)
    where = torch.device(device) if device is not None else _first_device(tensors)
    buffers = tuple(
        torch.cat([t.detach().reshape(-1).to(where) for t in tensors if t.dtype == d])
        for d in record.dtypes
    )
    return Packed(metadata, buffers)


def _encode(value: Any, tensors: list[torch.Tensor], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise TransferError(f"transfer: state nests deeper than MAX_DEPTH ({MAX_DEPTH})")
    if isinstance(value, torch.Tensor):
        if isinstance(value, DTensor):
            raise TransferError("transfer: pass a DTensor's local shard (local_state)")
        if len(tensors) >= MAX_TENSORS:
            raise TransferError(f"transfer: more than MAX_TENSORS ({MAX_TENSORS}) tensors")
        tensors.append(value)
        return [_TENSOR, len(tensors) - 1]
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, Mapping):
        items: list[Any] = []
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TransferError(f"transfer: key {key!r} is neither str nor int")
            items += [key, _encode(item, tensors, depth + 1)]
        return [_DICT, items]
    if isinstance(value, (list, tuple)):
        tag = _TUPLE if isinstance(value, tuple) else _LIST
        return [tag, [_encode(item, tensors, depth + 1) for item in value]]
    raise TransferError(f"transfer: cannot send a {type(value).__name__}")


def _first_device(tensors: list[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- unpacking ------------------------------------------------------------------------


def unpack(packed: Packed, into: Any = None, *, max_bytes: int = MAX_STATE_BYTES) -> Any:
    """The state ``packed`` holds. Tensors at the same place in ``into`` are filled in
    place (and returned); the others are views into ``packed.buffers``."""
    record = decode(packed.metadata, max_bytes)
    _check_buffers(record, packed.buffers)
    views = _views(record, packed.buffers)
    found = targets(record, into)
    with torch.no_grad():
        for i, target in enumerate(found):
            if target is not None:
                views[i] = target.copy_(views[i])
    return build(record, views)


def targets(record: Record, into: Any) -> list[torch.Tensor | None]:
    """Per tensor of ``record``, the tensor at the same place in ``into`` (None if there
    is none); raises if one of them has another shape or dtype."""
    found: list[torch.Tensor | None] = [None] * len(record.tensors)
    _match(record.tree, into, found)
    for (dtype, shape), target in zip(record.tensors, found, strict=True):
        if target is not None and (target.dtype, tuple(target.shape)) != (dtype, shape):
            raise TransferError(
                f"transfer: received {dtype} {shape} for a tensor of {target.dtype} "
                f"{tuple(target.shape)}"
            )
    return found


def build(record: Record, tensors: list[torch.Tensor]) -> Any:
    """The state: ``record``'s tree with its tensors (in walk order) in place."""
    return _build(record.tree, tensors)


def decode(metadata: bytes, max_bytes: int = MAX_STATE_BYTES) -> Record:
    """The validated record of ``metadata``; a receiver allocates at most ``max_bytes``."""
    if len(metadata) > MAX_METADATA_BYTES:
        raise TransferError(f"transfer: metadata of {len(metadata)} bytes is too large")
    try:
        raw = msgpack.unpackb(metadata, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise TransferError(f"transfer: metadata does not decode: {exc}") from None
    if not isinstance(raw, dict) or raw.get("v") != METADATA_VERSION:
        version = raw.get("v") if isinstance(raw, dict) else None
        raise TransferError(f"transfer: metadata version {version!r}, want {METADATA_VERSION}")
    names, numels, specs = raw.get("dtypes"), raw.get("numels"), raw.get("tensors")
    if not (isinstance(names, list) and isinstance(numels, list) and isinstance(specs, list)):
        raise TransferError("transfer: metadata lacks dtypes, numels or tensors")
    if len(specs) > MAX_TENSORS or len(names) != len(numels) or len(names) > len(_DTYPES):
        raise TransferError("transfer: metadata counts are out of bounds or inconsistent")
    if any(n not in _DTYPES for n in names) or len(set(names)) != len(names):
        raise TransferError(f"transfer: unknown or repeated dtypes {names!r}")
    dtypes = tuple(_DTYPES[n] for n in names)
    tensors = tuple(_spec(s, len(dtypes)) for s in specs)
    sums = [0] * len(dtypes)
    for index, shape in tensors:
        sums[index] += math.prod(shape)
    if sums != numels:
        raise TransferError(f"transfer: buffer sizes {numels} do not match the shapes {sums}")
    total = sum(n * d.itemsize for n, d in zip(numels, dtypes, strict=True))
    if total > max_bytes:
        raise TransferError(f"transfer: state of {total} bytes passes max_bytes ({max_bytes})")
    seen = [False] * len(tensors)
    _check_tree(raw.get("tree"), seen, 0)
    if not all(seen):
        raise TransferError("transfer: metadata lists tensors its tree never uses")
    return Record(
        raw["tree"], tuple((dtypes[i], shape) for i, shape in tensors), dtypes, tuple(numels)
    )


def _spec(spec: Any, dtypes: int) -> tuple[int, tuple[int, ...]]:
    ok = isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], list)
    ok = ok and _is_int(spec[0]) and 0 <= spec[0] < dtypes and len(spec[1]) <= MAX_DEPTH
    if ok and all(_is_int(n) and 0 <= n < 2**62 for n in spec[1]):
        return spec[0], tuple(spec[1])
    raise TransferError(f"transfer: bad tensor record {spec!r}"[:200])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_tree(node: Any, seen: list[bool], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TransferError(f"transfer: metadata nests deeper than MAX_DEPTH ({MAX_DEPTH})")
    if isinstance(node, _SCALARS):
        return
    if not (isinstance(node, list) and len(node) == 2):
        raise TransferError(f"transfer: bad node in metadata: {node!r}"[:200])
    tag, body = node
    if tag == _TENSOR:
        if not (_is_int(body) and 0 <= body < len(seen)) or seen[body]:
            raise TransferError(f"transfer: bad or repeated tensor reference {body!r}")
        seen[body] = True
        return
    if tag not in (_DICT, _LIST, _TUPLE) or not isinstance(body, list):
        raise TransferError(f"transfer: bad node in metadata: {node!r}"[:200])
    if tag == _DICT:
        if len(body) % 2 or not all(isinstance(k, (str, int)) for k in body[::2]):
            raise TransferError("transfer: bad dict in metadata")
        body = body[1::2]
    for child in body:
        _check_tree(child, seen, depth + 1)


def _check_buffers(record: Record, buffers: tuple[torch.Tensor, ...]) -> None:
    got = [(b.dtype, b.numel()) for b in buffers]
    want = list(zip(record.dtypes, record.numels, strict=True))
    if got != want:
        raise TransferError(f"transfer: buffers {got} do not match the metadata {want}")


def _views(record: Record, buffers: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    offsets = [0] * len(buffers)
    index = {d: i for i, d in enumerate(record.dtypes)}
    views = []
    for dtype, shape in record.tensors:
        b = index[dtype]
        n = math.prod(shape)
        views.append(buffers[b][offsets[b] : offsets[b] + n].view(shape))
        offsets[b] += n
    return views


def _match(node: Any, into: Any, targets: list[torch.Tensor | None]) -> None:
    """Which tensor of ``into`` receives each received tensor; checks shapes and dtypes."""
    if into is None or not isinstance(node, list):
        return
    tag, body = node
    if tag == _TENSOR:
        if not isinstance(into, torch.Tensor):
            return
        targets[body] = into  # shape and dtype checked by targets()
        return
    if tag == _DICT and isinstance(into, Mapping):
        for key, child in zip(body[::2], body[1::2], strict=True):
            if key in into:
                _match(child, into[key], targets)
    elif tag in (_LIST, _TUPLE) and isinstance(into, (list, tuple)):
        for child, target in zip(body, into, strict=False):
            _match(child, target, targets)


def _build(node: Any, views: list[torch.Tensor]) -> Any:
    if not isinstance(node, list):
        return node
    tag, body = node
    if tag == _TENSOR:
        return views[body]
    if tag == _DICT:
        return {k: _build(v, views) for k, v in zip(body[::2], body[1::2], strict=True)}
    items = [_build(child, views) for child in body]
    return tuple(items) if tag == _TUPLE else items
