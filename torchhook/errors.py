"""The elastic engine's errors: which ones re-form the group, which ones stop the job.

Two families, and one rule for everything else:

- **Retryable** (``GroupLost`` and its ``MembershipChanged``): the group failed because a
  member is gone or the view moved on. The engine leaves the group and re-forms, within
  the re-formation budget (``Settings.reform_attempts``, ``reform_timeout_s``).
- **Fatal** (``Fatal`` and its subclasses): retrying cannot help, so the job stops at once
  with a message naming the cause: no surviving copy of a shard (``NoSurvivingCopy``), a
  checkpoint that cannot be saved or loaded (``CheckpointFailed``), out of memory
  (``OutOfMemory``), an exception from the user's step function that is not a group
  failure (``StepFailed``), the budget spent (``ReformBudgetSpent``), this node flagged
  slow under ``slow_policy="exclude"`` (``SlowNodeExcluded``: the rest of the job goes on
  without it).

torch gives real types for some of this (``torch.OutOfMemoryError``, which
``torch.cuda.OutOfMemoryError`` is; ``torch.distributed.DistError`` and its subclasses for
store and network failures): those are matched by type. Gloo raises a plain
``RuntimeError`` whose text says that a peer is gone, and an interrupted DDP comm hook
surfaces as ``RuntimeError: Unable to cast ... to Tensor`` (docs/training.md §5, fact 7);
the text match lives in :func:`is_group_failure` alone, over :data:`GROUP_FAILURE_TEXT`,
and tests/torchhook/test_elastic_errors.py runs every row of that table.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "GROUP_FAILURE_TEXT",
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
    "classify",
    "is_group_failure",
]


class ElasticError(Exception):
    """Every error the elastic engine raises on purpose."""


class GroupLost(ElasticError, RuntimeError):
    """Retryable: the process group failed because a member is gone. A ``RuntimeError``
    too, as gloo's own errors are, so code that caught those keeps working."""


class MembershipChanged(GroupLost):
    """Retryable: a collective was abandoned because the view dropped a member."""


class Fatal(ElasticError):
    """Retrying cannot help: the job stops with this message."""


class NoSurvivingCopy(Fatal):
    """HSDP: no node holds some shard at the newest step; restart from a checkpoint."""


class CheckpointFailed(Fatal):
    """A checkpoint could not be saved or loaded for a reason other than a lost peer."""


class SlowNodeExcluded(Fatal):
    """This node was flagged slow with ``slow_policy="exclude"``: it has left the job (its
    registration is closed) and the other nodes re-form without it."""


class SpareWaitOver(Fatal):
    """A spare waited ``spare_wait_s`` without being drafted, or for ``join_timeout_s``
    without the job's view reaching ``target_nodes`` (``spare=True``)."""


class OutOfMemory(Fatal):
    """The device (or host) ran out of memory; the same step would run out again."""


class StepFailed(Fatal):
    """The user's code (step function, model or optimizer factory, ``parallelize``) raised
    something that is not a group failure: a bug, which another try would repeat."""


class ReformBudgetSpent(Fatal):
    """Re-forming the group failed ``reform_attempts`` times or for ``reform_timeout_s``."""


class SettingsError(ValueError):
    """A setting is out of range; the message names it."""


GROUP_FAILURE_TEXT: tuple[tuple[str, str], ...] = (
    ("gloo", "any error from gloo's transport: its errors carry the source path"),
    ("Connection closed by peer", "a peer's process died (its kernel closed the socket)"),
    ("Connection reset by peer", "a peer's host reset the connection"),
    ("Timed out", "an op or a connection ran into the group timeout (a peer stopped)"),
    ("NCCL", "an NCCL communicator error (a peer gone, or the communicator aborted)"),
)
"""(substring, why it means "the group failed") for errors torch gives no type for."""


def is_group_failure(exc: BaseException) -> bool:
    """Does ``exc`` say that the group failed because a member is gone? By type where torch
    has one (``DistError``), else by the text table; never for out-of-memory errors."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if isinstance(exc, (GroupLost, dist.DistError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(mark in text for mark, _ in GROUP_FAILURE_TEXT)


def classify(exc: BaseException, *, verdict: bool, where: str) -> Fatal | None:
    """None if ``exc`` is a group failure to re-form from (``verdict``: the membership
    already broke the group, whatever the exception says: an interrupted DDP hook raises
    an unrelated text), else the ``Fatal`` error to stop with. ``where`` names what ran
    ("the step function", "forming the group")."""
    if isinstance(exc, Fatal):
        return exc
    if isinstance(exc, torch.OutOfMemoryError):
        return OutOfMemory(f"out of memory in {where}: {_first_line(exc)}")
    if verdict or is_group_failure(exc):
        return None
    return StepFailed(f"{where} raised {type(exc).__name__}: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    # torch appends a C++ stack trace to its errors
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__
