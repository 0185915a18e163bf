"""Save ids: the 12 hex digits that name one save's files, and the kind of commit they tell.

docs/format.md (section 3) requires 12 lowercase hex digits, random per save.
The first digit also tells which metadata the save commits (0-7: one per
checkpoint; 8-f: one per rank), so the object-store sweep of one kind of save
keeps off the other kind's files (see :mod:`._object_garbage`).
"""

from __future__ import annotations

import uuid

__all__ = ["commits_per_rank", "new_save_id"]

_PER_RANK_BIT = 1 << 47  # the top bit of the 12 hex digits of a save id


def new_save_id(*, rank_local: bool) -> str:
    """A fresh 12-hex-digit save id whose first digit tells its kind: 8-f for rank-local metadata, 0-7 otherwise."""
    value = uuid.uuid4().int & (2 * _PER_RANK_BIT - 1)
    return f"{value | _PER_RANK_BIT if rank_local else value & ~_PER_RANK_BIT:012x}"


def commits_per_rank(save_id: str) -> bool:
    """Whether the save of ``save_id`` (made by :func:`new_save_id`) commits rank-local metadata."""
    return int(save_id[:1] or "0", 16) >= 8
