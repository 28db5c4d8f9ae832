"""A failed gloo group is put in the graveyard with every subgroup of its mesh.

HSDP's cross-node reduce runs in a subgroup of the default group (the replicate dimension
of its mesh). When a node loses power inside that reduce, no reset reaches the survivors:
the op stays stuck on them after the verdict. Destructing a gloo group with a stuck op
blocks until the op times out, so the teardown after the verdict must keep every group
alive, not only the default one (torchhook.groups, ``teardown``).

Four workers (2 nodes × 2 local ranks, a ``replicate × shard`` mesh), forked by a fork
server that imported this module; rank 3 stops itself (SIGSTOP: silence, no reset) and
rank 1 leaves its replicate group with an all-reduce stuck on it. Real gloo groups.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torchhook needs torch (install the [torch] extra)")

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from agent.procs import stop, until
from tests.torchhook.workers import run_worker
from torchhook.groups import ProcessGroups

_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload([__name__])

WORLD = 4
STOPPED, STUCK = 3, 1  # rank 1's replicate peer is rank 3
PG_TIMEOUT = timedelta(seconds=60)  # a teardown that waits for the stuck op takes this long
START_S = 60.0  # four workers importing torch on a loaded machine
_HELD: list[ProcessGroups] = []
TEARDOWN_S = 20.0  # a third of the group timeout: a teardown past it waited for the op


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False)
    groups = ProcessGroups("gloo", rank % 2)
    groups.init(store, rank, WORLD, PG_TIMEOUT)
    mesh = groups.mesh((2, 2), ("replicate", "shard"))
    replicas = mesh.get_group("replicate")
    dist.all_reduce(torch.ones(4), group=replicas)  # connected along both dimensions
    dist.all_reduce(torch.ones(4), group=mesh.get_group("shard"))
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{r}" for r in range(WORLD)])
    if rank == STOPPED:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if rank == STUCK:
        store.wait([f"stopped/{STOPPED}"])
        work = dist.all_reduce(torch.ones(4), group=replicas, async_op=True)
        # the op is on the wire, its peer silent: gloo's wait(timeout) leaves it running
        with pytest.raises(RuntimeError, match=r"(?i)timed out"):
            work.wait(timedelta(milliseconds=200))
        del work
    del replicas, mesh  # as HSDP's abandon drops its mesh and module
    started = time.monotonic()
    groups.teardown("graveyard")
    took = time.monotonic() - started
    kept = len(groups.graveyard[0]) if groups.graveyard else 0
    Path(f"{out}/{rank}.json").write_text(json.dumps({"teardown_s": took, "kept": kept}))
    _HELD.append(groups)  # as the engine holds it until os._exit: never destructed


def _worker_main(rank: int, port: int, out: str) -> None:
    run_worker(_worker, rank, port, out)


def test_a_stuck_op_in_a_mesh_subgroup_does_not_block_the_teardown(tmp_path: Path) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        _FORKS.Process(target=_worker_main, args=(r, store.port, str(tmp_path)))
        for r in range(WORLD)
    ]
    try:
        for proc in procs:
            proc.start()
        until(lambda: store.check([f"ready/{r}" for r in range(WORLD)]), START_S, "connected")
        pid = procs[STOPPED].pid
        assert pid is not None
        until(lambda: _state(pid) == "T", 10, "rank 3 stopped")
        store.set(f"stopped/{STOPPED}", "1")
        live = [p for r, p in enumerate(procs) if r != STOPPED]
        for proc in live:
            proc.join(TEARDOWN_S)
        report = "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.err")))
        assert [p.exitcode for p in live] == [0] * len(live), report
    finally:
        stop(*(p.pid for p in procs if p.pid is not None and p.is_alive()), sig=signal.SIGKILL)
        for proc in procs:
            proc.join(10)
    results = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1, 2)}
    for rank, result in results.items():
        # the default group, the replicate and the shard group, and no wait for the op
        assert result["kept"] >= 3, (rank, result)
        assert result["teardown_s"] < TEARDOWN_S, (rank, result)


def _state(pid: int) -> str:
    """The process state letter from /proc (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
