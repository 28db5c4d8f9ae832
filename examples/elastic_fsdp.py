"""In-process elastic FSDP2 on CPU/gloo: trainers on nodes, membership from each node's agent.

    SWIM_CONTROL=/run/swim/agent.sock python examples/elastic_fsdp.py --job demo \\
        --checkpoint-dir /shared/ckpt --checkpoint-every 2 --log steps.jsonl

The model is sharded with FSDP2 over the current group and checkpointed every
``--checkpoint-every`` steps into ``--checkpoint-dir`` (shared by all nodes). When a node
dies the survivors form a smaller group in the same processes, rebuild and reshard the
model, reload the newest complete checkpoint and go on from its step (a rollback). Every
node builds the same init (``--seed``): FSDP does not broadcast parameters. The global
batch of each step is fixed (``--global-batch``, 12) and split evenly over the ranks, so
the loss curve equals the single-process unsharded run that ``--reference`` prints.

Runs until ``--steps`` or the step written in ``--stop-file``. ``--fault`` makes this
node fail on purpose: it kills or stops its whole process group (the agent too, when the
caller started them in one) at the step boundary or inside backward, at ``--fault-step``
or at the first step after ``--fault-file`` appears that is not a checkpoint step (so the
survivors must roll back at least one step).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

# the same model (64 rows shard unevenly over 3 ranks, 22/22/20: resharding must get that
# right), data, failure-free reference and fault helpers as the DDP example, so both modes
# train the same job; run as a script, this directory is on sys.path
from elastic_ddp import batch, build_model, fault, optimizer_for, reference, stop_step
from torch import nn

from torchhook.elastic_fsdp import ElasticFSDP


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--job", default="elastic-fsdp-demo")
    ap.add_argument("--control", default=None, help="agent control socket (default: SWIM_CONTROL)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--stop-file", type=Path, default=None)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (pacing)")
    ap.add_argument("--log", type=Path, default=None, help="append one JSON line per step")
    ap.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument(
        "--fault",
        choices=["none", "kill-in-backward", "stop-in-backward", "kill", "stop"],
        default="none",
    )
    ap.add_argument("--fault-step", type=int, default=-1)
    ap.add_argument(
        "--fault-file", type=Path, default=None, help="fault at a step after it appears"
    )
    ap.add_argument("--min-nodes", type=int, default=1)
    ap.add_argument("--pg-timeout", type=float, default=15.0)
    ap.add_argument("--heartbeat-pause-ms", type=int, default=30_000)
    ap.add_argument("--reference", action="store_true", help="print the failure-free curve")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.reference:
        print(json.dumps(reference(args.steps, args.global_batch, args.seed)))
        return 0

    torch.set_num_threads(1)  # several trainers share a few cores in the tests
    el = ElasticFSDP(
        lambda: build_model(args.seed),
        optimizer_for,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
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

    def train_step(model: nn.Module) -> float:
        # optimizer and step are read here: both change when the group re-forms
        lo, hi = el.shard(args.global_batch)
        x, y = batch(el.step, args.global_batch)
        opt = el.optimizer
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
        if faulty and el.step == args.fault_step and args.fault.endswith("in-backward"):
            loss.register_hook(lambda grad: fault(args.fault, log))  # type: ignore[no-untyped-call]
        torch.autograd.backward(loss)
        opt.step()
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
            # the next step that is not a checkpoint step: the survivors must roll back
            args.fault_step = el.step + 1
            while args.fault_step % args.checkpoint_every == 0:
                args.fault_step += 1
        if faulty and el.step == args.fault_step and args.fault in ("kill", "stop"):
            fault(args.fault, log)
        loss = el.run_step(train_step)
        step = el.step - 1  # the step that ran (after a rollback: a step of the new group)
        emit(
            {
                "step": step,
                "loss": loss,
                "rank": el.rank,
                "world": el.world_size,
                "leader": el.order[0],
                "formations": el.reconfigurations,
                "formation_s": round(el.last_formation_s, 4),
                "resumed": el.resumed_step,
                "load_s": round(el.last_load_s, 4),
                "verdict_t": el.verdict_time,
            }
        )
        if args.step_sleep:
            time.sleep(args.step_sleep)
    emit({"final": True, "step": el.step, "world": el.world_size})
    if log is not None:
        log.close()
    sys.stdout.flush()
    el.exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
