"""torchhook.transfer: pack/unpack round trips in process, then a real 3-process gloo group.

The pure tests check that a state comes back bitwise and with its Python types (tuples,
int keys, bools, step counters), that tensors given as ``into`` are filled in place, and
that every malformed record is refused with ``TransferError`` before anything is touched.
The group test starts three worker processes (forked by a fork server that imported this
module, and so torch, once) on a gloo group whose TCPStore this process hosts; rank 1
trains a model with BatchNorm (float32 and int64 buffers) and Adam (two parameter groups,
state and step counters) and broadcasts it; ranks 0 and 2 start from other weights and
other hyperparameters. Each rank saves what it holds after the transfer and after one
more step on the same batch; this process compares the files bitwise. A second part does
the same with DTensor parameters (Replicate on a 1-D mesh), whose local tensors travel and
whose optimizer state must come back as DTensors.
"""

from __future__ import annotations

import json
import multiprocessing
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torchhook.transfer needs torch (install the [torch] extra)")

import msgpack
import torch
import torch.distributed as dist
from torch import nn

from agent.procs import stop
from tests.torchhook.workers import run_worker
from torchhook import state_codec, transfer
from torchhook.transfer import TransferError

TCPStore = dist.TCPStore  # type: ignore[attr-defined]  # implicit re-export (test_fsdp.py)
PrefixStore = dist.PrefixStore  # type: ignore[attr-defined]

_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload([__name__])

WORLD = 3
SOURCE = 1  # not rank 0: the source is whichever rank holds the newest state
RUN_TIMEOUT_S = 60.0
PG_TIMEOUT_S = 30.0


def _bitwise_equal(a: Any, b: Any) -> bool:
    """Same structure, same Python types, tensors equal bit for bit (NaN and -0.0 too)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return False
        return bool(torch.equal(_bits(a), _bits(b)))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1).contiguous()
    return flat if flat.dtype == torch.bool else flat.view(torch.uint8)


def _adam_state(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    first, rest = _groups(model)
    groups: list[dict[str, Any]] = [{"params": first, "lr": 1e-2}, {"params": rest}]
    opt = torch.optim.Adam(groups, lr=3e-3, betas=(0.8, 0.99))
    for step in range(steps):
        _train_step(model, opt, step)
    return model, opt


def _groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Two parameter groups: the first layer's parameters, and the rest."""
    first, *others = model.children()
    return list(first.parameters()), [p for m in others for p in m.parameters()]


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
    loss = nn.functional.mse_loss(model(x), y)
    torch.autograd.backward(loss)  # typed, unlike Tensor.backward
    opt.step()
    opt.zero_grad()


# --- in process ---------------------------------------------------------------------


def test_mixed_dtypes_scalars_and_containers_round_trip_bitwise() -> None:
    gen = torch.Generator().manual_seed(1)
    state = {
        "f32": torch.randn(3, 4, generator=gen),
        "f64": torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float64),
        "bf16": torch.randn(5, generator=gen).to(torch.bfloat16),
        "half": [torch.randn(2, 2, generator=gen).half(), torch.zeros(0, 7).half()],
        "ints": (torch.arange(6, dtype=torch.int64).view(2, 3), torch.tensor(7)),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.tensor([0, 255], dtype=torch.uint8),
        "strided": torch.arange(12.0).view(3, 4).t(),  # not contiguous
        7: {"nested": [None, True, 3, 2.5, "text", (1, 2)]},
    }
    packed = transfer.pack(state)
    assert len(packed.buffers) == 7  # one per dtype
    assert _bitwise_equal(transfer.unpack(packed), state)


@pytest.mark.parametrize("state", [{}, [], None, {"step": 12, "lr": 0.1, "name": "x"}])
def test_a_state_without_tensors_round_trips(state: Any) -> None:
    packed = transfer.pack(state)
    assert packed.buffers == ()
    assert _bitwise_equal(transfer.unpack(packed), state)


