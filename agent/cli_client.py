"""``swimctl``'s client commands: each is one control request to a running agent (schema in
agent/control.py), printed as text (agent/cli_format.py) or, with ``--json``, as the
request's result unchanged. agent/cli.py adds them to the ``swimctl`` group.

Rules: every command that prints takes ``--json``; an agent that refuses or cannot be
reached is exit status 1 with ``Error: ...`` on stderr; bad usage (a bad regular
expression included) is exit status 2 in click's usage-error style. ``version`` and
``--version`` describe this client; ``info`` reports the agent's own version.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click

from agent import DISTRIBUTION
from agent.cli_format import (
    STATUSES,
    FilterError,
    MemberFilter,
    info_text,
    jobs_text,
    members_text,
    version_text,
    view_text,
)
from agent.config import AgentConfigError, parse_tag_args
from agent.control import PROTOCOL_VERSION, ControlClient, ControlError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


CONTROL_PATH = click.Path(path_type=Path, readable=False)
"""Not checked by click: a user without access gets the client's error, which says who has."""


def _set_control(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    # A subcommand's --control overrides the group's (and so $SWIM_CONTROL); absent, the
    # group's value stands.
    if value is not None:
        ctx.ensure_object(dict)
        ctx.obj["control"] = value


def control_option(f: Any) -> Any:
    """``--control PATH`` accepted after the subcommand too (serf and consul style)."""
    option = click.option(
        "--control",
        type=CONTROL_PATH,
        expose_value=False,
        callback=_set_control,
        help="The agent's control socket (overrides swimctl --control and $SWIM_CONTROL).",
    )
    return option(f)


def _json_option(f: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(f)


def _client(ctx: click.Context) -> ControlClient:
    ctx.ensure_object(dict)
    return ControlClient(ctx.obj.get("control"))


def _call(ctx: click.Context, op: str, **args: Any) -> Any:
    try:
        return _client(ctx).request(op, **args)
    except ControlError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)


def _echo_json(result: Any) -> None:
    click.echo(json.dumps(result, indent=2, sort_keys=True))


# --- version ----------------------------------------------------------------------------


def version_info() -> dict[str, Any]:
    """This client's installed version and the protocol versions it (and an agent of the
    same installation) speaks; the ``version --json`` schema."""
    from importlib.metadata import PackageNotFoundError, version

    from agent.serf import PROTOCOL_VERSION_MAX as SERF_MAX
    from agent.serf import PROTOCOL_VERSION_MIN as SERF_MIN
    from swim import PROTOCOL_VERSION_MAX, PROTOCOL_VERSION_MIN

    try:
        installed = version(DISTRIBUTION)
    except PackageNotFoundError:
        installed = "unknown"
    return {
        "version": installed,
        "distribution": DISTRIBUTION,
        "gossip_protocol": {"min": PROTOCOL_VERSION_MIN, "max": PROTOCOL_VERSION_MAX},
        "serf_protocol": {"min": SERF_MIN, "max": SERF_MAX},
        "control_protocol": PROTOCOL_VERSION,
    }


def print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``swimctl --version`` (and ``swim-agent --version``): an eager flag, answered before
    any subcommand runs."""
    if value and not ctx.resilient_parsing:
        click.echo(version_text(version_info(), ctx.find_root().info_name or "swimctl"))
        ctx.exit(0)


@click.command(context_settings=CONTEXT)
@_json_option
def version(as_json: bool) -> None:
    """Show swimctl's version and the protocol versions it speaks (the agent's: info)."""
    result = version_info()
    if as_json:
        _echo_json(result)
    else:
        click.echo(version_text(result))


# --- members ----------------------------------------------------------------------------


def _filter(ctx: click.Context, name: str | None, status: str | None, tags: Iterable[str]) -> Any:
    try:
        return MemberFilter.parse(name, status, tags)
    except FilterError as exc:
        raise click.UsageError(str(exc), ctx) from None


@click.command(context_settings=CONTEXT)
@control_option
@click.option(
    "--status",
    metavar="REGEX",
    help=f"Only members whose status matches ({', '.join(STATUSES)}; e.g. 'suspect|dead').",
)
@click.option("--name", metavar="REGEX", help="Only members whose whole name matches.")
@click.option(
    "--tag",
    "tags",
    multiple=True,
    metavar="KEY=REGEX",
    help="Only members whose tag KEY matches in whole (missing: ''); repeatable, all must.",
)
@_json_option
@click.pass_context
def members(
    ctx: click.Context,
    status: str | None,
    name: str | None,
    tags: tuple[str, ...],
    as_json: bool,
) -> None:
    """List the members this agent knows, optionally filtered as serf members filters."""
    keep = _filter(ctx, name, status, tags)
    # a plain status name is filtered by the agent (less to send from a large cluster);
    # any regular expression is only ever run here, in the client
    result = _call(ctx, "members", **({"status": status} if status in STATUSES else {}))
    shown = [m for m in result if keep(m)]
    if as_json:
        _echo_json(shown)
    else:
        click.echo(members_text(shown))


# --- changes ----------------------------------------------------------------------------


@click.command(context_settings=CONTEXT)
@control_option
@click.argument("addrs", nargs=-1, required=True)
@_json_option
@click.pass_context
def join(ctx: click.Context, addrs: tuple[str, ...], as_json: bool) -> None:
    """Join the cluster through one or more HOST[:PORT] addresses."""
    result = _call(ctx, "join", addrs=list(addrs))
    if as_json:
        _echo_json(result)
    else:
        for problem in result["errors"]:
            click.echo(f"Warning: {problem}", err=True)
    if not result["joined"]:
        click.echo("Error: joined no address", err=True)
        sys.exit(1)
    if not as_json:
        click.echo(f"Successfully joined cluster by contacting {result['joined']} node(s).")


@click.command(context_settings=CONTEXT)
@control_option
@_json_option
@click.pass_context
def leave(ctx: click.Context, as_json: bool) -> None:
    """Leave the cluster gracefully and stop the agent."""
    result = _call(ctx, "leave")
    if as_json:
        _echo_json(result)
    else:
        click.echo("Graceful leave complete")


@click.command("force-leave", context_settings=CONTEXT)
@control_option
@click.argument("node")
@_json_option
@click.pass_context
def force_leave(ctx: click.Context, node: str, as_json: bool) -> None:
    """Mark a failed member as left, so it is forgotten instead of waited for."""
    result = _call(ctx, "force_leave", node=node)
    if as_json:
        _echo_json(result)
    else:
        click.echo(f"{result['node']}: {result['status']}")


@click.command(context_settings=CONTEXT)
@control_option
@click.argument("nodes", nargs=-1, required=True)
@_json_option
@click.pass_context
def probe(ctx: click.Context, nodes: tuple[str, ...], as_json: bool) -> None:
    """Probe members now instead of at their round-robin turn (e.g. a job lost them).

    Only the probe can make them suspect: a live member answers and stays alive. Exit
    status 1 when no probe started (each refusal is printed with its reason)."""
    result = _call(ctx, "probe", nodes=list(nodes))
    if as_json:
        _echo_json(result)
    else:
        for name in result["started"]:
            click.echo(f"{name}: probing")
        for name, reason in result["refused"].items():
            click.echo(f"Warning: {name}: not probed ({reason})", err=True)
    if not result["started"]:
        sys.exit(1)


@click.command(context_settings=CONTEXT)
@control_option
@click.option("--set", "to_set", multiple=True, help="KEY=VALUE (repeatable).")
@click.option("--delete", "to_delete", multiple=True, help="KEY (repeatable).")
@_json_option
@click.pass_context
def tags(
    ctx: click.Context, to_set: tuple[str, ...], to_delete: tuple[str, ...], as_json: bool
) -> None:
    """Change this agent's tags; they are gossiped with a new incarnation."""
    try:
        changes = parse_tag_args(to_set, "--set")
    except AgentConfigError as exc:
        raise click.UsageError(str(exc)) from None
    result = _call(ctx, "tags", set=changes, delete=list(to_delete))
    if as_json:
        _echo_json(result)
        return
    for key, value in sorted(result["tags"].items()):
        click.echo(f"{key}={value}")


