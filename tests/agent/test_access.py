"""Who may use the control socket (agent/access.py), with real users and a real agent.

The module creates real accounts (``useradd``/``groupadd``, removed at the end; leftovers of
a crashed run are removed first): group ``swimt-ctl`` (the agent's ``--control-group``) and
``swimt-admins`` (its ``--admin-group``); user ``swimt-in`` in the control group,
``swimt-out`` in neither, ``swimt-adm`` in both. The agents run as root (so "the agent's
user" is root), one as ``swimt-in``. Each client is a Python child that imports what it
needs as root and then becomes the test user (``setgroups``/``setgid``/``setuid``) before it
connects: ``SO_PEERCRED`` takes the credentials at connect time, and the checkout (and its
virtual environment and interpreter) need not be readable by the test users, as on a CI
machine. After the switch the child imports nothing more (only built-in modules), so a lazy
import fails here as it would there.

The rules without users or sockets (every op's class, the group arithmetic) are at the end.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent import access as access_module
from agent import control
from agent.access import Access, Peer, peer_of, proc_groups
from agent.config import AgentConfigError, build
from agent.control import ControlClient
from agent.demo import LocalAgent
from agent.procs import free_port, stop, until

ROOT = Path(__file__).resolve().parents[2]
CONTROL_GROUP, ADMIN_GROUP = "swimt-ctl", "swimt-admins"
USERS = {"swimt-in": [CONTROL_GROUP], "swimt-out": [], "swimt-adm": [CONTROL_GROUP, ADMIN_GROUP]}
TOOLS = ("useradd", "userdel", "groupadd", "groupdel")


def _skip_without_users() -> None:
    if os.geteuid() != 0:
        pytest.skip("creating users and switching to them needs root")
    if not hasattr(socket, "SO_PEERCRED"):
        pytest.skip("no SO_PEERCRED (Linux only)")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)} (Debian package passwd)")


_CHILD = r"""
import encodings.idna, json, os, pwd, socket, sys  # idna: getaddrinfo's, imported lazily
import agent.cli, agent.runtime, torchhook.client
from agent.control import ControlClient, ControlError, FrameDecoder, encode_frame, make_request

user, action, *args = sys.argv[1:]
pw = pwd.getpwnam(user)
os.setgroups(os.getgrouplist(user, pw.pw_gid))
os.setgid(pw.pw_gid)
os.setuid(pw.pw_uid)
os.chdir("/")


class NoMoreImports:  # other users may not read the checkout, its venv or the interpreter's
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in sys.builtin_module_names:
            return None
        raise ImportError(f"{name} imported after the switch to {user}: import it before")


sys.meta_path.insert(0, NoMoreImports)


def out(**fields):
    print(json.dumps(fields), flush=True)


if action in ("swimctl", "agent"):  # swimctl ARGS, in this process
    agent.cli.main(args, prog_name="swimctl")
elif action == "request":  # PATH OP ARGS-JSON, one connection each
    path, op, raw = args
    try:
        out(ok=True, result=ControlClient(path, 10).request(op, **json.loads(raw)))
    except ControlError as exc:
        out(ok=False, error=str(exc))
elif action == "register":  # PATH JOB: this process is local rank 0 of JOB on this node
    path, job = args
    try:
        with torchhook.client.Membership(job, control=path, local_rank=0, local_world_size=1) as m:
            view = m.wait(lambda v: m.node in v, 20)
            out(ok=True, node=m.node, members=list(view.names))
    except ControlError as exc:
        out(ok=False, error=str(exc))
elif action == "hold":  # PATH: connect, say so, stay until the other side closes
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(args[0])
        out(connected=True)
        s.recv(1)
elif action == "session":  # PATH [[OP, ARGS], ...] on one connection: every reply
    path, raw = args
    requests = json.loads(raw)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(b"".join(encode_frame(make_request(op, **a)) for op, a in requests))
        decoder, replies = FrameDecoder(), []
        while len(replies) < len(requests):
            data = s.recv(65536)
            if not data:
                break
            replies += decoder.feed(data)
    out(replies=replies)
