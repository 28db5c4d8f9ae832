"""``swimctl``: run an agent, and talk to a running one. Follows Serf's CLI conventions.

    swimctl agent --node NAME --bind HOST:PORT [--join HOST:PORT ...] [...]
    swimctl members [--status S] [--json]
    swimctl join ADDR...        swimctl leave        swimctl force-leave NODE
    swimctl info [--json]       swimctl monitor      swimctl tags --set k=v --delete k
    swimctl probe NODE... [--json]
    swimctl keys --list | --install KEY | --use KEY | --remove KEY
    swimctl demo [--torch]      (a local cluster of real agents; agent/demo.py, torch_demo.py)

Client commands reach the agent's control socket: ``--control PATH`` or ``$SWIM_CONTROL``,
else ``$XDG_RUNTIME_DIR/swim/agent.sock``, else ``/run/swim/agent.sock``. ``--control`` goes
before the subcommand (``swimctl --control PATH members``) or after it (``swimctl members
--control PATH``, as serf and consul users type it); after it wins. ``--json`` prints
the control API's result unchanged (schema in agent/control.py). Exit status: 0 on success,
1 when the agent refused or could not be reached, 2 for bad usage.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from agent.config import AgentConfigError, load, parse_tag_args
from agent.control import ControlClient, ControlError
from swim import PROFILES

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
CONTROL_PATH = click.Path(path_type=Path, readable=False)
"""Not checked by click: a user without access gets the client's error, which says who has."""


