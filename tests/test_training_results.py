"""bench/training_results.py ``power``: the rows of ``bench.torch_recovery --netns`` become a
well-formed result of its own question, with the packet counts summed per fault and the
same-run namespaces / loopback and power / SIGSTOP ratios."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from agent import config as agent_config
from bench import agent_variants, render, results, training_results


def _row(mode: str, fault: str, total: float, **counts: int) -> dict[str, Any]:
    return {
        "mode": mode,
        "fault": fault,
        "startup_s": 30.0,
        "window_s": 60.0,
        "verdict_s": total - 0.1,
        "last_verdict_s": total - 0.05,
        "resume_s": 0.1,
        "total_s": total,
        "rolled_back": 0,
        "victim_led": False,
        **counts,
    }


def test_power_rows_become_their_own_question_with_counts_and_ratios() -> None:
    ns, lo = "in-process DDP, namespaces", "in-process DDP"
    quiet = {"resets": 0, "icmp": 0, "dropped_in": 20, "dropped_out": 30}
    rows = [
        _row(ns, "power", 0.9, **quiet),
        _row(ns, "power", 1.1, **quiet),
        _row(ns, "kill", 0.6, resets=5, icmp=12, dropped_in=0, dropped_out=0),
        _row(ns, "stop", 1.0, resets=0, icmp=0, dropped_in=0, dropped_out=0),
        _row(lo, "kill", 0.5),
        _row(lo, "stop", 0.8),
    ]
    out = training_results.power(rows, nodes=3, ranks=2, profile="fast", step_sleep_s=0.02)
    data = {
        "format": results.FORMAT,
        "command": "python -m bench.torch_recovery --netns",
        "date": "2026-12-05",
        "commit": None,
        "machine": {"cpus": 2, "load_avg_start": None},
        "source": "measured",
        "notes": [],
        **out,
    }
    assert results.validate(data) == []
    assert out["question"] == "training-power-3x2-fast"
    figures = out["figures"]
    assert figures["in-process-ddp-ns-power.total_s"]["value"] == 1.0
    assert figures["in-process-ddp-ns-power.resets"]["value"] == 0
    assert figures["in-process-ddp-ns-kill.resets"]["value"] == 17
    main = {(r["mode"], r["fault"]): r for r in out["tables"][0]["rows"]}
    assert main[(ns, "power")]["dropped"] == 50
    assert main[(lo, "kill")]["resets"] is None  # loopback: nothing counted
    ratios = {r["label"]: r["value"] for r in out["ratios"]}
    assert (
        ratios["DDP, namespaces / loopback, SIGKILL at a step boundary: fault → first step"] == 1.2
    )
    assert ratios["DDP, power loss / SIGSTOP, namespaces: fault → first step"] == 1.0
    assert "Power loss beside SIGKILL and SIGSTOP" in "\n".join(render.section(data))


@pytest.mark.parametrize(
    ("text", "drops"), [("", [""]), ("on", ["on"]), ("on,off", ["on", "off"]), (",off,", ["off"])]
)
def test_early_drop_choices_parse_and_the_default_runs_at_the_profiles_setting(
    text: str, drops: list[str]
) -> None:
    assert agent_variants.on_off(text, "--early-drop") == drops


@pytest.mark.parametrize("text", ["yes", "on,maybe", "ON"])
def test_early_drop_choices_refuse_anything_else(text: str) -> None:
    with pytest.raises(SystemExit, match="--early-drop"):
        agent_variants.on_off(text, "--early-drop")


@pytest.mark.parametrize("small", ["on", "off"])
def test_a_small_group_row_starts_its_agents_with_that_protocol_setting(
    tmp_path: Path, small: str
) -> None:
    variant = {"early drop": "off", "stall drop": "on", "small group": small}
    args = agent_variants.agent_args(tmp_path, variant)
    assert args[:3] == ("--no-job-early-drop", "--job-stall-drop", "--config")
    config = agent_config.load(Path(args[3]), {"profile": "fast"})
    assert config.swim_config().small_group_confirmations is (small == "on")
    assert agent_variants.agent_args(tmp_path, {}) == ()
    assert agent_variants.mode(variant) == f", early drop off, stall drop on, small group {small}"


def test_every_combination_of_the_switches_asked_for_is_a_variant() -> None:
    parser = argparse.ArgumentParser()
    agent_variants.add_arguments(parser)
    args = parser.parse_args(["--stall-drop", "on,off", "--small-group", "off"])
    assert list(agent_variants.variants(args)) == [
        {"early drop": "", "stall drop": "on", "small group": "off"},
        {"early drop": "", "stall drop": "off", "small group": "off"},
    ]
