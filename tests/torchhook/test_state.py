"""The training state (torchhook.state, torchhook.rng, torchhook.state_wire).

In one process: the registry's checks, capture/restore round trips, bad snapshots that
leave every object as it was, schedulers carried over to a new optimizer (five kinds, the
learning rate equal to an uninterrupted run's at every later step), RNG streams restored,
the on_reset contract. With two real processes on a gloo group: rank 0's snapshot reaches
rank 1 through ``broadcast_snapshot`` and rank 1 then draws, schedules and samples as rank 0
does; a snapshot that cannot be encoded fails on both ranks at once.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import pickle
import random
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.context import ForkServerProcess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim import SGD, Optimizer
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    LambdaLR,
    LinearLR,
    LRScheduler,
    OneCycleLR,
    SequentialLR,
    StepLR,
)

import torchhook.state_wire as wire
from agent.procs import stop
from torchhook.batching import FixedGlobalBatch, FixedRankBatch, LrScale, ScaledLr
from torchhook.data import ElasticSampler
from torchhook.state import (
    MAX_NAME_CHARS,
    MAX_OBJECTS,
    Rebuilt,
    ResetCallbackError,
    SnapshotError,
    TrainingState,
    World,
)
from torchhook.state_wire import broadcast_snapshot, decode, encode

TCPStore = dist.TCPStore  # type: ignore[attr-defined]
PrefixStore = dist.PrefixStore  # type: ignore[attr-defined]

_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload([__name__])  # the workers fork with torch imported

STEPS = 12
SWAP_AT = 5


class Counter:
    """A user object: a step counter and a running loss."""

    def __init__(self) -> None:
        self.steps = 0
        self.loss_sum = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "loss_sum": self.loss_sum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.loss_sum = int(state["steps"]), float(state["loss_sum"])


def _optimizer(model: nn.Module) -> Optimizer:
    return SGD(model.parameters(), lr=0.1, momentum=0.9)


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4) * 0.95**step


SCHEDULERS: dict[str, Callable[[Optimizer], LRScheduler]] = {
    "lambda": lambda o: LambdaLR(o, _warmup),
    "step": lambda o: StepLR(o, step_size=3, gamma=0.5),
    "cosine": lambda o: CosineAnnealingLR(o, T_max=STEPS, eta_min=0.001),
    "onecycle": lambda o: OneCycleLR(o, max_lr=1.0, total_steps=STEPS + 1),
    "sequential": lambda o: SequentialLR(
        o, [LinearLR(o, start_factor=0.1, total_iters=3), CosineAnnealingLR(o, T_max=8)], [3]
    ),
}


def _setup(seed: int = 0) -> tuple[TrainingState, ElasticSampler, Counter, Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    opt = _optimizer(model)
    state = TrainingState(python_random=True, numpy_random=True)
    sampler = ElasticSampler(100, FixedGlobalBatch(8), rank=0, world_size=2, seed=3)
    counter = Counter()
    state.register("sampler", sampler)
    state.register("counter", counter)
    state.scheduler("lr", SCHEDULERS["lambda"], opt)
    return state, sampler, counter, opt


def _advance(state: TrainingState, sampler: ElasticSampler, counter: Counter, n: int) -> None:
    for _ in range(n):
        state.rebuilt("lr").optimizer.step()
        state.rebuilt("lr").current.step()
        sampler.advance()
        counter.steps += 1
        counter.loss_sum += 0.5
        torch.rand(2), random.random(), np.random.random()


def _objects(state: TrainingState) -> dict[str, Any]:
    return copy.deepcopy(state.capture()["objects"])


def _draws() -> tuple[list[float], float, float]:
    return torch.rand(4).tolist(), random.random(), float(np.random.random())


# --- registration ----------------------------------------------------------------------


def test_registration_refuses_bad_names_duplicates_and_objects_without_the_methods() -> None:
    state = TrainingState()
    state.register("counter", Counter())
    with pytest.raises(ValueError, match="'counter' is already registered"):
        state.register("counter", Counter())
    for bad in ("", "x" * (MAX_NAME_CHARS + 1), 7):
        with pytest.raises(ValueError, match="non-empty str"):
            state.register(bad, Counter())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'rng': Random has no state_dict\(\)"):
        state.register("rng", random.Random(1))
    with pytest.raises(TypeError, match="on_reset needs a callable"):
        state.on_reset(42)  # type: ignore[arg-type]
    for i in range(MAX_OBJECTS - 1):
        state.register(f"c{i}", Counter())
    with pytest.raises(ValueError, match=f"at most {MAX_OBJECTS}"):
        state.register("one-too-many", Counter())
    assert len(state.names) == MAX_OBJECTS


def test_a_factory_that_builds_no_stateful_object_is_refused() -> None:
    opt = _optimizer(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="factory's result: int has no state_dict"):
        Rebuilt(lambda o: 3, opt)  # type: ignore[type-var]


# --- capture and restore ---------------------------------------------------------------


def test_capture_then_restore_gives_back_every_object_and_the_rng() -> None:
    state, sampler, counter, _ = _setup()
    _advance(state, sampler, counter, 3)
    snap = state.capture()
    objects, draws = _objects(state), _draws()
    _advance(state, sampler, counter, 4)
    assert _objects(state) != objects
    state.restore(snap)
    assert _objects(state) == objects
    assert _draws() == draws
    assert sampler.position == 3 * 8 and counter.steps == 3


def test_encode_decode_round_trip_and_refusals() -> None:
    state, sampler, counter, _ = _setup()
    _advance(state, sampler, counter, 2)
    snap = state.capture()
    again = decode(encode(snap))
    state.restore(again)
    assert _objects(state) == snap["objects"]
    # bytes that would run code (a pickle of an arbitrary object) are refused, not loaded
    with pytest.raises(SnapshotError, match="do not load"):
        decode(pickle.dumps(Counter(), protocol=2))
    with pytest.raises(SnapshotError, match="do not load"):
        decode(b"not a snapshot")
    # the sender finds what receivers would refuse
    bad = copy.deepcopy(snap)
    bad["objects"]["counter"] = {"custom": Counter()}
    with pytest.raises(SnapshotError, match="do not load"):
        encode(bad)


def test_the_size_bound_refuses_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    state, *_ = _setup()
    data = encode(state.capture())
    monkeypatch.setattr(wire, "MAX_SNAPSHOT_BYTES", len(data) - 1)
    with pytest.raises(SnapshotError, match="above"):
        encode(state.capture())
    with pytest.raises(SnapshotError, match="above"):
        decode(data)


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda s: s["objects"].pop(key)


BAD: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "missing object": (_drop("counter"), r"missing \['counter'\]"),
    "unknown object": (lambda s: s["objects"].update(extra={}), r"unknown \['extra'\]"),
    "version": (lambda s: s.update(version=2), "version 2"),
    "objects not a dict": (lambda s: s.update(objects=[]), "'objects' is not a dict"),
    "rng kind missing": (lambda s: s["rng"].pop("numpy"), "carries RNG"),
    "rng kind unknown": (lambda s: s["rng"].update(cuda=[]), "carries RNG"),
    "torch rng dtype": (
        lambda s: s["rng"].update(torch=s["rng"]["torch"].float()),
        "torch RNG state is not a 1-D uint8",
    ),
    "torch rng size": (lambda s: s["rng"].update(torch=s["rng"]["torch"][:-1]), "bytes"),
    "python rng": (lambda s: s["rng"].update(python=(3, (1, 2), None)), "Python random"),
    "numpy key": (
        lambda s: s["rng"]["numpy"].update(key=torch.full((624,), -1)),
        "numpy RNG key",
    ),
    "scheduler groups": (
        lambda s: s["objects"]["lr"]["param_groups"].append({}),
        "'lr': the state has 2 parameter groups",
    ),
    "scheduler shape": (lambda s: s["objects"]["lr"].pop("scheduler"), "'lr': a Rebuilt"),
    # passes every check before loading; the sampler's own load_state_dict refuses it
    "sampler refuses": (
        lambda s: s["objects"]["sampler"].update(seed=99),
        "'sampler' refused its state",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_snapshot_changes_nothing(case: str) -> None:
    state, sampler, counter, opt = _setup()
    _advance(state, sampler, counter, 2)
    snap = state.capture()
    _advance(state, sampler, counter, 3)
    before, lr = _objects(state), opt.param_groups[0]["lr"]
    rng = torch.get_rng_state()
    spoil, message = BAD[case]
    spoil(snap)  # type: ignore[arg-type]
    with pytest.raises(SnapshotError, match=message):
        state.restore(snap)
    assert _objects(state) == before
    assert opt.param_groups[0]["lr"] == lr
    assert torch.equal(torch.get_rng_state(), rng)


def test_an_object_refusing_after_others_loaded_rolls_them_back() -> None:
    state, sampler, counter, _ = _setup()
    late = ElasticSampler(100, FixedGlobalBatch(8), rank=0, world_size=2, seed=3)
    state.register("late", late)  # loads after 'sampler', 'counter' and 'lr'
    _advance(state, sampler, counter, 2)
    snap = state.capture()
    _advance(state, sampler, counter, 3)
    before = _objects(state)
    snap["objects"]["late"]["num_samples"] = 7  # only the sampler's own check sees this
    with pytest.raises(SnapshotError, match=r"'late' refused .* the 3 objects loaded") as info:
        state.restore(snap)
    assert type(info.value.__cause__).__name__ == "SamplerStateError"
    assert _objects(state) == before


# --- schedulers over a new optimizer ---------------------------------------------------


def _schedule(kind: str, swap: str | None) -> list[tuple[float, float]]:
    """(lr, momentum) that each update applies; with ``swap`` the optimizer is rebuilt at SWAP_AT,
    its state loaded first ("loaded") or not ("fresh"), or a newcomer's state and optimizer
    take over from a snapshot that went through the wire encoding ("newcomer")."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = _optimizer(model)
    state = TrainingState()
    state.scheduler("lr", SCHEDULERS[kind], opt)
    seen = []
    for step in range(STEPS):
        if swap is not None and step == SWAP_AT:
            old = opt
            opt = _optimizer(model)
            if swap == "newcomer":  # a fresh process's state, loaded from the wire
                snap = decode(encode(state.capture()))
                state = TrainingState()
                state.scheduler("lr", SCHEDULERS[kind], opt)
                state.restore(snap)
            else:
                if swap == "loaded":
                    opt.load_state_dict(old.state_dict())
                state.rebind(opt)
        model(torch.ones(1, 3)).sum().backward()
        group = opt.param_groups[0]
        seen.append((group["lr"], group["momentum"]))  # what this update applies
        opt.step()
        state.rebuilt("lr").step()
    return seen


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_a_scheduler_survives_a_new_optimizer(kind: str) -> None:
    straight = _schedule(kind, None)
    assert len(set(straight)) > 2, "the schedule must move for the test to mean anything"
    assert _schedule(kind, "fresh") == straight
    assert _schedule(kind, "loaded") == straight
    assert _schedule(kind, "newcomer") == straight


