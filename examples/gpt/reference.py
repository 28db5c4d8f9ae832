"""The failure-free loss curve of ``train_elastic.py``, in one process: the reference.

    python examples/gpt/reference.py --steps 40        (prints a JSON list: loss per step)

The same model and init, optimizer, schedule and samples as the elastic script, without
sharding: step ``s`` takes the whole global batch, positions ``s × global_batch`` onward of
``ElasticSampler``'s stream, which the elastic ranks split in blocks. With a global batch
that every world size used divides, each rank's mean loss weighs the same, so the mean of
the ranks' gradients is this batch's gradient and the two runs apply the same updates to
the same samples; they differ only in the order floating-point sums are taken (sharded
reduce-scatter, the all-reduce across nodes), which is why comparisons use a tolerance.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from gpt import GPT, Windows, make_corpus, warmup_cosine
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import default_collate

from torchhook import ElasticSampler, FixedGlobalBatch


def reference(
    steps: int, global_batch: int = 24, block: int = 32, lr: float = 3e-3, seed: int = 0
) -> list[float]:
    data = Windows(make_corpus(4000, seed), block)
    stream = ElasticSampler(len(data), FixedGlobalBatch(global_batch), seed=seed)
    torch.manual_seed(seed)
    model = GPT(len(data.vocab), block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = LambdaLR(optimizer, warmup_cosine(steps))
    losses = []
    for step in range(steps):
        indices = stream.indices(step * global_batch, (step + 1) * global_batch)
        x, y = default_collate([data[i] for i in indices])
        loss = F.cross_entropy(model(x), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(reference(args.steps, args.global_batch, args.block, args.lr, args.seed)))


if __name__ == "__main__":
    main()
