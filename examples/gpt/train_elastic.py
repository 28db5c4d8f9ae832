"""A small GPT trained with FSDP2 on CPU/gloo, elastic: ``train_plain.py`` on swim's membership.

    LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 SWIM_CONTROL=/run/swim/agent.sock \\
        python examples/gpt/train_elastic.py --job gpt --nodes 3 --loss-log steps.r0.jsonl
    (and LOCAL_RANK=1; the same on every node, each beside its node's agent)

The same model, corpus, schedule and the user's own FSDP2 ``parallelize`` as the plain
script, made elastic with ``HSDP``: each node's ranks shard one copy of the model with
that ``parallelize`` (on the node's mesh), every node holds a copy, and the hook owns only
the dimension across nodes. A node that dies leaves the survivors training from memory at
the step they were at (no checkpoint, no step lost); a node that comes back joins at a step
boundary and takes its shards from a survivor. The ``DataLoader`` (worker processes)
reads through an ``ElasticSampler`` and ``Elastic.data``: a fixed global batch of one
sample stream, so every sample is used once and each step sees the same samples at any
world size; the sampler's position and the LR scheduler travel with the model. With a
global batch that every world size divides (24: worlds 2, 4 and 6 of two-rank nodes) each
rank's mean loss weighs the same, so the updates, and the loss curve, are the failure-free
run's (``reference.py``); for shares that differ, weight a summed loss by
``feed.sample_weight`` (docs/training.md §6). ``--loss-log`` gets one JSON line per step
from this rank. docs/training.md §9.2 shows the diff from the plain script.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch
import torch.nn.functional as F
from gpt import GPT, Windows, make_corpus, parallelize, warmup_cosine
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from torchhook import HSDP, Elastic, ElasticSampler, FixedGlobalBatch, Settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    # --loss-log: torchrun would take "--log" for an abbreviation of its own --log-dir
    ap.add_argument("--loss-log", "--log", default="", help="one JSON line per step (this rank)")
    ap.add_argument("--job", default="gpt")
    ap.add_argument("--control", default=None, help="agent socket (default: SWIM_CONTROL)")
    ap.add_argument("--nodes", type=int, default=1, help="nodes to wait for at the start")
    ap.add_argument("--min-nodes", type=int, default=1, help="nodes to train on after a loss")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    data = Windows(make_corpus(4000, args.seed), args.block)
    sampler = ElasticSampler(len(data), FixedGlobalBatch(args.global_batch), seed=args.seed)
    loader = DataLoader(
        data, batch_sampler=sampler, num_workers=args.workers, persistent_workers=True
    )

    def build_model() -> GPT:
        torch.manual_seed(args.seed)
        return GPT(len(data.vocab), args.block)

    def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=args.lr)

    hsdp = HSDP(build_model, build_optimizer, parallelize=parallelize)
    el = Elastic(hsdp, Settings(job=args.job, control=args.control, min_nodes=args.min_nodes))
    el.membership.wait(lambda view: len(view.members) >= args.nodes, timeout_s=600)
    feed = el.data(loader)  # its position travels with the model; before the first group
    schedule = el.scheduler("lr", lambda opt: LambdaLR(opt, warmup_cosine(args.steps)))

    def train_step(model: nn.Module) -> float:
        for x, y in feed.batches():  # this rank's share of the step, taken again if cut
            loss = F.cross_entropy(model(x), y.flatten())
            loss.backward()
        total = el.all_reduce(loss.detach().clone())
        return total.item() / el.world_size  # HSDP reduces across nodes and steps

    while el.step < args.steps:
        loss = el.run_step(train_step)
        schedule.step()
        if args.loss_log:
            with open(args.loss_log, "a") as log:
                record = {"step": el.step, "loss": loss, "world": el.world_size}
                print(json.dumps(record | {"t": time.time(), "pid": os.getpid()}), file=log)
    el.exit(0)


if __name__ == "__main__":
    main()