def test_an_optimizer_state_dict_with_step_counters_round_trips_and_loads() -> None:
    model, opt = _adam_state(steps=3)
    sd = opt.state_dict()
    assert isinstance(sd["state"][0]["step"], torch.Tensor)  # Adam's counter is a tensor
    got = transfer.unpack(transfer.pack(transfer.optimizer_state(opt)))
    assert _bitwise_equal(got, sd)  # int keys, the betas tuple, the two groups
    fresh, fresh_opt = _adam_state(steps=0)
    transfer.unpack(transfer.pack(transfer.local_state(model)), into=fresh.state_dict())
    transfer.load_optimizer(fresh_opt, got)
    _train_step(model, opt, 9)
    _train_step(fresh, fresh_opt, 9)
    assert _bitwise_equal(fresh.state_dict(), model.state_dict())
    assert _bitwise_equal(fresh_opt.state_dict(), opt.state_dict())


def test_into_fills_tensors_in_place_and_a_mismatch_changes_nothing() -> None:
    source = {"w": torch.randn(4, 3), "b": torch.randn(3), "n": torch.tensor(5)}
    packed = transfer.pack(source)
    w, b = torch.zeros(4, 3), torch.zeros(3)
    got = transfer.unpack(packed, into={"w": w, "b": b})
    assert got["w"] is w and got["b"] is b and torch.equal(w, source["w"])
    assert torch.equal(got["n"], source["n"])  # not in into: a new tensor
    w2, b2 = torch.zeros(4, 3), torch.zeros(2)
    with pytest.raises(TransferError, match="for a tensor of"):
        transfer.unpack(packed, into={"w": w2, "b": b2})
    assert not w2.any(), "w2 was written although b2 was refused"
    with pytest.raises(TransferError):
        transfer.unpack(packed, into={"w": torch.zeros(4, 3, dtype=torch.float64)})


def _record(**changes: Any) -> bytes:
    good = msgpack.unpackb(transfer.pack({"a": torch.ones(2)}).metadata, strict_map_key=False)
    return bytes(msgpack.packb({**good, **changes}))


@pytest.mark.parametrize(
    "metadata",
    [
        b"",
        b"\xc1 not msgpack",
        msgpack.packb([1, 2, 3]),
        _record(v=2),
        _record(dtypes=["float32", "float32"], numels=[2, 2]),
        _record(dtypes=["pickle"]),
        _record(numels=[3]),
        _record(tensors=[[0, [-2]]]),
        _record(tensors=[[5, [2]]]),
        _record(tree=["d", ["a", ["t", 0], "b", ["t", 0]]]),
        _record(tree=["d", ["a", ["x", 0]]]),
        _record(tree={"a": 1}),
        _record(tree=["d", []]),  # a listed tensor the tree never uses
        _record(tree=0),
        _record(numels=[2**40], tensors=[[0, [2**40]]]),  # passes max_bytes below
    ],
)
def test_bad_metadata_is_refused_with_the_typed_error(metadata: bytes) -> None:
    good = transfer.pack({"a": torch.ones(2)})
    with pytest.raises(TransferError):
        transfer.unpack(transfer.Packed(metadata, good.buffers), max_bytes=2**30)


