"""The CI variant of every scenario runs and shows the property it is about."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulations import run as cli
from simulations.experiments.harness import Params
from simulations.experiments.scenarios import REGISTRY, run, serf_model_s


def _ci(**extra: object) -> Params:
    return Params(seed=3, ci=True, extra=dict(extra))


def test_every_required_scenario_is_registered() -> None:
    want = {"steady", "crash", "dissemination", "slow-members", "loss", "partition", "churn"}
    assert want | {"scale"} <= set(REGISTRY)


def test_steady_has_no_false_positives_and_swim_like_load() -> None:
    result = run("steady", _ci())
    s = result.summary
    assert s["fp_suspect"] == 0 and s["fp_dead"] == 0
    # SWIM §5 Fig. 2: about 2 messages sent per member per period (plus rare gossip)
    assert 1.5 <= s["pkts_sent_per_member_per_period"] <= 4


def test_crash_is_detected_by_all_without_false_positives() -> None:
    result = run("crash", _ci())
    s = result.summary
    assert s["crashes"] == s["detected_by_all"] == 2
    assert s["fp_dead"] == 0
    assert 0.5 <= s["first_suspect_mean_periods"] <= 4
    assert s["all_dead_max_s"] < 30


def test_dissemination_reaches_everyone_within_seconds() -> None:
    result = run("dissemination", _ci())
    for row in result.tables["spread"]:
        assert row["t100_s"] is not None and row["t100_s"] < 5
        assert row["t50_s"] <= row["t99_s"] <= row["t100_s"]


def test_loss_still_reaches_everyone() -> None:
    result = run("loss", _ci())
    row = result.tables["spread"][0]
    assert row["loss"] == 0.1 and row["t100_s"] is not None


def test_serf_model_matches_the_published_table() -> None:
    # docs/design.md §5.8: n=30, loss 0: 0.6 / 1.2 / 1.8 s; n=10 000 at 30% loss: 1.8/2.8/3.6
    assert serf_model_s(30, 0.5, 0.0, 200, 3) == pytest.approx(0.6)
    assert serf_model_s(30, 0.99, 0.0, 200, 3) == pytest.approx(1.2)
    assert serf_model_s(30, 0.9999, 0.0, 200, 3) == pytest.approx(1.8)
    assert serf_model_s(10_000, 0.9999, 0.3, 200, 3) == pytest.approx(3.6)


def test_slow_members_swim_mode_reports_fps_and_detects_the_crash() -> None:
    result = run("slow-members", Params(seed=3, ci=True, lifeguard="swim"))
    row = result.tables["ablation"][0]
    assert row["crash_all_dead_s"] is not None
    assert row["lifeguard"] == "swim"


def test_partition_heals_into_one_membership() -> None:
    result = run("partition", _ci())
    s = result.summary
    assert s["dead_across_cut"] > 0
    assert s["fp_within_sides"] == 0
    assert s["merged_after_heal_s"] is not None


def test_churn_ends_in_agreement() -> None:
    result = run("churn", _ci(crash_per_min=6, restart_per_min=4, join_per_min=2, leave_per_min=2))
    s = result.summary
    assert s["agreed_after_churn_s"] is not None
    assert sum(s[k] for k in ("crashes", "restarts", "joins", "leaves")) >= 3


def test_scale_small_reports_speed() -> None:
    result = run("scale", Params(seed=3, ci=True, nodes=150))
    assert result.summary["events_per_wall_s"] > 0
    assert result.summary["update_t100_s"] is not None


def test_cli_prints_seed_and_hash_and_writes_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--scenario", "crash", "--ci", "--seed", "9", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].endswith("seed 9")
    i = lines.index("== summary of crash")
    assert lines[i + 1] == "seed: 9" and lines[i + 2].startswith("trace hash: ")
    assert (tmp_path / "crash.md").exists()
    assert (tmp_path / "crash-detection.csv").read_text().startswith("victim,")


def test_plots_are_written_or_skipped_with_a_message(tmp_path: Path) -> None:
    from simulations.reports import scenario as report

    result = run("crash", _ci(crashes=1))
    messages = report.write(result, tmp_path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert any("matplotlib is not installed" in m for m in messages)
    else:
        assert (tmp_path / "crash-dead_spread.png").stat().st_size > 1000
    assert (tmp_path / "crash-summary.csv").exists()


def test_config_overrides_and_lifeguard_modes() -> None:
    p = Params(
        lifeguard="lha-probe", extra={"cfg.suspicion_mult": "2", "cfg.enable_compression": "0"}
    )
    config = p.make_config()
    assert config.suspicion_mult == 2 and config.enable_compression is False
    assert config.lifeguard_lhm and config.lifeguard_nacks
    assert not config.lifeguard_dynamic_suspicion and not config.lifeguard_buddy
    with pytest.raises(ValueError):
        Params(extra={"cfg.no_such_field": "1"}).make_config()
    with pytest.raises(ValueError):
        Params(lifeguard="nope").make_config()
