"""Agent settings that bench/torch_recovery.py compares row by row in one run, each
``on,off`` (``SWITCHES``): ``--early-drop`` (the agents' ``job_early_drop``),
``--stall-drop`` (``job_stall_drop``) and ``--small-group`` (the protocol's
``small_group_confirmations``, through a ``[protocol]`` table in an agent configuration
file, agent/config.py). Interleaved with every other case, so load swings spread over
both sides alike. A row's mode ends with each switch it sets, e.g. ``, stall drop on``."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["SWITCHES", "add_arguments", "agent_args", "mode", "on_off", "variants"]

SWITCHES = {
    "early drop": ("--early-drop", "job-early-drop"),
    "stall drop": ("--stall-drop", "job-stall-drop"),
    "small group": ("--small-group", ""),
}
"""Row label → (this benchmark's option, the agent's flag; empty: a ``[protocol]``
setting in a configuration file)."""


def on_off(text: str, option: str) -> list[str]:
    """``option``'s value: ``on``, ``off`` or both, comma-separated; empty: one run at the
    profile's setting (``[""]``). ``SystemExit`` names anything else."""
    values = [d for d in text.split(",") if d]
    if not set(values) <= {"on", "off"}:
        raise SystemExit(f"{option}: {text!r} is not a list of on and off")
    return values or [""]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``on,off`` option per switch."""
    for label, (option, flag) in SWITCHES.items():
        setting = flag.replace("-", "_") or label.replace(" ", "_") + "_confirmations"
        parser.add_argument(
            option,
            default="",
            help=f"on,off: each in-process row with the agents' {setting} on and off, "
            "interleaved (default: the profile's setting)",
        )


def variants(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """Every combination of the switches' values asked for (label → ``on``/``off``/``""``)."""
    values = [
        on_off(getattr(args, option[2:].replace("-", "_")), option)
        for option, _ in SWITCHES.values()
    ]
    for combination in itertools.product(*values):
        yield dict(zip(SWITCHES, combination, strict=True))


def mode(variant: Mapping[str, str]) -> str:
    """The suffix of a row's mode: ``, early drop on`` and so on, for each switch set."""
    return "".join(f", {label} {value}" for label, value in variant.items() if value)


def agent_args(work: Path, variant: Mapping[str, str]) -> tuple[str, ...]:
    """The agents' extra arguments for one row (a switch at ``""``: the profile's
    setting); a configuration file, where one is needed, is written under ``work``."""
    args: tuple[str, ...] = ()
    for label, (_, flag) in SWITCHES.items():
        value = variant.get(label, "")
        if value and flag:
            args += (f"--{'' if value == 'on' else 'no-'}{flag}",)
        elif value:
            toml = work / "agent.toml"
            setting = "true" if value == "on" else "false"
            toml.write_text(f"[protocol]\nsmall_group_confirmations = {setting}\n")
            args += ("--config", str(toml))
    return args
