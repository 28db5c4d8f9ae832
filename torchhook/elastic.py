"""The names the elastic hooks had before the engine was composed, as thin functions.

``ElasticDDP(model, optimizer, job=...)`` is ``Elastic(DDP(model, optimizer),
Settings(job=...))``, and likewise for HSDP and FSDP: the keyword arguments are
``Settings`` fields (the strategy's own ones are named). New code can build the engine
directly (docs/training.md shows both).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchhook.engine import Elastic
from torchhook.parallel import DDP
from torchhook.parallel_fsdp import FSDP, Parallelize
from torchhook.parallel_hsdp import HSDP
from torchhook.settings import Settings
from torchhook.state import TrainingState

__all__ = ["ElasticDDP", "ElasticFSDP", "ElasticHSDP"]


def ElasticDDP(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    state: TrainingState | None = None,
    **settings: Any,
) -> Elastic:
    """Elastic DDP over the user's ``model`` and ``optimizer``."""
    return Elastic(DDP(model, optimizer), Settings(**settings), state=state)


def ElasticHSDP(
    build_model: Callable[[], nn.Module],
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    parallelize: Parallelize | None = None,
    **settings: Any,
) -> Elastic:
    """Elastic HSDP: shard within a node (``parallelize``), replicate across nodes."""
    return Elastic(
        HSDP(build_model, build_optimizer, parallelize=parallelize), Settings(**settings)
    )


def ElasticFSDP(
    build_model: Callable[[], nn.Module],
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    checkpoint_dir: Path,
    checkpoint_every: int,
    keep: int = 2,
    parallelize: Parallelize | None = None,
    state: TrainingState | None = None,
    **settings: Any,
) -> Elastic:
    """Elastic FSDP2 with checkpoints (a node's loss rolls back to the newest one)."""
    strategy = FSDP(
        build_model,
        build_optimizer,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        keep=keep,
        parallelize=parallelize,
    )
    return Elastic(strategy, Settings(**settings), state=state)