def test_without_the_carried_hyperparameters_a_new_scheduler_would_be_wrong() -> None:
    """What Rebuilt exists for: a fresh LambdaLR over a new optimizer, given only the old
    scheduler's state_dict, leaves the optimizer at the first step's learning rate."""
    opt = _optimizer(nn.Linear(2, 2))
    sched = LambdaLR(opt, _warmup)
    for _ in range(SWAP_AT):
        opt.step()
        sched.step()
    fresh = _optimizer(nn.Linear(2, 2))
    LambdaLR(fresh, _warmup).load_state_dict(sched.state_dict())
    assert fresh.param_groups[0]["lr"] != opt.param_groups[0]["lr"]


def test_a_refused_rebind_keeps_the_old_scheduler() -> None:
    state, *_ = _setup()
    rebuilt = state.rebuilt("lr")
    current, opt = rebuilt.current, rebuilt.optimizer
    two = SGD([{"params": [nn.Parameter(torch.ones(1))]} for _ in range(2)])
    with pytest.raises(SnapshotError, match="2 parameter groups, the old one 1"):
        state.rebind(two)
    assert rebuilt.current is current and rebuilt.optimizer is opt
    calls = []

    def once(o: Optimizer) -> LRScheduler:
        calls.append(o)
        if len(calls) > 1:
            raise RuntimeError("the user's factory failed")
        return StepLR(o, 2)

    flaky = state.scheduler("flaky", once, opt)
    first = flaky.current
    with pytest.raises(RuntimeError, match="factory failed"):
        flaky.rebind(_optimizer(nn.Linear(3, 2)))
    assert flaky.current is first and flaky.optimizer is opt


