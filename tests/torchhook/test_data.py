"""Data across world changes (torchhook.data): every sample of an epoch exactly once.

The job is simulated in one process the way the engine drives it: every rank of the world
has its own ``ElasticSampler`` and its own loader (real ``DataLoader``s with two worker
processes, or a stand-in that runs the sampler ahead like one); steps are taken in
lockstep; a world change can come at a step boundary or in the middle of a step (the
micro-batches the ranks had consumed of that step are thrown away, as the step is not
committed), always with batches prefetched but not consumed; survivors keep their sampler
objects and reconfigure, newcomers load a survivor's state. 3 nodes × 2 ranks lose a
node, then another, then regrow one: world sizes 6 → 4 → 2 → 4.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from torchhook.batching import BatchPolicy, BatchPolicyError, FixedGlobalBatch, FixedRankBatch
from torchhook.data import ElasticSampler, SamplerStateError

N = 50  # not a multiple of the global batch: steps cross epoch boundaries
SEED = 7
WORLDS = (6, 4, 2, 4)  # 3 nodes x 2 ranks: lose a node, another, regrow one


class Indices(Dataset[int]):
    """Sample i is the number i, so a batch shows which samples it holds."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


Loader = Callable[[ElasticSampler], Iterator[list[int]]]


def prefetching(depth: int) -> Loader:
    """A stand-in for a DataLoader: takes ``depth`` batches from the sampler ahead of use."""

    def make(sampler: ElasticSampler) -> Iterator[list[int]]:
        source = iter(sampler)
        ahead: deque[list[int]] = deque()

        def gen() -> Iterator[list[int]]:
            while True:
                while len(ahead) <= depth:
                    batch = next(source, None)
                    if batch is None:
                        break
                    ahead.append(batch)
                if not ahead:
                    return
                yield ahead.popleft()

        return gen()

    return make


@dataclass
class RealLoaders:
    """Real DataLoaders with workers, one per sampler object: a survivor keeps its loader
    and starts a new iterator on it (with persistent workers, the same workers). Records
    how far each sampler iterator ran ahead of the position."""

    persistent: bool = False
    lead: list[int] = field(default_factory=list)
    loaders: dict[int, DataLoader[int]] = field(default_factory=dict)

    def __call__(self, sampler: ElasticSampler) -> Iterator[list[int]]:
        loader = self.loaders.get(id(sampler))
        if loader is None:
            loader = DataLoader(
                Indices(),
                batch_sampler=sampler,
                num_workers=2,
                prefetch_factor=2,
                persistent_workers=self.persistent,
            )
            self.loaders[id(sampler)] = loader
        it = iter(loader)

        def gen() -> Iterator[list[int]]:
            for batch in it:
                # the sampler iterator (main process) is ahead of what the step consumed
                self.lead.append(it._sampler_iter.step_start - sampler.position)
                yield batch.tolist()

        return gen()

    def close(self) -> None:
        self.loaders.clear()  # the last references to persistent workers


@dataclass(frozen=True)
class Change:
    steps_before: int  # committed steps in the world before the change
    micro: int  # micro-batches of the next step consumed (and lost) before the change
    lost: int  # which node goes (shrinks), by age


def run(
    policy: BatchPolicy, changes: list[Change], final_steps: int, loaders: Loader
) -> tuple[list[int], ElasticSampler]:
    """Drive the job through WORLDS; returns the samples of committed steps, in step order
    and rank order within a step, and the last world's rank 0 sampler."""
    ranks_per_node = 2
    nodes: list[list[ElasticSampler]] = [
        [
            ElasticSampler(N, policy, rank=n * 2 + i, world_size=6, seed=SEED)
            for i in range(ranks_per_node)
        ]
        for n in range(3)
    ]
    committed: list[int] = []
    for phase, world in enumerate(WORLDS):
        samplers = [s for node in nodes for s in node]
        assert len(samplers) == world
        assert len({s.position for s in samplers}) == 1  # one position across the job
        batches = [loaders(s) for s in samplers]
        last = phase == len(WORLDS) - 1
        steps = final_steps if last else changes[phase].steps_before
        while steps > 0 or (last and len(committed) <= N):  # the last world ends in epoch 1+
            steps -= 1
            step: list[int] = []
            for s, it in zip(samplers, batches, strict=True):
                for _ in range(s.split.accumulation_steps):
                    step.extend(next(it))
            assert len(step) == samplers[0].split.global_batch
            committed.extend(step)
            for s in samplers:
                s.advance()
        if last:
            return committed, samplers[0]
        change = changes[phase]
        for s, it in zip(samplers, batches, strict=True):  # a step cut short: not committed
            for _ in range(min(change.micro, s.split.accumulation_steps - 1)):
                next(it)
        del batches  # the old loaders go, with what they prefetched
        if WORLDS[phase + 1] < world:
            del nodes[change.lost % len(nodes)]
        else:  # a new node: fresh samplers that take a survivor's state
            fresh = [ElasticSampler(N, policy, rank=0, world_size=1, seed=SEED) for _ in range(2)]
            nodes.append(fresh)
        survivor_state = nodes[0][0].state_dict()
        new_world = WORLDS[phase + 1]
        for rank, s in enumerate(s for node in nodes for s in node):
            s.load_state_dict(survivor_state)
            s.reconfigure(rank, new_world)
    raise AssertionError("unreachable")


