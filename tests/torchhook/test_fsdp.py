"""torchhook.fsdp with real processes and real gloo: shard, async checkpoint, reshard 4 → 3.

Every distributed test starts worker processes, forked by a multiprocessing fork server that
has this module (and so torch) imported. They form a gloo group through a TCPStore hosted
here, so the store outlives any worker (docs/training.md §5, fact 5). Each worker trains a
small MLP with FSDP2 on its even slice of a fixed global batch of 12 drawn from a generator
seeded by the step, and logs its local loss as a JSON line. Averaging the ranks' losses
gives the global-batch loss, which must equal an unsharded single-process reference run
(to ≤1e-6 relative, measured on torch 2.13, CPU/gloo).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.context import ForkServerProcess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torchhook.fsdp needs torch (install the [torch] extra)")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from agent.procs import stop, until
from torchhook.fsdp import MARKER, Checkpointer, complete_checkpoints, shard

# dist.TCPStore and dist.PrefixStore are public, but torch.distributed re-exports them
# implicitly, which strict mypy rejects; a pyproject override `implicit_reexport = true` for
# module torch.distributed would make these two ignores unnecessary.
TCPStore = dist.TCPStore  # type: ignore[attr-defined]
PrefixStore = dist.PrefixStore  # type: ignore[attr-defined]

# Workers fork from a fork server that imported this module, and so torch, once: an import
# costs ~2.7 s of CPU here, and 11 workers on 2 cores would spend most of the test on it.
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload([__name__])

GLOBAL_BATCH = 12
EVERY = 2
PG_TIMEOUT_S = 15.0  # backstop only (docs/training.md §5, fact 4); no test should reach it
PHASE_TIMEOUT_S = 60.0
REL_TOL = 1e-5


# --- model, data and the reference: shared by the workers and the test process ----------


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 64 rows over 3 ranks shard unevenly (22/22/20) and the 4-row output layer leaves
    # rank 2 an empty shard at world 3: both are cases resharding must get right.
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=gen), torch.randn(GLOBAL_BATCH, 4, generator=gen)


def _reference(steps: int) -> list[float]:
    """Losses of the same training, unsharded, in this process."""
    losses = []
    with torch.random.fork_rng():
        model = _model()
        opt = _optimizer(model)
        for step in range(steps):
            x, y = _batch(step)
            loss = F.mse_loss(model(x), y)
            torch.autograd.backward(loss)  # typed, unlike Tensor.backward
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


# --- the worker process -----------------------------------------------------------------


def _emit(**event: Any) -> None:
    print(json.dumps({**event, "t": time.time()}), flush=True)


def _train(cfg: dict[str, Any]) -> None:
    rank, world = cfg["rank"], cfg["world"]
    torch.set_num_threads(1)  # 4 processes on 2 cores
    client = TCPStore("127.0.0.1", cfg["port"], is_master=False)
    _join(client, "gen0", rank, world)
    if rank == cfg.get("stall_rank"):
        _stall_save_of(cfg["stall_step"])
    ckpt = Checkpointer(Path(cfg["dir"]), every_steps=EVERY, keep=2, timeout_s=PG_TIMEOUT_S)
    model, opt, start = _build(ckpt, cfg["resume"])
    leave = cfg.get("leave_after")
    _steps(ckpt, model, opt, range(start, leave or cfg["steps"]), gen=0)
    if leave is not None:
        # Planned in-process shrink: the last rank leaves, the others form generation 1 in
        # the same processes, with the same Checkpointer, and roll back to its checkpoint.
        ckpt.wait()  # nothing is stuck here, so the old group can be torn down cleanly
        del model, opt
        dist.destroy_process_group()
        if rank == world - 1:
            _emit(event="left")
            return
        _join(client, "gen1", rank, world - 1)
        model, opt, start = _build(ckpt, resume=True)
        _steps(ckpt, model, opt, range(start, cfg["steps"]), gen=1)
    began = time.perf_counter()
    ckpt.wait()
    _emit(event="done", wait_seconds=time.perf_counter() - began)
    dist.destroy_process_group()


def _join(client: Any, prefix: str, rank: int, world: int) -> None:
    # a new store prefix per generation (docs/training.md §5, fact 5)
    store = PrefixStore(prefix, client)
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def _build(ckpt: Checkpointer, resume: bool) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """A freshly sharded model and optimizer, loaded from the newest checkpoint if asked."""
    model = shard(_model())
    opt = _optimizer(model)
    if not resume:
        return model, opt, 0
    began = time.perf_counter()
    loaded = ckpt.load_latest(model, opt)
    _emit(event="loaded", step=loaded, seconds=time.perf_counter() - began)
    return model, opt, loaded or 0


def _steps(
    ckpt: Checkpointer, model: nn.Module, opt: torch.optim.Optimizer, steps: range, gen: int
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    for step in steps:
        x, y = _batch(step)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = F.mse_loss(model(x[mine]), y[mine])
        torch.autograd.backward(loss)  # typed, unlike Tensor.backward
        opt.step()
        opt.zero_grad()
        _emit(event="loss", step=step, loss=loss.item(), gen=gen, world=world)
        began = time.perf_counter()
        if ckpt.maybe_save(step + 1, model, opt):
            _emit(event="save_started", step=step + 1, seconds=time.perf_counter() - began)


def _stall_save_of(step: int) -> None:
    """Fault injection in the victim: its write of ``step``'s checkpoint hangs until the test
    SIGKILLs it, as when a node dies mid-save. Its training thread goes on meanwhile, and the
    other ranks write their shards, so the checkpoint lacks only this rank's part."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original = FileSystemWriter.write_data

    def write_data(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        if f"step-{step:010d}-" in str(self.path):
            _emit(event="stalled")
            time.sleep(PHASE_TIMEOUT_S)
        return original(self, *args, **kwargs)

    setattr(FileSystemWriter, "write_data", write_data)  # noqa: B010 (mypy: method assign)


def _worker_main(cfg_json: str, out: str, err: str) -> None:
    """Entry point of a worker, forked by the fork server; stdout and stderr go to files."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    code = 0
    try:
        _train(json.loads(cfg_json))
    except Exception as exc:
        _emit(event="failed", error=f"{type(exc).__name__}: {exc}"[:300])
        code = 3
    # os._exit: a save thread stuck on a dead peer must not hold up the exit ("Recipe", Exit)
    sys.stdout.flush()
    os._exit(code)


# --- the test side: launching, watching, reading ---------------------------------------


class _Phase:
    """A group of worker processes; their stdout (JSON lines) and stderr go to files."""

    def __init__(self, tmp: Path, name: str, world: int) -> None:
        self.logs = [tmp / f"{name}-rank{r}.out" for r in range(world)]
        self.errs = [tmp / f"{name}-rank{r}.err" for r in range(world)]
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.procs: list[ForkServerProcess] = []

    def start(self, **cfg: Any) -> None:
        world = len(self.logs)
        for rank in range(world):
            args = json.dumps({"rank": rank, "world": world, "port": self.store.port, **cfg})
            files = (str(self.logs[rank]), str(self.errs[rank]))
            for path in files:
                Path(path).write_bytes(b"")  # exists before the worker runs: it may be slow
            proc = _FORKS.Process(target=_worker_main, args=(args, *files))
            proc.start()
            self.procs.append(proc)

    def events(self, rank: int, kind: str) -> list[dict[str, Any]]:
        found = []
        for line in self.logs[rank].read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == kind:
                found.append(event)
        return found

    def wait_event(self, rank: int, kind: str, timeout_s: float) -> None:
        def seen() -> bool:
            if self.events(rank, kind):
                return True
            assert self.procs[rank].is_alive(), f"rank {rank} exited early\n{self.report()}"
            return False

        try:
            until(seen, timeout_s, f"no {kind!r} from rank {rank}")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.report()}") from exc

    def wait(self, timeout_s: float = PHASE_TIMEOUT_S) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
        return [proc.exitcode for proc in self.procs]

    def kill(self) -> None:
        stop(*(_pid(p) for p in self.procs if p.is_alive()), sig=signal.SIGKILL)
        for proc in self.procs:
            proc.join(timeout=10)  # its exit code, from the forkserver

    def losses(self, gen: int = 0) -> dict[int, float]:
        """Global-batch loss per step of generation ``gen``: the mean of the ranks'
        equal-sized slice losses, for the steps that every rank of it reported."""
        per_step: dict[int, list[float]] = {}
        world = 0
        for rank in range(len(self.procs)):
            for event in self.events(rank, "loss"):
                if event["gen"] == gen:
                    per_step.setdefault(event["step"], []).append(event["loss"])
                    world = event["world"]
        complete = {s: v for s, v in per_step.items() if len(v) == world}
        return {s: sum(v) / len(v) for s, v in sorted(complete.items())}

    def report(self) -> str:
        parts = []
        for rank, (out, err) in enumerate(zip(self.logs, self.errs, strict=True)):
            parts.append(f"--- rank {rank} rc={self.procs[rank].exitcode}\n{out.read_text()}")
            parts.append(err.read_text()[-3000:])
        return "\n".join(parts)


@contextmanager
def _phase(tmp: Path, name: str, world: int, **cfg: Any) -> Iterator[_Phase]:
    phase = _Phase(tmp, name, world)
    try:
        phase.start(**cfg)  # inside the try: a failed start still kills the ones started
        yield phase
    finally:
        phase.kill()


def _run_to_end(tmp: Path, name: str, world: int, **cfg: Any) -> _Phase:
    with _phase(tmp, name, world, **cfg) as phase:
        codes = phase.wait()
        assert codes == [0] * world, phase.report()
    return phase


def _pid(proc: ForkServerProcess) -> int:
    assert proc.pid is not None, "not started"
    return proc.pid


def _assert_matches(got: dict[int, float], ref: list[float], steps: range) -> None:
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step] == pytest.approx(ref[step], rel=REL_TOL), (step, got[step], ref[step])


# --- tests -------------------------------------------------------------------------------


def test_sigkill_mid_save_then_three_new_processes_reshard_and_resume(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    ref = _reference(10)
    victim = 1
    first, codes = _kill_mid_save(tmp_path, ckpt_dir, victim, step=6)
    assert codes[victim] == -signal.SIGKILL
    # without the victim nobody can finish training: the survivors fail (or are killed after
    # the backstop); a clean exit would mean the kill did not land mid-training
    assert 0 not in codes, first.report()
    trained = first.losses()
    assert len(trained) >= 6, first.report()
    _assert_matches(trained, ref, range(len(trained)))
    # step 6's shards of the survivors are on disk, the victim's never got there: the
    # checkpoint exists but is not complete, and only steps 2 and 4 are
    partial = list(ckpt_dir.glob("step-0000000006-*"))
    assert len(partial) == 1 and not (partial[0] / MARKER).exists(), first.report()
    saved = complete_checkpoints(ckpt_dir)
    assert [(c.step, c.world_size) for c in saved] == [(2, 4), (4, 4)]
    assert (ckpt_dir / "latest").read_text().strip() == saved[-1].path.name

    # A newer checkpoint complete on disk but for its marker (rank 0 died right before
    # writing it): loading it would "work" and resume at step 10, so it must be ignored.
    planted = ckpt_dir / "step-0000000010-00000000deadbeef"
    shutil.copytree(saved[-1].path, planted)
    (planted / MARKER).unlink()

    # the survivors' replacement: 3 new processes, world 3, resharding the world-4 checkpoint
    second = _run_to_end(tmp_path, "w3", 3, dir=str(ckpt_dir), steps=10, resume=True)
    assert [second.events(r, "loaded")[0]["step"] for r in range(3)] == [4, 4, 4]
    _assert_matches(second.losses(), ref, range(4, 10))
    # keep=2 pruned the older ones and the abandoned step-6 attempt, not the newer planted one
    assert [(c.step, c.world_size) for c in complete_checkpoints(ckpt_dir)] == [(8, 3), (10, 3)]
    assert not partial[0].exists()
    assert planted.is_dir() and not (planted / MARKER).exists()


def _kill_mid_save(
    tmp: Path, ckpt_dir: Path, victim: int, step: int
) -> tuple[_Phase, list[int | None]]:
    """Run 4 workers; SIGKILL ``victim`` while its write of ``step`` hangs; wait for the rest."""
    cfg = {"dir": str(ckpt_dir), "steps": 10, "resume": False}
    with _phase(tmp, "w4", 4, stall_rank=victim, stall_step=step, **cfg) as first:
        first.wait_event(victim, "stalled", PHASE_TIMEOUT_S)
        os.kill(_pid(first.procs[victim]), signal.SIGKILL)
        codes = first.wait(timeout_s=PG_TIMEOUT_S + 15)
    return first, codes


def test_in_process_shrink_rolls_back_with_the_same_checkpointer(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    ref = _reference(10)
    run = _run_to_end(
        tmp_path, "inproc", 4, dir=str(ckpt_dir), steps=10, resume=False, leave_after=7
    )
    _assert_matches(run.losses(gen=0), ref, range(0, 7))
    assert run.events(3, "left") and not run.events(3, "loaded")
    # step 7 was lost with the old group: generation 1 rolls back to the checkpoint of step 6
    assert [run.events(r, "loaded")[0]["step"] for r in range(3)] == [6, 6, 6]
    _assert_matches(run.losses(gen=1), ref, range(6, 10))
    assert [(c.step, c.world_size) for c in complete_checkpoints(ckpt_dir)] == [(8, 3), (10, 3)]


def test_complete_checkpoints_lists_only_marked_directories(tmp_path: Path) -> None:
    for name, marker in [
        ("step-0000000002-aa", {"step": 2, "saved_at": 1.0, "world": 4}),
        ("step-0000000004-bb", {"step": 4, "saved_at": 2.0, "world": 3}),
        ("step-0000000006-cc", None),  # no marker: an unfinished save
        ("step-0000000008-dd", "{torn"),  # a torn marker is not a marker
    ]:
        (tmp_path / name).mkdir()
        if marker is not None:
            text = marker if isinstance(marker, str) else json.dumps(marker)
            (tmp_path / name / MARKER).write_text(text)
    found = complete_checkpoints(tmp_path)
    assert [(c.step, c.world_size, c.path.name) for c in found] == [
        (2, 4, "step-0000000002-aa"),
        (4, 3, "step-0000000004-bb"),
    ]
    assert complete_checkpoints(tmp_path / "missing") == []


def test_maybe_save_only_every_k_steps_and_wait_without_save(tmp_path: Path) -> None:
    # No process group exists here: a step that is not a multiple of K must not touch it.
    ckpt = Checkpointer(tmp_path, every_steps=3)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert [ckpt.maybe_save(s, model, opt) for s in (0, 1, 2, 4, 5)] == [False] * 5
    assert ckpt.wait() is None
    with pytest.raises(ValueError):
        Checkpointer(tmp_path, every_steps=0)
