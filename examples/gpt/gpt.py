"""The model, the corpus and the user's sharding for the GPT example (plain PyTorch).

A character-level GPT (two transformer blocks); a corpus the example writes itself (sums
in words, ``"seventeen plus four is twenty one."``: a pattern a tiny model learns within
a few dozen steps, so the loss falls visibly); the learning-rate schedule; and
``parallelize``, the user's FSDP2 sharding: one ``fully_shard`` per block, then the root.
Shared by ``train_plain.py``, ``train_elastic.py`` and ``reference.py``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import Dataset

WORDS = [
    *("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"),
    *("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen"),
    *("seventeen", "eighteen", "nineteen"),
]
TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def spell(n: int) -> str:
    if n < 20:
        return WORDS[n]
    tens, ones = divmod(n, 10)
    return TENS[tens - 2] + ("" if ones == 0 else " " + WORDS[ones])


def make_corpus(sentences: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        a, b = rng.randrange(50), rng.randrange(50)
        lines.append(f"{spell(a)} plus {spell(b)} is {spell(a + b)}.")
    return "\n".join(lines) + "\n"


def warmup_cosine(total_steps: int, warmup: int = 5) -> Callable[[int], float]:
    """The LR factor at step ``s``: a linear warm-up, then a cosine decay to zero."""

    def factor(s: int) -> float:
        return min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / total_steps))

    return factor


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every ``block + 1`` characters of the corpus: the input and the next-character target."""

    def __init__(self, text: str, block: int) -> None:
        self.vocab = sorted(set(text))
        self.data = torch.tensor([self.vocab.index(c) for c in text], dtype=torch.long)
        self.block = block

    def __len__(self) -> int:
        return len(self.data) - self.block - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i : i + self.block + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, dim: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        # (batch × position, vocab): a 2-D result is not a view, which FSDP2's hooks need
        return self.head(self.ln(x).flatten(0, 1))


def parallelize(model: GPT, mesh: DeviceMesh) -> GPT:
    """The user's sharding: one FSDP2 unit per block, then the root."""
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
