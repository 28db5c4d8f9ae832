"""A real Slurm on this host (Debian's munged, slurmctld and slurmd 22.05, one slurmd per
node gpu1..gpu4, started here with a generated slurm.conf in a temp dir) and real agents
named after its nodes, each running the shipped drain handler (``swim-slurm-handler``) as
its event handler.

- SIGKILL the agents of gpu2 (idle) and gpu4 (drained by an admin beforehand): gpu2 is
  drained with our reason by exactly one survivor; gpu4's admin reason is left as it is;
  a repeated verdict changes nothing. Restart both: gpu2 resumes, gpu4 stays drained.
- The sbatch template (packaging/slurm/swim-elastic.sbatch) runs a 2-node job with a
  trivial trainer against the agents; the prolog and epilog (packaging/slurm/) check the
  agents and say so; one trainer exiting non-zero does not kill the other even though
  slurm.conf says KillOnBadExit=1 (the template's ``--kill-on-bad-exit=0``).

Everything started is stopped by pid at teardown, also on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest

from agent.demo import LocalAgent, wait_converged
from agent.procs import free_port, stop, until

ROOT = Path(__file__).resolve().parents[2]
NODES = ("gpu1", "gpu2", "gpu3", "gpu4")
NEEDED = ("munged", "mungekey", "slurmctld", "slurmd", "scontrol", "sbatch", "srun")

pytestmark = [
    pytest.mark.skipif(
        any(shutil.which(b) is None for b in NEEDED),
        reason="Slurm and munge not installed (scripts/setup.sh installs slurmctld, slurmd, "
        "slurm-client and munge with apt-get)",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="munged runs as user munge: needs root"),
]


@dataclass
class Slurm:
    """The daemons and the environment scontrol/sbatch need to reach them."""

    dir: Path
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def scontrol(self, *args: str) -> str:
        out = subprocess.run(
            ["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=20
        )
        assert out.returncode == 0, f"scontrol {' '.join(args)}: {out.stderr}"
        return out.stdout

    def node(self, name: str) -> tuple[set[str], str | None]:
        text = self.scontrol("show", "node", name)
        state = re.search(r"\sState=(\S+)", text)
        reason = re.search(r"^\s*Reason=(.*?)(?: \[[^\]]*\])?$", text, re.MULTILINE)
        assert state is not None, text
        return set(state.group(1).split("+")), reason.group(1) if reason else None

    def log_tail(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.dir.glob("*.log"))
        )


def _write_conf(d: Path, munge_socket: Path, agents_dir: Path) -> None:
    host = socket.gethostname()
    ports = {n: free_port() for n in NODES}
    # The prolog and epilog as a site installs them (packaging/slurm/), pointed at this
    # host's agents: one socket per Slurm node here, /run/swim/agent.sock on a real node.
    check = d / "swim-slurm-check"
    check.write_text(f'#!/bin/sh\nexec {sys.executable} -m agent.slurm_handler "$@"\n')
    for phase in ("prolog", "epilog"):
        wrapper = d / f"{phase}.sh"
        wrapper.write_text(
            "#!/bin/sh\n"
            f"export SWIM_CONTROL={agents_dir}/$SLURMD_NODENAME.sock "
            f"SWIM_SLURM_LOG={d}/checks.txt SWIM_SLURM_CHECK={check} "
            f"SWIM_SLURM_DEFAULTS=/nonexistent\n"
            f"exec {ROOT}/packaging/slurm/{phase}.sh\n"
        )
    for script in (check, d / "prolog.sh", d / "epilog.sh"):
        script.chmod(0o755)
    lines = [
        "ClusterName=swimtest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/slurmctld.pid",
        f"SlurmdPidFile={d}/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/slurmctld.log",
        f"SlurmdLogFile={d}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
        "KillOnBadExit=1",  # the template's --kill-on-bad-exit=0 must override it
        "KillWait=2",
        f"Prolog={d}/prolog.sh",
        f"Epilog={d}/epilog.sh",
        "PrologFlags=Alloc",
        *(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs=2 "
            "RealMemory=500 State=UNKNOWN"
            for n, p in ports.items()
        ),
        f"PartitionName=main Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
    ]
    (d / "slurm.conf").write_text("\n".join(lines) + "\n")
    for sub in ("state", *(f"spool/{n}" for n in NODES)):
        (d / sub).mkdir(parents=True)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    d = tmp_path_factory.mktemp("slurm")
    # munged (user munge) checks every directory above its own: pytest's are root's 0700
    munge = Path(tempfile.mkdtemp(prefix="swim-test-munge-"))
    munge.chmod(0o711)
    shutil.chown(munge, "munge", "munge")
    key = munge / "munge.key"
    subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, timeout=20)
    shutil.chown(key, "munge", "munge")
    key.chmod(0o600)
    (d / "agents").mkdir()
    _write_conf(d, munge / "munge.sock", d / "agents")
    env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
    cluster = Slurm(d, env)
    logs = [(d / f"{name}.out").open("wb") for name in ("munged", "slurmctld", *NODES)]
    try:
        cluster.procs.append(
            subprocess.Popen(
                [
                    *("munged", "-F", "-f", f"--socket={munge}/munge.sock"),
                    *(f"--key-file={key}", f"--pid-file={munge}/munged.pid"),
                    *(f"--seed-file={munge}/munged.seed", f"--log-file={munge}/munged.log"),
                ],
                user="munge",
                group="munge",
                extra_groups=[],
                stdout=logs[0],
                stderr=subprocess.STDOUT,
            )
        )
        until(lambda: (munge / "munge.sock").exists(), 10, "munged's socket")
        daemons = [["slurmctld", "-D", "-i"]] + [["slurmd", "-D", "-N", n] for n in NODES]
        for cmd, log in zip(daemons, logs[1:], strict=True):
            cluster.procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=d)
            )

        def all_idle() -> bool:
            return all(cluster.node(n)[0] == {"IDLE"} for n in NODES)

        until(all_idle, 30, "four idle Slurm nodes", poll_s=0.2, ignore=(AssertionError,))
        yield cluster
    except BaseException:
        print(cluster.log_tail())
        raise
    finally:
        # slurmd's job steps (slurmstepd) are children of slurmd: stop the daemons, then munged
        stop(*reversed(cluster.procs), timeout_s=10)
        for log in logs:
            log.close()
        shutil.rmtree(munge, ignore_errors=True)


def _handler_line(log: Path) -> str:
    return (
        f"member-failed,member-join={sys.executable} -m agent.slurm_handler --resume "
        f"--log-file {log}"
    )


def _agent(name: str, slurm: Slurm, join: int | None, port: int | None = None) -> LocalAgent:
    """An agent named after its Slurm node with the drain handler (one backup, after 1 s);
    ``port``: rebind the port of a dead one (memberlist refuses a dead member's name from
    a new address until it is reclaimed)."""
    extra = ["--event-handler", _handler_line(slurm.dir / f"handler-{name}.txt")]
    extra += ["--bind", f"127.0.0.1:{port}"] if port else []
    env = {
        "SLURM_CONF": slurm.env["SLURM_CONF"],
        "SWIM_SLURM_BACKUPS": "1",
        "SWIM_SLURM_BACKUP_DELAY_S": "1",
    }
    return LocalAgent(name, slurm.dir / "agents", "fast", join, extra, env=env)


def _lines(slurm: Slurm, pattern: str, since: str = "") -> list[str]:
    """The handlers' log lines matching ``pattern``, stamped ``since`` or later."""
    return [
        line
        for f in sorted(slurm.dir.glob("handler-*.txt"))
        for line in f.read_text().splitlines()
        if re.search(pattern, line) and line >= since
    ]


