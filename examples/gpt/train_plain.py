"""A small GPT trained with FSDP2 on CPU/gloo: the plain script, before it is made elastic.

    torchrun --nnodes 1 --nproc-per-node 2 examples/gpt/train_plain.py --steps 40 --loss-log l.jsonl

An ordinary PyTorch training script over ``gpt.py``'s model, corpus and the user's own
FSDP2 ``parallelize``, with a ``DataLoader`` that has worker processes.
``train_elastic.py`` is the same script made elastic; docs/training.md shows the diff.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt import GPT, Windows, make_corpus, parallelize, warmup_cosine
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, DistributedSampler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    # --loss-log: torchrun would take "--log" for an abbreviation of its own --log-dir
    ap.add_argument("--loss-log", default="", help="append one JSON line per step (rank 0)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = Windows(make_corpus(4000, args.seed), args.block)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(
        data, batch_size=args.global_batch // world, sampler=sampler, num_workers=args.workers
    )

    def build_model() -> GPT:
        torch.manual_seed(args.seed)
        return GPT(len(data.vocab), args.block)

    def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=args.lr)

    model = parallelize(build_model(), init_device_mesh("cpu", (world,)))
    optimizer = build_optimizer(model)
    schedule = LambdaLR(optimizer, warmup_cosine(args.steps))

    step, batches = 0, iter(loader)
    while step < args.steps:
        x, y = next(batches)
        loss = F.cross_entropy(model(x), y.flatten())
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        step += 1
        if args.loss_log and rank == 0:
            with open(args.loss_log, "a") as log:
                record = {"step": step, "loss": total.item() / world, "world": world}
                print(json.dumps(record | {"t": time.time(), "pid": os.getpid()}), file=log)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