def test_lr_scale_with_a_real_optimizer_and_inside_a_lambda_scheduler() -> None:
    """FixedRankBatch: after a loss the global batch shrinks and the rate follows the rule,
    set directly (a tensor rate in place) or through a LambdaLR that reads the sampler."""
    sampler = ElasticSampler(100, FixedRankBatch(8), rank=0, world_size=6)
    scale = LrScale(reference_batch=48)
    model = nn.Linear(2, 2)
    adam = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    rate = adam.param_groups[0]["lr"]
    scaled = ScaledLr.record(adam.param_groups, scale)
    sampler.reconfigure(rank=0, world_size=4)
    scaled.apply(adam.param_groups, sampler.split.global_batch)
    assert adam.param_groups[0]["lr"] is rate and float(rate) == pytest.approx(0.01 * 32 / 48)

    sgd = SGD(model.parameters(), lr=0.1)
    sched = LambdaLR(sgd, lambda s: 0.5 * scale.factor(sampler.split.global_batch))
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 * 32 / 48)
    sampler.reconfigure(rank=0, world_size=6)
    sgd.step()
    sched.step()
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5)


# --- RNG -------------------------------------------------------------------------------


def test_rng_restored_draws_what_the_source_draws() -> None:
    state = TrainingState(python_random=True, numpy_random=True)
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    torch.rand(3), random.random(), np.random.standard_normal()  # numpy keeps a gauss
    snap = state.capture()
    expected = _draws()
    torch.manual_seed(2), random.seed(2), np.random.seed(2)
    state.restore(snap)
    assert _draws() == expected
    # rng=False: checked, not loaded
    torch.manual_seed(3)
    mine = torch.get_rng_state()
    state.restore(snap, rng=False)
    assert torch.equal(torch.get_rng_state(), mine)


