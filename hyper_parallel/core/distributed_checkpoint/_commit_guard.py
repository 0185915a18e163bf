"""The guard of a filesystem commit against racing saves: the lease, the compare-and-swap check, the cleanup.

The coordinator of a save holds the directory's save lease
(:mod:`._save_lease`) from its set-up to the end of its cleanup, so a second
save to the same id fails at once with :class:`.ConcurrentSaveError`. At its
set-up it notes the identity of the committed metadata
(:func:`file_signature`); at the commit it checks, compare-and-swap style,
that the committed metadata is still the one it saw and that the lease still
names it (:func:`check_commit`). After the commit it deletes only the files
of the save it replaced (:mod:`._commit_cleanup`), then releases the lease
(:func:`clean_up_after_commit`). A dead save whose stale lease was broken
leaves files that :func:`drop_dead_save` deletes, unless they are committed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable

from hyper_parallel.core.distributed_checkpoint._commit_cleanup import committed_save_id, garbage_files, remove_files
from hyper_parallel.core.distributed_checkpoint._save_lease import LeaseHolder, SaveLease
from hyper_parallel.core.distributed_checkpoint.errors import ConcurrentSaveError

__all__ = ["file_signature", "check_commit", "drop_dead_save", "clean_up_after_commit"]


def file_signature(path: Path) -> tuple[int, ...] | None:
    """Identity of the file at ``path`` (device, inode, size, mtime) or ``None`` if absent: a commit replaces it."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return (-1,)
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, stat.S_IFMT(info.st_mode))


def check_commit(
    directory: Path, name: str, *, lease: SaveLease | None, base: tuple[int, ...] | None, save_id: str
) -> str | None:
    """Compare-and-swap check before the commit; return the save id of the metadata being replaced. Coordinator.

    Args:
        directory: The checkpoint directory.
        name: The metadata file this save commits.
        lease: The save lease this save holds (``None``: none taken).
        base: :func:`file_signature` of the metadata file at set-up.
        save_id: This save's id (in the error texts).

    Raises:
        ConcurrentSaveError: the lease was lost, or another save committed meanwhile.
    """
    if lease is not None and not lease.holds():
        raise ConcurrentSaveError(
            f"checkpoint {directory}: the save lease {lease.path} of this save (save id {save_id}) "
            "was removed or taken by another save while it ran (another process judged it stale, or a "
            "CheckpointManager deleted the directory); nothing was committed: save again"
        )
    if file_signature(directory / name) != base:
        replaced = committed_save_id(directory / name)
        raise ConcurrentSaveError(
            f"checkpoint {directory} was committed by another save (save id {replaced}) while this save "
            f"(save id {save_id}) ran; nothing of this save was committed: save again, or to another id"
        )
    return committed_save_id(directory / name)


def drop_dead_save(
    directory: Path, name: str, dead: LeaseHolder, *, save_id: str, rank: int | None, unlink: Callable[[Path], None]
) -> None:
    """Delete the files of the dead save whose stale lease was broken, unless they are committed. Coordinator.

    Args:
        directory: The checkpoint directory.
        name: The metadata file this save commits.
        dead: The holder of the broken lease.
        save_id: This save's id (its files are kept).
        rank: Only this rank's files (rank-local metadata), or ``None`` for all.
        unlink: Removes one file.
    """
    committed = committed_save_id(directory / name)
    garbage = {dead.save_id, dead.base_save_id} - {committed or "", save_id}
    remove_files(garbage_files(directory, garbage, rank=rank), unlink=unlink)


def clean_up_after_commit(paths: list[Path], lease: SaveLease | None, unlink: Callable[[Path], None]) -> None:
    """Delete the replaced save's files, then release the lease (also when a removal fails). Coordinator."""
    try:
        remove_files(paths, unlink=unlink)
    finally:
        if lease is not None:
            lease.release()
