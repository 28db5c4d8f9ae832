"""In-process elastic HSDP on CPU/gloo: shard within a node, replicate across nodes.

    LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 SWIM_CONTROL=/run/swim/agent.sock \\
        python examples/elastic_hsdp.py --job demo --log steps.r0.jsonl    (and LOCAL_RANK=1)

Each node's local ranks shard one copy of the model between them (FSDP2); every node holds
one copy. When a node dies the survivors go on from memory at the step they were at: no
checkpoint, no rollback (torchhook/parallel_hsdp.py). Every process builds the same init
(``--seed``): FSDP does not broadcast parameters at the first formation. The job, the
command line, the step log and the planned faults are examples/job.py's; the final
record's checksum covers this rank's shards, equal on every node for the same local rank.
"""

from __future__ import annotations

import job
from torch import nn

from torchhook import HSDP, Elastic, Settings


def main(argv: list[str] | None = None) -> int:
    args = job.parser(__doc__, job="elastic-hsdp-demo", pg_timeout_s=60.0).parse_args(argv)
    if not job.start(args):
        return 0
    hsdp = HSDP(lambda: job.build_model(args.seed), job.optimizer_for)
    state, counter = job.training_state()
    el = Elastic(hsdp, Settings(**job.hook_options(args)), state=state)
    log = job.StepLog(args.log)
    faults = job.Faults(args, log, fires=el.local_rank == 0)

    def forward_backward(model: nn.Module) -> float:
        # forward and backward only: HSDP reduces across nodes, commits and steps
        return job.slice_step(el, model, args, faults, None)

    def details() -> dict[str, object]:
        plan = el.last_plan
        assert el.model is not None  # after a step
        mesh = next(p.device_mesh for p in el.model.parameters() if hasattr(p, "device_mesh"))
        return {
            "restore": plan.restore if plan else None,
            "resumed": plan.step if plan else None,
            "mesh": list(mesh.mesh_dim_names or ()),
        }

    job.train(el, forward_backward, args, log, faults, details, counter)
    el.exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
