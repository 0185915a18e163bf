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
from typing import Any, Callable, Hashable, Sequence, TypeVar

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointNotFoundError, CheckpointValueError

__all__ = ["sent_with_location", "same_save_location", "one_save_read"]

_T = TypeVar("_T")
_R = TypeVar("_R")
_K = TypeVar("_K", bound=Hashable)

#: Locations a refusal names; the others are counted.
_SHOWN = 8


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


def same_save_location(merge: Callable[[list[_T]], _R]) -> Callable[[list[tuple[str | None, _T]]], _R]:
    """``merge`` of the messages :func:`sent_with_location` made, once every rank named the same location.

    Coordinator only, at a save's first step. A storage without a ``path`` (a custom one) is not compared.

    Raises:
        CheckpointValueError: ranks name different locations (names them, with their ranks, and the fix).
    """

    def checked(messages: list[tuple[str | None, _T]]) -> _R:
        places = _places(messages)
        if len(places) > 1:
            raise _refusal(places, action="save", fix=(
                "the coordinator would commit its directory listing files the others wrote elsewhere. Pass every "
                "rank the same checkpoint_id (no rank number or clock reading in it), or use_collectives=False for "
                "rank-local saves"))
        return merge([part for _, part in messages])

    return checked


def one_save_read(messages: list[tuple[str | None, str | None]]) -> list[None]:
    """Refuse a load whose ranks read metadata of different saves; a ``None`` part for every rank. Coordinator.

    ``messages``: each rank's :func:`sent_with_location` message of the save id it read. Ranks reading one
    save at different locations (copies of it) load one checkpoint.

    Raises:
        CheckpointValueError: the ranks name different locations holding different saves (names the locations).
        CheckpointNotFoundError: one location held two saves in turn (replaced while the ranks read it).
    """
    saves = _ranks_by([save_id for _, save_id in messages])
    if len(saves) <= 1:
        return [None] * len(messages)
    places = _places(messages)
    if len(places) > 1:
        raise _refusal(places, action="load", fix=(
            "each rank would load another checkpoint into one job's state. Pass every rank the same checkpoint_id, "
            "or use_collectives=False to load rank-local checkpoints"))
    seen = "; ".join(f"save {save_id} on ranks {holders}" for save_id, holders in saves.items())
    raise CheckpointNotFoundError(
        f"the checkpoint was replaced by another save while the ranks read its metadata ({seen}): loading on "
        "would mix the two saves across ranks. Load again once no save to this checkpoint id runs"
    )


def _ranks_by(values: Sequence[_K]) -> dict[_K, list[int]]:
    """The ranks giving each value (a rank's value at its position), in order of their first rank."""
    ranks: dict[_K, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    return ranks


def _places(messages: list[tuple[str | None, Any]]) -> dict[str | None, list[int]]:
    """The ranks naming each checkpoint location; a storage without a ``path`` (a custom one) is not compared."""
    places = _ranks_by([location for location, _ in messages])
    places.pop(None, None)
    return places


def _refusal(places: dict[str | None, list[int]], *, action: str, fix: str) -> CheckpointValueError:
    """The error naming the locations the ranks of one collective ``action`` gave, and ``fix``."""
    shown = "; ".join(f"ranks {held} to {location}" for location, held in list(places.items())[:_SHOWN])
    more = f"; and {len(places) - _SHOWN} more" if len(places) > _SHOWN else ""
    return CheckpointValueError(
        f"the ranks of one collective {action} name {len(places)} different checkpoints ({shown}{more}): {fix}")