def _set_control(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    # A subcommand's --control overrides the group's (and so $SWIM_CONTROL); absent, the
    # group's value stands.
    if value is not None:
        ctx.ensure_object(dict)
        ctx.obj["control"] = value


def _control_option(f: Any) -> Any:
    """``--control PATH`` accepted after the subcommand too (serf and consul style)."""
    option = click.option(
        "--control",
        type=CONTROL_PATH,
        expose_value=False,
        callback=_set_control,
        help="The agent's control socket (overrides swimctl --control and $SWIM_CONTROL).",
    )
    return option(f)


def _client(ctx: click.Context) -> ControlClient:
    return ControlClient(ctx.obj.get("control"))


def _call(ctx: click.Context, op: str, **args: Any) -> Any:
    try:
        return _client(ctx).request(op, **args)
    except ControlError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


@click.group(context_settings=CONTEXT)
@click.option(
    "--control",
    envvar="SWIM_CONTROL",
    type=CONTROL_PATH,
    help="The agent's control socket.",
)
@click.pass_context
def main(ctx: click.Context, control: Path | None) -> None:
    """Gossip membership and failure detection for GPU clusters (SWIM + Lifeguard)."""
    ctx.ensure_object(dict)
    ctx.obj["control"] = control


def _agent_options(f: Any) -> Any:
    options = [
        click.option("--node", help="Node name (default: host name)."),
        click.option("--bind", help="HOST:PORT for UDP and TCP (default 0.0.0.0:7946)."),
        click.option("--advertise", help="HOST:PORT peers should use to reach this node."),
        click.option("--join", "join", multiple=True, help="Join this HOST[:PORT] at start."),
        click.option("--retry-join", "retry_join", multiple=True, help="Retry joining this."),
        click.option("--retry-interval-ms", type=int, help="Between retry-join attempts."),
        click.option("--retry-max", type=int, help="Retry-join attempts; 0 = forever."),
        click.option("--profile", type=click.Choice(PROFILES)),
        click.option("--tag", "tag", multiple=True, help="KEY=VALUE tag (repeatable)."),
        click.option("--encrypt", help="Base64 AES key (16, 24 or 32 bytes)."),
        click.option("--keyring-file", type=click.Path(path_type=Path)),
        click.option("--metrics-addr", help="HOST:PORT to serve Prometheus /metrics on."),
        click.option("--control-group", help="Group that may use the control socket (swim)."),
        click.option("--admin-group", help="Group that may also run leave/join/keys/tags."),
        click.option(
            "--config",
            "config_file",
            type=click.Path(path_type=Path),
            help="TOML configuration file; flags override it.",
        ),
        click.option(
            "--log-level",
            type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@main.command(context_settings=CONTEXT)
@_control_option
@_agent_options
@click.pass_context
def agent(ctx: click.Context, /, **flags: Any) -> None:
    """Run an agent in the foreground until SIGTERM/SIGINT (graceful leave)."""
    _run_agent(ctx.obj.get("control"), flags)


def _run_agent(control: Path | None, flags: dict[str, Any]) -> None:
    import trio

    from agent.runtime import run_agent

    config_file = flags.pop("config_file", None)
    try:
        flags["tags"] = parse_tag_args(flags.pop("tag", ()))
        flags["control"] = str(control) if control else None
        config = load(config_file, flags)
    except AgentConfigError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s [%(levelname)s] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        trio.run(run_agent, config)
    except AgentConfigError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
    except (OSError, ControlError) as exc:  # ControlError: another agent has the socket
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)


@click.command(context_settings=CONTEXT)
@_agent_options
@click.option("--control", type=click.Path(path_type=Path), envvar="SWIM_CONTROL")
def agent_main(control: Path | None, **flags: Any) -> None:
    """swim-agent: the daemon (same as ``swimctl agent``)."""
    _run_agent(control, flags)


@main.command(context_settings=CONTEXT)
@_control_option
@click.option("--status", type=click.Choice(["alive", "suspect", "dead", "left"]))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def members(ctx: click.Context, status: str | None, as_json: bool) -> None:
    """List the members this agent knows."""
    result = _call(ctx, "members", **({"status": status} if status else {}))
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
        return
    rows = [("Name", "Address", "Status", "Incarnation", "Phi", "Tags")]
    for m in result:
        phi = "-" if m["phi"] is None else f"{m['phi']:.2f}"
        tags = ",".join(f"{k}={v}" for k, v in sorted(m["tags"].items()))
        rows.append(
            (m["name"], f"{m['addr']}:{m['port']}", m["status"], str(m["incarnation"]), phi, tags)
        )
    click.echo(_table(rows))


@main.command(context_settings=CONTEXT)
@_control_option
@click.argument("addrs", nargs=-1, required=True)
@click.pass_context
def join(ctx: click.Context, addrs: tuple[str, ...]) -> None:
    """Join the cluster through one or more HOST[:PORT] addresses."""
    result = _call(ctx, "join", addrs=list(addrs))
    for problem in result["errors"]:
        click.echo(f"Warning: {problem}", err=True)
    if not result["joined"]:
        click.echo("Error: joined no address", err=True)
        sys.exit(1)
    click.echo(f"Successfully joined cluster by contacting {result['joined']} node(s).")


@main.command(context_settings=CONTEXT)
@_control_option
@click.pass_context
def leave(ctx: click.Context) -> None:
    """Leave the cluster gracefully and stop the agent."""
    _call(ctx, "leave")
    click.echo("Graceful leave complete")


@main.command("force-leave", context_settings=CONTEXT)
@_control_option
@click.argument("node")
@click.pass_context
def force_leave(ctx: click.Context, node: str) -> None:
    """Mark a failed member as left, so it is forgotten instead of waited for."""
    result = _call(ctx, "force_leave", node=node)
    click.echo(f"{result['node']}: {result['status']}")


@main.command(context_settings=CONTEXT)
@_control_option
@click.argument("nodes", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def probe(ctx: click.Context, nodes: tuple[str, ...], as_json: bool) -> None:
    """Probe members now instead of at their round-robin turn (e.g. a job lost them).

    Only the probe can make them suspect: a live member answers and stays alive. Exit
    status 1 when no probe started (each refusal is printed with its reason)."""
    result = _call(ctx, "probe", nodes=list(nodes))
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
    else:
        for name in result["started"]:
            click.echo(f"{name}: probing")
        for name, reason in result["refused"].items():
            click.echo(f"Warning: {name}: not probed ({reason})", err=True)
    if not result["started"]:
        sys.exit(1)


@main.command(context_settings=CONTEXT)
@_control_option
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def info(ctx: click.Context, as_json: bool) -> None:
    """Show this agent's state and counters."""
    result = _call(ctx, "info")
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
        return
    for key in (
        "node",
        "addr",
        "port",
        "incarnation",
        "health_score",
        "profile",
        "encrypted",
        "version",
    ):
        click.echo(f"{key:>14}: {result[key]}")
    counts = ", ".join(f"{k} {v}" for k, v in result["members"].items())
    click.echo(f"{'members':>14}: {counts}")
    tags = ",".join(f"{k}={v}" for k, v in sorted(result["tags"].items()))
    click.echo(f"{'tags':>14}: {tags}")
    for key, value in result["stats"].items():
        click.echo(f"{key:>14}: {value}")


@main.command(context_settings=CONTEXT)
@_control_option
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


@main.command(context_settings=CONTEXT)
@_control_option
@click.option("--set", "to_set", multiple=True, help="KEY=VALUE (repeatable).")
@click.option("--delete", "to_delete", multiple=True, help="KEY (repeatable).")
@click.pass_context
def tags(ctx: click.Context, to_set: tuple[str, ...], to_delete: tuple[str, ...]) -> None:
    """Change this agent's tags; they are gossiped with a new incarnation."""
    try:
        changes = parse_tag_args(to_set, "--set")
    except AgentConfigError as exc:
        raise click.UsageError(str(exc)) from None
    result = _call(ctx, "tags", set=changes, delete=list(to_delete))
    for key, value in sorted(result["tags"].items()):
        click.echo(f"{key}={value}")


@main.command(context_settings=CONTEXT)
@_control_option
@click.option("--list", "do_list", is_flag=True, help="List the installed keys.")
@click.option("--install", help="Install a base64 key.")
@click.option("--use", help="Make an installed key the primary.")
@click.option("--remove", help="Remove a key (not the primary).")
@click.pass_context
def keys(
    ctx: click.Context, do_list: bool, install: str | None, use: str | None, remove: str | None
) -> None:
    """Manage this agent's gossip encryption keyring."""
    chosen = [(a, k) for a, k in (("install", install), ("use", use), ("remove", remove)) if k]
    if len(chosen) + int(do_list) != 1:
        raise click.UsageError("give exactly one of --list, --install, --use, --remove")
    action, key = chosen[0] if chosen else ("list", None)
    result = _call(ctx, "keys", action=action, **({"key": key} if key else {}))
    for k in result["keys"]:
        click.echo(f"{k}{'  (primary)' if k == result['primary'] else ''}")


@main.command(context_settings=CONTEXT)
@click.option("--agents", default=5, show_default=True, help="How many agents to start.")
@click.option("--profile", default="local", show_default=True, type=click.Choice(PROFILES))
@click.option(
    "--torch",
    "torch_job",
    is_flag=True,
    help="Instead: an elastic DDP job (needs torch); kill a node, watch it go on without it.",
)
@click.option(
    "--nodes",
    type=int,
    default=None,
    help="With --torch: how many nodes (agent + trainers each; 2 or more).  [default: 4]",
)
@click.option(
    "--ranks-per-node",
    type=int,
    default=None,
    help="With --torch: trainer processes per node, one per local rank (1..8).  [default: 1]",
)
def demo(
    agents: int,
    profile: str,
    torch_job: bool,
    nodes: int | None,
    ranks_per_node: int | None,
) -> None:
    """Start a local cluster of real agents, kill one, watch the others notice."""
    if torch_job:
        from agent.torch_demo import run_torch_demo

        n, r = 4 if nodes is None else nodes, 1 if ranks_per_node is None else ranks_per_node
        sys.exit(run_torch_demo(profile, n, r))
    if nodes is not None or ranks_per_node is not None:
        # the plain demo's size is --agents; silently ignoring these would mislead
        raise click.UsageError("--nodes and --ranks-per-node go with --torch (else: --agents)")
    from agent.demo import run_demo

    sys.exit(run_demo(agents, profile))


if __name__ == "__main__":
    main()
