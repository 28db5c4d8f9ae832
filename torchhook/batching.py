"""How one training step's samples are split over the ranks of the current world: pure rules.

A step consumes ``global_batch`` consecutive samples of the job's sample stream
(``torchhook.data``); this module says which rank takes how many of them and in how many
micro-batches. Two policies, each a function of the world size only, so every rank
computes the same split without talking to the others:

- :class:`FixedGlobalBatch` (the default for exact recovery): the global batch stays the
  same at every world size, so the failure-free run and a run with world changes apply
  the same updates to the same samples. Split rule: with ``q, r = divmod(global_batch,
  world_size)``, ranks ``0..r-1`` take ``q + 1`` samples and the others ``q`` (the
  remainder goes to the lowest ranks, one each). A rank's samples are one contiguous block
  of the step, in rank order.
- :class:`FixedRankBatch`: every rank takes ``rank_batch`` samples, so the global batch
  is ``rank_batch × world_size`` and changes with the world. The learning rate follows the
  user's rule of the global batch (:class:`LrScale`: linear, square root, or a function of
  the user's), applied by :class:`ScaledLr` to an optimizer's parameter groups from the base
  rates it recorded: ``lr = base_lr × rule(global_batch, reference_batch)``.

Micro-batches (gradient accumulation): after a loss the survivors' share of a fixed global
batch grows by N/(N−1), which can run a full GPU out of memory. ``max_micro_batch`` bounds
what one forward pass sees: a rank takes its share in ``accumulation_steps = ceil(largest
share / max_micro_batch)`` micro-batches, the same number on every rank (FSDP2's
all-gathers run once per forward, so every rank of a shard group must run the same number
of them), each as equal as possible (the larger ones first) and never empty. To get the
same gradients as one big batch, weight each sample's loss by ``1 / global_batch`` (sum
over the micro-batches), not by the micro-batch's size: the shares differ by one sample
when ``world_size`` does not divide ``global_batch``.

A split that cannot keep every micro-batch non-empty is refused with
:class:`BatchPolicyError` (a ``ValueError`` naming the setting): fewer samples than ranks,
or ``max_micro_batch=1`` with shares of unequal size. The refusal happens when the split is
computed, before any state changes (``ElasticSampler.reconfigure`` calls it first).

The learning rate rule: linear scaling (Goyal et al., "Accurate, Large Minibatch SGD:
Training ImageNet in 1 Hour", 2017) multiplies the rate by ``global_batch /
reference_batch``; square-root scaling (Krizhevsky, "One weird trick for parallelizing
convolutional neural networks", 2014; common for Adam) by its square root. ``ScaledLr``
sets each group's ``lr`` outright, so an LR scheduler that recomputes ``lr`` each step from
its own base rates (``LambdaLR``) overrides it: with a scheduler, scale inside it instead,
``LambdaLR(opt, lambda s: warmup(s) * scale.factor(sampler.split.global_batch))``.

No torch here: ``tests/torchhook/test_batching.py`` checks the rules over many worlds.
Megatron-LM's ``num_microbatches_calculator`` and ``MegatronPretrainingSampler``
(global batch = micro-batch × data-parallel size × accumulation steps, consumed samples
counted globally) are the public precedent; this module relaxes their "must divide
exactly" rule with the remainder rule above.
"""

from __future__ import annotations

import math
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

MAX_WORLD_SIZE = 1 << 20
"""Ranks one split may name: the split is a tuple with one entry per rank, so the bound
keeps a mistaken world size from allocating gigabytes; a million ranks is far beyond any
job this hook serves."""


class BatchPolicyError(ValueError):
    """A batch setting that cannot be honoured at this world size; the message names it."""


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BatchPolicyError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class StepSplit:
    """One step's samples over the ranks: ``per_rank[r]`` samples for rank ``r``, taken in
    ``accumulation_steps`` micro-batches."""

    per_rank: tuple[int, ...]
    accumulation_steps: int

    @property
    def world_size(self) -> int:
        return len(self.per_rank)

    @property
    def global_batch(self) -> int:
        return sum(self.per_rank)

    def offset(self, rank: int) -> int:
        """Where rank ``rank``'s block starts inside the step (ranks take blocks in order)."""
        return sum(self.per_rank[:rank])

    def micro_batches(self, rank: int) -> tuple[int, ...]:
        """The sizes of rank ``rank``'s micro-batches, in order (larger ones first)."""
        return split_evenly(self.per_rank[rank], self.accumulation_steps)


def split_evenly(total: int, parts: int) -> tuple[int, ...]:
    """``total`` as ``parts`` sizes differing by at most one, larger first."""
    q, r = divmod(total, parts)
    return (q + 1,) * r + (q,) * (parts - r)