@click.command(context_settings=CONTEXT)
@control_option
@click.option("--list", "do_list", is_flag=True, help="List the installed keys.")
@click.option("--install", help="Install a base64 key.")
@click.option("--use", help="Make an installed key the primary.")
@click.option("--remove", help="Remove a key (not the primary).")
@_json_option
@click.pass_context
def keys(
    ctx: click.Context,
    do_list: bool,
    install: str | None,
    use: str | None,
    remove: str | None,
    as_json: bool,
) -> None:
    """Manage this agent's gossip encryption keyring."""
    chosen = [(a, k) for a, k in (("install", install), ("use", use), ("remove", remove)) if k]
    if len(chosen) + int(do_list) != 1:
        raise click.UsageError("give exactly one of --list, --install, --use, --remove")
    action, key = chosen[0] if chosen else ("list", None)
    result = _call(ctx, "keys", action=action, **({"key": key} if key else {}))
    if as_json:
        _echo_json(result)
        return
    for k in result["keys"]:
        click.echo(f"{k}{'  (primary)' if k == result['primary'] else ''}")


# --- state ------------------------------------------------------------------------------


@click.command(context_settings=CONTEXT)
@control_option
@_json_option
@click.pass_context
def info(ctx: click.Context, as_json: bool) -> None:
    """Show this agent's state, version and counters."""
    result = _call(ctx, "info")
    if as_json:
        _echo_json(result)
    else:
        click.echo(info_text(result))


@click.command(context_settings=CONTEXT)
@control_option
@click.argument("job")
@_json_option
@click.pass_context
def view(ctx: click.Context, job: str, as_json: bool) -> None:
    """Show a training job's view: its nodes in global-rank order, as its trainers see it."""
    result = _call(ctx, "view", job=job)
    if as_json:
        _echo_json(result)
    else:
        click.echo(view_text(result, int(time.time() * 1000)))


@click.command(context_settings=CONTEXT)
@control_option
@_json_option
@click.pass_context
def jobs(ctx: click.Context, as_json: bool) -> None:
    """List every training job this agent knows: generation, nodes, ranks, fingerprint."""
    result = _call(ctx, "jobs")
    if as_json:
        _echo_json(result)
    else:
        click.echo(jobs_text(result))


@click.command(context_settings=CONTEXT)
@control_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def monitor(ctx: click.Context, as_json: bool) -> None:
    """Stream membership events and the agent's log notices until interrupted."""
    try:
        for event in _client(ctx).stream("monitor"):
            if as_json:
                click.echo(json.dumps(event, sort_keys=True))
            elif event.get("type") == "log":
                click.echo(f"{event['at_ms']:>10} [{event['level'].upper()}] {event['message']}")
            else:
                click.echo(
                    f"{event['at_ms']:>10} {event['type']:<8} {event.get('node', '')} "
                    f"(incarnation {event.get('incarnation', '-')})"
                )
    except ControlError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        pass


COMMANDS = (
    members,
    join,
    leave,
    force_leave,
    probe,
    info,
    monitor,
    tags,
    keys,
    view,
    jobs,
    version,
)
"""The client commands (agent/cli.py adds them to the ``swimctl`` group)."""
