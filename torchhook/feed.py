"""The elastic engine's side of the data: a ``DataLoader`` over an ``ElasticSampler`` across
world changes (``Elastic.data``), so that the training loop cannot get the sampler's rules
(``torchhook.data``) wrong.

The rules, each owned here or by ``torchhook.carry`` (which calls this module):

1. **Registered before the first group.** ``Elastic.data(loader)`` registers the sampler
   (``loader.batch_sampler``, or the sampler itself) in the engine's ``TrainingState``, so
   its position travels with the model: from the plan's source rank (DDP, HSDP) or with
   the checkpoint (FSDP, which rolls it back with the model). Every rank must register it
   before the first group forms (a newcomer's first snapshot holds it); HSDP's and FSDP's
   ``Elastic.scheduler`` forms the group, so ``data`` comes first, and a late call is
   refused with :class:`DataMisuse`.
2. **Reconfigured at every group**, after its state arrived and before ``on_reset``
   (``carry.py``): ``sampler.reconfigure(rank, world_size)``; the step's count of
   micro-batches taken starts over and the loader's iterator is dropped (its prefetched
   batches belong to the old split).
3. **One step, its micro-batches.** Inside the step function, :meth:`DataFeed.batches`
   yields this rank's ``split.accumulation_steps`` micro-batches of the step, starting a
   new ``iter(loader)`` on the first step of a group; the backward of every micro-batch
   but the last runs inside the strategy's ``no_sync`` (what ``Elastic.micro_batches(n)``
   does, with ``n`` from the batch policy). Weight a micro-batch's *summed* loss by
   :attr:`DataFeed.sample_weight` (``world_size / global_batch``: every strategy averages
   gradients over ranks, and shares can differ by one sample), and the gradient is the
   global batch's mean, at any world size.
4. **Advanced when the step commits**, by the engine (``Elastic.run_step``, as the step
   counter moves), never by the loop: a step cut short by a world change is not counted
   and is taken again, whole, at the new split. A committed step must have taken exactly
   its micro-batches, and the sampler's position must move only here; otherwise the
   stream and the model would disagree, so :class:`DataMisuse` stops the job.
5. **The end**: with ``num_epochs`` the stream ends at the last full step; a step that
   finds it ended raises :class:`DataExhausted`. Check :meth:`DataFeed.steps_left` first.

A new iterator draws its workers' base seed from torch's CPU generator; it is made inside
``torch.random.fork_rng`` so that a world change does not shift the model's random stream
(dropout after the change draws what it would have drawn without one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from torchhook.batching import StepSplit
from torchhook.data import ElasticSampler
from torchhook.errors import Fatal
from torchhook.parallel import micro_batches
from torchhook.state import TrainingState

__all__ = ["MAX_FEEDS", "DataExhausted", "DataFeed", "DataMisuse"]

MAX_FEEDS = 16
"""Feeds per engine: a job reads one stream, or a few (a second corpus, an evaluation set);
the bound catches ``Elastic.data`` called in a loop, each call a loader and a registration."""


class DataMisuse(Fatal):
    """The loop broke a rule of ``Elastic.data`` (the message says which): registered after
    the first group, a step that did not take exactly its micro-batches, the sampler's
    position moved outside the engine."""


class DataExhausted(Fatal):
    """The sample stream ended (``num_epochs``) before this step's micro-batches."""


def sampler_of(source: object) -> ElasticSampler:
    """The ``ElasticSampler`` of ``source``: the sampler itself or a loader's
    ``batch_sampler`` (``DataLoader(dataset, batch_sampler=sampler)``)."""
    if isinstance(source, ElasticSampler):
        return source
    sampler = getattr(source, "batch_sampler", None)
    if not isinstance(sampler, ElasticSampler):
        raise TypeError(
            f"Elastic.data needs an ElasticSampler or a DataLoader built with "
            f"batch_sampler=ElasticSampler(...), got {type(source).__qualname__} whose "
            f"batch_sampler is {type(sampler).__qualname__}"
        )
    return sampler


