"""A toy torchrun worker: trains a tiny model over gloo and logs every step.

    torchrun --rdzv-backend=swim --rdzv-endpoint=HOST:PORT --rdzv-id=JOB --nnodes=2:3 \\
             --nproc-per-node=1 --max-restarts=10 --monitor-interval=0.1 \\
             examples/torchrun_train.py --trainer-node NAME --steps-file steps.jsonl

Each completed step appends one JSON line: wall time ``t``, ``node``, ``local_rank``
(LOCAL_RANK: with several workers per node, the node's workers share one steps file),
``rank``, ``world``, ``restart`` (TORCHELASTIC_RESTART_COUNT), ``step`` (counted per worker
process) and ``group`` (MASTER_ADDR:MASTER_PORT: a new one per rendezvous round with the
swim backend).
Tests and bench/torchrun_recovery.py read these lines; nothing else is measured here.
Option names avoid prefixes of torchrun's own (argparse would call ``--node`` ambiguous).
Gradients are averaged with one gloo allreduce per step; ``--ddp`` wraps the model in DDP
instead (its first construction imports torch._dynamo: ~1.5 s more per worker start here,
which would be counted in every recovery time).
The process group timeout defaults to gloo's 30 min so the stock behaviour is what runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer-node", default=os.uname().nodename)
    parser.add_argument("--steps-file", required=True)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--step-delay", type=float, default=0.05)
    parser.add_argument("--pg-timeout", type=float, default=1800.0)
    parser.add_argument("--ddp", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    if args.ddp:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    group = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    with open(args.steps_file, "a", buffering=1) as out:
        for step in range(args.steps):
            x = torch.randn(8, 16)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if not args.ddp:
                average_gradients(model, world)
            opt.step()  # after the allreduce: the step is complete on every rank
            record = {
                "t": time.time(),
                "node": args.trainer_node,
                "local_rank": local_rank,
                "rank": rank,
                "world": world,
                "restart": restart,
                "step": step,
                "group": group,
            }
            out.write(json.dumps(record) + "\n")
            time.sleep(args.step_delay)
    dist.destroy_process_group()


def average_gradients(model: nn.Module, world: int) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


if __name__ == "__main__":
    main()
