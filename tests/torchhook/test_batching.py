"""The batch split rules (torchhook.batching): pure, checked over many worlds."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchhook.batching import (
    BatchPolicyError,
    FixedGlobalBatch,
    FixedRankBatch,
    LrScale,
    ScaledLr,
    StepSplit,
    accumulation_steps,
    split_evenly,
    split_global_batch,
    split_rank_batch,
)


def _check_split(split: StepSplit, max_micro_batch: int) -> None:
    steps = split.accumulation_steps
    for rank in range(split.world_size):
        sizes = split.micro_batches(rank)
        assert len(sizes) == steps  # the same number of forwards on every rank
        assert sum(sizes) == split.per_rank[rank]
        assert all(1 <= s <= max_micro_batch for s in sizes)
        assert list(sizes) == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    # the fewest micro-batches that keep the bound
    assert steps == 1 or -(-max(split.per_rank) // (steps - 1)) > max_micro_batch
    offsets = [split.offset(r) for r in range(split.world_size)]
    assert offsets == [sum(split.per_rank[:r]) for r in range(split.world_size)]


@given(
    global_batch=st.integers(1, 600),
    world_size=st.integers(1, 64),
    max_micro_batch=st.integers(1, 64),
)
def test_fixed_global_batch_keeps_the_batch_and_bounds_every_micro_batch(
    global_batch: int, world_size: int, max_micro_batch: int
) -> None:
    try:
        split = split_global_batch(global_batch, world_size, max_micro_batch)
    except BatchPolicyError as e:
        # refused only when some micro-batch would have to be empty
        q, r = divmod(global_batch, world_size)
        assert q == 0 or (r and accumulation_steps(q + 1, max_micro_batch) > q), e
        return
    assert split.global_batch == global_batch and split.world_size == world_size
    q, r = divmod(global_batch, world_size)
    assert split.per_rank == (q + 1,) * r + (q,) * (world_size - r)  # remainder: lowest ranks
    _check_split(split, max_micro_batch)


@given(rank_batch=st.integers(1, 100), world_size=st.integers(1, 64), bound=st.integers(1, 100))
def test_fixed_rank_batch_scales_the_global_batch(
    rank_batch: int, world_size: int, bound: int
) -> None:
    split = split_rank_batch(rank_batch, world_size, bound)
    assert split.per_rank == (rank_batch,) * world_size
    assert split.global_batch == rank_batch * world_size
    _check_split(split, bound)


def test_a_node_loss_raises_accumulation_instead_of_the_micro_batch() -> None:
    policy = FixedGlobalBatch(global_batch=48, max_micro_batch=8)
    # 3 nodes x 2 ranks -> 2 x 2 -> 1 x 2 -> 2 x 2
    assert [
        (policy.split(w).per_rank[0], policy.split(w).accumulation_steps) for w in (6, 4, 2)
    ] == [
        (8, 1),
        (12, 2),
        (24, 3),
    ]
    assert policy.split(4).micro_batches(0) == (6, 6)
    uneven = FixedGlobalBatch(global_batch=10, max_micro_batch=2).split(4)
    assert uneven.per_rank == (3, 3, 2, 2)
    assert [uneven.micro_batches(r) for r in range(4)] == [(2, 1), (2, 1), (1, 1), (1, 1)]
    # no bound: one micro-batch of the whole share
    assert FixedGlobalBatch(global_batch=10).split(4).accumulation_steps == 1
    assert FixedRankBatch(rank_batch=6, max_micro_batch=4).split(3).micro_batches(2) == (3, 3)


def test_refusals_name_the_setting() -> None:
    with pytest.raises(BatchPolicyError, match="global_batch=3 is smaller than the world"):
        split_global_batch(3, 4, 8)
    with pytest.raises(BatchPolicyError, match="max_micro_batch=1"):
        split_global_batch(10, 4, 1)  # shares 3,3,2,2 in 3 micro-batches: two would be empty
    assert split_global_batch(12, 4, 1).accumulation_steps == 3  # even shares are fine
    for bad in (0, -1, True, 2.0):
        with pytest.raises(BatchPolicyError, match="global_batch must be a positive integer"):
            FixedGlobalBatch(global_batch=bad)  # type: ignore[arg-type]
    with pytest.raises(BatchPolicyError, match="max_micro_batch"):
        FixedRankBatch(rank_batch=4, max_micro_batch=0)
    with pytest.raises(BatchPolicyError, match="world_size"):
        split_rank_batch(4, 0, 4)
    with pytest.raises(BatchPolicyError, match="world_size"):
        split_rank_batch(4, 1 << 21, 4)
    assert split_evenly(7, 3) == (3, 2, 2) and split_evenly(6, 3) == (2, 2, 2)


def test_lr_scale_rules_follow_the_global_batch_of_a_fixed_rank_batch() -> None:
    policy = FixedRankBatch(rank_batch=8)
    reference = policy.split(6).global_batch  # tuned at 3 nodes x 2 ranks
    after_loss = policy.split(4).global_batch
    assert LrScale(reference).factor(after_loss) == pytest.approx(4 / 6)
    assert LrScale(reference, "sqrt").factor(after_loss) == pytest.approx(math.sqrt(4 / 6))
    capped = LrScale(reference, lambda g, ref: min(1.0, g / ref))
    assert capped.factor(policy.split(8).global_batch) == 1.0
    assert capped.factor(after_loss) == pytest.approx(4 / 6)


def test_scaled_lr_sets_each_group_from_the_recorded_base() -> None:
    groups: list[dict[str, Any]] = [{"lr": 0.1}, {"lr": 0.02}]
    scaled = ScaledLr.record(groups, LrScale(48))
    assert scaled.base_lrs == (0.1, 0.02)
    assert scaled.apply(groups, 32) == pytest.approx(2 / 3)
    assert [g["lr"] for g in groups] == pytest.approx([0.1 * 2 / 3, 0.02 * 2 / 3])
    scaled.apply(groups, 64)  # from the base, not compounded on the last rate
    assert [g["lr"] for g in groups] == pytest.approx([0.1 * 4 / 3, 0.02 * 4 / 3])
    fresh: list[dict[str, Any]] = [{"lr": 0.1}, {"lr": 0.02}]  # a rebuilt optimizer's
    scaled.apply(fresh, 64)
    assert fresh == groups


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (lambda g, ref: 0.0, "returned 0.0"),
        (lambda g, ref: float("nan"), "returned nan"),
        (lambda g, ref: "2", "not a number"),
    ],
)
def test_a_bad_lr_rule_is_refused_and_changes_nothing(rule: Any, message: str) -> None:
    groups: list[dict[str, Any]] = [{"lr": 0.1}]
    scaled = ScaledLr.record(groups, LrScale(16, rule))
    with pytest.raises(BatchPolicyError, match=message):
        scaled.apply(groups, 8)
    assert groups == [{"lr": 0.1}]
    with pytest.raises(BatchPolicyError, match="2 parameter groups"):
        scaled.apply([{"lr": 1.0}, {"lr": 1.0}], 8)
    with pytest.raises(BatchPolicyError, match="lr rule must be"):
        LrScale(16, "cubic")  # type: ignore[arg-type]
    with pytest.raises(BatchPolicyError, match="reference_batch"):
        LrScale(0)
