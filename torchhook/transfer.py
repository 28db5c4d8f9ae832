"""Training state over a process group as tensors, never a pickle.

The format (``torchhook.state_codec``): a small msgpack record of the state's structure,
scalars, tensor dtypes and shapes, plus one flat buffer per dtype holding the tensors'
elements in walk order. :func:`broadcast` sends it from one source rank:

- with ``dist.broadcast``: a header (version, metadata length), the metadata as a uint8
  tensor, then the flat buffers, reinterpreted as bytes (a broadcast does no
  arithmetic, so any dtype travels, bool and bfloat16 included, on gloo and NCCL alike);
- each flat buffer goes in *segments*, in order, so the bytes on the wire are exactly
  the buffer: a tensor of ``DIRECT_BYTES`` or more is its own segment, sent straight from
  the source's tensor and received straight into the receiver's (the tensor given in
  ``into``, else a new one), with no copy on either side; runs of smaller tensors are
  coalesced into one staging segment of at most ``STAGING_BYTES``. A plain
  "concatenate, broadcast, split" costs a copy of the whole state on each side, which
  measured slower than the broadcast itself (BENCHMARKS.md, "State transfer");
- every collective is issued with ``async_op=True`` and handed to ``wait``: the elastic
  engine passes its verdict-aware wait, which ends a transfer whose group lost a member
  within one wait slice;
- receivers validate before they allocate or write: the header, the metadata (every
  bound of ``state_codec``) and the tensors given in ``into`` (shape and dtype) are
  checked before the first buffer byte moves. One small all-reduce then tells every rank
  whether anyone refused; if so, every rank raises :class:`TransferError` and the group
  stays in step (no rank waits for bytes that never come). A source that cannot pack its
  state sends a header of length 0, to the same effect. A transfer cut short (a verdict,
  a dead peer) leaves ``into`` partly written: a receiver only receives because what it
  holds is stale or absent, and the group that failed is abandoned anyway.

DTensors (FSDP2, HSDP): the caller passes local shards. :func:`local_state` and
:func:`optimizer_state` replace every DTensor by its ``to_local()`` (sharing storage, so
they can serve as ``into``); :func:`load_optimizer` loads with ``load_state_dict`` and
puts state shaped like a DTensor parameter's shard back onto its mesh. torch's
``broadcast_object_list`` pickles instead: a copy of everything into one byte string on
each side, and code from the wire run on load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchhook.state_codec import (
    MAX_DEPTH,
    MAX_METADATA_BYTES,
    MAX_STATE_BYTES,
    MAX_TENSORS,
    METADATA_VERSION,
    Packed,
    Record,
    TransferError,
    build,
    decode,
    encode,
    pack,
    targets,
    unpack,
)

__all__ = [
    "DIRECT_BYTES",
    "MAX_DEPTH",
    "MAX_METADATA_BYTES",
    "MAX_STATE_BYTES",
    "MAX_TENSORS",
    "STAGING_BYTES",
    "Packed",
    "TransferError",
    "Wait",
    "broadcast",
    "load_optimizer",
    "local_state",
    "optimizer_state",
    "pack",
    "unpack",
]

DIRECT_BYTES = 1 << 20
"""Tensors this large travel as their own broadcast, without a copy: a broadcast's fixed
cost (tens of microseconds) is then under 1 % of its time at gloo's GB/s rates, and the
~1,000 large tensors of a big model stay far under ``MAX_TENSORS`` broadcasts."""
STAGING_BYTES = 64 << 20
"""At most this much of small tensors is copied into one staging segment: bounds the
extra memory of a state made of many small tensors (biases, norms, step counters)."""

Wait = Callable[[dist.Work], None]


def broadcast(
    state: Any,
    src: int,
    *,
    group: dist.ProcessGroup | None = None,
    into: Any = None,
    device: torch.device | str | None = None,
    wait: Wait | None = None,
    max_bytes: int = MAX_STATE_BYTES,
) -> Any:
    """Collective: every rank of ``group`` calls it; ``src`` (a global rank, as in
    ``dist.broadcast``) passes ``state``, the others anything (ignored). Returns the
    state on every rank: the source's own ``state`` object, or on a receiver the
    received copy, with ``into``'s tensors filled in place and new tensors elsewhere.
    ``device`` is where the bytes travel: ``cuda:<local_rank>`` for NCCL, CPU (the
    default) for gloo. ``wait`` waits for one collective (default ``Work.wait``).
    Raises :class:`TransferError` on every rank when the source cannot pack its state
    or a receiver refuses the metadata or ``into`` (the group stays usable), and on a
    receiver that refuses the header (the group is then out of step, as after any failed
    collective, and is to be abandoned)."""
    where = torch.device(device) if device is not None else torch.device("cpu")
    waiter: Wait = wait if wait is not None else _plain_wait
    source = dist.get_rank() == src
    encoded, failure = None, None
    if source:
        try:
            encoded = encode(state)
        except TransferError as exc:
            failure = exc  # told to the receivers (length 0), so they do not wait for it
    header = torch.zeros(2, dtype=torch.int64, device=where)
    if source:
        header[0], header[1] = METADATA_VERSION, len(encoded[0]) if encoded else 0
    waiter(dist.broadcast(header, src, group=group, async_op=True))
    if failure is not None:
        raise failure
    version, length = (int(v) for v in header.tolist())
    if version == METADATA_VERSION and length == 0:
        raise TransferError(f"transfer: rank {src} could not pack its state")
    if version != METADATA_VERSION or not 0 < length <= MAX_METADATA_BYTES:
        raise TransferError(f"transfer: header {version}/{length} refused")
    if encoded is not None:
        meta = torch.frombuffer(bytearray(encoded[0]), dtype=torch.uint8).to(where)
    else:
        meta = torch.empty(length, dtype=torch.uint8, device=where)
    waiter(dist.broadcast(meta, src, group=group, async_op=True))
    refusal: TransferError | None = None
    if encoded is None:
        try:  # refuses before anything is received or written
            record = decode(bytes(meta.cpu().numpy()), max_bytes)
            found = targets(record, into)
        except TransferError as exc:
            refusal = exc
    # every rank learns of a refusal before any bytes move, so the group stays in step
    refused = torch.tensor([0 if refusal is None else 1], dtype=torch.int32, device=where)
    waiter(dist.all_reduce(refused, op=dist.ReduceOp.MAX, group=group, async_op=True))
    if refusal is not None:
        raise refusal
    if refused.item():
        raise TransferError("transfer: a receiver refused the state (its own error says why)")
    if encoded is not None:
        _, record, tensors = encoded
        _send(record, tensors, src, group, where, waiter)
        return state
    return build(record, _receive(record, found, src, group, where, waiter))


def _segments(record: Record) -> list[list[int]]:
    """The tensors (walk-order indices) of each segment, in wire order: per dtype in the
    record's order, a large tensor alone, runs of small ones together."""
    out: list[list[int]] = []
    for dtype in record.dtypes:
        run: list[int] = []
        run_bytes = 0
        for i, (d, shape) in enumerate(record.tensors):
            if d != dtype:
                continue
            size = _numel(shape) * dtype.itemsize
            if size >= DIRECT_BYTES or run_bytes + size > STAGING_BYTES:
                if run:
                    out.append(run)
                run, run_bytes = [], 0
            if size >= DIRECT_BYTES:
                out.append([i])
            else:
                run.append(i)
                run_bytes += size
        if run:
            out.append(run)
    return out


