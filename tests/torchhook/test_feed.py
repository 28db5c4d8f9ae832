"""torchhook.feed (``Elastic.data``'s rules) in one process: a real ``DataLoader`` with two
worker processes over an ``ElasticSampler``, driven the way the engine drives a feed
(``reconfigure`` at each group, ``committed`` when a step commits), and every misuse the
feed refuses with a typed error. The same rules across real node losses:
test_elastic_data.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

pytest.importorskip("torch", reason="the torch hook needs torch (pip install '.[torch]')")

import torch
from torch.utils.data import DataLoader, Dataset

from torchhook.batching import FixedGlobalBatch
from torchhook.data import ElasticSampler
from torchhook.errors import Fatal
from torchhook.feed import MAX_FEEDS, DataExhausted, DataFeed, DataMisuse
from torchhook.state import TrainingState

N = 10


class Indices(Dataset[int]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


class NoSync:
    """Records which micro-batches ran inside the strategy's no_sync."""

    def __init__(self) -> None:
        self.inside = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def _feed(
    policy: FixedGlobalBatch, *, epochs: int | None = None, workers: int = 2
) -> tuple[DataFeed, NoSync, TrainingState]:
    sampler = ElasticSampler(N, policy, seed=1, num_epochs=epochs)
    loader = DataLoader(Indices(), batch_sampler=sampler, num_workers=workers)
    no_sync, state = NoSync(), TrainingState()
    return DataFeed.register(loader, "data", state, no_sync, formed=False, count=0), no_sync, state


def _step(feed: DataFeed, no_sync: NoSync) -> tuple[list[int], list[bool]]:
    taken: list[int] = []
    synced: list[bool] = []
    for batch in feed.batches():
        taken += batch.tolist()
        synced.append(not no_sync.inside)
    return taken, synced


def test_steps_take_their_micro_batches_and_a_cut_step_is_taken_again_whole() -> None:
    feed, no_sync, state = _feed(FixedGlobalBatch(6, max_micro_batch=2))
    assert state.name_of(feed.sampler) == "data"
    stream = feed.sampler.indices(0, 60)
    feed.reconfigure(1, 2)  # world 2: rank 1 takes positions 3..5 of each step
    taken, synced = _step(feed, no_sync)
    assert taken == stream[3:6] and synced == [False, True]  # reduce on the last only
    feed.committed()
    assert feed.sampler.position == 6 and feed.sample_weight == 2 / 6
    _step(feed, no_sync)  # cut short: a world change before the commit
    feed.reconfigure(0, 3)  # world 3: rank 0 takes positions 0..1 of the same step
    taken, synced = _step(feed, no_sync)
    assert taken == stream[6:8] and synced == [True]
    feed.committed()
    assert feed.sampler.position == 12


def test_the_iterator_is_made_under_a_forked_rng() -> None:
    feed, no_sync, _ = _feed(FixedGlobalBatch(2), workers=2)
    feed.reconfigure(0, 1)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    _step(feed, no_sync)  # iter(loader) draws its workers' seed from torch's generator
    assert torch.equal(torch.rand(3), expected)


def test_misuse_is_refused_with_a_typed_error() -> None:
    feed, no_sync, state = _feed(FixedGlobalBatch(4, max_micro_batch=2), workers=0)
    with pytest.raises(DataMisuse, match="outside a step"):
        _step(feed, no_sync)
    feed.reconfigure(0, 1)
    batches = feed.batches()
    next(batches)
    with pytest.raises(DataMisuse, match="took 1 of its 2 micro-batches"):
        feed.committed()
    with pytest.raises(DataMisuse, match="twice in one step"):
        _step(feed, no_sync)
    feed.reconfigure(0, 1)  # a new group: the step starts over
    _step(feed, no_sync)
    feed.sampler.advance()  # the loop's own advance: the engine's job
    with pytest.raises(DataMisuse, match="moved outside the engine"):
        feed.committed()
    assert issubclass(DataMisuse, Fatal) and issubclass(DataExhausted, Fatal)
    with pytest.raises(DataMisuse, match="after the first group"):
        DataFeed.register(feed.sampler, "late", state, no_sync, formed=True, count=0)
    with pytest.raises(DataMisuse, match=f"at most {MAX_FEEDS}"):
        DataFeed.register(feed.sampler, "more", state, no_sync, formed=False, count=MAX_FEEDS)
    with pytest.raises(TypeError, match="batch_sampler=ElasticSampler"):
        DataFeed.register(DataLoader(Indices()), "plain", state, no_sync, formed=False, count=0)
    # the same sampler again (already registered by the user): not registered twice
    DataFeed.register(feed.sampler, "again", state, no_sync, formed=False, count=1)
    assert state.names == ("data",)


def test_the_end_of_the_stream_is_a_typed_error() -> None:
    feed, no_sync, _ = _feed(FixedGlobalBatch(4), epochs=1, workers=0)
    feed.reconfigure(0, 1)
    for _ in range(2):  # 10 samples: two full steps of 4, the remainder is not handed out
        _step(feed, no_sync)
        feed.committed()
    assert feed.steps_left() == 0
    with pytest.raises(DataExhausted, match=r"check feed\.steps_left"):
        _step(feed, no_sync)
