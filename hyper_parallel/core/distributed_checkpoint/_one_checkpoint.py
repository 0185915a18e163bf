"""Every rank of a collective save or load names the same checkpoint.

A collective save is one checkpoint written by every rank: the coordinator
commits the metadata in its own directory, listing every rank's files. A rank
given another ``checkpoint_id`` (a per-rank path: the rank or a timestamp in
it) wrote its files elsewhere, and the save used to commit, on every rank, a
checkpoint whose metadata lists files its directory does not hold. The first
step of a save (and of a load) now carries each rank's checkpoint location,
and the coordinator refuses when they differ. Local paths are compared
resolved (``os.path.realpath``), URLs as written.
"""

from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError

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
    text = None if location is None else os.fspath(location)
    if text is not None:
        text = text.rstrip("/") if "://" in text else os.path.realpath(text)
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
        if len(ranks) > 1:
            shown = "; ".join(f"ranks {held} to {location}" for location, held in
                              sorted(ranks.items(), key=lambda pair: pair[1][0])[:8])
            raise CheckpointValueError(
                f"the ranks of one collective {action} name {len(ranks)} different checkpoints ({shown}): "
                f"{_WHY[action]}"
            )
        return merge([message for _, message in messages])

    return checked
