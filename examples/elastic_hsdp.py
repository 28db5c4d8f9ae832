"""In-process elastic HSDP on CPU/gloo: shard within a node, replicate across nodes.

    LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 SWIM_CONTROL=/run/swim/agent.sock \\
        python examples/elastic_hsdp.py --job demo --log steps.r0.jsonl    (and LOCAL_RANK=1)

Each node's local ranks shard one copy of the model between them (FSDP2); every node holds
one copy. When a node dies the survivors go on from memory at the step they were at: no
checkpoint, no rollback (torchhook/elastic_hsdp.py). Every process builds the same init
(``--seed``): FSDP does not broadcast parameters at the first formation. The global batch
of each step is fixed (``--global-batch``, 12) and split evenly over the ranks, so the loss
curve equals the single-process unsharded run that ``--reference`` prints.

Runs until ``--steps`` or the step written in ``--stop-file``. ``--fault`` makes local rank
0 kill or stop its whole process group (the node) at the step boundary or inside backward,
at ``--fault-step`` or at the step after ``--fault-file`` appears. The final record carries
a checksum of this rank's shards and optimizer state: equal on every node for the same
local rank.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

# the same model, data, failure-free reference and fault helpers as the DDP example, so
# every mode trains the same job; run as a script, this directory is on sys.path
from elastic_ddp import batch, build_model, fault, optimizer_for, reference, stop_step
from torch import nn
from torch.distributed.tensor import DTensor

from torchhook.elastic_hsdp import ElasticHSDP


def shard_checksum(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()

    def add(t: torch.Tensor) -> None:
        local = t.to_local() if isinstance(t, DTensor) else t
        h.update(local.detach().cpu().numpy().tobytes())

    for p in model.parameters():
        add(p)
        for key in sorted(opt.state[p]):
            value = opt.state[p][key]
            if isinstance(value, torch.Tensor):
                add(value)
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--job", default="elastic-hsdp-demo")
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
    ap.add_argument("--fault-step", type=int, default=-1)
    ap.add_argument(
        "--fault-file", type=Path, default=None, help="fault at the step after it appears"
    )
    ap.add_argument("--min-nodes", type=int, default=1)
    ap.add_argument("--pg-timeout", type=float, default=60.0)
    ap.add_argument("--heartbeat-pause-ms", type=int, default=30_000)
    ap.add_argument("--reference", action="store_true", help="print the failure-free curve")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.reference:
        print(json.dumps(reference(args.steps, args.global_batch, args.seed)))
        return 0

    torch.set_num_threads(1)  # several trainers share a few cores in the tests
    el = ElasticHSDP(
        lambda: build_model(args.seed),
        optimizer_for,
        job=args.job,
        control=args.control,
        min_nodes=args.min_nodes,
        pg_timeout_s=args.pg_timeout,
        heartbeat_pause_ms=args.heartbeat_pause_ms,
    )
    faulty = el.local_rank == 0  # one process brings the whole node down
    log = args.log.open("a") if args.log else None

    def emit(record: dict[str, Any]) -> None:
        record.update(t=time.time(), node=el.node, local_rank=el.local_rank, pid=os.getpid())
        line = json.dumps(record)
        if log is not None:
            log.write(line + "\n")
            log.flush()
        print(line, flush=True)

    def forward_backward(model: nn.Module) -> float:
        # forward and backward only: ElasticHSDP reduces across nodes, commits and steps
        lo, hi = el.shard(args.global_batch)
        x, y = batch(el.step, args.global_batch)
        loss = nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
        if faulty and el.step == args.fault_step and args.fault.endswith("in-backward"):
            loss.register_hook(lambda grad: fault(args.fault, log))  # type: ignore[no-untyped-call]
        torch.autograd.backward(loss)
        # the global batch's mean from the ranks' slice means, weighted by slice size
        total = el.all_reduce(loss.detach().clone() * (hi - lo))
        mean: float = float(total) / args.global_batch
        return mean

    faulting = False
    while True:
        limit = stop_step(args.stop_file)
        if el.step >= (limit if limit is not None else args.steps):
            break
        if args.fault_file is not None and args.fault_file.exists() and not faulting:
            faulting = True
            args.fault_step = el.step + 1  # the next step, so the fault lands mid-training
        if faulty and el.step == args.fault_step and args.fault in ("kill", "stop"):
            fault(args.fault, log)
        loss = el.run_step(forward_backward)
        plan = el.last_plan
        emit(
            {
                "step": el.step - 1,
                "loss": loss,
                "rank": el.rank,
                "world": el.world_size,
                "leader": el.order[0],
                "formations": el.reconfigurations,
                "formation_s": round(el.last_formation_s, 4),
                "restore": plan.restore if plan else None,
                "resumed": plan.step if plan else None,
                "verdict_t": el.verdict_time,
            }
        )
        if args.step_sleep:
            time.sleep(args.step_sleep)
    emit(
        {
            "final": True,
            "step": el.step,
            "world": el.world_size,
            "checksum": shard_checksum(el.model, el.optimizer),
        }
    )
    if log is not None:
        log.close()
    sys.stdout.flush()
    el.exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