"""


def _as_user(user: str, *args: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, user, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        check=False,
    )


def _json(user: str, *args: str) -> dict[str, Any]:
    done = _as_user(user, *args)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _request(user: str, path: Path, op: str, **args: Any) -> dict[str, Any]:
    return _json(user, "request", str(path), op, json.dumps(args))


def _remove_accounts() -> None:
    for user in USERS:
        subprocess.run(["userdel", "-f", user], capture_output=True, timeout=30, check=False)
    for group in (CONTROL_GROUP, ADMIN_GROUP):
        subprocess.run(["groupdel", group], capture_output=True, timeout=30, check=False)


@pytest.fixture(scope="module")
def accounts() -> Iterator[dict[str, int]]:
    """The test groups and users (uid by name); removed before (a crashed run's) and after."""
    _skip_without_users()
    _remove_accounts()
    try:
        for group in (CONTROL_GROUP, ADMIN_GROUP):
            subprocess.run(["groupadd", "--system", group], timeout=30, check=True)
        for user, groups in USERS.items():
            extra = ["-G", ",".join(groups)] if groups else []
            subprocess.run(
                ["useradd", "--system", "-N", "-M", "-s", "/usr/sbin/nologin", *extra, user],
                timeout=30,
                check=True,
            )
        yield {user: pwd.getpwnam(user).pw_uid for user in USERS}
    finally:
        _remove_accounts()


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    """A directory every test user may pass (pytest's own tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="swim-access-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def agents(accounts: dict[str, int], workdir: Path) -> Iterator[list[LocalAgent]]:
    """Two root agents with the test groups; the second is SIGKILLed at once (so the
    first has a failed member to force-leave by the time a test asks)."""
    flags = ["--control-group", CONTROL_GROUP, "--admin-group", ADMIN_GROUP]
    started: list[LocalAgent] = []
    try:
        started.append(LocalAgent("agent-0", workdir, "fast", None, flags))
        started[0].wait_ready(20)
        started.append(LocalAgent("agent-1", workdir, "fast", started[0].port, flags))
        until(lambda: "agent-1" in started[0].members(), 20, "agent-1 joined")
        started[1].stop(signal.SIGKILL)
        yield started
    finally:
        for a in started:
            a.stop(signal.SIGKILL)


def test_socket_belongs_to_the_control_group(agents: list[LocalAgent]) -> None:
    st = agents[0].control.stat()
    assert st.st_mode & 0o777 == 0o660
    assert st.st_gid == grp.getgrnam(CONTROL_GROUP).gr_gid


def test_group_member_registers_a_job_watch(agents: list[LocalAgent]) -> None:
    got = _json("swimt-in", "register", str(agents[0].control), "job-a")
    assert got == {"ok": True, "node": "agent-0", "members": ["agent-0"]}, got
    members = _request("swimt-in", agents[0].control, "members")
    assert members["ok"] and "agent-0" in {m["name"] for m in members["result"]}
    listed = _as_user("swimt-in", "swimctl", "--control", str(agents[0].control), "info")
    assert listed.returncode == 0 and "agent-0" in listed.stdout, listed.stderr


def test_outsider_is_refused_with_a_clear_error(
    agents: list[LocalAgent], accounts: dict[str, int]
) -> None:
    path = agents[0].control
    # the file mode stops it at connect: the torch hook and swimctl say who has access
    got = _json("swimt-out", "register", str(path), "job-a")
    assert not got["ok"] and "permission denied on the agent's socket" in got["error"], got
    assert "members of the socket's group" in got["error"]
    cli = _as_user("swimt-out", "swimctl", "--control", str(path), "members")
    assert cli.returncode == 1, cli
    assert cli.stderr.startswith("Error: permission denied on the agent's socket"), cli.stderr
    assert "Traceback" not in cli.stderr
    # a socket widened by mistake: the agent's own check refuses, naming the group
    path.chmod(0o666)
    try:
        got = _request("swimt-out", path, "members")
        cli = _as_user("swimt-out", "swimctl", "--control", str(path), "members")
    finally:
        path.chmod(0o660)
    uid = accounts["swimt-out"]
    assert not got["ok"] and f"refused: peer uid {uid}" in got["error"], got
    assert f"a member of group '{CONTROL_GROUP}'" in got["error"]
    assert cli.returncode == 1 and f"Error: refused: peer uid {uid}" in cli.stderr, cli.stderr
    assert "Traceback" not in cli.stderr


def test_member_cannot_force_leave_but_an_admin_can(
    agents: list[LocalAgent], accounts: dict[str, int]
) -> None:
    path = agents[0].control
    until(lambda: agents[0].members()["agent-1"]["status"] == "dead", 20, "agent-1 dead")
    needs = f"force_leave needs root, the agent's user (root) or group '{ADMIN_GROUP}'"
    # refused, and the same connection still serves what the member may do
    session = _json(
        "swimt-in",
        "session",
        str(path),
        json.dumps([["force_leave", {"node": "agent-1"}], ["info", {}], ["tags", {}]]),
    )
    refused, info, tags = session["replies"]
    assert refused == {"ok": False, "error": needs}
    assert info["ok"] and info["result"]["node"] == "agent-0"
    assert not tags["ok"] and tags["error"].startswith("tags needs root")
    cli = _as_user("swimt-in", "swimctl", "--control", str(path), "force-leave", "agent-1")
    assert cli.returncode == 1 and cli.stderr.strip() == f"Error: {needs}", cli.stderr
    assert agents[0].members()["agent-1"]["status"] == "dead"
    # an admin_group member may
    done = _as_user("swimt-adm", "swimctl", "--control", str(path), "force-leave", "agent-1")
    assert done.returncode == 0 and done.stdout.strip() == "agent-1: left", done.stderr
    # counted, and logged with the peer
    stats = ControlClient(path).request("info")["stats"]
    assert stats["control_refused_requests"] >= 3
    log = agents[0].log_path.read_text()
    assert f"refused force_leave from uid {accounts['swimt-in']} (pid " in log


def test_agent_run_by_an_ordinary_user(accounts: dict[str, int], workdir: Path) -> None:
    """As ``swimt-in``: the socket goes to a supplementary group of the agent's user; that
    user is "the agent's user" (admin); a group it is not in is a clear start-up error."""
    home = workdir / "as-user"
    home.mkdir()
    os.chown(home, accounts["swimt-in"], -1)
    path = home / "agent.sock"
    command = ["--control", str(path), "agent", "--node", "solo"]
    command += ["--bind", f"127.0.0.1:{free_port()}", "--profile", "local"]
    bad = _as_user("swimt-in", "agent", *command, "--control-group", ADMIN_GROUP)
    assert bad.returncode == 2, bad
    assert f"control_group '{ADMIN_GROUP}': the agent's user (swimt-in) may not give" in bad.stderr
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _CHILD,
            "swimt-in",
            "agent",
            *command,
            "--control-group",
            "swimt-ctl",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        until(path.exists, 20, "the agent's socket", ignore=(OSError,))
        until(lambda: _request("swimt-in", path, "info")["ok"], 20, "the agent answers")
        st = path.stat()
        assert (st.st_uid, st.st_gid) == (accounts["swimt-in"], grp.getgrnam(CONTROL_GROUP).gr_gid)
        # its own user may run admin ops (this one fails in its handler, not at the door)
        got = _request("swimt-in", path, "force_leave", node="ghost")
        assert not got["ok"] and "needs" not in got["error"], got
        got = _request("swimt-adm", path, "force_leave", node="ghost")  # admin_group: unset
        assert got == {"ok": False, "error": "force_leave needs root, the agent's user (swimt-in)"}
        assert ControlClient(path).request("tags", set={"a": "b"})["tags"] == {"a": "b"}  # root
    finally:
        stop(proc)
        assert proc.stderr is not None
        errors = proc.stderr.read()
        proc.stderr.close()
    assert "Traceback" not in errors, errors


def test_peer_groups_of_another_users_process(
    accounts: dict[str, int], workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real connection from ``swimt-in``: its supplementary group is seen through
    SO_PEERGROUPS, and through /proc/PID/status when the socket option is not there."""
    path = workdir / "peer.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        path.chmod(0o666)
        server.listen(1)
        server.settimeout(20)
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, "swimt-in", "hold", str(path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            conn, _ = server.accept()
            with conn:
                assert child.stdout is not None and "connected" in child.stdout.readline()
                ctl = grp.getgrnam(CONTROL_GROUP).gr_gid
                primary = pwd.getpwnam("swimt-in").pw_gid
                expected = (child.pid, accounts["swimt-in"], primary, frozenset({primary, ctl}))
                peer = peer_of(conn)
                assert peer is not None and vars_of(peer) == expected
                monkeypatch.setattr(access_module, "SO_PEERGROUPS", -1)  # an unknown option
                peer = peer_of(conn)
                assert peer is not None and vars_of(peer) == expected
        finally:
            stop(child)
            if child.stdout is not None:
                child.stdout.close()


def vars_of(peer: Peer) -> tuple[int, int, int, frozenset[int]]:
    return peer.pid, peer.uid, peer.gid, peer.groups


# --- the rules alone -----------------------------------------------------------------------

READ_OPS = {"members", "info", "view", "watch", "probe", "monitor", "jobs"}
"""The ops a control-group member may run (``jobs`` where that op exists); all others are
admin."""


@pytest.mark.parametrize("op", sorted(control.OPS))
def test_every_op_names_its_class(op: str) -> None:
    assert control.OPS[op].access == ("read" if op in READ_OPS else "admin")


def test_an_op_without_a_class_is_admin() -> None:
    assert control.Op().access == "admin"


@pytest.fixture
def rules() -> Access:
    access = Access()  # the default group: swim, else the agent's own
    access.gid, access.group, access.agent_uid, access.agent_user = 500, "g", 1000, "svc"
    access.admin = ("adm", 600)
    return access


@pytest.mark.parametrize(
    ("uid", "groups", "connects", "admin"),
    [
        (0, {0}, True, True),  # root
        (1000, {1000}, True, True),  # the agent's user
        (2000, {500}, True, False),  # the control group as primary gid
        (2000, {100, 500}, True, False),  # ... or a supplementary one
        (2000, {100, 500, 600}, True, True),  # and admin_group
        (2000, {100, 600}, True, True),  # admin_group alone (the file mode needs the other)
        (2000, {100}, False, False),
    ],
)
def test_who_may_do_what(
    rules: Access, uid: int, groups: set[int], connects: bool, admin: bool
) -> None:
    peer = Peer(pid=1, uid=uid, gid=min(groups), groups=frozenset(groups))
    assert (rules.connection_refusal(peer) is None) == connects
    assert rules.request_refusal("members", peer) is None
    refusal = rules.request_refusal("keys", peer)
    assert (refusal is None) == admin
    if refusal is not None:
        assert refusal == "keys needs root, the agent's user (svc) or group 'adm'"
    assert rules.stats() == {
        "control_refused_connections": int(not connects),
        "control_refused_requests": int(not admin),
    }


def test_peer_groups_of_a_real_connection() -> None:
    """Through a real socket pair: this process's uid, gid and supplementary groups."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        peer = peer_of(left)
    assert peer is not None
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
    assert peer.groups == {os.getegid(), *os.getgroups()}


def test_proc_groups(tmp_path: Path) -> None:
    assert set(proc_groups(os.getpid(), os.geteuid()) or ()) == set(os.getgroups())
    status = tmp_path / "7" / "status"
    status.parent.mkdir()
    status.write_text("Name:\tx\nUid:\t5\t6\t6\t6\nGid:\t9\t9\t9\t9\nGroups:\t9 12 13 \n")
    assert proc_groups(7, 6, tmp_path) == (9, 12, 13)
    assert proc_groups(7, 5, tmp_path) is None  # that pid is someone else's process now
    assert proc_groups(8, 6, tmp_path) is None  # gone
    status.write_text("Name:\tx\nUid:\t5\t6\t6\t6\n")
    assert proc_groups(7, 6, tmp_path) is None


def test_default_group_falls_back_to_the_agents_own(caplog: pytest.LogCaptureFixture) -> None:
    try:
        grp.getgrnam("swim")
    except KeyError:
        pass
    else:
        pytest.skip("this machine has a group swim: the default is used as it is")
    with caplog.at_level("INFO", logger="swim.agent"):
        access = Access()
    assert (access.gid, access.defaulted) == (os.getegid(), True)
    assert caplog.text.count("there is no group 'swim' on this machine") == 1


def test_config_names_a_missing_group() -> None:
    with pytest.raises(AgentConfigError, match="control_group: there is no group 'no-such-grp"):
        build({"control_group": "no-such-grp-x"})
    with pytest.raises(AgentConfigError, match="admin_group: there is no group 'no-such-grp"):
        build({"admin_group": "no-such-grp-x"})
    with pytest.raises(AgentConfigError, match="admin_group must be a non-empty string"):
        build({"admin_group": ""})
    own = grp.getgrgid(os.getegid()).gr_name
    config = build({"control_group": own, "admin_group": own})
    assert (config.control_group, config.admin_group) == (own, own)
