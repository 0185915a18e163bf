"""Every rank of a collective save or load names the same checkpoint.

A collective save is one checkpoint written by every rank: the coordinator
commits the metadata in its own directory, listing every rank's files. A rank
given another ``checkpoint_id`` (a per-rank path: the rank or a timestamp in
it) wrote its files elsewhere, and the save used to commit, on every rank, a
checkpoint whose metadata lists files its directory does not hold. The first
step of a save (and of a load) now carries each rank's checkpoint location,
and the coordinator refuses a save when they differ. Paths are compared as
written (a local ``Path`` made absolute, symlinks kept: one path may resolve
differently on two hosts; an object-store path as given). A load is refused
only when the ranks also read different saves: ranks may each read their own
copy of one save (staged to node-local disks), which is one checkpoint.
"""

from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError, CheckpointValueError

__all__ = ["sent_with_location", "same_location_first"]

_T = TypeVar("_T")
_R = TypeVar("_R")


_WHY = {
    "save": "the coordinator would commit its directory listing files the others wrote elsewhere. Pass every rank "
            "the same checkpoint_id (no rank number or clock reading in it), or use_collectives=False for "
            "rank-local saves",
    "load": "each rank would load another checkpoint into one job's state. Pass every rank the same "
            "checkpoint_id, or use_collectives=False to load rank-local checkpoints",
}


def sent_with_location(storage: Any, local: Callable[[], _T]) -> Callable[[], tuple[str | None, _T]]:
    """``local``, whose message also names ``storage``'s checkpoint location (its ``path``). All ranks."""
    location = getattr(storage, "path", None)
    if location is None:
        text = None
    elif isinstance(location, os.PathLike):
        text = os.path.abspath(os.fspath(location))  # normalised, symlinks kept (as local_directory keeps them)
    else:
        text = str(location).rstrip("/")  # a URL or an fsspec path: as written, never against this rank's cwd
    return lambda: (text, local())


def same_location_first(merge: Callable[[list[_T]], _R], *, action: str) -> Callable[[list[tuple[str | None, _T]]], _R]:
    """``merge`` of the messages :func:`sent_with_location` made, once every rank named the same location.

    Coordinator only. A storage without a ``path`` (a custom one) is not compared.

    Args:
        merge: The step's own coordinator function.
        action: ``"save"`` or ``"load"``, for the message.

    Raises:
        CheckpointValueError: ranks name different locations (names them, with their ranks, and the fix).
    """

    def checked(messages: list[tuple[str | None, _T]]) -> _R:
        ranks: dict[str, list[int]] = {}
        for rank, (location, _) in enumerate(messages):
            if location is not None:
                ranks.setdefault(location, []).append(rank)
        merged = [message for _, message in messages]
        if len(ranks) <= 1:
            return merge(merged)
        shown = "; ".join(f"ranks {held} to {location}" for location, held in
                          sorted(ranks.items(), key=lambda pair: pair[1][0])[:8])
        refusal = CheckpointValueError(
            f"the ranks of one collective {action} name {len(ranks)} different checkpoints ({shown}): {_WHY[action]}")
        if action == "save":
            raise refusal
        try:
            return merge(merged)  # copies of one save at several paths load as one checkpoint
        except CheckpointError as exc:
            raise refusal from exc

    return checked
