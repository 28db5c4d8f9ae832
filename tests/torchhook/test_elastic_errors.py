"""The engine's typed errors, settings and re-formation budget (pure: no group, no agent).

Every row of the one text table (``errors.GROUP_FAILURE_TEXT``) is run; torch's own types
(out of memory, ``DistError``) are matched by type; anything else from the user's code is
fatal; every setting out of range is refused with a message naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

pytest.importorskip("torch", reason="torchhook needs torch (install the [torch] extra)")

import torch
import torch.distributed as dist

from torchhook.engine import Elastic
from torchhook.errors import (
    GROUP_FAILURE_TEXT,
    CheckpointFailed,
    GroupLost,
    MembershipChanged,
    NoSurvivingCopy,
    OutOfMemory,
    ReformBudgetSpent,
    SettingsError,
    StepFailed,
    classify,
    is_group_failure,
)
from torchhook.settings import RETRY_WAIT_S, ReformBudget, Settings

# what gloo and NCCL say, one example per row of the table
SAMPLES = {
    "gloo": "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.7]:4122",
    "Connection closed by peer": "Connection closed by peer [10.0.0.7]:41234",
    "Connection reset by peer": "write: Connection reset by peer",
    "Timed out": "Timed out waiting 60000ms for recv operation to complete",
    "NCCL": "NCCL communicator was aborted on rank 3",
}


def test_every_row_of_the_text_table_is_a_group_failure() -> None:
    assert [mark for mark, _ in GROUP_FAILURE_TEXT] == list(SAMPLES)
    for mark, why in GROUP_FAILURE_TEXT:
        assert why, mark
        exc = RuntimeError(SAMPLES[mark])
        assert is_group_failure(exc), mark
        assert classify(exc, verdict=False, where="step 3") is None, mark


def test_types_decide_where_torch_has_them() -> None:
    assert is_group_failure(MembershipChanged("view 4 dropped ['n2']"))
    assert is_group_failure(GroupLost("a peer is gone"))
    assert is_group_failure(dist.DistNetworkError("socket closed"))
    assert is_group_failure(dist.DistStoreError("store gone"))
    # out of memory is never a group failure, even when its text names NCCL or gloo
    oom = torch.OutOfMemoryError("CUDA out of memory (NCCL buffer, gloo)")
    assert not is_group_failure(oom)
    fatal = classify(oom, verdict=True, where="step 7")
    assert isinstance(fatal, OutOfMemory) and "step 7" in str(fatal)
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError  # one type to match


@pytest.mark.parametrize(
    "exc",
    [ValueError("shapes differ"), KeyError("x"), RuntimeError("mat1 and mat2 shapes cannot")],
)
def test_a_bug_in_the_step_stops_the_job_unless_a_verdict_came(exc: Exception) -> None:
    fatal = classify(exc, verdict=False, where="step 12")
    assert isinstance(fatal, StepFailed)
    assert "step 12" in str(fatal) and type(exc).__name__ in str(fatal)
    # a verdict first: the group is broken whatever the step says (an interrupted DDP
    # hook raises an unrelated "Unable to cast" text)
    assert classify(exc, verdict=True, where="step 12") is None


def test_fatal_errors_pass_through_as_they_are() -> None:
    for fatal in (NoSurvivingCopy("no copy of shard 1"), CheckpointFailed("disk full")):
        assert classify(fatal, verdict=True, where="forming") is fatal


def test_settings_defaults_are_valid_and_frozen() -> None:
    s = Settings(job="train")
    assert s.quorum == "majority" and s.reform_attempts >= 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.job = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("job", ""),
        ("quorum", "most"),
        ("backend", "mpi"),
        ("min_nodes", 0),
        ("min_nodes", True),
        ("reform_attempts", 0),
        ("reform_attempts", 10**9),
        ("pg_timeout_s", 0),
        ("formation_timeout_s", -1.0),
        ("join_timeout_s", math.inf),
        ("reform_timeout_s", math.nan),
        ("reform_backoff_s", -0.1),
        ("heartbeat_pause_ms", 0),
        ("local_rank", -1),
        ("local_world_size", 0),
        ("slow_policy", "evict"),
        ("slow_factor", 1.0),
        ("slow_factor", math.nan),
        ("slow_windows", 0),
        ("slow_quick_factor", -1.0),
        ("slow_quick_factor", math.inf),
        ("slow_quick_factor", 1.2),
        ("slow_window_steps", 0),
        ("slow_window_steps", 10**6),
        ("target_nodes", -1),
        ("target_nodes", 10**6),
        ("target_nodes", True),
        ("spare_wait_s", 0),
        ("spare_wait_s", 10**9),
        ("spare", "yes"),
    ],
)
def test_a_bad_setting_is_refused_by_name(field: str, value: Any) -> None:
    options: dict[str, Any] = {"job": "train", field: value}
    with pytest.raises(SettingsError, match=field):
        Settings(**options)


def test_the_quick_factor_is_off_or_at_least_the_slow_factor() -> None:
    assert Settings("train", slow_quick_factor=0).slow_quick_factor == 0
    assert Settings("train", slow_factor=2.0, slow_quick_factor=2.0).slow_quick_factor == 2.0
    with pytest.raises(SettingsError, match=r"slow_quick_factor must be 0 .* >= slow_factor"):
        Settings("train", slow_factor=2.5)


def test_replacing_a_slow_node_is_refused_without_spares() -> None:
    with pytest.raises(SettingsError, match=r"slow_policy=.replace. needs target_nodes"):
        Settings(job="j", slow_policy="replace")
    assert Settings(job="j", slow_policy="exclude").slow_policy == "exclude"
    assert Settings(job="j", slow_policy="replace", target_nodes=3).slow_policy == "replace"
    with pytest.raises(SettingsError, match="spare=True needs target_nodes"):
        Settings(job="j", spare=True)


def test_settings_that_contradict_each_other_are_refused() -> None:
    with pytest.raises(SettingsError, match="local_rank"):
        Settings(job="j", local_rank=2, local_world_size=2)
    with pytest.raises(SettingsError, match="reform_backoff_max_s"):
        Settings(job="j", reform_backoff_s=3.0, reform_backoff_max_s=1.0)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_reform_budget_backs_off_and_ends() -> None:
    clock = _Clock()
    s = Settings(job="j", reform_attempts=6, reform_backoff_s=0.1, reform_backoff_max_s=0.3)
    budget = ReformBudget(s, clock)
    delays = [budget.failed("leader gone", unreachable=False) for _ in range(5)]
    # at once after the first failure, then doubling, capped
    assert delays == [0.0, 0.1, 0.2, 0.3, 0.3]
    with pytest.raises(ReformBudgetSpent, match=r"reform_attempts=6.*leader gone"):
        budget.failed("leader gone", unreachable=False)


def test_the_reform_budget_ends_by_time_and_waits_for_an_unreachable_leader() -> None:
    clock = _Clock()
    budget = ReformBudget(Settings(job="j", reform_timeout_s=5.0), clock)
    assert budget.failed("store gone", unreachable=True) == RETRY_WAIT_S
    clock.t += 5.5
    with pytest.raises(ReformBudgetSpent, match="reform_timeout_s"):
        budget.failed("store gone", unreachable=False)
    # a budget as large as allowed never overflows its backoff
    huge = ReformBudget(Settings(job="j", reform_attempts=10_000, reform_timeout_s=1e9), clock)
    last = [huge.failed("x", unreachable=False) for _ in range(9_999)][-1]
    assert last == Settings(job="j").reform_backoff_max_s


def test_paused_goes_to_the_membership_and_is_a_no_op_without_it() -> None:
    calls: list[tuple[str, float]] = []

    class Pausing:
        @contextlib.contextmanager
        def paused(self, reason: str, max_s: float) -> Iterator[None]:
            calls.append((reason, max_s))
            yield

    with Elastic.paused(cast(Any, SimpleNamespace(membership=Pausing())), "ckpt", max_s=30.0):
        assert calls == [("ckpt", 30.0)]
    with Elastic.paused(cast(Any, SimpleNamespace(membership=object())), "eval"):
        pass  # a client without pauses: nothing to tell


def test_the_public_api_resolves() -> None:
    import torchhook

    for name in torchhook.__all__:
        assert getattr(torchhook, name) is not None, name
    with pytest.raises(AttributeError):
        _ = torchhook.ElasticNothing
