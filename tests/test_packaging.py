"""The distribution: a wheel built from a clean checkout installs into a fresh virtual
environment of its own, and the daemon and ``swimctl`` run there without torch.

That is how the README says to install the daemon (an environment of its own, next to the
systemd unit), so the import names it ships (``swim``, ``phi``, ``agent``, ``torchhook``,
``simulations``) never meet a user's. The fresh environment installs the runtime
dependencies from the package index, as an operator's would (CI reaches the index).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from agent import DISTRIBUTION
from agent.procs import free_port, stop, until

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"agent", "phi", "simulations", "swim", "torchhook"}

pytestmark = pytest.mark.slow


def _checkout(dest: Path) -> Path:
    """The files a clean clone has: tracked ones plus new ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = ROOT / name.decode()
        if source.is_file():  # a deleted but still tracked file is not in a clean checkout
            target = dest / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def _run(*argv: str | Path, timeout_s: float = 300) -> str:
    done = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert done.returncode == 0, f"{argv} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
    return done.stdout


def _serving(agent: subprocess.Popen[bytes], control: Path) -> bool:
    if agent.poll() is not None:  # an exited agent is a failure now, not a wait
        raise RuntimeError(f"the packaged agent exited with {agent.returncode}")
    return control.exists()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("dist")
    src = _checkout(tmp / "src")
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", tmp / "dist", src)  # fmt: skip
    (built,) = (tmp / "dist").glob("*.whl")
    return built


def test_the_wheel_carries_the_packages_and_nothing_else(wheel: Path) -> None:
    assert wheel.name.startswith(DISTRIBUTION.replace("-", "_") + "-")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == PACKAGES
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert f"Name: {DISTRIBUTION}\n" in text
    # torch is an extra, never a requirement of the daemon
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    assert [r for r in requires if r.startswith("Requires-Dist: torch")] == [
        'Requires-Dist: torch>=2.2; extra == "torch"'
    ]


def test_a_fresh_venv_runs_the_daemon_and_swimctl_without_torch(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    _run(venv / "bin" / "pip", "install", "-q", "--disable-pip-version-check", wheel, timeout_s=600)
    python, swimctl = venv / "bin" / "python", venv / "bin" / "swimctl"
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True, check=False)
    assert probe.returncode != 0, "torch must not come with the daemon"
    assert "members" in _run(swimctl, "--help")

    control = tmp_path / "agent.sock"
    port = free_port()
    log = (tmp_path / "agent.log").open("w")
    agent = subprocess.Popen(
        [
            venv / "bin" / "swim-agent",
            "--node",
            "packaged",
            "--bind",
            f"127.0.0.1:{port}",
            "--control",
            control,
            "--profile",
            "local",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,  # not the checkout: imports must come from the venv
    )
    try:
        until(lambda: _serving(agent, control), 30, "the packaged agent's control socket")
        info = json.loads(_run(swimctl, "info", "--json", "--control", control))
        assert (info["node"], info["port"], info["version"]) == ("packaged", port, "0.1.0")
        members = json.loads(_run(swimctl, "members", "--json", "--control", control))
        assert [(m["name"], m["status"]) for m in members] == [("packaged", "alive")]
        # the Slurm scripts come with the wheel and run without torch (docs/runbook.md)
        assert "--resume" in _run(venv / "bin" / "swim-slurm-handler", "--help")
        check = subprocess.run(
            [venv / "bin" / "swim-slurm-check", "--control", control, "--allow-alone"],
            capture_output=True, text=True, timeout=30, check=False, cwd=tmp_path,
        )  # fmt: skip
        assert check.returncode == 0 and "ok: agent packaged is alive" in check.stderr
    except Exception as exc:
        exc.add_note("agent log:\n" + (tmp_path / "agent.log").read_text())
        raise
    finally:
        stop(agent, sig=signal.SIGTERM, timeout_s=15)
        log.close()
    assert agent.returncode == 0, (tmp_path / "agent.log").read_text()
