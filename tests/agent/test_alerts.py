"""packaging/alerts.yml: valid Prometheus rules, and each alert fires for the series of its
failure mode (promtool's rule unit tests in tests/agent/promtool/alerts_test.yml)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

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
    assert "SUCCESS: 8 rules found" in report


@needs_promtool
def test_each_alert_fires_for_its_failure_mode() -> None:
    report = _promtool("test", "rules", "alerts_test.yml", cwd=ROOT / "tests/agent/promtool")
    assert "SUCCESS" in report
