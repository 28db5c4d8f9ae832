"""In-process elastic FSDP2 on CPU/gloo: trainers on nodes, membership from each node's agent.

    SWIM_CONTROL=/run/swim/agent.sock python examples/elastic_fsdp.py --job demo \\
        --checkpoint-dir /mnt/ckpt --checkpoint-every 2 --log steps.jsonl

The model is sharded with FSDP2 over every rank of the current group and checkpointed every
``--checkpoint-every`` steps into ``--checkpoint-dir`` (shared by all nodes). When a node
dies the survivors form a smaller group in the same processes, rebuild and reshard the
model, reload the newest complete checkpoint and go on from its step (a rollback). Every
process builds the same init (``--seed``): FSDP does not broadcast parameters. A planned
fault (``--fault-file``) lands on the first step after the file appears that is not a
checkpoint step, so the survivors must roll back at least one step. The job, the command
line, the step log and the faults are examples/job.py's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from job import Faults, StepLog, batch, build_model, optimizer_for, parser, start, train
from torch import nn

from torchhook.elastic_fsdp import ElasticFSDP


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, job="elastic-fsdp-demo", pg_timeout_s=15.0)
    ap.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    ap.add_argument("--checkpoint-every", type=int, default=2)
    args = ap.parse_args(argv)
    if not start(args):
        return 0
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
    log = StepLog(args.log)
    every = args.checkpoint_every
    faults = Faults(args, log, fires=el.local_rank == 0, skip=lambda step: step % every == 0)

    def train_step(model: nn.Module) -> float:
        # optimizer and step are read here: both change when the group re-forms
        lo, hi = el.shard(args.global_batch)
        x, y = batch(el.step, args.global_batch)
        opt = el.optimizer
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
        faults.in_backward(el.step, loss)
        torch.autograd.backward(loss)
        opt.step()
        # the global batch's mean from the ranks' slice means, weighted by slice size
        total = el.all_reduce(loss.detach().clone() * (hi - lo))
        mean: float = float(total) / args.global_batch
        return mean

    def details() -> dict[str, object]:
        return {"resumed": el.resumed_step, "load_s": round(el.last_load_s, 4)}

    train(el, train_step, args, log, faults, details)
    el.exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