def test_rng_choices_must_match_between_ranks() -> None:
    snap = TrainingState(python_random=True).capture()
    with pytest.raises(SnapshotError, match=r"carries RNG \['python', 'torch'\]"):
        TrainingState().restore(snap)
    with pytest.raises(ValueError, match="cuda_devices"):
        TrainingState(cuda_devices=[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_travels_per_device() -> None:
    state = TrainingState()
    torch.cuda.manual_seed(5)
    snap = state.capture()
    expected = torch.rand(4, device="cuda").tolist()
    torch.cuda.manual_seed(6)
    state.restore(decode(encode(snap)))
    assert torch.rand(4, device="cuda").tolist() == expected


# --- on_reset and World ----------------------------------------------------------------


def test_reset_calls_every_callback_in_order_and_wraps_their_errors() -> None:
    state = TrainingState()
    old = World(world_size=6, rank=4, nodes=("a", "b", "c"), step=10)
    new = World(world_size=4, rank=2, nodes=("a", "c"), step=10)
    calls: list[tuple[str, World, World]] = []
    state.on_reset(lambda o, n: calls.append(("first", o, n)))
    state.on_reset(lambda o, n: calls.append(("second", o, n)))  # a second lambda: #1
    state.reset(old, new)
    assert calls == [("first", old, new), ("second", old, new)]

    def broken(o: World, n: World) -> None:
        raise KeyError("user bug")

    state.on_reset(broken)
    with pytest.raises(ResetCallbackError, match=r"'.*broken#2' raised KeyError") as info:
        state.reset(old, new)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(ValueError, match="already registered"):
        state.on_reset(broken)
    with pytest.raises(ValueError, match="'named' is already registered"):
        state.on_reset(lambda o, n: None, name="named")
        state.on_reset(lambda o, n: None, name="named")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"world_size": 0}, "world_size"),
        ({"rank": 4}, "rank must be in 0..3"),
        ({"rank": True}, "rank must be an integer"),
        ({"nodes": ["a"]}, "nodes must be a tuple"),
        ({"nodes": ("a", "")}, "nodes must be a tuple"),
        ({"nodes": ("a",) * 5}, "5 nodes for 4 ranks"),
        ({"step": -1}, "step"),
    ],
)
def test_world_is_checked(fields: dict[str, Any], message: str) -> None:
    good: dict[str, Any] = {"world_size": 4, "rank": 1, "nodes": ("a", "b"), "step": 0}
    with pytest.raises(ValueError, match=message):
        World(**(good | fields))


