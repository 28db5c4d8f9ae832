"""Agent settings that bench/torch_recovery.py compares row by row in one run: ``--early-drop
on,off`` (the agents' ``job_early_drop``) and ``--small-group on,off`` (the protocol's
``small_group_confirmations``, through a ``[protocol]`` table in an agent configuration
file, agent/config.py). Interleaved with every other case, so load swings spread over
both sides alike."""

from __future__ import annotations

from pathlib import Path

__all__ = ["agent_args", "on_off"]


def on_off(text: str, option: str) -> list[str]:
    """``option``'s value: ``on``, ``off`` or both, comma-separated; empty: one run at the
    profile's setting (``[""]``). ``SystemExit`` names anything else."""
    values = [d for d in text.split(",") if d]
    if not set(values) <= {"on", "off"}:
        raise SystemExit(f"{option}: {text!r} is not a list of on and off")
    return values or [""]


def agent_args(work: Path, early_drop: str, small_group: str) -> tuple[str, ...]:
    """The agents' extra arguments for one row (``""``: the profile's setting); a
    configuration file, where one is needed, is written under ``work``."""
    args: tuple[str, ...] = ()
    if early_drop:
        args += (f"--{'' if early_drop == 'on' else 'no-'}job-early-drop",)
    if small_group:
        toml = work / "agent.toml"
        value = "true" if small_group == "on" else "false"
        toml.write_text(f"[protocol]\nsmall_group_confirmations = {value}\n")
        args += ("--config", str(toml))
    return args
