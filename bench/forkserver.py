"""Trainers forked from one process that imported torch before the measurement, so that a
restarted node's start does not spend its CPU-seconds on the test machine's shared cores.

Why: on this 2-core test machine every node shares the CPUs, and any CPU work slows the
training nodes' steps, whatever its scheduling class. Measured once by hand, loads
started beside the failure-free baseline of bench/mixed_efficiency.py (3 nodes × 2 ranks
+ 1 spare, 77-78 ms a step; about 8 s each): one busy loop at ``SCHED_IDLE`` made the
steps 86-88 ms, one at normal priority 90 ms, two torch imports at a time at
``SCHED_IDLE`` 91 ms. So what a restart costs is its CPU-seconds, and two
``import torch`` are ~3.6 of its ~6.5 (1.8 CPU-s each here). A rebooting host on a
cluster spends them on CPUs of its own. A *fork server* (as Python's
``multiprocessing`` forkserver and DataLoader workers do) imports torch and the trainer's
modules once, before the baseline, and forks each restarted trainer from that state; the
child then runs the trainer script as ``__main__`` exactly as ``python SCRIPT ARGS`` would
(its own environment, working directory, log, process group, network namespace), so the
recovery code under test is the same; only the import is skipped. What the rest of a
start costs is still measured (bench/mixed_restarts.py).

    server = ForkServer.start(workdir, preload=("torch", "elastic_ddp"), path=("examples",))
    proc = server.launch(cmd, env, log, pgid)   # a Popen-like handle: pid, poll(), wait()
    server.close()

The command is the one ``TrainingNode.start_trainers`` builds: prefixes the server knows
(``parse``: a network namespace, ``SCHED_IDLE``, a ``timeout -s KILL`` bound) and then
``PYTHON SCRIPT ARGS``; anything else is refused with ``ForkError``, never run another way.
Requests are one JSON line each over a Unix socket; the server reaps every child and writes
its exit status to ``<pid>.exit`` in its state folder, so a handle's ``poll`` and ``wait``
give the exit code as ``Popen``'s do (``-N`` for a signal). Bounded: ``MAX_REQUEST_BYTES``
per request, ``ACCEPT_POLL_S`` between reaps. ``close`` stops the server; its children
live in their nodes' process groups and are stopped with them (agent/procs.py ``stop``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import json
import math
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.procs import stop, until

__all__ = ["ACCEPT_POLL_S", "MAX_REQUEST_BYTES", "ForkError", "ForkServer", "Forked", "parse"]

ACCEPT_POLL_S = 0.05
"""How often the server reaps its exited children while it waits for a request."""
MAX_REQUEST_BYTES = 1 << 20
"""A request (command, environment) larger than this is refused: a trainer's is ~10 KiB."""
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")  # where ``ip netns add`` keeps a namespace's handle


