"""packaging/alerts.yml: valid Prometheus rules, and each alert fires for the series of its
failure mode (promtool's rule unit tests in tests/agent/promtool/alerts_test.yml);
packaging/grafana-dashboard.json queries only metrics the agent exports."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.metrics import AgentMetrics
from swim import Address, Node

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian package 'prometheus'; scripts/setup.sh)",
)


def _promtool(*args: str, cwd: Path) -> str:
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    return report


@needs_promtool
def test_alerting_rules_are_valid() -> None:
    report = _promtool("check", "rules", "packaging/alerts.yml", cwd=ROOT)
    assert "SUCCESS: 10 rules found" in report


@needs_promtool
def test_each_alert_fires_for_its_failure_mode() -> None:
    report = _promtool("test", "rules", "alerts_test.yml", cwd=ROOT / "tests/agent/promtool")
    assert "SUCCESS" in report


def test_grafana_dashboard_queries_only_metrics_the_agent_exports() -> None:
    node = Node("n0", Address("127.0.0.1", 7946), rng=random.Random(1), now_ms=0)
    exported = set(re.findall(r"^# TYPE (\w+)", AgentMetrics(node, dict).render().decode(), re.M))
    names = {f"{n}_total" if n + "_total" in exported else n for n in exported}
    names |= {f"{n}_bucket" for n in exported}
    dashboard = json.loads((ROOT / "packaging" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    for expr in exprs:
        for metric in re.findall(r"\b(swim_\w+)", expr):
            assert metric in names or metric.removesuffix("_total") in exported, (metric, expr)


def test_grafana_dashboard_lists_the_unhealthy_members_in_a_table() -> None:
    """One row per member: its name and status (the labels both queries group by), how many
    agents see it so and since when, joined by Grafana's merge transformation."""
    dashboard = json.loads((ROOT / "packaging" / "grafana-dashboard.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    (table,) = [p for p in dashboard["panels"] if p["type"] == "table"]
    assert table["gridPos"]["y"] == 0  # the first thing an operator sees
    targets = table["targets"]
    assert [t["expr"] for t in targets] == [
        'count by (member, status) (swim_member_unhealthy{job="swim"})',
        'max by (member, status) (swim_member_unhealthy_since_seconds{job="swim"})',
    ]
    assert all(t["instant"] and t["format"] == "table" for t in targets)
    kinds = [t["id"] for t in table["transformations"]]
    assert kinds == ["merge", "organize"]
    renamed = table["transformations"][1]["options"]["renameByName"]
    assert set(renamed.values()) == {"Member", "Status", "Agents seeing it", "Since"}
