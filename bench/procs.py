"""Local processes for interop tests and benchmarks: real serf agents next to our agents.

``LocalSerf`` runs Debian's ``serf agent`` on 127.0.0.1 with its own gossip and RPC ports
and reads its view with ``serf members -format=json``; ``LocalAgent`` (agent/demo.py) runs
ours. Both stop their process by pid (agent/procs.py's ``stop``), and never leave one behind
on error. A ``serf`` command that fails raises ``SerfError``: while its agent is busy that
is a "not yet" for a poller (``until(..., ignore=(SerfError,))``), not a test failure.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from agent.demo import LocalAgent
from agent.procs import free_port, stop, until

__all__ = ["SERF", "LocalAgent", "LocalSerf", "SerfError", "free_port", "serf_command"]

SERF = shutil.which("serf")


class SerfError(RuntimeError):
    """A ``serf`` command failed (its agent not up yet, or busy)."""


def serf_command(
    name: str,
    port: int,
    rpc: str,
    profile: str,
    join_port: int | None = None,
    tags: dict[str, str] | None = None,
    encrypt: str | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    """``serf agent`` on 127.0.0.1:``port`` with its RPC on ``rpc``, joining ``join_port``
    (the serf twin of agent/demo.py's ``agent_command``)."""
    if SERF is None:
        raise RuntimeError("serf is not installed (apt-get install -y serf)")
    args = [
        *(SERF, "agent", f"-node={name}", f"-bind=127.0.0.1:{port}", f"-rpc-addr={rpc}"),
        *(f"-profile={profile}", "-log-level=debug"),
    ]
    for key, value in (tags or {}).items():
        args += ["-tag", f"{key}={value}"]
    if join_port is not None:
        args.append(f"-join=127.0.0.1:{join_port}")
    if encrypt is not None:
        args.append(f"-encrypt={encrypt}")
    return args + (extra or [])


class LocalSerf:
    def __init__(
        self,
        name: str,
        workdir: Path,
        profile: str = "local",
        join: int | None = None,
        tags: dict[str, str] | None = None,
        encrypt: str | None = None,
        extra: list[str] | None = None,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.rpc = f"127.0.0.1:{free_port()}"
        self.log_path = workdir / f"{name}.serf.log"
        args = serf_command(name, self.port, self.rpc, profile, join, tags, encrypt, extra)
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)

    def _cmd(self, *args: str, timeout_s: float = 10) -> subprocess.CompletedProcess[str]:
        assert SERF is not None
        return subprocess.run(
            [SERF, *args, f"-rpc-addr={self.rpc}"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def members(self) -> dict[str, dict[str, Any]]:
        out = self._cmd("members", "-format=json")
        if out.returncode != 0:
            raise SerfError(f"serf members failed: {out.stderr.strip()}")
        return {m["name"]: m for m in json.loads(out.stdout)["members"]}

    def ready(self) -> bool:
        """Whether ``serf members`` answers; raises if the agent exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"serf {self.name} exited: {self.log_path.read_text()[-2000:]}")
        try:
            self.members()
        except (SerfError, json.JSONDecodeError):
            return False
        return True

    def wait_ready(self, timeout_s: float = 20) -> None:
        until(self.ready, timeout_s, f"serf {self.name} ready")

    def leave(self) -> None:
        self._cmd("leave", timeout_s=20)

    def user_event(self, name: str, payload: str) -> None:
        """``serf event -coalesce=false NAME PAYLOAD`` (flags before the arguments)."""
        assert SERF is not None
        out = subprocess.run(
            [SERF, "event", f"-rpc-addr={self.rpc}", "-coalesce=false", name, payload],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if out.returncode != 0:
            raise SerfError(f"serf event failed: {out.stdout.strip()} {out.stderr.strip()}")

    def query(self, name: str, payload: str, timeout: str = "3s") -> dict[str, Any]:
        """``serf query`` as JSON (``Acks``, ``Responses``: node name -> answer)."""
        assert SERF is not None
        args = [SERF, "query", f"-rpc-addr={self.rpc}", "-format=json", f"-timeout={timeout}"]
        out = subprocess.run(
            [*args, name, payload], capture_output=True, text=True, timeout=30, check=False
        )
        if out.returncode != 0:
            raise SerfError(f"serf query failed: {out.stdout.strip()} {out.stderr.strip()}")
        result: dict[str, Any] = json.loads(out.stdout)
        return result

    def set_tags(self, **tags: str) -> None:
        args = []
        for key, value in tags.items():
            args += ["-set", f"{key}={value}"]
        out = self._cmd("tags", *args)
        if out.returncode != 0:
            raise SerfError(f"serf tags failed: {out.stderr.strip()}")

    def stop(self, sig: int = signal.SIGKILL, timeout_s: float = 10) -> None:
        stop(self.proc, sig=sig, timeout_s=timeout_s)
        self._log.close()
