"""Which storage a save or a load uses, and the rank number of a rank that works alone.

:func:`writer_for` / :func:`reader_for` hand back the caller's storage (reset
to the ``checkpoint_id``) or pick the first storage class that takes the id
(an object-store URL, then a filesystem path). :func:`rank_alone` is the rank
a save or load without collectives in a job of several ranks runs as (its
rank-local metadata file is named after it).
"""

from __future__ import annotations

from typing import Any

from hyper_parallel import platform
from hyper_parallel.core.distributed_checkpoint._fsspec_reader import FsspecReader
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import FsspecWriter
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.filesystem_reader import FileSystemReader
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointId, StorageReader, StorageWriter

__all__ = ["WRITER_CLASSES", "READER_CLASSES", "writer_for", "reader_for", "rank_alone"]

#: Storage classes tried in order when only a ``checkpoint_id`` is given.
WRITER_CLASSES: list[type[StorageWriter]] = [FsspecWriter, FileSystemWriter]
READER_CLASSES: list[type[StorageReader]] = [FsspecReader, FileSystemReader]


def rank_alone(no_dist: bool, use_collectives: bool) -> int | None:
    """This rank's number when it saves or loads on its own in a job of several ranks."""
    if no_dist or use_collectives or platform.get_world_size() <= 1:
        return None
    return platform.get_rank()


def _pick(checkpoint_id: CheckpointId | None, storage: Any, classes: list[type], kind: str, verb: str) -> Any:
    if storage is not None:
        if checkpoint_id is not None:
            storage.reset(checkpoint_id)
        return storage
    if checkpoint_id is None:
        raise CheckpointValueError(f"{verb} needs a checkpoint_id (a directory path) or a {kind}")
    for cls in classes:
        if cls.validate_checkpoint_id(checkpoint_id):
            return cls(checkpoint_id)
    raise CheckpointValueError(
        f"checkpoint_id {checkpoint_id!r} is not a filesystem path nor a storage URL this installation "
        f"handles; pass a directory path or a {kind}"
    )


def writer_for(checkpoint_id: CheckpointId | None, storage_writer: StorageWriter | None) -> StorageWriter:
    """The caller's writer (reset to ``checkpoint_id``), or the first storage that takes the id."""
    return _pick(checkpoint_id, storage_writer, WRITER_CLASSES, "storage_writer", "save")


def reader_for(checkpoint_id: CheckpointId | None, storage_reader: StorageReader | None) -> StorageReader:
    """The caller's reader (reset to ``checkpoint_id``), or the first storage that takes the id."""
    return _pick(checkpoint_id, storage_reader, READER_CLASSES, "storage_reader", "load")