def test_a_dead_member_is_drained_once_and_resumed_but_an_admin_drain_stays(
    slurm: Slurm,
) -> None:
    slurm.scontrol("update", "NodeName=gpu4", "State=DRAIN", "Reason=bad dimm")
    agents: dict[str, LocalAgent] = {}
    try:
        agents["gpu1"] = _agent("gpu1", slurm, None)
        agents["gpu1"].wait_ready(20)
        for n in NODES[1:]:
            agents[n] = _agent(n, slurm, agents["gpu1"].port)
        for a in agents.values():
            a.wait_ready(20)
        wait_converged(list(agents.values()), 30)
        # four joins seen by four agents, three candidates each: the third of a ranking is
        # neither first nor the one backup, and says so in one line
        until(
            lambda: _lines(slurm, r"member-join: not for this agent: gpu\d \(gpu\d acts\)"), 10, ""
        )
        ports = {n: a.port for n, a in agents.items()}
        for n in ("gpu2", "gpu4"):
            stop(agents[n].proc, sig=signal.SIGKILL)

        def gpu2_drained() -> bool:
            flags, reason = slurm.node("gpu2")
            return "DRAIN" in flags and (reason or "").startswith("swim: gpu2 failed at ")

        took = until(gpu2_drained, 30, "gpu2 drained by swim", poll_s=0.1)
        print(f"SIGKILL -> gpu2 drained in Slurm: {took:.2f} s")
        # Both survivors ran the handler for both members: one acted for each, the other
        # checked as its backup a second later and found nothing to do.
        until(lambda: len(_lines(slurm, r"member-failed (gpu2|gpu4): ")) >= 4, 20, "handlers ran")
        ran = _lines(slurm, r"member-failed gpu2: .* ran: scontrol update")
        assert len(ran) == 1, _lines(slurm, "")
        drain = 'ran: scontrol update NodeName=gpu2 State=DRAIN Reason="swim: gpu2 failed at'
        assert "elected; gpu2 is IDLE; " + drain in ran[0]
        actor = re.search(r"swim-slurm-handler\[(gpu\d)\]", ran[0])
        assert actor is not None and f"seen by {actor.group(1)}" in ran[0]
        backup = _lines(slurm, rf"member-failed gpu2: backup 1 after {actor.group(1)}")
        assert len(backup) == 1 and "no action: gpu2 is drained already by swim" in backup[0]
        admin = _lines(slurm, r"member-failed gpu4: (elected|backup)")
        assert len(admin) == 2 and all("for another reason (bad dimm)" in a for a in admin)
        assert slurm.node("gpu4") == ({"IDLE", "DRAIN"}, "bad dimm")
        reason = slurm.node("gpu2")[1]

        # A repeated verdict on the same agent: nothing is rewritten.
        again = subprocess.run(
            [sys.executable, "-m", "agent.slurm_handler", "--resume"],
            input="gpu2\t127.0.0.1\t\t\n",
            capture_output=True,
            text=True,
            timeout=30,
            env={
                **slurm.env,
                "SERF_EVENT": "member-failed",
                "SERF_SELF_NAME": actor.group(1),
                "SWIM_CONTROL": str(agents[actor.group(1)].control),
            },
        )
        assert again.returncode == 0 and "drained already by swim" in again.stderr
        assert slurm.node("gpu2")[1] == reason

        # Back alive: ours resumes, the admin's stays.
        restarted = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        restarted_at = time.monotonic()
        for n in ("gpu2", "gpu4"):
            agents[n].stop(signal.SIGKILL)
            agents[n] = _agent(n, slurm, agents["gpu1"].port, ports[n])
        until(lambda: "DRAIN" not in slurm.node("gpu2")[0], 30, "gpu2 resumed", poll_s=0.1)
        print(f"restart -> gpu2 resumed in Slurm: {time.monotonic() - restarted_at:.2f} s")
        join4 = r"member-join gpu4: (elected|backup \d after gpu\d),"
        until(lambda: _lines(slurm, join4, restarted), 20, "gpu4's return handled")
        kept = _lines(slurm, join4, restarted)
        assert all("drained for another reason (bad dimm); kept" in k for k in kept), kept
        assert not _lines(slurm, r"member-join gpu4: .* ran: ")
        assert len(_lines(slurm, r"member-join gpu2: .* ran: .*State=RESUME")) == 1
        assert slurm.node("gpu4") == ({"IDLE", "DRAIN"}, "bad dimm")
    except BaseException:
        print(slurm.log_tail(), *_lines(slurm, ""), sep="\n")
        raise
    finally:
        for a in agents.values():
            a.stop(signal.SIGKILL)
        with contextlib.suppress(AssertionError):
            slurm.scontrol("update", "NodeName=gpu4", "State=RESUME")


