"""The serf comparison benchmark runs end to end on a tiny cluster and writes its report.

No timing is asserted here (speed targets are checked by reading the benchmark's numbers,
see BENCHMARKS.md); this only proves the benchmark works and cleans up after itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import compare_serf
from bench.procs import SERF


@pytest.mark.skipif(SERF is None, reason="serf not installed (scripts/setup.sh installs it)")
def test_benchmark_produces_a_report(tmp_path: Path) -> None:
    out = tmp_path / "BENCH.md"
    rc = compare_serf.main(
        [
            "--sizes",
            "3",
            "--profile",
            "local",
            "--settle-s",
            "1",
            "--window-s",
            "2",
            "--kills",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    text = out.read_text()
    assert "| serf | 3 |" in text and "| swim | 3 |" in text
    assert "| 3 |" in text.split("Ratios swim/serf")[1]
    for line in text.splitlines():
        if line.startswith(("| serf | 3", "| swim | 3")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert not cells[5].startswith("n/a"), "every survivor saw the killed agent dead"