class ForkError(RuntimeError):
    """A request the server cannot run as asked (fatal for that request, never retried)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """A command split into what the child sets up and the script it runs."""

    netns: str | None
    idle: bool
    timeout_s: float | None
    script: str
    """The script's path, or the module's name with ``module``."""
    args: tuple[str, ...]
    module: bool = False
    """``python -m MODULE ARGS`` rather than ``python SCRIPT ARGS``."""


def parse(cmd: Sequence[str]) -> Plan:
    """The prefixes of ``cmd`` (``ip netns exec NS``, ``chrt --idle 0``, ``timeout
    --foreground -s KILL N``, any order), then ``PYTHON SCRIPT ARGS`` or ``PYTHON -m MODULE
    ARGS``. Raises ``ForkError`` on anything else: a prefix or an interpreter option this
    server cannot reproduce must not be dropped."""
    rest = list(cmd)
    netns: str | None = None
    idle = False
    timeout_s: float | None = None
    while rest:
        if rest[:3] == ["ip", "netns", "exec"] and len(rest) > 3:
            netns, rest = rest[3], rest[4:]
        elif rest[:3] == ["chrt", "--idle", "0"]:
            idle, rest = True, rest[3:]
        elif rest[:4] == ["timeout", "--foreground", "-s", "KILL"] and len(rest) > 4:
            try:
                timeout_s = float(rest[4])
            except ValueError:
                raise ForkError(f"timeout {rest[4]!r} is not a number") from None
            rest = rest[5:]
        else:
            break
    python = ("python", "python3", Path(sys.executable).name)
    if len(rest) >= 3 and Path(rest[0]).name in python and rest[1] == "-m":
        return Plan(netns, idle, timeout_s, rest[2], tuple(rest[3:]), module=True)
    if len(rest) < 2 or Path(rest[0]).name not in python or rest[1].startswith("-"):
        raise ForkError(f"not a python script command after the known prefixes: {rest[:3]}")
    return Plan(netns, idle, timeout_s, rest[1], tuple(rest[2:]))


class Forked:
    """A forked trainer, as much of ``subprocess.Popen`` as the harness uses."""

    def __init__(self, pid: int, state: Path) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exit = state / f"{pid}.exit"

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(FileNotFoundError, ValueError):
                self.returncode = int(self._exit.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class ForkServer:
    """The client side: starts the server process and asks it for children."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: Path, state: Path) -> None:
        self.proc = proc
        self.sock = sock
        self.state = state

    @classmethod
    def start(
        cls,
        workdir: Path,
        preload: Sequence[str],
        path: Sequence[str | Path] = (),
        timeout_s: float = 60,
        name: str = "forkserver",
    ) -> ForkServer:
        """The server, once it has imported ``preload`` (with ``path`` on ``sys.path``);
        its socket, log and exit statuses are ``name``.* in ``workdir``."""
        sock = workdir / f"{name}.sock"
        state = workdir / f"{name}.exits"
        state.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "bench.forkserver", str(sock), str(state)]
        cmd += [f"--path={p}" for p in path] + list(preload)
        with (workdir / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        server = cls(proc, sock, state)

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"fork server exited with {proc.returncode}")
            return sock.exists()

        until(ready, timeout_s, "fork server ready")
        return server

    def launch(
        self, cmd: Sequence[str], env: Mapping[str, str], log: Path, pgid: int, cwd: Path
    ) -> Forked:
        """``cmd`` forked from the server (``parse`` says which commands), writing ``log``,
        in process group ``pgid``. Raises ``ForkError`` if the server refused it."""
        parse(cmd)  # refuse here, before the server is asked
        req = {"cmd": list(cmd), "env": dict(env), "log": str(log), "pgid": pgid, "cwd": str(cwd)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(str(self.sock))
            s.sendall(json.dumps(req).encode() + b"\n")
            reply = json.loads(_line(s))
        if "error" in reply:
            raise ForkError(str(reply["error"]))
        return Forked(int(reply["pid"]), self.state)

    def close(self) -> None:
        stop(self.proc)


def _line(s: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST_BYTES:
            raise ForkError("request too large")
    return buf


def _setns(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _child(req: Mapping[str, Any], plan: Plan) -> None:
    """In the forked child: become ``python SCRIPT ARGS`` as asked; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)  # first, so that a failure below lands in the trainer's log
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.setpgid(0, int(req["pgid"]))  # 0: a group of its own, which it leads
        if plan.netns is not None:
            _setns(plan.netns)
        if plan.idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        if plan.timeout_s is not None:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # as timeout -s KILL: no cleanup
            signal.alarm(max(1, math.ceil(plan.timeout_s)))
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        random.seed()  # a fresh process seeds from the OS; a fork would share the parent's
        gc.unfreeze()
        sys.argv = [plan.script, *plan.args]  # run_module sets argv[0] to the module's file
        try:
            if plan.module:  # python -m: the working directory first on the path
                sys.path[0] = os.getcwd()
                sys.modules.pop(plan.script, None)  # as in a fresh process: only __main__
                runpy.run_module(plan.script, run_name="__main__", alter_sys=True)
            else:
                sys.path[0] = str(Path(plan.script).resolve().parent)
                runpy.run_path(plan.script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # the child reports and exits, whatever it was
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()  # as an interpreter's exit would (torchhook/stores.py)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(state: Path) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        tmp = state / f"{pid}.tmp"
        tmp.write_text(str(os.waitstatus_to_exitcode(status)))
        tmp.replace(state / f"{pid}.exit")


def serve(sock_path: Path, state: Path, preload: Sequence[str]) -> None:
    import importlib

    for name in preload:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # children's collections leave the parent's pages unshared otherwise
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(str(sock_path) + ".tmp")
        os.replace(str(sock_path) + ".tmp", sock_path)  # exists only once it listens
        srv.listen(16)
        srv.settimeout(ACCEPT_POLL_S)
        while True:
            _reap(state)
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10)
                try:
                    req = json.loads(_line(conn))
                    plan = parse(req["cmd"])
                except (ForkError, ValueError, KeyError, TypeError, OSError) as e:
                    with contextlib.suppress(OSError):
                        conn.sendall(json.dumps({"error": str(e)}).encode() + b"\n")
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    srv.close()
                    conn.close()
                    _child(req, plan)
                with contextlib.suppress(OSError):  # as shells do: no window before the
                    os.setpgid(pid, int(req["pgid"]) or pid)  # child's own setpgid
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print("usage: python -m bench.forkserver SOCKET STATE_DIR [--path=DIR ...] MODULE ...")
        return 2
    sock, state, rest = Path(args[0]), Path(args[1]), args[2:]
    for p in (a.removeprefix("--path=") for a in rest if a.startswith("--path=")):
        sys.path.insert(0, str(Path(p).resolve()))
    serve(sock, state, [a for a in rest if not a.startswith("--path=")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
