"""bench/forkserver.py: a restarted trainer forked from a process that imported its modules
once runs its script as ``__main__`` with the asked environment, working directory, log,
process group, scheduling class, network namespace and bound; the exit code comes back as
``Popen``'s would; a command it cannot reproduce is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.procs import stop
from agent.training_nodes import ROOT
from bench.forkserver import ForkError, ForkServer, parse

SCRIPT = """
import json, os, sys, time
import fork_probe_module
print(json.dumps({
    "name": __name__, "argv": sys.argv, "env": os.environ.get("PROBE"),
    "path0": sys.path[0], "cwd": os.getcwd(), "pgid": os.getpgid(0),
    "sched": os.sched_getscheduler(0), "preloaded": fork_probe_module.LOADS,
    "netns": os.readlink("/proc/self/ns/net"),
}), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
raise SystemExit(int(sys.argv[1]))
"""
MODULE = "import os\nLOADS = os.getpid()\n"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ForkServer]:
    (tmp_path / "fork_probe_module.py").write_text(MODULE)
    srv = ForkServer.start(tmp_path, ["fork_probe_module"], path=[tmp_path])
    yield srv
    srv.close()


def _group(tmp_path: Path) -> subprocess.Popen[bytes]:
    """A process group for the forked children, as a node's agent leads one."""
    return subprocess.Popen(["sleep", "60"], process_group=0)


def test_parse_accepts_the_prefixes_a_node_uses_and_refuses_others() -> None:
    plan = parse(
        ["chrt", "--idle", "0", "ip", "netns", "exec", "h1", "timeout", "--foreground", "-s",
         "KILL", "12.5", sys.executable, "s.py", "--x", "1"]
    )  # fmt: skip
    assert (plan.netns, plan.idle, plan.timeout_s) == ("h1", True, 12.5)
    assert (plan.script, plan.args) == ("s.py", ("--x", "1"))
    for bad in (["nice", "-n", "5", sys.executable, "s.py"], ["bash", "-c", "x"], [sys.executable]):
        with pytest.raises(ForkError):
            parse(bad)


def test_a_forked_script_runs_as_main_as_asked(server: ForkServer, tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    leader = _group(tmp_path)
    try:
        log = tmp_path / "probe.log"
        cmd = ["chrt", "--idle", "0", sys.executable, str(script), "7"]
        proc = server.launch(cmd, {"PROBE": "yes"}, log, leader.pid, tmp_path / "work")
        assert proc.wait(30) == 7
        got = json.loads(log.read_text().splitlines()[-1])
        assert got["name"] == "__main__" and got["argv"] == [str(script), "7"]
        assert got["env"] == "yes" and got["cwd"] == str(tmp_path / "work")
        assert got["path0"] == str(tmp_path) and got["pgid"] == leader.pid
        assert got["sched"] == os.SCHED_IDLE
        assert got["preloaded"] == server.proc.pid, "imported once, in the server"
        assert got["netns"] == os.readlink("/proc/self/ns/net")
    finally:
        stop(leader, sig=signal.SIGKILL)


def test_a_signal_and_the_bound_give_popen_exit_codes(server: ForkServer, tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    leader = _group(tmp_path)
    try:
        log = tmp_path / "probe.log"
        bounded = ["timeout", "--foreground", "-s", "KILL", "1", sys.executable, str(script)]
        proc = server.launch([*bounded, "sleep"], {}, log, leader.pid, ROOT)
        assert proc.poll() is None
        assert proc.wait(30) == -signal.SIGALRM, "the bound kills it as timeout -s KILL would"
        killed = server.launch([sys.executable, str(script), "sleep"], {}, log, leader.pid, ROOT)
        os.killpg(leader.pid, signal.SIGKILL)  # the node's group, as TrainingNode.stop does
        assert killed.wait(30) == -signal.SIGKILL
    finally:
        stop(leader, sig=signal.SIGKILL)


def test_a_request_it_cannot_run_is_refused_and_the_server_lives(
    server: ForkServer, tmp_path: Path
) -> None:
    with pytest.raises(ForkError):
        server.launch(["bash", "-c", "true"], {}, tmp_path / "x.log", os.getpgid(0), ROOT)
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    with pytest.raises(ForkError, match="python script"):
        server.launch([sys.executable, "-c", "pass"], {}, tmp_path / "x.log", os.getpgid(0), ROOT)
    bad_ns = [*("ip", "netns", "exec", "no-such-ns"), sys.executable, str(script), "0"]
    proc = server.launch(bad_ns, {}, tmp_path / "y.log", os.getpgid(0), ROOT)
    assert proc.wait(30) == 1 and "no-such-ns" in (tmp_path / "y.log").read_text()
    assert server.proc.poll() is None


def test_a_module_runs_as_python_m_in_a_group_of_its_own(
    server: ForkServer, tmp_path: Path
) -> None:
    (tmp_path / "fork_probe_main.py").write_text(SCRIPT)
    log = tmp_path / "m.log"
    proc = server.launch([sys.executable, "-m", "fork_probe_main", "3"], {}, log, 0, tmp_path)
    assert proc.wait(30) == 3
    import json

    got = json.loads(log.read_text().splitlines()[-1])
    assert got["name"] == "__main__" and got["argv"][1:] == ["3"]
    assert got["argv"][0].endswith("fork_probe_main.py"), "as python -m sets it"
    assert got["pgid"] == proc.pid, "group 0: a group of its own, which it leads"
    assert got["path0"] == str(tmp_path), "python -m puts the working directory first"


def test_a_forked_trainer_lives_in_the_asked_network_namespace(
    server: ForkServer, tmp_path: Path
) -> None:
    ns = f"fork-test-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        script = tmp_path / "probe.py"
        script.write_text(SCRIPT)
        log = tmp_path / "ns.log"
        cmd = ["ip", "netns", "exec", ns, sys.executable, str(script), "0"]
        assert server.launch(cmd, {}, log, os.getpgid(0), ROOT).wait(30) == 0
        got = json.loads(log.read_text().splitlines()[-1])
        assert got["netns"] == f"net:[{os.stat(f'/run/netns/{ns}').st_ino}]"
        assert got["netns"] != os.readlink("/proc/self/ns/net")
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=True)


def test_exit_handlers_run_as_at_an_interpreter_exit(server: ForkServer, tmp_path: Path) -> None:
    script = tmp_path / "atexit_probe.py"
    script.write_text("import atexit\natexit.register(print, 'bye', flush=True)\n")
    log = tmp_path / "a.log"
    assert server.launch([sys.executable, str(script)], {}, log, os.getpgid(0), ROOT).wait(30) == 0
    assert log.read_text().splitlines() == ["bye"], "the script's handler, once"
