"""Protocol configuration with memberlist's presets.

Rules: every field is an integer with its unit in the name, or a flag; every field says
where its default comes from; invalid combinations raise ``ConfigError`` at construction,
so a running node never meets a config it cannot honour.

Sources: hashicorp/memberlist @ 1b4c746 config.go ``DefaultLANConfig``, ``DefaultWANConfig``,
``DefaultLocalConfig``; net.go constants (``MetaMaxSize``, ``maxPushStateBytes``,
``maxPushPullRequests``); serf ``DefaultConfig`` (``MaxQueueDepth`` 4096) for the broadcast
queue bound. Lifeguard switches follow arXiv 1707.00788 §IV (LHA-Probe, LHA-Suspicion, nacks,
buddy system); they exist so the simulator can run the paper's ablation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

META_MAX_BYTES = 512
"""net.go ``MetaMaxSize``: node metadata larger than this is refused."""

PROTOCOL_VERSION_MIN = 1
"""net.go ``ProtocolVersionMin``: the oldest protocol we understand (advertised as PMin)."""
PROTOCOL_VERSION_MAX = 5
"""net.go ``ProtocolVersionMax``: the newest protocol we understand (advertised as PMax)."""


PROFILES = ("lan", "wan", "local", "fast")
"""The presets: memberlist's three, and ours for low-latency clusters."""


class ConfigError(ValueError):
    """A configuration value or combination that the protocol cannot honour."""