TRAINER = """
import json, os, sys, time
from pathlib import Path
from agent.control import ControlClient

out = Path(os.environ["TRAINER_OUT"])
node = os.environ["SLURMD_NODENAME"]
client = ControlClient(None, 5)  # SWIM_CONTROL, as the elastic hook finds its agent
deadline = time.monotonic() + 15
while client.request("info")["members"]["alive"] < 2 and time.monotonic() < deadline:
    time.sleep(0.05)  # the job's own agents may still be joining
record = {
    "node": node,
    "agent": client.request("info")["node"],
    "alive": client.request("info")["members"]["alive"],
    "local_rank": os.environ["LOCAL_RANK"],
    "local_world_size": os.environ["LOCAL_WORLD_SIZE"],
    "argv": sys.argv[1:],
}
if os.environ["SLURM_NODEID"] == "1":
    (out / f"{node}.json").write_text(json.dumps({**record, "exit": 3}))
    sys.exit(3)
while len(list(out.glob("*.json"))) < 1 and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(1.0)  # with KillOnBadExit=1 in effect, srun would have killed this task by now
(out / f"{node}.json").write_text(json.dumps({**record, "survived": True}))
"""


def _job_state(slurm: Slurm, job: str) -> str:
    found = re.search(r"JobState=(\S+)", slurm.scontrol("show", "job", job))
    return found.group(1) if found else "?"


