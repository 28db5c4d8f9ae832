"""torchhook: elastic PyTorch training on swim's membership.

The public API: the engine (``Elastic``), its settings, the parallelism strategies, the
data it feeds (``ElasticSampler`` and its batch policies, for ``Elastic.data``), the
errors it raises, and the membership client. Everything else in the package is a part of
the engine with its own rules (docs/design.md lists them). Importing the package does not
import torch; the names that need it load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "DDP",
    "FSDP",
    "HSDP",
    "CheckpointFailed",
    "DataExhausted",
    "DataFeed",
    "DataMisuse",
    "Elastic",
    "ElasticDDP",
    "ElasticError",
    "ElasticFSDP",
    "ElasticHSDP",
    "ElasticSampler",
    "Fatal",
    "FixedGlobalBatch",
    "FixedRankBatch",
    "GroupLost",
    "Membership",
    "MembershipChanged",
    "NoSurvivingCopy",
    "OutOfMemory",
    "ReformBudgetSpent",
    "Settings",
    "SettingsError",
    "SlowNodeExcluded",
    "SpareWaitOver",
    "StepFailed",
    "TrainingState",
    "View",
    "World",
    "mesh_dim",
]

_HOMES = {
    "Elastic": "torchhook.engine",
    "ElasticDDP": "torchhook.elastic",
    "ElasticHSDP": "torchhook.elastic",
    "ElasticFSDP": "torchhook.elastic",
    "DDP": "torchhook.parallel",
    "HSDP": "torchhook.parallel_hsdp",
    "FSDP": "torchhook.parallel_fsdp",
    "mesh_dim": "torchhook.parallel_hsdp",
    "Settings": "torchhook.settings",
    "Membership": "torchhook.client",
    "TrainingState": "torchhook.state",
    "ElasticSampler": "torchhook.data",
    "FixedGlobalBatch": "torchhook.batching",
    "FixedRankBatch": "torchhook.batching",
    "DataFeed": "torchhook.feed",
    "DataMisuse": "torchhook.feed",
    "DataExhausted": "torchhook.feed",
    "World": "torchhook.state",
    "View": "torchhook.client",
    **{
        name: "torchhook.errors"
        for name in (
            "CheckpointFailed",
            "ElasticError",
            "Fatal",
            "GroupLost",
            "MembershipChanged",
            "NoSurvivingCopy",
            "OutOfMemory",
            "ReformBudgetSpent",
            "SettingsError",
            "SlowNodeExcluded",
            "SpareWaitOver",
            "StepFailed",
        )
    },
}

if TYPE_CHECKING:
    from torchhook.batching import FixedGlobalBatch, FixedRankBatch
    from torchhook.client import Membership, View
    from torchhook.data import ElasticSampler
    from torchhook.elastic import ElasticDDP, ElasticFSDP, ElasticHSDP
    from torchhook.engine import Elastic
    from torchhook.errors import (
        CheckpointFailed,
        ElasticError,
        Fatal,
        GroupLost,
        MembershipChanged,
        NoSurvivingCopy,
        OutOfMemory,
        ReformBudgetSpent,
        SettingsError,
        SlowNodeExcluded,
        SpareWaitOver,
        StepFailed,
    )
    from torchhook.feed import DataExhausted, DataFeed, DataMisuse
    from torchhook.parallel import DDP
    from torchhook.parallel_fsdp import FSDP
    from torchhook.parallel_hsdp import HSDP, mesh_dim
    from torchhook.settings import Settings
    from torchhook.state import TrainingState, World


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'torchhook' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
