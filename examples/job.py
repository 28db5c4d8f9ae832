"""What the in-process example trainers share: one job (model, data, optimizer, the
failure-free reference), their command line and the hook options it sets, one step on a
rank's slice of the global batch, their step log, planned faults and the training loop.
elastic_ddp.py, elastic_hsdp.py and elastic_fsdp.py differ only in the strategy they plug in and
in what they pass to one step. Run as scripts, this directory is on sys.path.

The job: a small MLP on a fixed synthetic regression. The global batch of each step is
fixed (``--global-batch``, 12) and every rank takes an equal slice of it, so the loss curve
does not depend on the world size and equals the single-process run that ``--reference``
prints (12 divides every world size the tests use: 1, 2, 3, 4, 6).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from torchhook.errors import SlowNodeExcluded
from torchhook.state import TrainingState

IN_DIM = 16
EXCLUDED_EXIT = 3
"""Exit status of a trainer whose node was flagged slow and excluded."""
FAULTS = (
    "none",
    "kill-in-backward",
    "stop-in-backward",
    "power-in-backward",
    "kill",
    "stop",
    "power",
    "reject",
    "blackout",
    "bug",
)
STEP_BOUNDARY_FAULTS = ("kill", "stop", "power", "reject", "blackout")
POWER_IFACE = "eth0"
"""The interface a ``power`` fault cuts: the node's only link in its network namespace."""


def power_cut_rules(iface: str, action: str = "-I") -> str:
    """``iptables-restore --noflush`` input that drops every packet in and out of
    ``iface`` (``-I``; ``-D`` deletes the same rules), both rules committed at once: a host
    losing power sends nothing more, no TCP reset and no ICMP, and answers nothing. The
    rules come first in their chains, so the dropped packets are counted by them alone."""
    at = " 1" if action == "-I" else ""
    return (
        f"*filter\n{action} INPUT{at} -i {iface} -j DROP\n"
        f"{action} OUTPUT{at} -o {iface} -j DROP\nCOMMIT\n"
    )


def reject_rules(iface: str, action: str = "-I") -> str:
    """``iptables-restore --noflush`` input that rejects every packet in and out of
    ``iface`` (``-I``; ``-D`` deletes the same rules): TCP with a reset, the rest with ICMP
    port unreachable. The node stays alive, but every connection through the link is reset
    and its agent answers no probe: to its peers it looks crashed (a ``reject`` fault: the
    one real way to give a live node's peers the evidence of a crash)."""
    at = " 1" if action == "-I" else ""
    return (
        f"*filter\n{action} INPUT{at} -i {iface} -p tcp -j REJECT --reject-with tcp-reset\n"
        f"{action} OUTPUT{at} -o {iface} -p tcp -j REJECT --reject-with tcp-reset\n"
        f"{action} INPUT{at} -i {iface} -j REJECT --reject-with icmp-port-unreachable\n"
        f"{action} OUTPUT{at} -o {iface} -j REJECT --reject-with icmp-port-unreachable\n"
        "COMMIT\n"
    )


def own_network_namespace() -> bool:
    """Whether this process runs in a named network namespace (one of ``ip netns list``,
    /run/netns): a ``power`` fault drops every packet of an interface, which must never be
    the host's own (init's namespace is not listed there)."""
    try:
        mine = os.stat("/proc/self/ns/net")
        named = list(Path("/run/netns").iterdir()) if Path("/run/netns").is_dir() else []
        for path in named:
            with contextlib.suppress(OSError):
                st = os.stat(path)
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                    return True
    except OSError:
        return False
    return False


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # 64 rows shard unevenly over 3 ranks (22/22/20): resharding must get that right
    return nn.Sequential(
        nn.Linear(IN_DIM, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, IN_DIM, generator=g)
    y = torch.sin(x[:, :4].sum(dim=1, keepdim=True)) + 0.1 * x[:, 4:5]
    return x, y


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def scheduler_for(optimizer: torch.optim.Optimizer) -> LambdaLR:
    """A decaying learning rate: the loss curve matches the reference only if the
    scheduler's position and ``lr`` travel with the model (and roll back with FSDP)."""
    return LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.02 * step))


def reference(steps: int, global_batch: int, seed: int) -> list[float]:
    """The same training in one process on the whole batch: the failure-free curve."""
    model = build_model(seed)
    opt = optimizer_for(model)
    sched = scheduler_for(opt)
    losses = []
    for step in range(steps):
        x, y = batch(step, global_batch)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        torch.autograd.backward(loss)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