def stream(length: int) -> list[int]:
    return ElasticSampler(N, FixedRankBatch(1), rank=0, world_size=1, seed=SEED).indices(0, length)


def assert_exactly_once(committed: list[int]) -> None:
    assert len(committed) > N  # the run crosses into the second epoch
    full, rest = divmod(len(committed), N)
    for e in range(full):  # every finished epoch: every sample exactly once
        assert Counter(committed[e * N : (e + 1) * N]) == Counter(range(N))
    current = committed[full * N :]
    assert len(set(current)) == len(current) == rest  # the epoch under way: none twice
    assert committed == stream(len(committed))  # and in the failure-free order


changes_st = st.lists(
    st.builds(Change, st.integers(0, 3), st.integers(0, 2), st.integers(0, 2)),
    min_size=3,
    max_size=3,
)


@settings(max_examples=150, deadline=None)
@given(
    changes=changes_st,
    depth=st.integers(0, 6),
    global_batch=st.sampled_from([10, 12]),
    max_micro=st.sampled_from([2, 3, 12]),
)
def test_exactly_once_across_shrink_and_regrow_for_any_change_points(
    changes: list[Change], depth: int, global_batch: int, max_micro: int
) -> None:
    policy = FixedGlobalBatch(global_batch=global_batch, max_micro_batch=max_micro)
    committed, last = run(policy, changes, final_steps=6, loaders=prefetching(depth))
    assert_exactly_once(committed)
    assert last.position == len(committed)


@settings(max_examples=60, deadline=None)
@given(changes=changes_st, depth=st.integers(0, 6), rank_batch=st.integers(1, 4))
def test_exactly_once_with_a_fixed_per_rank_batch(
    changes: list[Change], depth: int, rank_batch: int
) -> None:
    policy = FixedRankBatch(rank_batch=rank_batch, max_micro_batch=2)
    committed, _ = run(policy, changes, final_steps=8, loaders=prefetching(depth))
    assert_exactly_once(committed)


@settings(max_examples=3, deadline=None)
@given(changes=changes_st)
@example(
    # step 4 holds positions 48..59, across the epoch boundary; the first change cuts it
    # after one micro-batch, with the next batches (of epoch 1) already prefetched
    changes=[Change(4, 1, 1), Change(1, 0, 0), Change(0, 2, 0)]
)
def test_two_node_losses_and_a_regrow_with_real_dataloaders(changes: list[Change]) -> None:
    """A run with two node losses and a regrow consumes each index of the epoch exactly
    once: real DataLoaders, two worker processes each, batches prefetched at every change."""
    loaders = RealLoaders()
    policy = FixedGlobalBatch(global_batch=12, max_micro_batch=2)  # 1, 2, 3 micro-batches
    committed, _ = run(policy, changes, final_steps=3, loaders=loaders)
    loaders.close()
    assert_exactly_once(committed)
    assert max(loaders.lead) > 0  # the loaders did run ahead of the steps
    assert not multiprocessing.active_children()  # every worker is gone


def test_persistent_workers_drop_prefetched_batches_on_a_new_iterator() -> None:
    loaders = RealLoaders(persistent=True)
    policy = FixedGlobalBatch(global_batch=10, max_micro_batch=2)
    changes = [Change(2, 1, 2), Change(2, 1, 0), Change(3, 0, 0)]
    committed, _ = run(policy, changes, final_steps=2, loaders=loaders)
    loaders.close()
    assert_exactly_once(committed)
    assert max(loaders.lead) > 0
    assert not multiprocessing.active_children()


def test_the_epoch_permutation_depends_on_seed_and_epoch_only() -> None:
    a = ElasticSampler(N, FixedGlobalBatch(12), rank=0, world_size=6, seed=SEED)
    b = ElasticSampler(N, FixedRankBatch(3), rank=1, world_size=2, seed=SEED)
    b.advance(40)
    assert a.indices(0, 3 * N) == b.indices(0, 3 * N)
    epochs = [sorted(a.indices(e * N, (e + 1) * N)) for e in range(3)]
    assert epochs == [list(range(N))] * 3
    assert a.indices(0, N) != a.indices(N, 2 * N)  # a new order every epoch
    other = ElasticSampler(N, FixedGlobalBatch(12), rank=0, world_size=6, seed=SEED + 1)
    assert other.indices(0, N) != a.indices(0, N)
    plain = ElasticSampler(N, FixedGlobalBatch(12), rank=0, world_size=6, shuffle=False)
    assert plain.indices(45, 55) == [45, 46, 47, 48, 49, 0, 1, 2, 3, 4]
    assert (b.epoch, a.epoch) == (0, 0)
    b.advance(10)
    assert b.epoch == 1