def test_bounds_are_enforced_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    deep: Any = torch.ones(1)
    for _ in range(transfer.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(TransferError, match="MAX_DEPTH"):
        transfer.pack(deep)
    nested = ["t", 0]
    for _ in range(transfer.MAX_DEPTH + 1):
        nested = ["l", [nested]]
    good = transfer.pack({"a": torch.ones(2)})
    with pytest.raises(TransferError, match="MAX_DEPTH"):
        transfer.unpack(transfer.Packed(_record(tree=nested), good.buffers))
    monkeypatch.setattr(state_codec, "MAX_TENSORS", 3)
    with pytest.raises(TransferError, match="MAX_TENSORS"):
        transfer.pack([torch.ones(1)] * 4)
    with pytest.raises(TransferError):  # a received record with too many tensors
        transfer.unpack(transfer.Packed(_record(tensors=[[0, [1]]] * 4), good.buffers))
    monkeypatch.setattr(state_codec, "MAX_METADATA_BYTES", 64)
    with pytest.raises(TransferError, match="MAX_METADATA_BYTES"):
        transfer.pack({"x" * 100: 1})


@pytest.mark.parametrize("leaf", [object(), b"raw", {1.5: 2}, {True: 1}])
def test_unsupported_leaves_and_keys_are_refused_at_pack(leaf: Any) -> None:
    with pytest.raises(TransferError):
        transfer.pack({"x": leaf})


def test_large_tensors_travel_alone_and_small_ones_in_bounded_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transfer, "STAGING_BYTES", 1000)
    big = transfer.DIRECT_BYTES // 4  # float32 elements of one direct tensor
    state = [
        torch.ones(100),  # 400 B
        torch.ones(big),
        torch.ones(100, dtype=torch.int64),  # another dtype: its own buffer
        torch.ones(100),
        torch.ones(100),
        torch.ones(100),  # the third 400 B passes 1000 B: a new run
        torch.ones(0),
    ]
    _, record, _ = state_codec.encode(state)
    assert transfer._segments(record) == [[0], [1], [3, 4], [5, 6], [2]]


def test_buffers_that_do_not_match_the_metadata_are_refused() -> None:
    good = transfer.pack({"a": torch.ones(2)})
    for buffers in [(), (torch.ones(3),), (torch.ones(2, dtype=torch.float64),)]:
        with pytest.raises(TransferError, match="buffers"):
            transfer.unpack(transfer.Packed(good.metadata, buffers))