# --- two processes on a real gloo group ------------------------------------------------


def _emit(out: Any, **event: Any) -> None:
    out.write(json.dumps(event) + "\n")
    out.flush()


def _gloo_worker(rank: int, port: int, path: str) -> None:
    code = 0
    with open(path, "w") as out:
        try:
            torch.set_num_threads(1)
            store = PrefixStore("state", TCPStore("127.0.0.1", port, is_master=False))
            timeout = timedelta(seconds=20)  # a backstop: both ranks run to the end
            dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
            state, sampler, counter, _ = _setup(seed=rank)  # rank 1 starts elsewhere
            if rank == 0:
                _advance(state, sampler, counter, 7)
            waits: list[str] = []

            def wait(work: dist.Work) -> None:
                waits.append(type(work).__name__)
                work.wait()

            snap = state.capture() if rank == 0 else None
            got = broadcast_snapshot(snap, 0, wait=wait)
            state.restore(got)
            lr = state.rebuilt("lr").optimizer.param_groups[0]["lr"]
            _emit(out, event="state", lr=lr, position=sampler.position, steps=counter.steps)
            _emit(out, event="draws", draws=_draws(), waits=len(waits))
            # a snapshot the sender cannot encode fails on both ranks, at once
            bad = state.capture()
            bad["objects"]["counter"] = {"custom": Counter()}
            try:
                broadcast_snapshot(bad if rank == 0 else None, 0)
            except SnapshotError as exc:
                _emit(out, event="refused", error=str(exc))
            dist.destroy_process_group()
        except Exception as exc:
            _emit(out, event="failed", error=f"{type(exc).__name__}: {exc}"[:500])
            code = 3
    sys.stdout.flush()
    os._exit(code)


@contextmanager
def _workers(tmp: Path) -> Iterator[tuple[list[ForkServerProcess], list[Path]]]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    paths = [tmp / f"rank{r}.jsonl" for r in range(2)]
    procs: list[ForkServerProcess] = []
    try:
        for rank, path in enumerate(paths):
            proc = _FORKS.Process(target=_gloo_worker, args=(rank, store.port, str(path)))
            proc.start()
            procs.append(proc)
        yield procs, paths
    finally:
        stop(*(p.pid for p in procs if p.pid is not None and p.is_alive()), sig=signal.SIGKILL)
        for proc in procs:
            proc.join(timeout=10)


def test_rank_0s_snapshot_reaches_rank_1_over_gloo(tmp_path: Path) -> None:
    with _workers(tmp_path) as (procs, paths):
        for proc in procs:
            proc.join(timeout=60)
        logs = [p.read_text() for p in paths]
        assert [p.exitcode for p in procs] == [0, 0], logs
    events = [{e["event"]: e for e in map(json.loads, log.splitlines())} for log in logs]
    zero, one = events
    assert zero["state"] == one["state"]
    assert zero["state"]["position"] == 7 * 8 and zero["state"]["steps"] == 7
    assert zero["draws"]["draws"] == one["draws"]["draws"]
    assert zero["draws"]["waits"] == one["draws"]["waits"] == 2  # length, then bytes
    assert "do not load" in zero["refused"]["error"]  # the sender's own check
    assert "could not be encoded" in one["refused"]["error"]  # length -1, no wait for bytes
