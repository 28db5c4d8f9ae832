"""``swim-slurm-handler``: drain a dead member's Slurm node, once, from an event handler;
``swim-slurm-check``: the prolog/epilog check of this node's agent.

The handler is run by the agent (``--event-handler member-failed,member-join=PATH``) with
Serf's contract (agent/handlers.py): ``SERF_EVENT``, ``SERF_SELF_NAME``, the event's
members on stdin, and ``SWIM_CONTROL``. For each member it asks this node's
agent (``SWIM_CONTROL``) which members are alive and ranks the agents that may act
(agent/slurm.py ``ranking``). Only the first reads the node's state with ``scontrol show
node`` and, if agent/slurm.py ``decide`` says so, runs ``scontrol update``; the next
``--backups`` (2) do the same after ``rank x --backup-delay-s`` (5 s), which finds the work
done unless the first was dead too; every other agent logs who acts and exits. A backup's
wait holds back the agent's later handler runs (they run one at a time), never the
protocol.
Every option is a flag or an environment variable (``SWIM_SLURM_*``, below), so a handler
line with no arguments is configured from the agent's environment (the unit's
``Environment=``).

Bounds: every scontrol call has a timeout (``--timeout-s``, default 10 s), the whole run a
budget (``--budget-s``, default 25 s: under the agent's 30 s handler timeout, so the
handler reports what it left rather than being killed; members left are logged, not
handled), stdin at most ``MAX_STDIN_MEMBERS`` lines. Log lines go to stderr (the agent logs
a handler's output) and to ``--log-file`` if given; each names the event, the member, the
node, the decision and the command run. Exit codes: 0 done (or nothing to do), 1 an
scontrol call failed or timed out, or the budget ran out, 2 a bad setting or input, 3 the
local agent could not be asked (nobody is elected then: acting blind on every agent is
what the election exists to prevent).

``swim-slurm-check --phase prolog|epilog`` (packaging/slurm/prolog.sh and epilog.sh):
the agent answers on its control socket, sees itself alive and, unless ``--allow-alone``,
at least one other alive member. It says so on one line (stderr, syslog, ``--log-file``)
and exits 0; when the check fails it exits 0 too unless ``--strict``, where it exits 1 and
Slurm drains the node ("Prolog error") and requeues the job.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import syslog
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from agent.control import ControlClient, ControlError
from agent.slurm import (
    DEFAULT_DRAIN_EVENTS,
    DRAIN_EVENT_CHOICES,
    RESUME_EVENTS,
    Member,
    SlurmError,
    candidates,
    decide,
    drain_reason,
    parse_actor_tag,
    parse_map,
    parse_member_line,
    parse_node,
    ranking,
    slurm_node,
    update_command,
)

__all__ = ["MAX_STDIN_MEMBERS", "check_main", "main"]

MAX_STDIN_MEMBERS = 100_000
"""Member lines read from stdin: Serf coalesces at most a cluster's worth into one event;
ten times the largest cluster here, so a runaway writer cannot hold the handler."""

LOGGED_NAMES = 10
"""Members named in the one line about those other agents act for; the rest are counted
(the agent keeps 8 KiB of a handler's output)."""

CONTROL_TIMEOUT_S = 5.0
"""How long the agent's control socket may take to answer the handler or the check."""

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_AGENT = 0, 1, 2, 3


class _Log:
    """One line per decision, to stderr and an optional file, prefixed with who says it."""

    def __init__(self, prefix: str, path: Path | None, to_syslog: bool = False) -> None:
        self.prefix = prefix
        self.path = path
        self.to_syslog = to_syslog

    def __call__(self, message: str) -> None:
        line = f"{self.prefix}: {message}"
        print(line, file=sys.stderr, flush=True)
        if self.to_syslog:
            syslog.syslog(syslog.LOG_NOTICE, line)
        if self.path is not None:
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            try:
                with self.path.open("a") as f:
                    f.write(f"{stamp} {line}\n")
            except OSError as exc:
                print(f"{self.prefix}: cannot write {self.path}: {exc}", file=sys.stderr)


def _run(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """One scontrol call, bounded; raises ``SlurmError`` on timeout or a missing binary."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{cmd[0]} {cmd[1]} timed out after {timeout_s:g} s") from None
    except OSError as exc:
        raise SlurmError(f"cannot run {cmd[0]}: {exc.strerror or exc}") from None


def _act(member: Member, event: str, me: str, role: str, opts: dict[str, Any], log: _Log) -> bool:
    """Read the node's state, decide and act for one member (``role``: ``elected`` or
    ``backup N after X``); False if a Slurm call failed."""
    node = slurm_node(member, opts["mapping"], opts["node_tag"])
    shown = _run([opts["scontrol"], "show", "node", node], opts["timeout_s"])
    if shown.returncode != 0:
        log(f"{event} {member.name}: {role}; scontrol show node {node} failed: {_tail(shown)}")
        return False
    when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    action = decide(
        event,
        node,
        parse_node(shown.stdout),
        reason=drain_reason(event, member, when, me),
        drain_events=opts["drain_events"],
        resume=opts["resume"],
    )
    if action.kind == "none":
        log(f"{event} {member.name}: {role}, no action: {action.why}")
        return True
    cmd = update_command(opts["scontrol"], node, action)
    done = _run(cmd, opts["timeout_s"])
    shown_cmd = " ".join([*cmd[:-1], f'Reason="{action.reason}"'] if action.reason else cmd)
    if done.returncode != 0:
        log(f"{event} {member.name}: {role}; {shown_cmd} failed: {_tail(done)}")
        return False
    log(f"{event} {member.name}: {role}; {action.why}; ran: {shown_cmd}")
    return True


def _tail(proc: subprocess.CompletedProcess[str]) -> str:
    text = (proc.stderr or proc.stdout or "").strip().replace("\n", " | ")
    return f"exit {proc.returncode}: {text[-300:]}"


def _alive(opts: dict[str, Any]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = ControlClient(opts["control"], CONTROL_TIMEOUT_S).request(
        "members", status="alive"
    )
    return result


def run_handler(opts: dict[str, Any], lines: list[str], log: _Log) -> int:
    """The whole run for one event; the exit code.

    First every member this agent won (agent/slurm.py ``ranking``), then, after ``rank x
    backup_delay_s``, those it is a backup for, each with a fresh look at the alive members
    (a member alive again by then is not drained, one dead again is not resumed)."""
    event, me = opts["event"], opts["self_name"]
    if event not in opts["drain_events"] | (RESUME_EVENTS if opts["resume"] else frozenset()):
        log(f"{event}: nothing to do")
        return EXIT_OK
    members = [parse_member_line(line) for line in lines if line.strip()]
    if not members:
        return EXIT_OK
    try:
        alive = _alive(opts)
        me = me or ControlClient(opts["control"], CONTROL_TIMEOUT_S).request("info")["node"]
    except ControlError as exc:
        log(f"{event}: cannot ask the local agent who acts, so nobody here acts: {exc}")
        return EXIT_NO_AGENT
    start = time.monotonic()
    work: list[tuple[int, Member, str]] = []  # (rank, member, the winner)
    others: list[str] = []
    for member in members:
        ranked = ranking(member.name, candidates(alive, member.name, opts["actor_tag"]))
        rank = ranked.index(me) if me in ranked else len(ranked)
        if rank <= opts["backups"]:
            work.append((rank, member, ranked[0]))
        else:
            others.append(f"{member.name} ({ranked[0] if ranked else 'no agent'} acts)")
    if others:  # one line, however many members a coalesced event holds
        more = f" and {len(others) - LOGGED_NAMES} more" if len(others) > LOGGED_NAMES else ""
        log(f"{event}: not for this agent: {', '.join(others[:LOGGED_NAMES])}{more}")
    failed = False
    work.sort(key=lambda w: w[0])
    for i, (rank, member, winner) in enumerate(work):
        wait_s = start + rank * opts["backup_delay_s"] - time.monotonic()
        if time.monotonic() + max(wait_s, 0) > start + opts["budget_s"]:
            rest = ", ".join(w[1].name for w in work[i:])
            log(f"{event}: budget of {opts['budget_s']:g} s spent; not handled: {rest}")
            return EXIT_FAILED
        role = "elected"
        try:
            if rank > 0:
                time.sleep(max(wait_s, 0))
                now_alive = {m["name"] for m in _alive(opts)}
                if (member.name in now_alive) != (event in RESUME_EVENTS):
                    log(f"{event} {member.name}: backup {rank} after {winner}: changed since")
                    continue
                role = f"backup {rank} after {winner}"
            failed |= not _act(member, event, me, role, opts, log)
        except (SlurmError, ControlError) as exc:
            log(f"{event} {member.name}: {role}: {exc}")
            failed = True
    return EXIT_FAILED if failed else EXIT_OK


def _events(value: str) -> frozenset[str]:
    events = frozenset(e.strip() for e in value.split(",") if e.strip())
    if not events or not events <= DRAIN_EVENT_CHOICES:
        raise click.BadParameter(
            f"{value!r}: a comma-separated subset of {', '.join(sorted(DRAIN_EVENT_CHOICES))}"
        )
    return events


def _read_stdin(stream: Iterable[str]) -> list[str]:
    lines = list(itertools.islice(stream, MAX_STDIN_MEMBERS + 1))
    if len(lines) > MAX_STDIN_MEMBERS:
        raise SlurmError(f"stdin: more than {MAX_STDIN_MEMBERS} member lines")
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--resume/--no-resume",
    envvar="SWIM_SLURM_RESUME",
    default=False,
    help="On member-join, resume a node that swim drained. [SWIM_SLURM_RESUME]",
)
@click.option(
    "--drain-on",
    envvar="SWIM_SLURM_DRAIN_ON",
    default="member-failed",
    show_default=True,
    help="Events that drain, comma-separated (member-failed, "
    "member-leave, member-reap). [SWIM_SLURM_DRAIN_ON]",
)
@click.option(
    "--map",
    "map_file",
    envvar="SWIM_SLURM_MAP",
    type=click.Path(path_type=Path),
    help="File of 'member slurm-node' lines. [SWIM_SLURM_MAP]",
)
@click.option(
    "--node-tag",
    envvar="SWIM_SLURM_NODE_TAG",
    help="Member tag holding the Slurm node name. [SWIM_SLURM_NODE_TAG]",
)
@click.option(
    "--actor-tag",
    envvar="SWIM_SLURM_ACTOR_TAG",
    help="Only agents with tag KEY[=VALUE] act. [SWIM_SLURM_ACTOR_TAG]",
)
@click.option(
    "--scontrol",
    envvar="SWIM_SLURM_SCONTROL",
    default="scontrol",
    show_default=True,
    help="The scontrol binary. [SWIM_SLURM_SCONTROL]",
)
@click.option(
    "--timeout-s",
    envvar="SWIM_SLURM_TIMEOUT_S",
    type=click.FloatRange(0.1, 300),
    default=10.0,
    show_default=True,
    help="Per scontrol call. [SWIM_SLURM_TIMEOUT_S]",
)
@click.option(
    "--budget-s",
    envvar="SWIM_SLURM_BUDGET_S",
    type=click.FloatRange(1, 3600),
    default=25.0,
    show_default=True,
    help="For the whole run. [SWIM_SLURM_BUDGET_S]",
)
@click.option(
    "--backups",
    envvar="SWIM_SLURM_BACKUPS",
    type=click.IntRange(0, 10),
    default=2,
    show_default=True,
    help="Next agents in the ranking that check and act too. [SWIM_SLURM_BACKUPS]",
)
@click.option(
    "--backup-delay-s",
    envvar="SWIM_SLURM_BACKUP_DELAY_S",
    type=click.FloatRange(0, 60),
    default=5.0,
    show_default=True,
    help="Backup N acts after N times this. [SWIM_SLURM_BACKUP_DELAY_S]",
)
@click.option(
    "--log-file",
    envvar="SWIM_SLURM_LOG",
    type=click.Path(path_type=Path),
    help="Also append log lines here. [SWIM_SLURM_LOG]",
)
@click.option(
    "--control",
    envvar="SWIM_CONTROL",
    type=click.Path(path_type=Path),
    help="This node's agent (set by the agent for its handlers). [SWIM_CONTROL]",
)
def main(**kw: Any) -> None:
    """Drain (and optionally resume) the Slurm node of a failed member; one agent acts."""
    event = os.environ.get("SERF_EVENT", "")
    me = os.environ.get("SERF_SELF_NAME", "")
    log = _Log(f"swim-slurm-handler[{me or '?'}]", kw["log_file"])
    try:
        opts = {
            **kw,
            "event": event,
            "self_name": me,
            "drain_events": _events(kw["drain_on"]) if kw["drain_on"] else DEFAULT_DRAIN_EVENTS,
            "mapping": parse_map(kw["map_file"].read_text()) if kw["map_file"] else {},
            "actor_tag": parse_actor_tag(kw["actor_tag"]),
        }
        if not event:
            raise SlurmError("SERF_EVENT is not set: run me as an event handler")
        lines = _read_stdin(sys.stdin)
    except (SlurmError, click.BadParameter, OSError) as exc:
        log(f"not run: {exc}")
        sys.exit(EXIT_USAGE)
    try:
        sys.exit(run_handler(opts, lines, log))
    except SlurmError as exc:
        log(f"not run: {exc}")
        sys.exit(EXIT_USAGE)


def check_agent(control: Path | None, allow_alone: bool) -> tuple[bool, str]:
    """Whether this node's agent is usable for a job, and the sentence that says why."""
    client = ControlClient(control, CONTROL_TIMEOUT_S)
    try:
        info = client.request("info")
        mine = [m for m in client.request("members") if m["name"] == info["node"]]
    except ControlError as exc:
        return False, str(exc)
    status = mine[0]["status"] if mine else "missing"
    alive = int(info["members"].get("alive", 0))
    said = f"agent {info['node']} is {status}, sees {alive} alive (health {info['health_score']})"
    if status != "alive":
        return False, said
    if alive < 2 and not allow_alone:
        return False, said + ": alone, it has not joined the cluster"
    return True, said


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--phase", type=click.Choice(["prolog", "epilog", "check"]), default="check")
@click.option(
    "--strict/--no-strict",
    envvar="SWIM_SLURM_STRICT",
    default=False,
    help="Exit 1 when the check fails (Slurm then drains the node). [SWIM_SLURM_STRICT]",
)
@click.option(
    "--allow-alone",
    is_flag=True,
    envvar="SWIM_SLURM_ALLOW_ALONE",
    help="A one-member cluster passes. [SWIM_SLURM_ALLOW_ALONE]",
)
@click.option("--log-file", envvar="SWIM_SLURM_LOG", type=click.Path(path_type=Path))
@click.option("--control", envvar="SWIM_CONTROL", type=click.Path(path_type=Path))
def check_main(
    phase: str, strict: bool, allow_alone: bool, log_file: Path | None, control: Path | None
) -> None:
    """Check this node's agent for a Slurm prolog or epilog; one line says the result."""
    node = os.environ.get("SLURMD_NODENAME", "?")
    job = os.environ.get("SLURM_JOB_ID", "-")
    log = _Log(f"swim-slurm-{phase}[{node} job {job}]", log_file, to_syslog=True)
    ok, said = check_agent(control, allow_alone)
    if ok and node not in ("?", said.split()[1]):
        said += f" (its name differs from the Slurm node {node}: map it for the drain handler)"
    log(("ok: " if ok else "FAILED: ") + said + ("" if ok or strict else " (not strict: exit 0)"))
    sys.exit(EXIT_FAILED if strict and not ok else EXIT_OK)


if __name__ == "__main__":
    check_main() if sys.argv[1:2] == ["--phase"] else main()