def _send(
    record: Record,
    tensors: list[torch.Tensor],
    src: int,
    group: dist.ProcessGroup | None,
    where: torch.device,
    waiter: Wait,
) -> None:
    works = []
    keep = []  # staging and converted tensors must outlive their broadcast
    for segment in _segments(record):
        parts = [tensors[i].detach().reshape(-1).to(where) for i in segment]
        flat = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
        keep.append(flat)
        if flat.numel():
            works.append(dist.broadcast(_as_bytes(flat), src, group=group, async_op=True))
    for work in works:
        waiter(work)


def _receive(
    record: Record,
    found: list[torch.Tensor | None],
    src: int,
    group: dist.ProcessGroup | None,
    where: torch.device,
    waiter: Wait,
) -> list[torch.Tensor]:
    """Received tensors in walk order: ``found``'s where given, new ones elsewhere."""
    out: list[torch.Tensor] = [
        t if t is not None else torch.empty(shape, dtype=dtype, device=where)
        for t, (dtype, shape) in zip(found, record.tensors, strict=True)
    ]
    works = []
    copies: list[tuple[torch.Tensor, list[int]]] = []
    for segment in _segments(record):
        first = out[segment[0]]
        if len(segment) == 1 and first.is_contiguous() and first.device == where:
            flat = first.detach().view(-1)  # straight into the tensor
        else:
            dtype = record.tensors[segment[0]][0]
            flat = torch.empty(sum(out[i].numel() for i in segment), dtype=dtype, device=where)
            copies.append((flat, segment))
        if flat.numel():
            works.append(dist.broadcast(_as_bytes(flat), src, group=group, async_op=True))
    for work in works:
        waiter(work)
    with torch.no_grad():
        for flat, segment in copies:
            offset = 0
            for i in segment:
                n = out[i].numel()
                out[i].copy_(flat[offset : offset + n].view_as(out[i]))
                offset += n
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _as_bytes(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _plain_wait(work: dist.Work) -> None:
    work.wait()


# --- model and optimizer state, DTensor-aware ----------------------------------------


def local_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every DTensor replaced by its local shard: the
    tensors share storage with the module's, so as ``into`` they are filled in place."""
    return {k: _local(v) for k, v in module.state_dict().items()}


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every DTensor replaced by its local shard."""
    sd = optimizer.state_dict()
    state = {
        pid: {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
        for pid, st in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def load_optimizer(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``; then, for a DTensor parameter, its state
    shaped like the parameter's local shard (Adam's moments) becomes a DTensor on the
    parameter's mesh and placements again (load_state_dict leaves plain tensors)."""
    optimizer.load_state_dict(dict(state))
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor) or p not in optimizer.state:
                continue
            shape = p.to_local().shape
            optimizer.state[p] = {
                k: _wrap(p, v) if _is_shard_of(v, shape) else v
                for k, v in optimizer.state[p].items()
            }


def _is_shard_of(v: Any, shape: torch.Size) -> bool:
    plain = isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
    return plain and v.dim() > 0 and v.shape == shape


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _wrap(p: DTensor, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
