"""Global ranks in a job's view: the trainers' own numbering where they published it.

The job's trainers decide which node holds which slot of the training group
(torchhook/roster.py): a hot spare that replaces a failed node takes that node's slot and
global ranks, the survivors keep theirs. Join order alone cannot tell, so every training
node publishes its slot's first global rank beside its job tag, and the view uses it.

The rank tag, one per job and node, set by the node's agent from local rank 0's ``group``
frame (``{"group": str, "rank": int}``, the node's first global rank in that group):

    key   ``swim.rank/<job>``
    value ``<first_rank>`` (ASCII digits, ``0..MAX_FIRST_RANK``)

- Published and removed together with the job tag (one metadata update), so a node's rank
  always belongs to the group token in its job tag. A ``group`` frame without ``rank`` (a
  trainer before published ranks, or a node leaving its group) removes it; so does a
  spare's role and a broken registration.
- Compatibility: a separate key, because an older agent's job tag parser
  (``JobTag.decode``) takes only 4, 5 or 6 fields with a known role in the sixth and
  ignores any other value as malformed: an extra field would make older agents drop the
  node from the job. Older agents read only the ``swim.job/`` keys (``job_members`` looks
  up its job's key, ``summaries`` skips keys outside that prefix), so they ignore this one
  and keep numbering in join order; a newer agent reading nodes without it falls back to
  join order too. An older agent ignores the ``rank`` field of a ``group`` frame.
- Size: key at most 74 bytes (a 64-character job name), value at most 7 digits; a change
  that would not fit the node's 512-byte metadata publishes the job tag alone (the view
  then numbers in join order), never refuses the group.

Numbering (``number``): the published ranks count where every training node of the view
published one, all of them in the same (non-empty) group, and their ranges tile
``0..world-1`` without a gap or an overlap; otherwise (an older agent or trainer anywhere,
a node just registered, neither in the group nor a spare yet, or a re-formation in
flight: some nodes already in the new group, some not) the view
numbers the training nodes in join order, as before. ``RANKS_FROM_TRAINERS`` or
``RANKS_FROM_JOIN_ORDER`` says which rule gave the numbers. Spares have no global ranks.

Pure: no trio, no sockets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from agent.control import MAX_TARGET_NODES, ROLE_TRAINING, JobMember
from agent.job_tag import MAX_LOCAL_RANKS

__all__ = [
    "MAX_FIRST_RANK",
    "RANKS_FROM_JOIN_ORDER",
    "RANKS_FROM_TRAINERS",
    "RANK_TAG_PREFIX",
    "check_first_rank",
    "decode_first_rank",
    "encode_first_rank",
    "number",
    "rank_key",
]

RANK_TAG_PREFIX = "swim.rank/"
MAX_FIRST_RANK = MAX_TARGET_NODES * MAX_LOCAL_RANKS - 1
"""The largest first global rank: a job's most training nodes times a node's most local
ranks (7 digits in the tag)."""
RANKS_FROM_TRAINERS = "trainers"
RANKS_FROM_JOIN_ORDER = "join order"


def rank_key(job: str) -> str:
    return RANK_TAG_PREFIX + job


def check_first_rank(value: object) -> int:
    """A valid first global rank, else ``ValueError`` naming the field."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_FIRST_RANK:
        raise ValueError(f"rank must be an int in 0..{MAX_FIRST_RANK}, got {value!r}"[:200])
    return value


def encode_first_rank(first: int) -> str:
    return str(check_first_rank(first))


def decode_first_rank(value: object) -> int | None:
    """A peer's rank tag value; a malformed one (hostile or a future format) is ignored."""
    if not isinstance(value, str) or not (value.isascii() and value.isdigit()) or len(value) > 7:
        return None
    first = int(value)
    return first if first <= MAX_FIRST_RANK else None


def number(
    members: Sequence[JobMember], published: Mapping[str, int]
) -> tuple[list[JobMember], str]:
    """``members`` (join-age order) with ``first_rank`` set on the training nodes, and the
    rule that numbered them (module docstring). ``published``: first ranks by node name."""
    training = [m for m in members if m.role == ROLE_TRAINING]
    if _trusted(training, published):
        firsts, source = {m.name: published[m.name] for m in training}, RANKS_FROM_TRAINERS
    else:
        firsts, source, first = {}, RANKS_FROM_JOIN_ORDER, 0
        for m in training:
            firsts[m.name] = first
            first += m.ranks
    return [replace(m, first_rank=firsts.get(m.name)) for m in members], source


def _trusted(training: list[JobMember], published: Mapping[str, int]) -> bool:
    if not training or any(m.name not in published for m in training):
        return False
    if len({m.group for m in training}) != 1 or not training[0].group:
        return False  # ranks from different formations are never mixed
    expected = 0
    for first, ranks in sorted((published[m.name], m.ranks) for m in training):
        if first != expected:
            return False  # a gap or an overlap: some node's rank is stale
        expected += ranks
    return True
