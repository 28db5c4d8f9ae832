"""The training state on the wire: a ``torchhook.state`` snapshot as bytes, and its
broadcast from one rank to a process group.

Encoding: ``torch.save`` into memory, read back with ``torch.load(weights_only=True)``.
Not msgpack: RNG states and user state hold tensors, which msgpack cannot carry without a
format of our own, and ``weights_only`` loading admits only tensors and plain containers, so
no code runs from the bytes a peer sent (``pickle`` proper would run any). The sender
decodes its own bytes once, so a snapshot that receivers would refuse (an object of the
user's own class) fails on the sender too.

The broadcast (:func:`broadcast_snapshot`): the length first (one int64), then the bytes as
one uint8 tensor. Each collective runs with ``async_op=True`` and is waited for by ``wait``
(default ``work.wait()``; the engine passes its verdict-aware wait, which checks the view
between short slices), so a verdict can end it. A sender whose snapshot cannot be encoded
sends length -1: every receiver raises the same typed error at once instead of waiting for
bytes that never come. Model and optimizer state do not travel here; the strategy moves
them as tensors.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroup, Work

from torchhook.state import Snapshot, SnapshotError, check_shape

MAX_SNAPSHOT_BYTES = 64 << 20
"""Bytes of one encoded snapshot. The RNG states are a few KiB and schedulers, samplers and
counters less; the model and optimizer travel separately. A receiver allocates the length it
is sent, so a corrupt or mistaken length must not allocate gigabytes."""


def encode(snapshot: Snapshot) -> bytes:
    """``snapshot`` as bytes (``torch.save``). The bytes are decoded once here, as a
    receiver will: a snapshot holding something that ``weights_only`` loading refuses (an
    object of the user's own class) fails on the sender too, not only on the receivers.
    :class:`SnapshotError` for that, a wrong shape or a size above ``MAX_SNAPSHOT_BYTES``."""
    check_shape(snapshot)
    buffer = io.BytesIO()
    try:
        torch.save(dict(snapshot), buffer)
    except Exception as exc:  # pickling raises many types (an unpicklable lambda, a lock)
        raise SnapshotError(f"snapshot does not encode: {type(exc).__name__}: {exc}") from exc
    if buffer.tell() > MAX_SNAPSHOT_BYTES:
        raise SnapshotError(f"snapshot is {buffer.tell()} bytes, above {MAX_SNAPSHOT_BYTES}")
    data = buffer.getvalue()
    decode(data)
    return data


def decode(data: bytes | bytearray | memoryview) -> Snapshot:
    """The snapshot in ``data``, loaded with ``weights_only=True``; :class:`SnapshotError`
    for anything else (too big, corrupt, or holding objects other than tensors and plain
    containers)."""
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise SnapshotError(f"snapshot is {len(data)} bytes, above {MAX_SNAPSHOT_BYTES}")
    try:
        loaded = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    except Exception as exc:  # corrupt bytes raise many types; each is this one error
        raise SnapshotError(f"snapshot bytes do not load: {type(exc).__name__}: {exc}") from exc
    return check_shape(loaded)


def _plain_wait(work: Work) -> None:
    work.wait()


def _collective(tensor: torch.Tensor, src: int, group: ProcessGroup | None, wait: Any) -> None:
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    if work is None:  # async_op=True always returns a Work on a group this rank is in
        raise RuntimeError("broadcast returned no Work: is this rank in the group?")
    wait(work)


def broadcast_snapshot(
    snapshot: Snapshot | None,
    src: int,
    *,
    group: ProcessGroup | None = None,
    device: torch.device | None = None,
    wait: Callable[[Work], None] = _plain_wait,
) -> Snapshot:
    """Rank ``src`` (a global rank, as in ``dist.broadcast``) sends ``snapshot``; every rank
    of ``group`` returns it (``src`` its own). Two broadcasts, each ``async_op=True`` and
    ended by ``wait``: the length (int64), then the bytes (uint8). ``device``: where the
    tensors live (``cuda`` for NCCL; default CPU). Raises :class:`SnapshotError` on every
    rank if the source's snapshot cannot be encoded or a length is out of bounds."""
    on = torch.device("cpu") if device is None else device
    payload: bytes | None = None
    error: SnapshotError | None = None
    if dist.get_rank() == src:
        if snapshot is None:
            raise ValueError("the source rank must pass its snapshot")
        try:
            payload = encode(snapshot)
        except SnapshotError as exc:
            error = exc
    length = torch.tensor([-1 if payload is None else len(payload)], dtype=torch.int64)
    length = length.to(on)
    _collective(length, src, group, wait)
    if error is not None:
        raise error
    n = int(length.item())
    if not 0 <= n <= MAX_SNAPSHOT_BYTES:
        raise SnapshotError(f"the source sent length {n}: its snapshot could not be encoded")
    if payload is not None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(on)
    else:
        data = torch.empty(n, dtype=torch.uint8, device=on)
    _collective(data, src, group, wait)
    if payload is not None:
        assert snapshot is not None
        return snapshot
    return decode(data.cpu().numpy().tobytes())
