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

import job
from torch import nn

from torchhook import FSDP, Elastic, Settings


def main(argv: list[str] | None = None) -> int:
    ap = job.parser(__doc__, job="elastic-fsdp-demo", pg_timeout_s=15.0)
    ap.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    ap.add_argument("--checkpoint-every", type=int, default=2)
    args = ap.parse_args(argv)
    if not job.start(args):
        return 0
    fsdp = FSDP(
        lambda: job.build_model(args.seed),
        job.optimizer_for,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
    )
    state, counter = job.training_state()
    el = Elastic(fsdp, Settings(**job.hook_options(args)), state=state)
    log = job.StepLog(args.log)
    every = args.checkpoint_every
    faults = job.Faults(args, log, fires=el.local_rank == 0, skip=lambda step: step % every == 0)

    def train_step(model: nn.Module) -> float:
        # the optimizer is read here: it changes when the group re-forms
        return job.slice_step(el, model, args, faults, el.optimizer)

    def details() -> dict[str, object]:
        return {"resumed": fsdp.resumed_step, "load_s": round(fsdp.last_load_s, 4)}

    job.train(el, train_step, args, log, faults, details, counter)
    el.exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
