"""Data that survives a world change: an elastic batch sampler for ``torch.utils.data.DataLoader``.

The rules, which give every sample of an epoch to exactly one step of the job, across
shrinks and regrows:

1. **One stream.** The job reads one endless stream of sample indices: epoch ``e`` is a
   permutation of ``range(num_samples)`` that depends on ``(seed, e)`` only (numpy's
   ``default_rng([seed, e])``; the identity with ``shuffle=False``), and the stream is
   epoch 0, then epoch 1, and so on. Stream position ``p`` holds sample
   ``perm(p // num_samples)[p % num_samples]``. Every rank computes the same stream.
2. **One position.** The job's place in the stream is ``position``: the number of samples
   that *committed steps* consumed, over all ranks. A step takes the next
   ``global_batch`` positions of the stream, and each rank takes its block of them as
   ``torchhook.batching`` splits it (in micro-batches). A step may cross an epoch boundary.
3. **Counted by the step, not by the loader.** A ``DataLoader`` with workers asks the
   sampler for ``prefetch_factor × num_workers`` batches ahead, and those are gone from
   the sampler's iterator before the training step has seen them. So the iterator does not
   move the position: the training loop calls :meth:`ElasticSampler.advance` after each
   committed step (one ``global_batch`` by default). A step cut short by a world change is
   not committed and is taken again, whole, at the new world: the same samples, so with
   ``FixedGlobalBatch`` the run applies the same updates as the failure-free one.
4. **At a world change** every rank of the new world loads the same state (a survivor's
   :meth:`~ElasticSampler.state_dict`, which is what a newcomer receives), calls
   :meth:`~ElasticSampler.reconfigure` with its new rank and world size, and starts a new
   loader iterator (``iter(loader)``): batches prefetched by the old one are dropped, and
   an iterator made before the change yields nothing more (it checks the sampler's
   ``generation``). The remaining positions are then split at the new world size.

The sampler is passed as ``batch_sampler=``: it yields this rank's micro-batches (lists of
indices) in the main process; workers only load them. Its state is four numbers (``seed``,
``num_samples``, ``shuffle``, ``position``); rank and world size are not state, they come
from the world.

``torchdata``'s ``StatefulDataLoader`` protocol: the sampler and its iterator both have
``state_dict``/``load_state_dict``. StatefulDataLoader snapshots the sampler's iterator when
it hands a batch to a worker and restores it on ``load_state_dict``, so its own
checkpoints resume after the last batch it yielded; restoring an iterator state at the
same world also sets the sampler's ``position`` to the start of the step that iterator was
in. ``torchdata`` is not a dependency; only the protocol is matched (its sources:
``torchdata/stateful_dataloader/stateful_dataloader.py``, ``sampler.py``).

The end: with ``num_epochs`` set the stream stops after ``num_epochs × num_samples``
positions, at the last *full* step: a final remainder shorter than one step is not handed
out (choose a global batch that divides the total to see all of the last epoch). Without
``num_epochs`` the stream is endless and the training loop counts steps.

Public precedent: Megatron-LM's ``MegatronPretrainingSampler`` (a global
``consumed_samples`` counter, each rank its block of the global batch) and PyTorch's
``DistributedSampler`` (a permutation from ``seed + epoch``); this sampler differs from the
latter in never padding or dropping to even out ranks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from torchhook.batching import BatchPolicy, StepSplit

PERMUTATIONS_KEPT = 2
"""Epoch permutations cached in the main process (each ``num_samples`` int64). A batch
spans at most one epoch boundary unless an epoch is smaller than a step, and a loader's
prefetch runs a few batches ahead, so two cover the normal case; an older epoch is
recomputed (correct, only slower)."""

STATE_VERSION = 1


class SamplerStateError(ValueError):
    """A sampler state that does not belong to this sampler; the message names the field."""


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SamplerStateError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class ElasticSampler(Sampler[list[int]]):
    """This rank's micro-batches of the job's sample stream (module docstring: the rules).

    ``num_samples`` is ``len(dataset)``; ``policy`` a ``torchhook.batching`` policy
    (``FixedGlobalBatch`` or ``FixedRankBatch``); ``rank``/``world_size`` the current
    world's (leave them out under ``Elastic.data``, which sets them at every group);
    ``seed`` the permutation seed (same on every rank).
    """

    def __init__(
        self,
        num_samples: int,
        policy: BatchPolicy,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
    ) -> None:
        super().__init__()
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.seed = _check_int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.policy = policy
        self.end: int | None = None
        if num_epochs is not None:
            self.end = _check_int("num_epochs", num_epochs, 1) * num_samples
        self._position = 0
        self._generation = 0
        self._perms: OrderedDict[int, np.ndarray[Any, np.dtype[np.int64]]] = OrderedDict()
        self.rank, self.world_size, self.split = self._checked_world(rank, world_size)

    # -- the world ------------------------------------------------------------------------

    def _checked_world(self, rank: int, world_size: int) -> tuple[int, int, StepSplit]:
        split = self.policy.split(world_size)  # raises BatchPolicyError naming the setting
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
        return rank, world_size, split

    def reconfigure(self, rank: int, world_size: int) -> None:
        """Switch to a new world at a step boundary: the remaining positions are split at
        ``world_size``. Iterators made before this call yield nothing more; start a new
        loader iterator. Validates first: a refused split changes nothing."""
        self.rank, self.world_size, self.split = self._checked_world(rank, world_size)
        self._generation += 1

    @property
    def generation(self) -> int:
        """Bumped by every reconfigure and state load; an iterator of an older one stops."""
        return self._generation

    # -- the position ---------------------------------------------------------------------

    @property
    def position(self) -> int:
        """Samples consumed by committed steps since the start of the job, over all ranks."""
        return self._position

    @property
    def epoch(self) -> int:
        """The epoch of the next sample to be consumed."""
        return self._position // self.num_samples

    def advance(self, samples: int | None = None) -> None:
        """Record a committed step: ``samples`` consumed over all ranks (default: one step,
        ``split.global_batch``). Call it on every rank, after the optimizer step."""
        n = self.split.global_batch if samples is None else samples
        _check_int("samples", n, 0)
        if self.end is not None and self._position + n > self.end:
            raise ValueError(
                f"advance({n}) passes the end of the stream ({self.end} samples, "
                f"num_epochs × num_samples) from position {self._position}"
            )
        self._position += n

    def steps_left(self) -> int | None:
        """Full steps left at the current world (None: endless stream)."""
        if self.end is None:
            return None
        return (self.end - self._position) // self.split.global_batch

    def __len__(self) -> int:
        """Micro-batches this rank's iterator yields from the current position (bounded
        streams only: an endless stream has no length)."""
        steps = self.steps_left()
        if steps is None:
            raise TypeError("an endless ElasticSampler has no length; set num_epochs")
        return steps * self.split.accumulation_steps

    # -- the state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The job's place in the data: what a newcomer receives from a survivor."""
        return {
            "version": STATE_VERSION,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "position": self._position,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a survivor's (or a checkpoint's) position. The stream must be the same one:
        a different ``num_samples``, ``seed`` or ``shuffle`` is refused, naming it.
        Validates first; iterators made before the load stop."""
        if not isinstance(state, Mapping):
            raise SamplerStateError(f"sampler state must be a mapping, got {type(state)}")
        missing = {"version", "num_samples", "seed", "shuffle", "position"} - set(state)
        if missing:
            raise SamplerStateError(f"sampler state lacks {sorted(missing)}")
        if state["version"] != STATE_VERSION:
            raise SamplerStateError(f"sampler state version {state['version']!r} is unknown")
        mine = self.state_dict()
        if state["shuffle"] not in (0, 1):  # True and False compare equal to 1 and 0
            raise SamplerStateError(f"shuffle must be 0 or 1, got {state['shuffle']!r}")
        theirs = {
            "num_samples": _check_int("num_samples", state["num_samples"], 1),
            "seed": _check_int("seed", state["seed"], 0),
            "shuffle": int(state["shuffle"]),
        }
        for key, value in theirs.items():
            if value != mine[key]:
                raise SamplerStateError(
                    f"sampler state has {key}={state[key]!r}, this sampler {mine[key]!r}: "
                    "not the same sample stream"
                )
        position = _check_int("position", state["position"], 0)
        if self.end is not None and position > self.end:
            raise SamplerStateError(f"position {position} is past the end ({self.end})")
        self._position = position
        self._generation += 1

    # -- the stream -----------------------------------------------------------------------

    def _permutation(self, epoch: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        perm = self._perms.get(epoch)
        if perm is None:
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                perm = np.arange(self.num_samples, dtype=np.int64)
            self._perms[epoch] = perm
            while len(self._perms) > PERMUTATIONS_KEPT:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def indices(self, start: int, stop: int) -> list[int]:
        """The sample indices at stream positions ``start..stop-1``."""
        out: list[int] = []
        n = self.num_samples
        while start < stop:
            epoch, offset = divmod(start, n)
            take = min(stop - start, n - offset)
            out.extend(self._permutation(epoch)[offset : offset + take].tolist())
            start += take
        return out

    def __iter__(self) -> _StreamIterator:
        return _StreamIterator(self)


class _StreamIterator(Iterator[list[int]]):
    """This rank's micro-batches from the sampler's position at the world of its creation.

    Its own cursor (``step_start``, ``micro``) runs ahead of the sampler's position by what
    the loader prefetched; only ``advance`` moves the position."""

    def __init__(self, sampler: ElasticSampler) -> None:
        self._sampler = sampler
        self._generation = sampler.generation
        self._rank = sampler.rank
        self._split = sampler.split
        sizes = self._split.micro_batches(self._rank)
        base = self._split.offset(self._rank)
        self._bounds = [
            (base + sum(sizes[:i]), base + sum(sizes[: i + 1])) for i in range(len(sizes))
        ]
        self.step_start = sampler.position
        self.micro = 0

    def __iter__(self) -> _StreamIterator:
        return self

    def __next__(self) -> list[int]:
        s = self._sampler
        if s.generation != self._generation:
            raise StopIteration  # the world changed: this iterator's split is void
        step = self._split.global_batch
        if self.micro == 0 and s.end is not None and self.step_start + step > s.end:
            raise StopIteration
        lo, hi = self._bounds[self.micro]
        batch = s.indices(self.step_start + lo, self.step_start + hi)
        self.micro += 1
        if self.micro == len(self._bounds):
            self.micro = 0
            self.step_start += step
        return batch

    # torchdata's Stateful protocol (StatefulDataLoader snapshots the sampler's iterator).
    def state_dict(self) -> dict[str, int]:
        return {
            "step_start": self.step_start,
            "micro": self.micro,
            "rank": self._rank,
            "world_size": self._split.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume after the last batch handed out. At another world (or rank) the step that
        was under way starts over, whole, at the new split."""
        if not isinstance(state, Mapping):
            raise SamplerStateError(f"iterator state must be a mapping, got {type(state)}")
        s = self._sampler
        step_start = _check_int("step_start", state.get("step_start"), 0)
        micro = _check_int("micro", state.get("micro"), 0)
        if s.end is not None and step_start > s.end:
            raise SamplerStateError(f"step_start {step_start} is past the end ({s.end})")
        same_world = state.get("rank") == self._rank and (
            state.get("world_size") == self._split.world_size
        )
        if not same_world:
            micro = 0
        elif micro >= len(self._bounds):
            raise SamplerStateError(f"micro {micro} is not below {len(self._bounds)} micro-batches")
        s.load_state_dict({**s.state_dict(), "position": step_start})
        self._generation = s.generation
        self.step_start, self.micro = step_start, micro
