"""Elastic training from a DataLoader with worker processes: every sample of an epoch once.

    SWIM_CONTROL=/run/swim/agent.sock python examples/elastic_data.py --job demo \\
        --strategy ddp --log steps.jsonl

The data is a map-style dataset of ``--samples`` regression samples (sample ``i`` is made
from ``i`` alone and carries ``i``, so a batch shows which samples it holds), read through
``DataLoader(dataset, batch_sampler=ElasticSampler(...), num_workers=2)`` and
``Elastic.data``: a fixed global batch (``--global-batch``) cut into micro-batches of at
most ``--max-micro-batch`` samples, so a rank takes more micro-batches, not bigger ones,
when the world shrinks. Each micro-batch taken logs an ``attempt`` record and each
committed step a record with the sample indices this rank consumed in it, so a test can
check that every sample of every epoch went to exactly one committed step. ``--reference``
prints the failure-free loss curve (one process, the same sample stream). The job's
model, command line, step log and planned faults are examples/job.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import job
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from torchhook import DDP, FSDP, HSDP, Elastic, ElasticSampler, FixedGlobalBatch, Settings
from torchhook.parallel import Parallelism


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Sample ``i``: inputs and target from a generator seeded by ``i``, and ``i`` itself."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = torch.randn(job.IN_DIM, generator=torch.Generator().manual_seed(5000 + i))
        y = torch.sin(x[:4].sum()).reshape(1) + 0.1 * x[4:5]
        return x, y, i


def sampler_for(args: argparse.Namespace) -> ElasticSampler:
    policy = FixedGlobalBatch(args.global_batch, max_micro_batch=args.max_micro_batch)
    return ElasticSampler(args.samples, policy, seed=args.seed)


def reference(args: argparse.Namespace) -> list[float]:
    """The same sample stream in one process, one batch per step: the failure-free curve."""
    data, sampler = Samples(args.samples), sampler_for(args)
    model = job.build_model(args.seed)
    opt = job.optimizer_for(model)
    sched = job.scheduler_for(opt)
    losses = []
    xs = torch.stack([data[i][0] for i in range(len(data))])
    ys = torch.stack([data[i][1] for i in range(len(data))])
    for step in range(args.steps):
        idx = sampler.indices(step * args.global_batch, (step + 1) * args.global_batch)
        x, y = xs[idx], ys[idx]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        torch.autograd.backward(loss)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


def strategy(args: argparse.Namespace) -> Parallelism:
    def build() -> nn.Module:
        return job.build_model(args.seed)

    if args.strategy == "ddp":
        model = build()
        return DDP(model, job.optimizer_for(model))
    if args.strategy == "hsdp":
        return HSDP(build, job.optimizer_for)
    return FSDP(
        build,
        job.optimizer_for,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
    )


def main(argv: list[str] | None = None) -> int:
    ap = job.parser(__doc__, job="elastic-data-demo", pg_timeout_s=60.0)
    ap.add_argument("--strategy", choices=("ddp", "hsdp", "fsdp"), default="ddp")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--max-micro-batch", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.set_defaults(global_batch=24)
    args = ap.parse_args(argv)
    if args.reference:
        print(json.dumps(reference(args)))
        return 0
    job.start(args)
    state, counter = job.training_state()
    el = Elastic(strategy(args), Settings(**job.hook_options(args)), state=state)
    sampler = sampler_for(args)
    loader = DataLoader(
        Samples(args.samples),
        batch_sampler=sampler,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,  # a world change restarts no worker
    )
    feed = el.data(loader)  # before el.scheduler: with HSDP/FSDP that forms the group
    sched = el.scheduler("lr", job.scheduler_for)
    log = job.StepLog(args.log)
    every = args.checkpoint_every
    skip = (lambda s: s % every == 0) if args.strategy == "fsdp" else (lambda s: False)
    faults = job.Faults(args, log, fires=el.local_rank == 0, skip=skip)

    def where() -> dict[str, Any]:
        return {"rank": el.rank, "world": el.world_size, "token": el.group_token}

    def train_step(model: nn.Module) -> tuple[float, list[int]]:
        opt = None if args.strategy == "hsdp" else el.optimizer  # HSDP steps it itself
        if opt is not None:
            opt.zero_grad()
        taken: list[int] = []
        total = torch.zeros(())
        for i, (x, y, idx) in enumerate(feed.batches()):
            faults.in_step(el.step)
            taken += idx.tolist()
            log.emit({"attempt": el.step, "micro": i, "indices": idx.tolist()} | where())
            loss = nn.functional.mse_loss(model(x), y, reduction="sum")
            if i == 0:
                faults.in_backward(el.step, loss)
            torch.autograd.backward(loss * feed.sample_weight)
            total += loss.detach()
        # the loss's all-reduce before the optimizer step (Elastic.run_step's rule)
        total = el.all_reduce(total)
        if opt is not None:
            opt.step()
        return float(total) / feed.split.global_batch, taken

    while True:
        limit = job.stop_step(args.stop_file)
        if el.step >= (limit if limit is not None else args.steps):
            break
        faults.before_step(el.step)
        loss, taken = el.run_step(train_step)
        sched.step()
        counter.steps += 1
        record = {"step": el.step - 1, "loss": loss, "indices": taken, "counter": counter.steps}
        record |= {"position": sampler.position, "micro_batches": feed.split.accumulation_steps}
        record |= {"t": time.time(), "node": el.node, "local_rank": el.local_rank}
        log.emit(record | where() | {"pid": os.getpid()})
        if args.step_sleep:
            time.sleep(args.step_sleep)
    log.emit({"final": True, "step": el.step, "world": el.world_size, "pid": os.getpid()})
    log.close()
    el.exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