@dataclass
class Job:
    id: str
    output: str
    records: dict[str, dict[str, object]]
    checks: dict[str, str]  # "prolog gpu1" -> its line


def _run_template(slurm: Slurm, tmp_path: Path, settings: dict[str, str]) -> Job:
    """sbatch the shipped template on gpu1,gpu2 with the trivial trainer; wait for the
    job and both epilogs."""
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **slurm.env,
        "SWIM_TRAIN": f"{sys.executable} {trainer}",
        "SWIM_MIN_NODES": "2",
        "TRAINER_OUT": str(out),
        **settings,
    }
    submitted = subprocess.run(
        [
            *("sbatch", "--parsable", "-N", "2", "-w", "gpu1,gpu2"),
            *("--ntasks-per-node=1", "--gpus-per-node=0", f"--output={tmp_path}/job.out"),
            str(ROOT / "packaging" / "slurm" / "swim-elastic.sbatch"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
        cwd=tmp_path,
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    until(lambda: _job_state(slurm, job) in ("COMPLETED", "FAILED"), 30, f"job {job} ended")
    checks = slurm.dir / "checks.txt"

    def said() -> dict[str, str]:
        lines = checks.read_text().splitlines() if checks.exists() else []
        found = (re.search(rf"swim-slurm-(\w+)\[(gpu\d) job {job}\]: (.*)", ln) for ln in lines)
        return {f"{m.group(1)} {m.group(2)}": m.group(3) for m in found if m}

    until(lambda: len(said()) == 4, 20, f"job {job}'s prologs and epilogs")
    records = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    text = (tmp_path / "job.out").read_text()
    assert _job_state(slurm, job) == "FAILED", text  # the trainers' status is the job's
    assert "trainers finished (srun exit 3)" in text, text
    return Job(job, text, records, said())


def _check_trainers(job: Job) -> None:
    """Both ran, each reached its own node's agent with torchrun's variables and the
    template's arguments, and gpu1's outlived gpu2's bad exit (KillOnBadExit=1 in
    slurm.conf: the template's --kill-on-bad-exit=0 is what keeps it)."""
    assert set(job.records) == {"gpu1", "gpu2"}, job.output
    for node, rec in job.records.items():
        assert rec["agent"] == node and rec["alive"] == 2
        assert rec["local_rank"] == "0" and rec["local_world_size"] == "1"
        assert rec["argv"] == ["--job", f"swim-elastic-{job.id}", "--min-nodes", "2"]
    assert job.records["gpu1"].get("survived") and job.records["gpu2"]["exit"] == 3


def test_the_sbatch_template_with_the_system_agents_and_the_checks_that_pass(
    slurm: Slurm, tmp_path: Path
) -> None:
    agents: list[LocalAgent] = []
    try:
        agents.append(LocalAgent("gpu1", slurm.dir / "agents", "local", None))
        agents[0].wait_ready(20)
        agents.append(LocalAgent("gpu2", slurm.dir / "agents", "local", agents[0].port))
        wait_converged(agents, 30)
        job = _run_template(slurm, tmp_path, {"SWIM_CONTROL": f"{slurm.dir}/agents/%N.sock"})
        assert f"swim-elastic: job swim-elastic-{job.id} on 2 nodes" in job.output
        _check_trainers(job)
        for where, line in job.checks.items():
            assert line.startswith(f"ok: agent {where.split()[1]} is alive, sees 2 alive"), where
    except BaseException:
        print(slurm.log_tail())
        raise
    finally:
        for a in agents:
            a.stop(signal.SIGKILL)


def test_the_sbatch_template_with_agents_in_the_job_and_checks_that_fail(
    slurm: Slurm, tmp_path: Path
) -> None:
    """No system agents: the prolog and epilog say so (and, not strict, let the job run);
    the template starts one agent per node in the job, on SWIM_PORT + node index, and
    they leave when the trainers are done."""
    port = free_port()
    settings = {
        "SWIM_AGENTS": "job",
        "SWIM_PORT": str(port),
        "SWIM_PROFILE": "local",
        "SWIMCTL": f"{sys.executable} -m agent.cli",
        "TMPDIR": str(tmp_path),
    }
    try:
        job = _run_template(slurm, tmp_path, settings)
        _check_trainers(job)
        for where, line in job.checks.items():
            assert line.startswith("FAILED: cannot reach the agent"), where
            assert line.endswith("(not strict: exit 0)")
        assert not list(tmp_path.glob("swim-*.sock"))  # the job's agents left and exited
    except BaseException:
        print(slurm.log_tail())
        raise
