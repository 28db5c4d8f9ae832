"""README.md's headline rows: which figures of which result question each row shows, and
what ran beside them in the same run. bench/render.py fills the table from results/;
tests/test_results.py checks that every row links to a section that exists."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HEADLINES", "Headline"]


@dataclass(frozen=True)
class Headline:
    """One row of README.md's headline table: figures of one question, and the figures
    of what ran beside them in the same run (short name, figure key)."""

    label: str
    question: str
    figures: tuple[str, ...]
    peers: tuple[tuple[str, tuple[str, ...]], ...] = ()


DET64 = "detection-64-serf-local-swim-fast-swim-lan"
DETLAN = "detection-8-32-64-serf-lan-swim-lan"
TRAIN = "training-recovery-3x2-fast"
HEADLINES: tuple[Headline, ...] = (
    Headline(
        "`fast`: a crashed agent dead at every survivor (median), 64 agents",
        DET64,
        ("swim-fast-64.last_dead_s",),
        (("serf `local`", ("serf-local-64.last_dead_s",)), ("`lan`", ("swim-lan-64.last_dead_s",))),
    ),
    Headline(
        "`fast`: CPU per agent, 64 agents",
        DET64,
        ("swim-fast-64.cpu_ms",),
        (("serf `local`", ("serf-local-64.cpu_ms",)), ("`lan`", ("swim-lan-64.cpu_ms",))),
    ),
    Headline(
        "`lan` against serf `lan`, 64 agents: dead everywhere (median), CPU",
        DETLAN,
        ("swim-lan-64.last_dead_s", "swim-lan-64.cpu_ms"),
        (("serf `lan`", ("serf-lan-64.last_dead_s", "serf-lan-64.cpu_ms")),),
    ),
    Headline(
        "Training, in-process DDP, early drop off: node SIGKILLed → first step without it (median)",
        TRAIN,
        ("in-process-ddp-kill.total_s",),
        (
            ("torchrun + swim", ("torchrun-swim-kill.total_s",)),
            ("torchrun + c10d", ("torchrun-c10d-kill.total_s",)),
        ),
    ),
    Headline(
        "Training, in-process DDP: node SIGSTOPped → first step without it (median)",
        TRAIN,
        ("in-process-ddp-stop.total_s",),
        (
            ("torchrun + swim", ("torchrun-swim-stop.total_s",)),
            ("torchrun + c10d", ("torchrun-c10d-stop.total_s",)),
        ),
    ),
    Headline(
        "Training, in-process DDP, `fast` with its early drop: node SIGKILLed at a step "
        "boundary → first step without it (median)",
        "training-early-drop-3x2-fast",
        ("in-process-ddp-early-drop-on-kill.total_s",),
        (("early drop off", ("in-process-ddp-early-drop-off-kill.total_s",)),),
    ),
    Headline(
        "Training, in-process DDP, each node in a namespace, `fast` with its stall drop: node "
        "SIGSTOPped, node loses power → first step without it (median)",
        "training-stall-drop-3x2-fast",
        (
            "in-process-ddp-namespaces-stall-drop-on-stop.total_s",
            "in-process-ddp-namespaces-stall-drop-on-power.total_s",
        ),
        (
            (
                "stall drop off",
                (
                    "in-process-ddp-namespaces-stall-drop-off-stop.total_s",
                    "in-process-ddp-namespaces-stall-drop-off-power.total_s",
                ),
            ),
        ),
    ),
    Headline(
        "Training with a hot spare, DDP, each node in a namespace: node loses power → first "
        "step at the same world (median)",
        "training-spares-power-3x2-fast",
        ("in-process-ddp-namespaces-spare-power.total_s",),
    ),
    Headline(
        "Training without a spare, DDP and HSDP, each node in a namespace: node loses power → "
        "first step at the reduced world (median)",
        "training-power-3x2-fast",
        (
            "in-process-ddp-namespaces-small-group-on-power.total_s",
            "in-process-hsdp-namespaces-small-group-on-power.total_s",
        ),
        (
            (
                "`small_group_confirmations` off",
                (
                    "in-process-ddp-namespaces-small-group-off-power.total_s",
                    "in-process-hsdp-namespaces-small-group-off-power.total_s",
                ),
            ),
        ),
    ),
    Headline(
        "Training, in-process HSDP: node SIGKILLed inside backward (median)",
        TRAIN,
        (
            "in-process-hsdp-kill-in-backward.total_s",
            "in-process-hsdp-kill-in-backward.rolled_back",
        ),
    ),
    Headline(
        "Step efficiency, a node killed and restarted every minute",
        "step-efficiency-3x2-fast",
        ("in-process.efficiency",),
        (
            ("torchrun + swim", ("torchrun-swim.efficiency",)),
            ("torchrun + c10d", ("torchrun-c10d.efficiency",)),
        ),
    ),
    Headline(
        "Step efficiency with a hot spare, one fault a minute for an hour (power loss, "
        "SIGKILL, SIGSTOP, a 3× slowdown in turn), each node in a namespace",
        "step-efficiency-mixed-3x2-fast-1spare",
        ("efficiency_between_faults",),
        (
            ("fault → first step at the same world, power loss", ("power.same_world_s",)),
            ("SIGKILL", ("kill.same_world_s",)),
            ("SIGSTOP", ("stop.same_world_s",)),
            ("slowdown", ("slow.same_world_s",)),
        ),
    ),
    Headline(
        "Simulator: 10,000 members for 60 simulated seconds (median wall time)",
        "sim-scale-10000",
        ("wall_s",),
    ),
)
