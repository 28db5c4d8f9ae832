"""``swimctl``: run an agent, and talk to a running one. Follows Serf's CLI conventions.

    swimctl agent --node NAME --bind HOST:PORT [--join HOST:PORT ...] [...]
    swimctl members [--status REGEX] [--name REGEX] [--tag KEY=REGEX ...] [--json]
    swimctl join ADDR...        swimctl leave        swimctl force-leave NODE
    swimctl info                swimctl monitor      swimctl tags --set k=v --delete k
    swimctl probe NODE...       swimctl jobs         swimctl view JOB
    swimctl keys --list | --install KEY | --use KEY | --remove KEY
    swimctl version             swimctl --version
    swimctl demo [--torch]      (a local cluster of real agents; agent/demo.py, torch_demo.py)

The client commands live in agent/cli_client.py (their text output in agent/cli_format.py);
every one that prints takes ``--json``. This module holds the group, the agent's own flags
and the demo.

Client commands reach the agent's control socket: ``--control PATH`` or ``$SWIM_CONTROL``,
else ``$XDG_RUNTIME_DIR/swim/agent.sock``, else ``/run/swim/agent.sock``. ``--control`` goes
before the subcommand (``swimctl --control PATH members``) or after it (``swimctl members
--control PATH``, as serf and consul users type it); after it wins. ``--json`` prints
the control API's result unchanged (schema in agent/control.py). Exit status: 0 on success,
1 when the agent refused or could not be reached, 2 for bad usage.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click

from agent.cli_client import COMMANDS, CONTEXT, CONTROL_PATH, control_option, print_version
from agent.config import AgentConfigError, load, parse_tag_args
from agent.control import ControlError
from agent.cpu_cgroup import check_cpu_cgroup
from swim import PROFILES

_version_option = click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=print_version,
    help="Show the version and the protocol versions spoken, then exit.",
)


@click.group(context_settings=CONTEXT)
@click.option(
    "--control",
    envvar="SWIM_CONTROL",
    type=CONTROL_PATH,
    help="The agent's control socket.",
)
@_version_option
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
        click.option(
            "--advertise-interface",
            help="Advertise this interface's address (IPv4, else IPv6) with bind's port.",
        ),
        click.option("--join", "join", multiple=True, help="Join this HOST[:PORT] at start."),
        click.option("--retry-join", "retry_join", multiple=True, help="Retry joining this."),
        click.option("--retry-interval-ms", type=int, help="Between retry-join attempts."),
        click.option("--retry-max", type=int, help="Retry-join attempts; 0 = forever."),
        click.option("--profile", type=click.Choice(PROFILES)),
        click.option("--tag", "tag", multiple=True, help="KEY=VALUE tag (repeatable)."),
        click.option("--encrypt", help="Base64 AES key (16, 24 or 32 bytes)."),
        click.option("--keyring-file", type=click.Path(path_type=Path)),
        click.option(
            "--encrypt-file",
            type=click.Path(path_type=Path),
            help="File holding the base64 key (mode 0600).",
        ),
        click.option(
            "--data-dir",
            type=click.Path(path_type=Path),
            help="State directory: key changes are saved to DATA_DIR/keyring.json.",
        ),
        click.option(
            "--metrics-addr", help="HOST:PORT to serve Prometheus /metrics and the status page on."
        ),
        click.option("--control-group", help="Group that may use the control socket (swim)."),
        click.option("--admin-group", help="Group that may also run leave/join/keys/tags."),
        click.option(
            "--event-handler",
            "event_handlers",
            multiple=True,
            help="[FILTER=]COMMAND run on events, as Serf's -event-handler (repeatable).",
        ),
        click.option("--event-handler-timeout-ms", type=int, help="Kill a handler after this."),
        click.option(
            "--job-early-drop/--no-job-early-drop",
            default=None,
            help="Drop a crashed node from job views on strong evidence (default: on with fast).",
        ),
        click.option(
            "--job-stall-drop/--no-job-stall-drop",
            default=None,
            help="A stalled job stops waiting for a suspect node (default: on with fast).",
        ),
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
@control_option
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
    check_cpu_cgroup(config.profile)
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
@_version_option
def agent_main(control: Path | None, **flags: Any) -> None:
    """swim-agent: the daemon (same as ``swimctl agent``)."""
    _run_agent(control, flags)


@main.command(context_settings=CONTEXT)
@click.option("--agents", default=5, show_default=True, help="How many agents to start.")
@click.option(
    "--profile",
    default=None,
    type=click.Choice(PROFILES),
    help="The agents' profile.  [default: fast; with --torch: local]",
)
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
    profile: str | None,
    torch_job: bool,
    nodes: int | None,
    ranks_per_node: int | None,
) -> None:
    """Start a local cluster of real agents, kill one, watch the others notice."""
    if torch_job:
        from agent.torch_demo import run_torch_demo

        n, r = 4 if nodes is None else nodes, 1 if ranks_per_node is None else ranks_per_node
        # local, as its test runs it: the trainers share this host's CPUs with the agents,
        # and an agent starved for longer than fast's suspicion window is declared dead
        # (docs/tuning.md §1)
        sys.exit(run_torch_demo(profile or "local", n, r))
    if nodes is not None or ranks_per_node is not None:
        # the plain demo's size is --agents; silently ignoring these would mislead
        raise click.UsageError("--nodes and --ranks-per-node go with --torch (else: --agents)")
    from agent.demo import run_demo

    sys.exit(run_demo(agents, profile or "fast"))


for _command in COMMANDS:
    main.add_command(_command)

if __name__ == "__main__":
    main()