# --- a real gloo group --------------------------------------------------------------


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = PrefixStore("transfer", TCPStore("127.0.0.1", port, is_master=False))
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    model, opt = _adam_state(steps=3)
    if rank != SOURCE:  # other weights, no optimizer state, other hyperparameters
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-0.5)
        first, rest = _groups(model)
        opt = torch.optim.Adam([{"params": first}, {"params": rest}], lr=0.5)
    waits: list[str] = []

    def wait(work: dist.Work) -> None:
        waits.append(type(work).__name__)
        work.wait()

    state = {"model": transfer.local_state(model), "optimizer": transfer.optimizer_state(opt)}
    got = transfer.broadcast(
        {**state, "step": 3}, SOURCE, into={"model": state["model"]}, wait=wait
    )
    if rank != SOURCE:
        transfer.load_optimizer(opt, got["optimizer"])
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": got["step"]},
        f"{out}/{rank}-received.pt",
    )
    _train_step(model, opt, 3)
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{out}/{rank}-stepped.pt"
    )
    _dtensor_part(rank, out)
    in_place = _mixed_part(rank, out)
    refused = [
        _refusal({"x": object()}, None),
        _refusal({"w": torch.ones(3)}, {"w": torch.ones(2)}),
    ]
    # after a refusal the group is still in step: the next transfer works
    after = transfer.broadcast({"n": torch.tensor([rank])}, SOURCE)["n"].item()
    result = {"waits": len(waits), "refused": refused, "in_place": in_place, "after": after}
    Path(f"{out}/{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _dtensor_part(rank: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(0 if rank == SOURCE else 50 + rank)
    lin = nn.Linear(5, 6, bias=False)
    local = torch.randn(6, 5, generator=gen)
    lin.weight = nn.Parameter(DTensor.from_local(local, mesh, [Replicate()], run_check=False))
    opt = torch.optim.Adam(lin.parameters(), lr=0.1)

    def step() -> None:
        grad = torch.linspace(-1, 1, 30).view(6, 5)
        lin.weight.grad = DTensor.from_local(grad, mesh, [Replicate()], run_check=False)
        opt.step()

    if rank == SOURCE:
        step()
    state = {"model": transfer.local_state(lin), "optimizer": transfer.optimizer_state(opt)}
    got = transfer.broadcast(state, SOURCE, into={"model": state["model"]})
    if rank != SOURCE:
        transfer.load_optimizer(opt, got["optimizer"])
    step()
    kinds = [type(v).__name__ for v in opt.state[lin.weight].values()]
    torch.save(
        {
            "weight": transfer.local_state(lin)["weight"],
            "optimizer": transfer.optimizer_state(opt),
            "kinds": kinds,
        },
        f"{out}/{rank}-dtensor.pt",
    )


def _refusal(state: Any, into: Any) -> str:
    """The error of a transfer that must fail on every rank: "" if it did not."""
    try:
        transfer.broadcast(state, SOURCE, into=into)
    except TransferError as exc:
        return str(exc)
    return ""


def _mixed_part(rank: int, out: str) -> bool:
    """Large tensors sent straight (into a given tensor, or a new one), a non-contiguous
    target, several staging runs (a small ``STAGING_BYTES``), bool and bfloat16."""
    transfer.STAGING_BYTES = 4096  # this worker process only
    gen = torch.Generator().manual_seed(0 if rank == SOURCE else rank)
    big = torch.randn(300_000, generator=gen)  # 1.2 MB: over DIRECT_BYTES
    state = {
        "big": big,
        "bf": torch.randn(600_000, generator=gen).to(torch.bfloat16),
        "odd": torch.randn(5, 7, generator=gen),
        "small": [torch.randn(100, generator=gen) for _ in range(40)],
        "mask": torch.rand(50, generator=gen) > 0.5,
    }
    odd = torch.zeros(7, 5).t()  # a non-contiguous target
    got = transfer.broadcast(state, SOURCE, into={"big": big, "odd": odd})
    torch.save(got, f"{out}/{rank}-mixed.pt")
    return got["big"] is big and got["odd"] is (state["odd"] if rank == SOURCE else odd)


def _worker_main(rank: int, port: int, out: str) -> None:
    run_worker(_worker, rank, port, out)


@pytest.mark.slow
def test_a_trained_model_and_adam_state_reach_every_rank_bitwise(tmp_path: Path) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        _FORKS.Process(target=_worker_main, args=(r, store.port, str(tmp_path)))
        for r in range(WORLD)
    ]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(RUN_TIMEOUT_S)
        report = "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.err")))
        assert [p.exitcode for p in procs] == [0] * WORLD, report
    finally:
        stop(*(p.pid for p in procs if p.pid is not None and p.is_alive()), sig=9)
        for proc in procs:
            proc.join(10)

    def load(rank: int, what: str) -> Any:
        return torch.load(tmp_path / f"{rank}-{what}.pt", weights_only=True)

    for what in ("received", "stepped", "dtensor", "mixed"):
        source = load(SOURCE, what)
        for rank in set(range(WORLD)) - {SOURCE}:
            assert _bitwise_equal(load(rank, what), source), (rank, what)
    received = load(SOURCE, "received")
    assert received["step"] == 3 and len(received["optimizer"]["param_groups"]) == 2
    assert received["optimizer"]["param_groups"][0]["lr"] == 1e-2
    assert received["optimizer"]["state"][0]["step"].item() == 3.0
    # the receivers' optimizer state is a DTensor again, not a plain tensor
    assert load(0, "dtensor")["kinds"] == ["Tensor", "DTensor", "DTensor"]
    # header, metadata, the refusal check and one buffer per dtype (float32, int64),
    # each through ``wait``
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result["waits"] == 5 and result["in_place"] and result["after"] == SOURCE
        # the source cannot pack: every rank raises, none waits for bytes
        assert ("cannot send" if rank == SOURCE else "could not pack") in result["refused"][0]
        # a receiver's tensor has another shape: every rank raises, the group stays usable
        why = "a receiver refused" if rank == SOURCE else "for a tensor of"
        assert why in result["refused"][1], result