def test_a_world_change_ends_the_old_iterator_and_a_refused_split_changes_nothing() -> None:
    s = ElasticSampler(N, FixedGlobalBatch(12, max_micro_batch=3), rank=1, world_size=4)
    it = iter(s)
    assert next(it) == s.indices(3, 6)
    s.reconfigure(0, 2)
    assert next(it, None) is None  # stale: the split it was cutting is void
    assert s.split.per_rank == (6, 6) and s.split.accumulation_steps == 2
    with pytest.raises(BatchPolicyError, match="smaller than the world"):
        s.reconfigure(0, 13)
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1"):
        s.reconfigure(2, 2)
    assert (s.rank, s.world_size, s.split.world_size, s.generation) == (0, 2, 2, 1)


def test_state_is_the_position_and_refuses_another_stream() -> None:
    s = ElasticSampler(N, FixedGlobalBatch(12), rank=0, world_size=4, seed=SEED)
    s.advance()
    s.advance(5)
    state = s.state_dict()
    assert state == {"version": 1, "num_samples": N, "seed": SEED, "shuffle": 1, "position": 17}
    fresh = ElasticSampler(N, FixedGlobalBatch(12), rank=3, world_size=4, seed=SEED)
    fresh.load_state_dict(state)
    assert fresh.position == 17 and fresh.generation == 1
    for key, value in (("seed", SEED + 1), ("num_samples", N + 1), ("shuffle", 0)):
        with pytest.raises(SamplerStateError, match=key):
            fresh.load_state_dict({**state, key: value})
    bad_states: list[Any] = [{**state, "position": -1}, {**state, "version": 2}, {"position": 3}]
    bad_states += [{**state, "seed": "7"}, {**state, "shuffle": 2}, [("position", 1)]]
    for bad in bad_states:
        with pytest.raises(SamplerStateError):
            fresh.load_state_dict(bad)
    assert fresh.position == 17
    with pytest.raises(SamplerStateError, match="num_samples"):
        ElasticSampler(0, FixedGlobalBatch(12), rank=0, world_size=1)


def test_a_bounded_stream_ends_at_the_last_full_step() -> None:
    s = ElasticSampler(
        N, FixedGlobalBatch(12, max_micro_batch=6), rank=1, world_size=2, num_epochs=2
    )
    assert s.steps_left() == 8 and len(s) == 8  # 100 samples: 8 steps of 12, 4 left over
    assert [len(b) for b in s] == [6] * 8
    with pytest.raises(TypeError, match="no length"):
        len(ElasticSampler(N, FixedGlobalBatch(12), rank=0, world_size=1))
    s.advance(96)
    with pytest.raises(ValueError, match="passes the end"):
        s.advance()
    assert list(s) == []


def test_stateful_dataloader_protocol_resumes_after_the_last_batch_handed_out() -> None:
    """torchdata's StatefulDataLoader snapshots the sampler and its iterator when it hands
    a batch to a worker, and on load restores the sampler, makes a new iterator and loads
    the iterator's state: the same sequence here, without torchdata."""
    policy = FixedGlobalBatch(12, max_micro_batch=2)
    s = ElasticSampler(N, policy, rank=2, world_size=4, seed=SEED)
    it = iter(s)
    handed = [next(it) for _ in range(5)]  # 2 micro-batches a step: mid-step 3
    assert handed[0] == s.indices(6, 8)
    sampler_state, iter_state = s.state_dict(), it.state_dict()  # position still 0
    rest = [next(it) for _ in range(4)]

    again = ElasticSampler(N, policy, rank=2, world_size=4, seed=SEED)
    again.load_state_dict(sampler_state)
    it2 = iter(again)
    it2.load_state_dict(iter_state)
    assert [next(it2) for _ in range(4)] == rest
    assert again.position == 24  # the start of the step that iterator was in

    elsewhere = ElasticSampler(N, policy, rank=0, world_size=2, seed=SEED)  # other world
    it3 = iter(elsewhere)
    it3.load_state_dict(iter_state)
    assert next(it3) == elsewhere.indices(24, 26)  # the step starts over, whole
    with pytest.raises(SamplerStateError, match="micro"):
        iter(again).load_state_dict({**iter_state, "micro": 2})


def test_torchdata_stateful_dataloader_if_installed() -> None:
    sdl = pytest.importorskip(
        "torchdata.stateful_dataloader", reason="torchdata is optional and not installed"
    )
    policy = FixedGlobalBatch(12, max_micro_batch=3)

    def loader() -> tuple[ElasticSampler, Any]:
        s = ElasticSampler(N, policy, rank=1, world_size=2, seed=SEED)
        return s, sdl.StatefulDataLoader(Indices(), batch_sampler=s, num_workers=2)

    s, dl = loader()
    it = iter(dl)
    seen = [next(it).tolist() for _ in range(4)]
    s.advance()
    s.advance()
    state = dl.state_dict()
    rest = [next(it).tolist() for _ in range(4)]
    del it
    s2, dl2 = loader()
    dl2.load_state_dict(state)
    assert [b.tolist() for _, b in zip(range(4), dl2, strict=False)] == rest
    assert s2.position == s.position == 24 and seen[0] == s.indices(6, 9)
