"""In-process elastic HSDP on CPU/gloo: shard within a node, replicate across nodes.

    LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 SWIM_CONTROL=/run/swim/agent.sock \\
        python examples/elastic_hsdp.py --job demo --log steps.r0.jsonl    (and LOCAL_RANK=1)

Each node's local ranks shard one copy of the model between them (FSDP2); every node holds
one copy. When a node dies the survivors go on from memory at the step they were at: no
checkpoint, no rollback (torchhook/elastic_hsdp.py). Every process builds the same init
(``--seed``): FSDP does not broadcast parameters at the first formation. The job, the
command line, the step log and the planned faults are examples/job.py's; the final
record's checksum covers this rank's shards, equal on every node for the same local rank.
"""

from __future__ import annotations

import torch
from job import Faults, StepLog, batch, build_model, optimizer_for, parser, start, train
from torch import nn

from torchhook.elastic_hsdp import ElasticHSDP


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__, job="elastic-hsdp-demo", pg_timeout_s=60.0).parse_args(argv)
    if not start(args):
        return 0
    el = ElasticHSDP(
        lambda: build_model(args.seed),
        optimizer_for,
        job=args.job,
        control=args.control,
        min_nodes=args.min_nodes,
        pg_timeout_s=args.pg_timeout,
        heartbeat_pause_ms=args.heartbeat_pause_ms,
    )
    log = StepLog(args.log)
    faults = Faults(args, log, fires=el.local_rank == 0)

    def forward_backward(model: nn.Module) -> float:
        # forward and backward only: ElasticHSDP reduces across nodes, commits and steps
        lo, hi = el.shard(args.global_batch)
        x, y = batch(el.step, args.global_batch)
        loss = nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
        faults.in_backward(el.step, loss)
        torch.autograd.backward(loss)
        # the global batch's mean from the ranks' slice means, weighted by slice size
        total = el.all_reduce(loss.detach().clone() * (hi - lo))
        mean: float = float(total) / args.global_batch
        return mean

    def details() -> dict[str, object]:
        plan = el.last_plan
        return {"restore": plan.restore if plan else None, "resumed": plan.step if plan else None}

    train(el, forward_backward, args, log, faults, details)
    el.exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