def checksum(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """Parameters and optimizer state this process holds (its shards, when sharded)."""
    h = hashlib.sha256()

    def add(t: torch.Tensor) -> None:
        local = t.to_local() if hasattr(t, "to_local") else t
        h.update(local.detach().cpu().numpy().tobytes())

    for p in model.parameters():
        add(p)
        for key in sorted(opt.state.get(p, {})):
            if isinstance(value := opt.state[p][key], torch.Tensor):
                add(value)
    return h.hexdigest()[:16]


def parser(description: str | None, *, job: str, pg_timeout_s: float) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--job", default=job)
    ap.add_argument("--control", default=None, help="agent control socket (default: SWIM_CONTROL)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--stop-file", type=Path, default=None, help="stop at the step written in it")
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (pacing)")
    ap.add_argument("--log", type=Path, default=None, help="append one JSON line per step")
    ap.add_argument("--fault", choices=FAULTS, default="none")
    ap.add_argument("--fault-step", type=int, default=-1)
    ap.add_argument("--fault-file", type=Path, default=None, help="fault after it appears")
    ap.add_argument(
        "--power-iface",
        default=POWER_IFACE,
        help="the interface a power fault cuts (in the node's own network namespace)",
    )
    ap.add_argument(
        "--reject-ms", type=int, default=300, help="how long a reject fault resets the link"
    )
    ap.add_argument("--min-nodes", type=int, default=1)
    ap.add_argument("--pg-timeout", type=float, default=pg_timeout_s)
    ap.add_argument("--heartbeat-pause-ms", type=int, default=30_000)
    ap.add_argument("--reference", action="store_true", help="print the failure-free curve")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-work", type=float, default=0.0, help="seconds slept inside each step")
    slow = "while it exists: --step-work times its number (or --slow-times)"
    ap.add_argument("--slow-file", type=Path, default=None, help=slow)
    ap.add_argument("--slow-times", type=float, default=1.0, help="--step-work times this")
    ap.add_argument("--slow-policy", default="report")
    ap.add_argument("--slow-factor", type=float, default=1.3)
    ap.add_argument("--slow-windows", type=int, default=2)
    ap.add_argument("--slow-quick-factor", type=float, default=2.0)
    ap.add_argument("--slow-window-steps", type=int, default=10)
    ap.add_argument(
        "--target-nodes", type=int, default=0, help="the job's size; nodes beyond it are spares"
    )
    ap.add_argument(
        "--spare", action="store_true", help="start as a spare (register once at the target)"
    )
    ap.add_argument(
        "--reference-seeds",
        default="",
        help="with --reference: comma-separated seeds, one curve each (a JSON list of lists)",
    )
    return ap


def hook_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``torchhook.Settings`` fields every example takes from the command line."""
    return {
        "job": args.job,
        "control": args.control,
        "min_nodes": args.min_nodes,
        "pg_timeout_s": args.pg_timeout,
        "heartbeat_pause_ms": args.heartbeat_pause_ms,
        "slow_policy": args.slow_policy,
        "slow_factor": args.slow_factor,
        "slow_windows": args.slow_windows,
        "slow_quick_factor": args.slow_quick_factor,
        "slow_window_steps": args.slow_window_steps,
        "target_nodes": args.target_nodes,
        "spare": args.spare,
    }


SLOW_BASE_MS: list[float] = []
"""This rank's step compute time (the engine's figure) when the slowdown began."""


def step_work(el: Any, args: argparse.Namespace) -> None:
    """Stand-in compute inside the step (``--step-work`` seconds); while ``--slow-file``
    exists, the rank is slowed by the number written in it (else ``--slow-times``): it
    sleeps on top for (factor - 1) times its own step compute time from before the
    slowdown (``el.pace.figure_ms``), so the whole step's compute, not only the stand-in,
    takes factor times as long: a slow node for the fail-slow checks."""
    seconds = args.step_work
    factor = None
    if args.slow_file is not None:
        with contextlib.suppress(FileNotFoundError):
            text = args.slow_file.read_text().strip()
            factor = float(text) if text else args.slow_times
    if factor is None:
        SLOW_BASE_MS.clear()
    else:
        if not SLOW_BASE_MS:
            SLOW_BASE_MS.append(el.pace.figure_ms or seconds * 1000)
        seconds += (factor - 1) * SLOW_BASE_MS[0] / 1000
    if seconds > 0:
        time.sleep(seconds)


def slice_step(
    el: Any,
    model: nn.Module,
    args: argparse.Namespace,
    faults: Faults,
    opt: torch.optim.Optimizer | None,
) -> float:
    """Forward and backward on this rank's equal slice of step ``el.step``'s global batch
    (``faults`` may fire inside backward), between ``opt.zero_grad()`` and ``opt.step()``
    when ``opt`` is given (HSDP steps its optimizer itself); returns the global
    batch's mean loss, from the ranks' slice means weighted by slice size."""
    lo, hi = el.shard(args.global_batch)
    faults.in_step(el.step)
    x, y = batch(el.step, args.global_batch)
    if opt is not None:
        opt.zero_grad()
    loss = nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
    step_work(el, args)
    faults.in_backward(el.step, loss)
    torch.autograd.backward(loss)
    # every collective of the step before any local state changes: a verdict during the
    # loss all-reduce re-runs the step, and an optimizer step taken before it would then
    # be applied twice on this rank (Elastic.run_step's rule)
    total = el.all_reduce(loss.detach().clone() * (hi - lo))
    if opt is not None:
        opt.step()
    mean: float = float(total) / args.global_batch
    return mean


def start(args: argparse.Namespace) -> bool:
    """Logging; prints the reference curve and returns False when that was asked for."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if os.environ.get("SWIM_DEBUG"):
        logging.getLogger("torchhook").setLevel(logging.DEBUG)
    if args.reference:
        if args.reference_seeds:
            seeds = [int(x) for x in args.reference_seeds.split(",")]
            print(json.dumps([reference(args.steps, args.global_batch, s) for s in seeds]))
        else:
            print(json.dumps(reference(args.steps, args.global_batch, args.seed)))
        return False
    torch.set_num_threads(1)  # several trainers share a few cores in the tests
    return True


