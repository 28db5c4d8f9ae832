"""In-process elastic DDP on CPU/gloo: trainers on nodes, membership from each node's agent.

    SWIM_CONTROL=/run/swim/agent.sock python examples/elastic_ddp.py --job demo --log steps.jsonl

One process per local rank: with several per node, start them with ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` set (as torchrun does) or pass ``--local-rank``/``--local-world-size``.
Every process starts from its own random init on purpose: consistency comes from the group
(the new group's source rank broadcasts). The job, the command line, the step log and the
planned faults (``--fault``) are examples/job.py's.
"""

from __future__ import annotations

import zlib

import job
from torch import nn

from agent.control import ControlClient
from torchhook import DDP, Elastic, Settings
from torchhook.client import local_place


def rank_seed(node: str, local_rank: int) -> int:
    """A different init on every process on purpose: consistency must come from the group
    (a test recomputes the first rank 0's init from its node's name)."""
    return zlib.crc32(f"{node}/{local_rank}".encode())


def main(argv: list[str] | None = None) -> int:
    ap = job.parser(__doc__, job="elastic-demo", pg_timeout_s=60.0)
    ap.add_argument("--local-rank", type=int, default=None, help="default: LOCAL_RANK or 0")
    ap.add_argument(
        "--local-world-size", type=int, default=None, help="default: LOCAL_WORLD_SIZE or 1"
    )
    args = ap.parse_args(argv)
    if not job.start(args):
        return 0
    node = ControlClient(args.control).request("info")["node"]
    local_rank, local_world_size = local_place(args.local_rank, args.local_world_size)
    model = job.build_model(rank_seed(node, local_rank))
    opt = job.optimizer_for(model)
    settings = Settings(
        local_rank=local_rank, local_world_size=local_world_size, **job.hook_options(args)
    )
    state, counter = job.training_state()
    el = Elastic(DDP(model, opt), settings, state=state)
    log = job.StepLog(args.log)
    faults = job.Faults(args, log, fires=el.local_rank == 0)

    def train_step(ddp: nn.Module) -> float:
        return job.slice_step(el, ddp, args, faults, opt)

    def details() -> dict[str, object]:
        return {"source": el.last_plan.source if el.last_plan else None}

    job.train(el, train_step, args, log, faults, details, counter)
    el.exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