def accumulation_steps(largest_share: int, max_micro_batch: int) -> int:
    """Micro-batches needed so that no micro-batch of ``largest_share`` samples exceeds
    ``max_micro_batch``."""
    _positive("max_micro_batch", max_micro_batch)
    return -(-largest_share // max_micro_batch)


def _split(per_rank: tuple[int, ...], max_micro_batch: int, setting: str) -> StepSplit:
    steps = accumulation_steps(max(per_rank), max_micro_batch)
    if min(per_rank) < steps:
        raise BatchPolicyError(
            f"{setting}: shares of {min(per_rank)} to {max(per_rank)} samples over "
            f"{len(per_rank)} ranks cannot be cut into {steps} non-empty micro-batches of "
            f"at most max_micro_batch={max_micro_batch}; raise max_micro_batch or pick a "
            "global batch that the world size divides"
        )
    return StepSplit(per_rank, steps)


def _world(world_size: int) -> int:
    _positive("world_size", world_size)
    if world_size > MAX_WORLD_SIZE:
        raise BatchPolicyError(f"world_size {world_size} is above {MAX_WORLD_SIZE}")
    return world_size


def split_global_batch(global_batch: int, world_size: int, max_micro_batch: int) -> StepSplit:
    """The fixed-global-batch split (remainder to the lowest ranks, one each)."""
    _positive("global_batch", global_batch)
    _world(world_size)
    if global_batch < world_size:
        raise BatchPolicyError(
            f"global_batch={global_batch} is smaller than the world ({world_size} ranks): "
            "every rank needs at least one sample per step"
        )
    per_rank = split_evenly(global_batch, world_size)
    return _split(per_rank, max_micro_batch, f"global_batch={global_batch}")


def split_rank_batch(rank_batch: int, world_size: int, max_micro_batch: int) -> StepSplit:
    """The fixed-per-rank-batch split: ``rank_batch`` samples on every rank."""
    _positive("rank_batch", rank_batch)
    _world(world_size)
    return _split((rank_batch,) * world_size, max_micro_batch, f"rank_batch={rank_batch}")


@dataclass(frozen=True)
class FixedGlobalBatch:
    """Keep ``global_batch`` samples per step at every world size; no micro-batch above
    ``max_micro_batch`` (default: no bound beyond the share itself)."""

    global_batch: int
    max_micro_batch: int | None = None

    def __post_init__(self) -> None:
        _positive("global_batch", self.global_batch)
        if self.max_micro_batch is not None:
            _positive("max_micro_batch", self.max_micro_batch)

    def split(self, world_size: int) -> StepSplit:
        bound = self.global_batch if self.max_micro_batch is None else self.max_micro_batch
        return split_global_batch(self.global_batch, world_size, bound)


@dataclass(frozen=True)
class FixedRankBatch:
    """Keep ``rank_batch`` samples per rank and step; the global batch follows the world."""

    rank_batch: int
    max_micro_batch: int | None = None

    def __post_init__(self) -> None:
        _positive("rank_batch", self.rank_batch)
        if self.max_micro_batch is not None:
            _positive("max_micro_batch", self.max_micro_batch)

    def split(self, world_size: int) -> StepSplit:
        bound = self.rank_batch if self.max_micro_batch is None else self.max_micro_batch
        return split_rank_batch(self.rank_batch, world_size, bound)


BatchPolicy = FixedGlobalBatch | FixedRankBatch


LrRule = Literal["linear", "sqrt"] | Callable[[int, int], float]
"""``"linear"``, ``"sqrt"``, or ``rule(global_batch, reference_batch) -> factor``."""


@dataclass(frozen=True)
class LrScale:
    """The learning-rate factor at a global batch: ``rule(global_batch, reference_batch)``,
    where ``reference_batch`` is the global batch the base rates were tuned for."""

    reference_batch: int
    rule: LrRule = "linear"

    def __post_init__(self) -> None:
        _positive("reference_batch", self.reference_batch)
        if self.rule not in ("linear", "sqrt") and not callable(self.rule):
            raise BatchPolicyError(f"lr rule must be 'linear', 'sqrt' or a function: {self.rule!r}")

    def factor(self, global_batch: int) -> float:
        """The factor at ``global_batch``; a user rule's result must be a positive finite
        number (else :class:`BatchPolicyError` naming the rule and the value)."""
        _positive("global_batch", global_batch)
        ratio = global_batch / self.reference_batch
        if self.rule == "linear":
            return ratio
        if self.rule == "sqrt":
            return math.sqrt(ratio)
        assert callable(self.rule)
        value = self.rule(global_batch, self.reference_batch)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BatchPolicyError(f"lr rule {self.rule!r} returned {value!r}, not a number")
        if not math.isfinite(value) or value <= 0:
            raise BatchPolicyError(f"lr rule {self.rule!r} returned {value!r} at {global_batch}")
        return float(value)


@dataclass(frozen=True)
class ScaledLr:
    """Base learning rates recorded once (:meth:`record`, at registration, before any
    scaling) and the rule; :meth:`apply` sets each group's rate for a global batch."""

    scale: LrScale
    base_lrs: tuple[float, ...]

    @classmethod
    def record(cls, param_groups: Sequence[MutableMapping[str, Any]], scale: LrScale) -> ScaledLr:
        return cls(scale, tuple(float(g["lr"]) for g in param_groups))

    def apply(self, param_groups: Sequence[MutableMapping[str, Any]], global_batch: int) -> float:
        """``lr = base_lr × factor`` in each group (a new optimizer's groups too, as long as
        there are as many); returns the factor. Validates first: a refusal changes nothing.
        A tensor ``lr`` (a fused or capturable optimizer) is filled in place."""
        if len(param_groups) != len(self.base_lrs):
            raise BatchPolicyError(
                f"the optimizer has {len(param_groups)} parameter groups, "
                f"the recorded base rates {len(self.base_lrs)}"
            )
        factor = self.scale.factor(global_batch)
        for group, base in zip(param_groups, self.base_lrs, strict=True):
            if hasattr(group["lr"], "fill_"):
                group["lr"].fill_(base * factor)
            else:
                group["lr"] = base * factor
        return factor
