"""State transfer as tensors: model and Adam state from one rank to the others, against a
plain gloo broadcast of the same bytes in the same run.

The model is a stack of ``Linear(hidden, hidden)`` layers on CPU with about ``--params-m``
million parameters (100 M by default: 24 layers of 2048 × 2048 + bias, 400 MB of fp32),
and its Adam state (``exp_avg``, ``exp_avg_sq``, a step counter per parameter): 1.2 GB in
all. ``--worlds`` processes (2, then 3 by default) form a gloo group over loopback; rank
0 (the source) holds the trained state, the others a model of the same shape and an Adam
with no state. Per repetition, alternating so that load drift hits both alike:

- *plain*: one ``dist.broadcast`` of one flat uint8 tensor of the state's total size,
  already allocated on every rank: the wire's rate, the upper bound;
- *transfer*: ``torchhook.transfer.broadcast`` of ``{"model": local_state(model),
  "optimizer": optimizer_state(opt), "step": …}`` with the receivers' parameters as
  ``into``, then ``load_optimizer``: the encoding on the source, the header and metadata,
  the buffers (large tensors straight into the parameters or into new tensors) and the
  optimizer load all count.

Each is timed from a barrier to the slowest rank's end (an all-reduce of the elapsed
times, MAX), after one untimed repetition of both. Once per world, after the timed
repetitions, *the old way* is timed the same way: one broadcast per parameter tensor
and ``broadcast_object_list`` of the optimizer's state dict (a pickle), then
``load_state_dict``. After every transfer the receivers' state is checked against the
source's (a float64 checksum of every tensor, all-reduced MIN and MAX). The processes
share this host's cores, so rates are a loopback figure, not a network's.

    python -m bench.state_transfer [--params-m 100] [--worlds 2,3] [--runs 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agent.procs import stop
from bench import results
from torchhook import transfer

HIDDEN = 2048
SOURCE = 0
RUN_TIMEOUT_S = 600.0
"""A world whose workers have not finished by then is killed and reported as failed."""


# --- the worker -----------------------------------------------------------------------


def _model(layers: int, source: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)))
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if source:
                p.uniform_(-0.02, 0.02, generator=gen)
            else:
                p.zero_()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 if source else 0.5)
    if source:  # Adam's state after some steps, made without a backward pass over 1.2 GB
        for p in model.parameters():
            opt.state[p] = {
                "step": torch.tensor(7.0),
                "exp_avg": p.detach() * 0.1,
                "exp_avg_sq": p.detach().square(),
            }
    return model, opt


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    began = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _checksum(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Raise unless every rank holds the same parameters and optimizer state."""
    total = torch.zeros(1, dtype=torch.float64)
    for i, p in enumerate(model.parameters()):
        st = opt.state[p]
        for t in (p, st["exp_avg"], st["exp_avg_sq"], st["step"]):
            total += t.detach().double().sum() * (i + 1)
    lo, hi = total.clone(), total.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if lo.item() != hi.item():
        raise RuntimeError(f"rank {dist.get_rank()}: state differs after the transfer")
    if opt.param_groups[0]["lr"] != 1e-3:
        raise RuntimeError(f"rank {dist.get_rank()}: param_groups did not arrive")


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = [t for st in opt.state.values() for t in st.values()] + list(model.parameters())
    return sum(t.numel() * t.element_size() for t in tensors)


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    store = dist.PrefixStore(  # type: ignore[attr-defined]
        f"w{world}",
        dist.TCPStore("127.0.0.1", port, is_master=False),  # type: ignore[attr-defined]
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    source = rank == SOURCE
    model, opt = _model(cfg["layers"], source)
    size = torch.tensor([_state_bytes(model, opt) if source else 0])
    dist.broadcast(size, SOURCE)
    nbytes = int(size.item())
    plain = torch.zeros(nbytes, dtype=torch.uint8)

    def plain_broadcast() -> None:
        dist.broadcast(plain, SOURCE)

    def tensor_transfer() -> None:
        here = transfer.local_state(model)
        state = {"model": here, "optimizer": transfer.optimizer_state(opt), "step": 7}
        got = transfer.broadcast(state, SOURCE, into={"model": here})
        if not source:
            transfer.load_optimizer(opt, got["optimizer"])

    times: dict[str, list[float]] = {"plain": [], "transfer": []}
    for run in range(cfg["runs"] + 1):  # the first is untimed: first touches, warm-up
        for name, fn in (("plain", plain_broadcast), ("transfer", tensor_transfer)):
            if not source:
                opt.state.clear()  # each transfer starts from a receiver without state
                gc.collect()
            elapsed = _timed(fn)
            if run:
                times[name].append(elapsed)
        _checksum(model, opt)
    plain = torch.empty(0, dtype=torch.uint8)  # frees the baseline buffer
    old_s = None
    if cfg["old_way"]:
        if not source:
            opt.state.clear()
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            gc.collect()
        old_s = _timed(lambda: _old_way(model, opt, source))
        _checksum(model, opt)
    if source:
        Path(cfg["out"]).write_text(json.dumps({"bytes": nbytes, "times": times, "old": old_s}))
    dist.destroy_process_group()


def _old_way(model: nn.Module, opt: torch.optim.Optimizer, source: bool) -> None:
    """What the HSDP engine did before: a broadcast per parameter tensor, then the
    optimizer state dict pickled through ``broadcast_object_list``."""
    for p in model.parameters():
        dist.broadcast(p.detach(), SOURCE)
    payload: list[Any] = [opt.state_dict() if source else None]
    dist.broadcast_object_list(payload, src=SOURCE)
    if not source:
        opt.load_state_dict(payload[0])


def _worker_main(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    try:
        _worker(rank, world, port, cfg)
    except Exception as exc:
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.exit(3)


# --- the driver -----------------------------------------------------------------------


def run_world(world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One group of ``world`` processes; the source's timings."""
    spawn = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "source.json"
        procs = [
            spawn.Process(
                target=_worker_main, args=(r, world, store.port, {**cfg, "out": str(out)})
            )
            for r in range(world)
        ]
        try:
            for proc in procs:
                proc.start()
            deadline = time.monotonic() + RUN_TIMEOUT_S
            for proc in procs:
                proc.join(max(0.1, deadline - time.monotonic()))
            codes = [p.exitcode for p in procs]
        finally:
            stop(*(p.pid for p in procs if p.pid is not None and p.is_alive()), sig=9)
            for proc in procs:
                proc.join(10)
        if codes != [0] * world:
            raise RuntimeError(f"world {world}: workers exited {codes}")
        data: dict[str, Any] = json.loads(out.read_text())
        return data


def _summary(world: int, data: dict[str, Any]) -> dict[str, Any]:
    gb = data["bytes"] / 1e9
    plain, moved = data["times"]["plain"], data["times"]["transfer"]
    ratios = [p / t for p, t in zip(plain, moved, strict=True)]
    return {
        "world": world,
        "gb": gb,
        "plain_s": plain,
        "transfer_s": moved,
        "plain_gbps": gb / statistics.median(plain),
        "transfer_gbps": gb / statistics.median(moved),
        "ratio": statistics.median(ratios),
        "ratio_range": (min(ratios), max(ratios)),
        "old_s": data["old"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-m", type=int, default=100, help="model size, M parameters")
    parser.add_argument("--worlds", default="2,3", help="group sizes, one run each")
    parser.add_argument("--runs", type=int, default=5, help="timed repetitions per world")
    parser.add_argument("--no-old-way", action="store_true", help="skip the pickled baseline")
    results.add_arguments(parser)
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    layers = max(1, round(args.params_m * 1e6 / (HIDDEN * HIDDEN + HIDDEN)))
    if args.runs < 1 or any(w < 2 for w in worlds):
        parser.error("--runs >= 1 and every world >= 2")
    started = results.machine()
    cfg = {"layers": layers, "runs": args.runs, "old_way": not args.no_old_way}
    rows = []
    print(f"{layers} layers of {HIDDEN}x{HIDDEN}: {layers * (HIDDEN + 1) * HIDDEN / 1e6:.1f} M")
    for world in worlds:
        row = _summary(world, run_world(world, cfg))
        rows.append(row)
        old = f"{row['old_s']:.2f} s" if row["old_s"] is not None else "-"
        print(
            f"world {world}: {row['gb']:.2f} GB; plain {row['plain_gbps']:.2f} GB/s, "
            f"transfer {row['transfer_gbps']:.2f} GB/s, ratio {row['ratio']:.2f} "
            f"({row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f}); old way {old}",
            flush=True,
        )
    print(json.dumps({"benchmark": "state_transfer", "rows": rows}))
    results.record(args, "bench.state_transfer", argv, started, _result(rows, args, layers))
    return 0


def _result(rows: list[dict[str, Any]], args: argparse.Namespace, layers: int) -> dict[str, Any]:
    params_m = layers * (HIDDEN + 1) * HIDDEN / 1e6
    worlds = "-".join(str(r["world"]) for r in rows)
    figures: dict[str, Any] = {}
    ratios = []
    table_rows = []
    for r in rows:
        w = r["world"]
        figures[f"transfer_gbps_{w}"] = results.figure(
            f"world {w}: state transfer rate, median",
            r["transfer_gbps"],
            "GB/s",
            2,
            spread=(r["gb"] / max(r["transfer_s"]), r["gb"] / min(r["transfer_s"])),
            runs=len(r["transfer_s"]),
        )
        figures[f"plain_gbps_{w}"] = results.figure(
            f"world {w}: plain broadcast of the same bytes, median",
            r["plain_gbps"],
            "GB/s",
            2,
            spread=(r["gb"] / max(r["plain_s"]), r["gb"] / min(r["plain_s"])),
            runs=len(r["plain_s"]),
        )
        ratios.append(
            {
                "label": f"world {w}: transfer rate / plain broadcast rate (median per run)",
                "value": r["ratio"],
            }
        )
        if r["old_s"] is not None:
            ratios.append(
                {
                    "label": f"world {w}: old way (pickle) time / transfer time",
                    "value": r["old_s"] / statistics.median(r["transfer_s"]),
                    "digits": 1,
                }
            )
        table_rows.append(
            {
                "world": w,
                "gb": r["gb"],
                "plain": _stat(r["plain_s"]),
                "transfer": _stat(r["transfer_s"]),
                "ratio": results.stat(r["ratio"], lo=r["ratio_range"][0], hi=r["ratio_range"][1]),
                "old": r["old_s"],
            }
        )
    return {
        "question": f"state-transfer-{args.params_m}m-{worlds}",
        "title": (
            f"State transfer: a {params_m:.1f} M-parameter model and its Adam state, "
            f"{worlds.replace('-', ' and ')} ranks"
        ),
        "method": (
            f"A stack of {layers} Linear({HIDDEN}, {HIDDEN}) layers on CPU ({params_m:.1f} M "
            "fp32 parameters) with Adam state (two moments and a step per parameter), sent "
            "from one rank to the others of a gloo group over loopback with "
            "torchhook.transfer.broadcast (metadata, then the tensors: large ones straight "
            "into the receivers' parameters or new tensors; then load_optimizer), "
            f"alternating with one dist.broadcast of a preallocated flat tensor of the same "
            f"bytes; {args.runs} repetitions each "
            "after one untimed, timed from a barrier to the slowest rank's end. The old way "
            "(a broadcast per parameter, the optimizer state dict through "
            "broadcast_object_list) once."
        ),
        "figures": figures,
        "peers": ["plain dist.broadcast of the same bytes", "broadcast_object_list (pickle)"],
        "ratios": ratios,
        "tables": [
            {
                "caption": "Seconds per transfer of the whole state (median, min–max)",
                "columns": [
                    results.column("world", "ranks"),
                    results.column("gb", "state, GB", 2),
                    results.column("plain", "plain broadcast, s", 2),
                    results.column("transfer", "transfer, s", 2),
                    results.column("ratio", "rate ratio", 2),
                    results.column("old", "old way (pickle), s", 2),
                ],
                "rows": table_rows,
            }
        ],
    }


def _stat(values: list[float]) -> dict[str, float] | None:
    return results.stat(statistics.median(values), lo=min(values), hi=max(values))


if __name__ == "__main__":
    sys.exit(main())