@dataclass(frozen=True, slots=True)
class Config:
    """All protocol knobs. Defaults are memberlist's LAN profile (``Config.lan()``)."""

    probe_interval_ms: int = 1000
    """Time between failure probes, before local-health scaling. memberlist ProbeInterval."""
    probe_timeout_ms: int = 500
    """Wait for a direct ack before asking helpers; should be ≥ the 99th-pct RTT (SWIM §4).
    memberlist ProbeTimeout (never scaled by local health, commit 7003fd4)."""
    indirect_checks: int = 3
    """Helpers asked to ping a target indirectly (SWIM k). memberlist IndirectChecks."""
    suspicion_mult: int = 4
    """α: suspicion min = α·max(1, log10 n)·probe interval. memberlist SuspicionMult (LAN 4
    since f5f2aba, after Lifeguard's analysis)."""
    suspicion_max_timeout_mult: int = 6
    """β: suspicion max = β·min (Lifeguard). memberlist SuspicionMaxTimeoutMult."""
    retransmit_mult: int = 4
    """Piggyback limit = mult·ceil(log10(n+1)). memberlist RetransmitMult."""
    gossip_interval_ms: int = 200
    """Dedicated gossip round period (0 disables). memberlist GossipInterval."""
    gossip_nodes: int = 3
    """Peers per gossip round. memberlist GossipNodes."""
    gossip_to_the_dead_time_ms: int = 30_000
    """Keep gossiping to a dead node this long so it can refute; also the reap delay.
    memberlist GossipToTheDeadTime."""
    gossip_to_dead_separately: bool = True
    """Draw gossip targets from live members, plus one recently dead member with
    probability ≈ dead/n (chitchat's rule), instead of memberlist's single draw over both,
    which wastes a broadcast's few transmissions on dead nodes after several failures.
    Ours; off reproduces memberlist exactly."""
    push_pull_interval_ms: int = 30_000
    """Full TCP state sync period before n-scaling (0 disables). memberlist PushPullInterval."""
    tcp_timeout_ms: int = 10_000
    """Deadline for a stream (push-pull, user message) dial+read+write. memberlist TCPTimeout."""
    awareness_max_multiplier: int = 8
    """Local health score ranges 0..max−1; timeouts scale ×(score+1).
    memberlist AwarenessMaxMultiplier."""
    udp_buffer_size: int = 1400
    """Packet budget in bytes, including piggybacked gossip. memberlist UDPBufferSize."""
    disable_tcp_pings: bool = False
    """Skip the TCP fallback ping when UDP probes fail. memberlist DisableTcpPings."""
    dead_node_reclaim_time_ms: int = 0
    """After this long a dead node's name may be reused from another address (0 = never).
    memberlist DeadNodeReclaimTime."""
    enable_compression: bool = True
    """LZW-compress outgoing packets when it helps. memberlist EnableCompression."""
    protocol_version: int = 2
    """Protocol version we speak (PCur), 2..5. memberlist ProtocolVersion2Compatible."""
    delegate_protocol_min: int = 2
    """Delegate versions advertised in Vsn; Serf's values (serf ProtocolVersionMin), so a
    mixed cluster passes memberlist's ``verifyProtocol``."""
    delegate_protocol_max: int = 5
    """serf ProtocolVersionMax."""
    delegate_protocol_version: int = 5
    """DCur as serf 0.9.4 advertises it (Vsn ``01 05 02 02 05 05`` in the golden captures)."""

    reconnect_interval_ms: int = 30_000
    """How often to try a push-pull with one failed member, so a healed partition merges
    back (0 disables). serf ``ReconnectInterval``; attempted with probability
    failed/alive per tick, as serf's ``reconnect`` does."""
    reconnect_timeout_ms: int = 24 * 3600 * 1000
    """How long a failed member is remembered for reconnects. serf ``ReconnectTimeout``."""

    # Lifeguard switches (arXiv 1707.00788 §IV); all on in memberlist.
    lifeguard_lhm: bool = True
    """LHA-Probe: local health multiplier scales probe and ack deadlines."""
    lifeguard_dynamic_suspicion: bool = True
    """LHA-Suspicion: timeout starts at max and decays with independent confirmations."""
    lifeguard_nacks: bool = True
    """Ask indirect helpers for nacks, so a missing nack counts against our own health."""
    lifeguard_buddy: bool = True
    """Buddy system: a ping to a suspect carries the suspicion so it can refute at once."""

    # The fast profile (ours, not memberlist's): Phi-adaptive probe timeouts (swim/rtt.py)
    # and a suspicion window derived from dissemination time. All off in lan/wan/local.
    adaptive_probe_timeout: bool = False
    """Per-peer direct-ack timeout from the phi accrual detector over that peer's RTTs,
    instead of the fixed ``probe_timeout_ms`` (which then applies only until
    ``rtt_min_samples`` exist). Also scaled by local health (Lifeguard §IV-A)."""
    probe_timeout_phi: int = 8
    """Phi at which a missing ack counts as late: a live peer's ack is this late with
    probability ≈ 10^−phi (8: Akka's and Cassandra's conviction threshold)."""
    probe_timeout_min_ms: int = 20
    """Lower bound of the adaptive timeout: keeps a few ms of scheduling noise on a fast
    fabric from sending every probe indirect."""
    probe_timeout_max_ms: int = 500
    """Upper bound of the adaptive timeout; must leave the indirect phase time within the
    probe interval."""
    rtt_window: int = 16
    """Samples the per-peer RTT mean and variance are averaged over (exponential window)."""
    rtt_min_std_ms: int = 5
    """Floor on the RTT deviation in the phi model (Akka ``min-std-deviation``): a peer
    that always answered in exactly 1 ms still gets 1 + 5.2·5 ms at phi 8."""
    rtt_min_samples: int = 4
    """RTT samples a peer needs before its adaptive timeout replaces ``probe_timeout_ms``."""
    derived_suspicion: bool = False
    """Suspicion min = ``suspicion_safety_mult`` · 2 · dissemination time (gossip rounds
    for n members × (gossip interval + half the measured RTT, at most
    ``probe_timeout_max_ms``)): the time a falsely
    suspected member needs to hear the accusation and spread its refutation
    (``formulas.derived_suspicion_timeout_ms``), instead of α·log10(n)·probe interval.
    Max, confirmations (k = suspicion_mult − 2) and the decay stay Lifeguard's."""
    suspicion_safety_mult: int = 2
    """Margin on the derived suspicion window (2: twice the time the refutation needs)."""
    verify_unconfirmed_suspicion: bool = False
    """Before declaring dead a suspect whose timer ran out with fewer than k independent
    confirmations (the accusation rests on too few accusers), send it the accusation with
    a ping, twice; a live member's refutation rides back on its ack and clears the
    suspicion, and only silence for one (adaptive) probe timeout makes it dead. Guards
    against a refutation that gossip failed to bring (one 10%-loss soak run lost one in
    ~700) and against stale accusations held by a member that was paused. Ours; costs one
    probe timeout on the unconfirmed path only."""
    suspicion_verify_copies: int = 2
    """Copies of that last-chance accusation + ping, sent together. A copy is lost when
    its ping or the ack is (1 − (1 − loss)²: 19 % at 10 % loss), so the last chance fails
    for a live member with that to the power of the copies: 3.6 % with 2, 0.13 % with 4.
    In the frontier's ``worst`` condition (10 % loss, heavy jitter) 2 copies let one
    observer in about 16 runs declare a live member dead whose refutation it never got
    (simulations/RESULTS.md §9). Copies cost only small packets, on a path that runs only
    for a suspicion nobody confirmed."""

    recovered_hold_ms: int = 0
    """A member that was suspect, dead or left in our view and came back alive (it refuted
    an accusation, or restarted) less than this long ago has just shown that it is slow
    rather than gone: a suspicion of it runs Lifeguard's maximum window, is not shortened
    by confirmations and ends with the last-chance ping. On a saturated box (a fleet
    booting at once) a busy member answers late while its accusers run on time, and their
    confirmations are no independent evidence. A first join is no such evidence. Costs a
    member that crashes within this time of such a recovery the maximum window instead of
    the confirmed one. 0: off (memberlist). Ours."""
    starved_lag_ms: int = 0
    """A timer handed back this much after its deadline means this node was itself
    descheduled (its process starved of CPU or stopped): for one probe interval after, its
    own health score rises by one (Lifeguard §IV-A: a slow node waits longer before it
    accuses), and a suspicion that runs out while this node was starved since it began is
    held to Lifeguard's maximum window, then given the last-chance ping however many
    confirmed it (a box starved as a whole, such as a fleet starting at once, fails every
    probe at once, so the confirmations are not independent). 0: off (memberlist). Ours."""

    # Faster detection (ours, all off in lan/wan/local, on in fast; measured in
    # simulations/RESULTS.md §9). Each shortens one phase of the detection budget.
    coordinated_probes: bool = False
    """Probe targets from a schedule every member computes alike instead of each member's
    own shuffled round robin: in probe round r (wall-clock time // probe interval) the
    member at position i of the name-sorted ring of live members probes position
    i + 1 + (r mod (n − 1)). Each round is then a permutation, so every member is probed
    once per round (a crashed member waits < 2 intervals for its first probe instead of
    ~4.6 in 1 % of crashes), and over n − 1 rounds everyone probes everyone (SWIM §4.3's
    bound on time to first detection holds). Needs loosely synchronised clocks (NTP's
    milliseconds are plenty); unsynchronised clocks degrade it to a random order."""
    early_probe_conclusion: bool = False
    """A round-robin probe ends as soon as every path it tried has failed (direct timeout
    passed, every helper nacked, the TCP ping refused or failed) instead of waiting for a
    late ack until the end of the probe interval, as urgent probes already do. A live
    member keeps its TCP ping open (or acks), so only a dead process or an unreachable
    host ends a probe early."""
    suspicion_cross_checks: int = 0
    """Expected number of members that probe a suspect at once when they first hear the
    accusation (each with probability cross_checks / (n − 1)); a failed cross-check is an
    independent confirmation (Lifeguard §IV-B), a live suspect refutes on the buddy
    accusation the cross-check carries. 0: off (confirmations wait for the round robin)."""
    verify_confirmed_suspicion: bool = False
    """With ``verify_unconfirmed_suspicion``: the last-chance ping goes to every suspect
    whose window ran out, confirmed or not. Confirmations prove that several members could
    not reach the suspect, not that its refutation reached us: in the frontier's ``worst``
    condition one observer in thousands of suspicions missed a refutation everyone else had
    and declared a live member dead. Costs one adaptive probe timeout per real death."""
    confirmed_suspicion_safety_mult: int = 0
    """With ``derived_suspicion``: once k independent confirmations are in, the window may
    end at ``formulas.derived_suspicion_timeout_ms`` with this safety multiple (1: the
    time the refutation itself needs) instead of the unconfirmed minimum. 0: off
    (Lifeguard's decay ends at min)."""

    small_group_confirmations: bool = False
    """With ``confirmed_suspicion_safety_mult``: a group too small for Lifeguard's k
    confirmations (``n − 2 < suspicion_mult − 2``, e.g. 3 members at α = 4; memberlist then
    sets k to 0 and the window runs for min) expects one from every member that could give
    one (k = n − 2) instead. The timer still starts at min, so a suspicion nobody confirms
    ends as before; once every other member has failed to reach the suspect too, the window
    ends at the confirmed window, as k confirmations end it in a larger group. Ours: at 3
    members it takes a power loss's verdict from ~0.85 to ~0.7 s (the confirmed suspicion
    skips the last-chance ping, as it does in larger groups). 2 members: nobody could
    confirm, no change."""

    # Encryption (only with a keyring). memberlist GossipVerifyIncoming/Outgoing.
    gossip_verify_incoming: bool = True
    """With a keyring: drop input that fails authentication (packets: ``decrypt_failed``,
    plain streams: ``not_encrypted``). False accepts plaintext and packets no key opens
    (read as plaintext), as memberlist does while encryption is being rolled out; never
    leave it off once every member has the key."""
    gossip_verify_outgoing: bool = True
    """With a keyring: encrypt what we send. False sends plaintext (first step of a
    rollout, together with ``gossip_verify_incoming=False`` on every member)."""

    # Limits (TigerBeetle-style: everything is bounded).
    max_members: int = 65_536
    """Member table bound; alive messages for new members beyond it are dropped, counted."""
    max_broadcast_queue: int = 4096
    """Queued broadcasts kept; the most-transmitted are pruned beyond it (serf MaxQueueDepth)."""
    max_push_pull_nodes: int = 65_536
    """Node states accepted in one push-pull (memberlist allows 1 Mi; we bound it lower)."""
    max_stream_bytes: int = 20 * 1024 * 1024
    """Largest stream payload accepted. net.go ``maxPushStateBytes``."""
    max_pending_relays: int = 1024
    """Indirect-ping requests we relay at once; more are dropped and counted."""
    max_user_msg_bytes: int = 20 * 1024 * 1024
    """Largest user message over a stream. net.go ``maxUserMsgBytes``."""

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def lan(cls, **overrides: Any) -> Config:
        """memberlist ``DefaultLANConfig``: 1 s probes, α=4, β=6, 200 ms gossip to 3 nodes."""
        return cls(**overrides)

    @classmethod
    def wan(cls, **overrides: Any) -> Config:
        """memberlist ``DefaultWANConfig``: 5 s probes with a 3 s timeout, α=6, 500 ms gossip
        to 4 nodes, 60 s push-pull, 30 s TCP timeout."""
        values: dict[str, Any] = {
            "probe_interval_ms": 5000,
            "probe_timeout_ms": 3000,
            "suspicion_mult": 6,
            "gossip_interval_ms": 500,
            "gossip_nodes": 4,
            "gossip_to_the_dead_time_ms": 60_000,
            "push_pull_interval_ms": 60_000,
            "tcp_timeout_ms": 30_000,
        }
        values.update(overrides)
        return cls(**values)

    @classmethod
    def local(cls, **overrides: Any) -> Config:
        """memberlist ``DefaultLocalConfig``: 200 ms probe timeout, 1 indirect check, α=3,
        retransmit mult 2, 100 ms gossip, 15 s push-pull, 1 s TCP timeout."""
        values: dict[str, Any] = {
            "probe_timeout_ms": 200,
            "indirect_checks": 1,
            "suspicion_mult": 3,
            "retransmit_mult": 2,
            "gossip_interval_ms": 100,
            "gossip_to_the_dead_time_ms": 15_000,
            "push_pull_interval_ms": 15_000,
            "tcp_timeout_ms": 1000,
        }
        values.update(overrides)
        return cls(**values)

    @classmethod
    def fast(cls, **overrides: Any) -> Config:
        """Ours, for one low-latency LAN (a GPU cluster): 250 ms probes with Phi-adaptive
        per-peer timeouts (20–125 ms), 3 indirect checks, gossip every 50 ms to 4 members,
        a suspicion window derived from dissemination time (0.85 s at 64 members, up to
        β = 4 times that without confirmations, half of it with k confirmations) and a
        last-chance ping to a suspect nobody confirmed; and probe rounds
        coordinated across members, probes that end when every path failed, and four
        cross-checks of each fresh accusation. A crash is dead everywhere in ~0.7 s at 64
        members (simulator; p99 ≤ 1.3 s up to 20 % loss); a member that stalls for more
        than ~0.5 s is declared dead too. Every choice and its measurement:
        simulations/RESULTS.md §5 and §9, BENCHMARKS.md."""
        values: dict[str, Any] = {
            "probe_interval_ms": 250,
            "probe_timeout_ms": 100,
            "adaptive_probe_timeout": True,
            "probe_timeout_min_ms": 20,
            "probe_timeout_max_ms": 125,
            "suspicion_max_timeout_mult": 4,
            "derived_suspicion": True,
            "verify_unconfirmed_suspicion": True,
            "suspicion_verify_copies": 4,
            "coordinated_probes": True,
            "early_probe_conclusion": True,
            "suspicion_cross_checks": 4,
            "confirmed_suspicion_safety_mult": 1,
            "small_group_confirmations": True,
            "starved_lag_ms": 250,
            "recovered_hold_ms": 30_000,
            "gossip_interval_ms": 50,
            "gossip_nodes": 4,
            "gossip_to_the_dead_time_ms": 15_000,
            "push_pull_interval_ms": 30_000,
            "tcp_timeout_ms": 2000,
        }
        values.update(overrides)
        return cls(**values)

    @classmethod
    def profile(cls, name: str, **overrides: Any) -> Config:
        """The preset called ``name`` (one of ``PROFILES``), with overrides."""
        if name not in PROFILES:
            raise ConfigError(f"unknown profile {name!r} (one of {', '.join(PROFILES)})")
        preset: Any = getattr(cls, name)
        return preset(**overrides)  # type: ignore[no-any-return]

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed, validated like a new config."""
        return dataclasses.replace(self, **changes)


def _validate(c: Config) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        if f.type in ("bool", bool):
            need(isinstance(value, bool), f"{f.name} must be a bool, got {value!r}")
        else:
            need(
                isinstance(value, int) and not isinstance(value, bool),
                f"{f.name} must be an integer, got {value!r}",
            )
            need(value >= 0, f"{f.name} must be >= 0, got {value}")
    need(c.probe_interval_ms > 0, "probe_interval_ms must be > 0")
    need(c.probe_timeout_ms > 0, "probe_timeout_ms must be > 0")
    need(
        c.probe_timeout_ms < c.probe_interval_ms,
        f"probe_timeout_ms ({c.probe_timeout_ms}) must be shorter than probe_interval_ms "
        f"({c.probe_interval_ms}): the indirect and TCP phases run in the rest of the interval",
    )
    need(c.suspicion_mult >= 1, "suspicion_mult must be >= 1")
    need(c.suspicion_max_timeout_mult >= 1, "suspicion_max_timeout_mult must be >= 1")
    need(c.retransmit_mult >= 1, "retransmit_mult must be >= 1")
    need(c.awareness_max_multiplier >= 1, "awareness_max_multiplier must be >= 1")
    need(
        c.gossip_interval_ms == 0 or c.gossip_nodes > 0,
        "gossip_nodes must be > 0 when gossip_interval_ms is set",
    )
    need(
        512 <= c.udp_buffer_size <= 65_507,
        f"udp_buffer_size must be within 512..65507 bytes, got {c.udp_buffer_size}",
    )
    need(
        2 <= c.protocol_version <= PROTOCOL_VERSION_MAX,
        f"protocol_version must be within 2..{PROTOCOL_VERSION_MAX}, got {c.protocol_version}",
    )
    need(
        c.delegate_protocol_min <= c.delegate_protocol_version <= c.delegate_protocol_max,
        "delegate protocol versions must satisfy min <= version <= max",
    )
    need(c.delegate_protocol_max <= 255, "delegate protocol versions must fit in a byte")
    need(c.tcp_timeout_ms > 0, "tcp_timeout_ms must be > 0")
    need(c.probe_timeout_phi >= 1, "probe_timeout_phi must be >= 1")
    need(c.rtt_window >= 1, "rtt_window must be >= 1")
    need(c.rtt_min_samples >= 1, "rtt_min_samples must be >= 1")
    need(c.suspicion_safety_mult >= 1, "suspicion_safety_mult must be >= 1")
    if c.adaptive_probe_timeout:
        need(
            0 < c.probe_timeout_min_ms <= c.probe_timeout_max_ms < c.probe_interval_ms,
            "adaptive probe timeouts need 0 < probe_timeout_min_ms "
            f"({c.probe_timeout_min_ms}) <= probe_timeout_max_ms ({c.probe_timeout_max_ms}) "
            f"< probe_interval_ms ({c.probe_interval_ms})",
        )
    if c.derived_suspicion:
        need(c.gossip_interval_ms > 0, "derived_suspicion needs gossip_interval_ms > 0")
    need(
        c.confirmed_suspicion_safety_mult == 0 or c.derived_suspicion,
        "confirmed_suspicion_safety_mult needs derived_suspicion",
    )
    need(
        c.confirmed_suspicion_safety_mult <= c.suspicion_safety_mult,
        f"confirmed_suspicion_safety_mult ({c.confirmed_suspicion_safety_mult}) must not "
        f"exceed suspicion_safety_mult ({c.suspicion_safety_mult})",
    )
    need(
        not c.small_group_confirmations or c.confirmed_suspicion_safety_mult > 0,
        "small_group_confirmations needs confirmed_suspicion_safety_mult > 0 (the window the "
        "confirmations end at)",
    )
    need(c.suspicion_cross_checks <= 16, "suspicion_cross_checks must be <= 16")
    need(
        1 <= c.suspicion_verify_copies <= 8,
        f"suspicion_verify_copies must be 1..8 (is {c.suspicion_verify_copies})",
    )
    need(
        not c.verify_confirmed_suspicion or c.verify_unconfirmed_suspicion,
        "verify_confirmed_suspicion needs verify_unconfirmed_suspicion",
    )
    need(c.max_members >= 2, "max_members must be >= 2")
    need(c.max_broadcast_queue >= 1, "max_broadcast_queue must be >= 1")
    need(c.max_push_pull_nodes >= 1, "max_push_pull_nodes must be >= 1")
    need(c.max_stream_bytes >= 1024, "max_stream_bytes must be >= 1024")