class StepLog:
    """One JSON line per record, to stdout and ``path``."""

    def __init__(self, path: Path | None) -> None:
        self._file: TextIO | None = path.open("a") if path else None

    def emit(self, record: dict[str, Any]) -> None:
        line = json.dumps(record)
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()
        print(line, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        sys.stdout.flush()


class Faults:
    """A planned failure of this node: SIGKILL or SIGSTOP of its whole process group (agent
    and every local rank, when the caller started them in one), or a power loss (every
    packet of ``--power-iface`` dropped, ``power_cut_rules``, then the SIGKILL: the node
    must run in a network namespace of its own, and as root), or (``reject``, there too)
    every connection of that link reset for ``--reject-ms``, the node left alive, or
    (``blackout``) every packet of it dropped for as long, the node left alive; at
    ``--fault-step`` or at the first step after ``--fault-file`` appears (and that ``skip``
    does not reject), at the step boundary or inside backward; or (``bug``) an exception
    from the step function. Only local rank 0 fires it."""

    def __init__(
        self,
        args: argparse.Namespace,
        log: StepLog,
        *,
        fires: bool,
        skip: Callable[[int], bool] = lambda step: False,
    ) -> None:
        self.kind: str = args.fault
        self.step: int = args.fault_step
        self.file: Path | None = args.fault_file
        self.log = log
        self.fires = fires and self.kind != "none"
        self.skip = skip
        self._armed = False
        self.iface: str = args.power_iface
        self.reject_s: float = getattr(args, "reject_ms", 300) / 1000
        cuts = self.kind.startswith("power") or self.kind in ("reject", "blackout")
        if self.fires and cuts and not own_network_namespace():
            raise SystemExit(
                f"--fault {self.kind} drops every packet of {self.iface}: run the node in "
                "a network namespace of its own (tests/netns/training.py)"
            )

    def before_step(self, step: int) -> None:
        if self.file is not None and not self._armed and self.file.exists():
            self._armed = True
            self.step = step + 1  # the next step, so the fault lands mid-training
            while self.skip(self.step):
                self.step += 1
        if self.fires and step == self.step and self.kind in STEP_BOUNDARY_FAULTS:
            self._fire()

    def in_step(self, step: int) -> None:
        """``bug``: the step function raises, as a bug in the user's code would."""
        if self.fires and step == self.step and self.kind == "bug":
            self.log.emit({"fault": self.kind, "t": time.time(), "pid": os.getpid()})
            raise ValueError(f"a planned bug in the step function at step {step}")

    def in_backward(self, step: int, loss: torch.Tensor) -> None:
        """Call with the loss before ``backward``: fires as gradients start flowing."""
        if self.fires and step == self.step and self.kind.endswith("in-backward"):
            loss.register_hook(lambda grad: self._fire())  # type: ignore[no-untyped-call]

    def _fire(self) -> None:
        if self.kind in ("reject", "blackout"):  # alive: cut for a while, then back
            rules = reject_rules if self.kind == "reject" else power_cut_rules
            self._cut(rules(self.iface))
            time.sleep(self.reject_s)
            self._restore(rules(self.iface, "-D"))
            return
        if self.kind.startswith("power"):
            self._cut()  # logs the fault
        else:
            self.log.emit({"fault": self.kind, "t": time.time(), "pid": os.getpid()})
        sig = signal.SIGSTOP if self.kind.startswith("stop") else signal.SIGKILL
        os.killpg(os.getpgid(0), sig)

    def _cut(self, rules: str | None = None) -> None:
        """Drop every packet of the node's link (or apply ``rules``), then log: ``t`` is
        when the rules were in (``cut_s``: how long committing them took, the fault's own
        uncertainty)."""
        began = time.time()
        self._restore(power_cut_rules(self.iface) if rules is None else rules)
        now = time.time()
        self.log.emit({"fault": self.kind, "t": now, "cut_s": now - began, "pid": os.getpid()})

    @staticmethod
    def _restore(rules: str) -> None:
        done = subprocess.run(
            ["iptables-restore", "-w", "5", "--noflush"],
            input=rules,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if done.returncode != 0:  # no cut: no fault either, and the run says why
            raise RuntimeError(f"iptables-restore: exit {done.returncode}: {done.stderr}")


class StepCounter:
    """Steps completed, kept as the job's own state: registered in the engine's
    ``TrainingState``, so after a world change every rank holds the count of the step it
    goes on from (taken from the source rank, or from the checkpoint with FSDP)."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state["steps"])


def training_state() -> tuple[TrainingState, StepCounter]:
    """The examples' training state: the RNG and a ``StepCounter``."""
    state, counter = TrainingState(), StepCounter()
    state.register("counter", counter)
    return state, counter


def stop_step(path: Path | None) -> int | None:
    if path is None or not path.exists():
        return None
    text = path.read_text().strip()
    return int(text) if text.isdigit() else None


def train(
    el: Any,
    step: Callable[[Any], float],
    args: argparse.Namespace,
    log: StepLog,
    faults: Faults,
    details: Callable[[], dict[str, Any]],
    counter: StepCounter,
) -> None:
    """Run ``el.run_step(step)`` (and the LR scheduler, registered in the engine's
    training state) until ``--steps`` or the stop file's step, logging each
    step (with ``details()``) and a final record with this process's checksum. The
    counter counts after ``run_step`` returns, where per-step state (a scheduler, a
    sampler's position) is updated."""

    sched = el.scheduler("lr", scheduler_for)

    def where() -> dict[str, Any]:
        return {"t": time.time(), "node": el.node, "local_rank": el.local_rank, "pid": os.getpid()}

    shown: dict[str, float] = {}
    while True:
        limit = stop_step(args.stop_file)
        if el.step >= (limit if limit is not None else args.steps):
            break
        faults.before_step(el.step)
        try:
            loss = el.run_step(step)
        except SlowNodeExcluded as exc:  # slow_policy="exclude": this node leaves
            log.emit({"excluded": str(exc), "step": el.step} | where())
            log.close()
            el.exit(EXCLUDED_EXIT)
        sched.step()  # per-step state: after run_step returns
        counter.steps += 1
        record = {"step": el.step - 1, "loss": loss, "rank": el.rank, "world": el.world_size}
        record |= {"counter": counter.steps}
        record |= {"leader": el.order[0], "formations": el.reconfigurations}
        record |= {"formation_s": round(el.last_formation_s, 4), "verdict_t": el.verdict_time}
        if (phases := el.timeline.last) and phases is not shown:  # a re-formation's phases
            shown = phases
            record["phases"] = {k: round(t - phases["left"], 4) for k, t in phases.items()}
            record["left_t"] = phases["left"]
        record |= {"slow": list(el.pace.flagged)}
        if (verdict := el.pace.last_verdict) is not None and verdict.ratios:
            # the slowest node's figure over the reference in the last window: the margin
            # a run with no slow node keeps below the thresholds
            record["slow_top"] = round(max(verdict.ratios.values()), 3)
        log.emit(record | details() | where())
        if args.step_sleep:
            time.sleep(args.step_sleep)
    final = {"final": True, "step": el.step, "world": el.world_size}
    log.emit(final | {"checksum": checksum(el.model, el.optimizer)} | where())
    log.close()
