"""In-process elastic DDP on CPU/gloo: trainers on nodes, membership from each node's agent.

    SWIM_CONTROL=/run/swim/agent.sock python examples/elastic_ddp.py --job demo --log steps.jsonl

One process per local rank: with several per node, start them with ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` set (as torchrun does) or pass ``--local-rank``/``--local-world-size``.

Every process starts from its own random init on purpose: consistency comes from the group
(DDP broadcasts from rank 0). The global batch of each step is fixed (``--global-batch``)
and split over the ranks, so the loss curve does not depend on the world size. Runs until
``--steps`` or until the step written in ``--stop-file`` (a test writes it), then prints a
checksum of parameters and optimizer state. ``--fault`` makes this node fail on purpose
at ``--fault-step``: local rank 0 kills or stops its whole process group (the node: agent
and every local rank, when the caller started them in one) inside backward, or at the step
boundary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchhook.elastic import ElasticDDP

IN_DIM = 16


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_DIM, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, IN_DIM, generator=g)
    y = torch.sin(x[:, :4].sum(dim=1, keepdim=True)) + 0.1 * x[:, 4:5]
    return x, y


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def checksum(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for state in opt.state.values():
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                h.update(value.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def reference(steps: int, global_batch: int, seed: int) -> list[float]:
    """The same training in one process on the whole batch: the failure-free curve."""
    model = build_model(seed)
    opt = optimizer_for(model)
    losses = []
    for step in range(steps):
        x, y = batch(step, global_batch)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def rank_seed(node: str, local_rank: int) -> int:
    """A different init on every process on purpose: consistency must come from the group
    (a test recomputes the first rank 0's init from its node's name)."""
    return zlib.crc32(f"{node}/{local_rank}".encode())


def fault(kind: str, log: Any) -> None:
    sig = signal.SIGKILL if kind.startswith("kill") else signal.SIGSTOP
    record = json.dumps({"fault": kind, "t": time.time(), "pid": os.getpid()})
    if log is not None:
        log.write(record + "\n")
        log.flush()
    print(record, flush=True)
    os.killpg(os.getpgid(0), sig)


def stop_step(path: Path | None) -> int | None:
    if path is None or not path.exists():
        return None
    text = path.read_text().strip()
    return int(text) if text.isdigit() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--job", default="elastic-demo")
    ap.add_argument("--control", default=None, help="agent control socket (default: SWIM_CONTROL)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--stop-file", type=Path, default=None)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (pacing)")
    ap.add_argument("--log", type=Path, default=None, help="append one JSON line per step")
    ap.add_argument(
        "--fault",
        choices=["none", "kill-in-backward", "stop-in-backward", "kill", "stop"],
        default="none",
    )
    ap.add_argument("--fault-step", type=int, default=10)
    ap.add_argument(
        "--fault-file", type=Path, default=None, help="fault at the step after it appears"
    )
    ap.add_argument("--min-nodes", type=int, default=1)
    ap.add_argument("--pg-timeout", type=float, default=60.0)
    ap.add_argument("--heartbeat-pause-ms", type=int, default=30_000)
    ap.add_argument("--local-rank", type=int, default=None, help="default: LOCAL_RANK or 0")
    ap.add_argument(
        "--local-world-size", type=int, default=None, help="default: LOCAL_WORLD_SIZE or 1"
    )
    ap.add_argument("--reference", action="store_true", help="print the failure-free curve")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if os.environ.get("SWIM_DEBUG"):
        logging.getLogger("torchhook").setLevel(logging.DEBUG)
    if args.reference:
        print(json.dumps(reference(args.steps, args.global_batch, args.seed)))
        return 0

    from agent.control import ControlClient

    node = ControlClient(args.control).request("info")["node"]
    local_rank = args.local_rank if args.local_rank is not None else _env("LOCAL_RANK", 0)
    model = build_model(rank_seed(node, local_rank))
    opt = optimizer_for(model)
    el = ElasticDDP(
        model,
        opt,
        job=args.job,
        control=args.control,
        min_nodes=args.min_nodes,
        pg_timeout_s=args.pg_timeout,
        heartbeat_pause_ms=args.heartbeat_pause_ms,
        local_rank=local_rank,
        local_world_size=args.local_world_size,
    )
    faulty = el.local_rank == 0  # one process of the node brings the whole node down
    log = args.log.open("a") if args.log else None

    def emit(record: dict[str, Any]) -> None:
        record.update(t=time.time(), node=el.node, local_rank=el.local_rank, pid=os.getpid())
        line = json.dumps(record)
        if log is not None:
            log.write(line + "\n")
            log.flush()
        print(line, flush=True)

    def train_step(ddp: nn.Module) -> float:
        lo, hi = el.shard(args.global_batch)
        x, y = batch(el.step, args.global_batch)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x[lo:hi]), y[lo:hi])
        if faulty and el.step == args.fault_step and args.fault.endswith("in-backward"):
            loss.register_hook(lambda grad: fault(args.fault, log))
        loss.backward()
        opt.step()
        # the mean of the ranks' means is the whole batch's mean (equal slices)
        total = el.all_reduce(loss.detach().clone() * (hi - lo))
        return float(total) / args.global_batch

    while True:
        limit = stop_step(args.stop_file)
        if el.step >= (limit if limit is not None else args.steps):
            break
        if args.fault_file is not None and args.fault_file.exists() and args.fault_step > el.step:
            args.fault_step = el.step + 1  # the next step, so the fault lands mid-training
        if faulty and el.step == args.fault_step and args.fault in ("kill", "stop"):
            fault(args.fault, log)
        loss = el.run_step(train_step)
        step = el.step - 1  # the step that ran (a new member learns the count on joining)
        emit(
            {
                "step": step,
                "loss": loss,
                "rank": el.rank,
                "world": el.world_size,
                "leader": el.order[0],
                "source": el.last_plan.source if el.last_plan else None,
                "formations": el.reconfigurations,
                "formation_s": round(el.last_formation_s, 4),
                "verdict_t": el.verdict_time,
            }
        )
        if args.step_sleep:
            time.sleep(args.step_sleep)
    emit({"final": True, "step": el.step, "checksum": checksum(model, opt), "world": el.world_size})
    if log is not None:
        log.close()
    sys.stdout.flush()
    el.exit(0)
    return 0


def _env(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default


if __name__ == "__main__":
    raise SystemExit(main())
