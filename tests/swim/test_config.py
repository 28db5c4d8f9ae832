"""Config presets carry memberlist's values; invalid combinations raise at construction."""

from __future__ import annotations

import pytest

from swim import Config, ConfigError


# docs/design.md §5.1: memberlist config.go Default{LAN,WAN,Local}Config
@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        (
            Config.lan,
            dict(
                probe_interval_ms=1000,
                probe_timeout_ms=500,
                indirect_checks=3,
                suspicion_mult=4,
                suspicion_max_timeout_mult=6,
                retransmit_mult=4,
                gossip_interval_ms=200,
                gossip_nodes=3,
                gossip_to_the_dead_time_ms=30_000,
                push_pull_interval_ms=30_000,
                tcp_timeout_ms=10_000,
                awareness_max_multiplier=8,
                udp_buffer_size=1400,
            ),
        ),
        (
            Config.wan,
            dict(
                probe_interval_ms=5000,
                probe_timeout_ms=3000,
                indirect_checks=3,
                suspicion_mult=6,
                suspicion_max_timeout_mult=6,
                retransmit_mult=4,
                gossip_interval_ms=500,
                gossip_nodes=4,
                gossip_to_the_dead_time_ms=60_000,
                push_pull_interval_ms=60_000,
                tcp_timeout_ms=30_000,
                awareness_max_multiplier=8,
            ),
        ),
        (
            Config.local,
            dict(
                probe_interval_ms=1000,
                probe_timeout_ms=200,
                indirect_checks=1,
                suspicion_mult=3,
                suspicion_max_timeout_mult=6,
                retransmit_mult=2,
                gossip_interval_ms=100,
                gossip_nodes=3,
                gossip_to_the_dead_time_ms=15_000,
                push_pull_interval_ms=15_000,
                tcp_timeout_ms=1000,
            ),
        ),
    ],
    ids=["lan", "wan", "local"],
)
def test_presets_match_memberlist(preset, expected) -> None:
    config = preset()
    for name, value in expected.items():
        assert getattr(config, name) == value, name
    assert config.lifeguard_lhm and config.lifeguard_dynamic_suspicion
    assert config.lifeguard_nacks and config.lifeguard_buddy
    assert config.enable_compression and not config.disable_tcp_pings
    assert config.dead_node_reclaim_time_ms == 0


def test_presets_take_overrides_and_replace_validates() -> None:
    assert Config.wan(gossip_nodes=7).gossip_nodes == 7
    assert Config.lan().replace(lifeguard_lhm=False).lifeguard_lhm is False
    with pytest.raises(ConfigError):
        Config.lan().replace(probe_timeout_ms=5000)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(probe_timeout_ms=1000), "must be shorter than probe_interval_ms"),
        (dict(probe_interval_ms=0), "probe_interval_ms must be > 0"),
        (dict(probe_interval_ms=-5), ">= 0"),
        (dict(probe_interval_ms=1.5), "must be an integer"),
        (dict(lifeguard_lhm=1), "must be a bool"),
        (dict(suspicion_mult=0), "suspicion_mult must be >= 1"),
        (dict(udp_buffer_size=100), "udp_buffer_size"),
        (dict(udp_buffer_size=70_000), "udp_buffer_size"),
        (dict(protocol_version=1), "protocol_version"),
        (dict(protocol_version=6), "protocol_version"),
        (dict(gossip_nodes=0), "gossip_nodes must be > 0"),
        (dict(delegate_protocol_version=9), "delegate protocol versions"),
        (dict(awareness_max_multiplier=0), "awareness_max_multiplier"),
        (dict(max_members=1), "max_members"),
        (dict(max_stream_bytes=10), "max_stream_bytes"),
    ],
)
def test_invalid_configs_raise_clear_errors(changes, message) -> None:
    with pytest.raises(ConfigError, match=message):
        Config(**changes)


def test_gossip_may_be_disabled() -> None:
    assert Config(gossip_interval_ms=0, gossip_nodes=0).gossip_nodes == 0