class DataFeed:
    """One loader (or bare sampler) across the engine's groups: the module docstring's rules.

    Made by ``Elastic.data``; the loop uses :meth:`batches`, :attr:`split`,
    :attr:`sample_weight`, :meth:`steps_left` and :attr:`sampler` (read it, never advance
    it). ``no_sync`` is the strategy's (``Parallelism.no_sync``)."""

    def __init__(
        self, source: Iterable[Any], no_sync: Callable[[], AbstractContextManager[None]]
    ) -> None:
        self.sampler = sampler_of(source)
        self._source = source
        self._no_sync = no_sync
        self._iterator: Iterator[Any] | None = None
        self._taken = 0
        self._started = False
        self._expected = self.sampler.position
        self._formed = False

    @classmethod
    def register(
        cls,
        source: Iterable[Any],
        name: str,
        state: TrainingState,
        no_sync: Callable[[], AbstractContextManager[None]],
        *,
        formed: bool,
        count: int,
    ) -> DataFeed:
        """Rule 1: a feed whose sampler is in ``state`` (under ``name``, unless the caller
        registered that very object already); refused once a group has ``formed`` or with
        ``count`` feeds already (:data:`MAX_FEEDS`)."""
        if formed:
            raise DataMisuse(
                "Elastic.data after the first group formed: call it on every rank before "
                "Elastic.scheduler (which forms the group for HSDP and FSDP) and the first "
                "step, so that every snapshot of the job state holds the sampler"
            )
        if count >= MAX_FEEDS:
            raise DataMisuse(f"Elastic.data {name!r}: at most {MAX_FEEDS} feeds per engine")
        feed = cls(source, no_sync)
        if state.name_of(feed.sampler) is None:
            state.register(name, feed.sampler)
        return feed

    # -- the world (carry.py) -------------------------------------------------------------

    def reconfigure(self, rank: int, world_size: int) -> None:
        """Rule 2: a new group; its state (the sampler's position) has arrived."""
        self.sampler.reconfigure(rank, world_size)
        self._iterator = None  # its workers and prefetched batches go with it
        self._taken, self._started = 0, False
        self._expected = self.sampler.position
        self._formed = True

    def committed(self) -> None:
        """Rule 4: the step committed: check it took its micro-batches, then advance."""
        n = self.split.accumulation_steps
        if self._taken != n:
            raise DataMisuse(
                f"a committed step took {self._taken} of its {n} micro-batches from "
                "Elastic.data: iterate feed.batches() once, to the end, in every step"
            )
        self._check_position()
        self.sampler.advance()
        self._expected = self.sampler.position
        self._taken, self._started = 0, False

    # -- the loop's API -------------------------------------------------------------------

    @property
    def split(self) -> StepSplit:
        """The current world's split (``global_batch``, ``accumulation_steps``, shares)."""
        return self.sampler.split

    @property
    def sample_weight(self) -> float:
        """``world_size / global_batch``: the weight of one sample's loss, so that the
        averaged gradient is the global batch's mean (rule 3)."""
        return self.split.world_size / self.split.global_batch

    def steps_left(self) -> int | None:
        """Full steps left in the stream at the current world (None: endless)."""
        return self.sampler.steps_left()

    def batches(self) -> Iterator[Any]:
        """Rule 3: this rank's micro-batches of the current step, inside the step function;
        every backward but the last accumulates (no gradient reduction)."""
        if not self._formed:
            raise DataMisuse("feed.batches() outside a step: call it inside the step function")
        if self._started:
            raise DataMisuse("feed.batches() twice in one step: a step takes one pass")
        self._check_position()
        self._started = True
        n = self.split.accumulation_steps
        batches = self._current()
        for i in micro_batches(self._no_sync, n):
            try:
                batch = next(batches)
            except StopIteration:
                raise DataExhausted(
                    f"the sample stream ended at position {self.sampler.position} "
                    f"(num_epochs) in micro-batch {i} of {n}; check feed.steps_left() "
                    "before the step"
                ) from None
            self._taken += 1
            yield batch

    def _current(self) -> Iterator[Any]:
        if self._iterator is None:
            with torch.random.fork_rng(devices=[]):  # the workers' seed: not the model's draw
                self._iterator = iter(self._source)
        return self._iterator

    def _check_position(self) -> None:
        if self.sampler.position != self._expected:
            raise DataMisuse(
                f"the sampler's position moved outside the engine ({self._expected} -> "
                f"{self.sampler.position}): Elastic.data advances it when a step commits "
                "and loads it at a world change; do not call advance() or load_state_dict()"
            )
