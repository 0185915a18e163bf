"""What the commit of a save hands every rank: a receipt, and the committed metadata read when used.

The committed metadata lists every rank's chunks, so it grows with the world
size; sending it to every rank after the commit made the bytes a
non-coordinator rank receives grow with the world too (the performance
contract forbids it). A save whose writer can read back what it committed (the
filesystem and fsspec writers) therefore sends every rank one small
:class:`CommitReceipt` (the save id and the metadata file) instead. The
coordinator returns the metadata it committed; every other rank returns a
:class:`CommittedMetadataView`, a :class:`.Metadata` that reads the committed
metadata from the checkpoint the first time a field is used (most callers never
use it), and refuses with :class:`.CheckpointNotFoundError` when a later save
has replaced that checkpoint meanwhile.

A multi-rank ``async_save`` (:mod:`._background_commit`) answers its "async
write" step the same way, before its coordinator has committed: there the view
first waits (at most ``HP_CKPT_COLLECTIVE_TIMEOUT`` seconds) until the
checkpoint holds the save, as long as the rank's own results record is still
stored (the coordinator removes the records once its commit is over), and
refuses once the commit is over without the save: never the previous save's
metadata.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from hyper_parallel.core.distributed_checkpoint._fsspec_reader import FsspecReader
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import FsspecWriter
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointNotFoundError,
    CollectiveTimeoutError,
    IncompleteCheckpointError,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_reader import FileSystemReader
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.storage import StorageWriter

__all__ = [
    "CommitReceipt",
    "CommitWait",
    "CommittedMetadataView",
    "commit_answers",
    "metadata_of_answer",
    "metadata_reader_of",
    "receipt_of",
    "record_probe_of",
]

_FIELDS = frozenset(f.name for f in dataclasses.fields(Metadata))
#: First and longest pause between two looks at a checkpoint whose commit is still running.
_POLL_FIRST, _POLL_MAX = 0.005, 0.25
#: While the commit runs, the metadata (up to 64 MiB in-line) is read again at most this often.
_REREAD_SECONDS = 2.0


@dataclass(frozen=True)
class CommitReceipt:
    """What a commit sends every rank in place of the committed metadata.

    Attributes:
        save_id: The committed save's id.
        location: The checkpoint (path or URL), for messages.
    """

    save_id: str
    location: str


def receipt_of(committed: Metadata, *, location: Any) -> CommitReceipt:
    """The receipt of ``committed``, the metadata just committed at ``location``. Coordinator; pure."""
    return CommitReceipt(save_id=committed.storage_meta.save_id, location=str(location))


def metadata_reader_of(writer: StorageWriter) -> Callable[[], Metadata] | None:
    """Reads back the metadata ``writer`` committed (its location now), or ``None`` if unknown. Any rank.

    The filesystem and fsspec writers (subclasses included) commit ``metadata.json``
    where their readers find it; another writer gives ``None`` (its commit sends
    every rank the metadata itself). Rank-local writers give ``None``.
    """
    if not isinstance(writer, FileSystemWriter) or writer.rank_local:
        return None
    if isinstance(writer, FsspecWriter):
        url, filesystem, options = writer.path, writer.fs, dict(writer.storage_options)
        return lambda: FsspecReader(url, filesystem=filesystem, **options).read_metadata()
    path = writer.path
    return lambda: FileSystemReader(path).read_metadata()


def record_probe_of(writer: StorageWriter, *, rank: int, save_id: str) -> Callable[[], bool] | None:
    """Tells whether ``rank``'s results record of ``save_id`` is still stored at ``writer``'s location now. Any rank.

    The coordinator's background commit removes every rank's record once it
    is over (committed or failed), after writing the metadata. ``None`` for
    writers :func:`metadata_reader_of` gives ``None``. Nothing is read until called.
    """
    if metadata_reader_of(writer) is None:
        return None
    if isinstance(writer, FsspecWriter):
        url, filesystem, options = writer.path, writer.fs, dict(writer.storage_options)
        return lambda: FsspecWriter(url, filesystem=filesystem, **options).read_rank_record(
            rank, save_id=save_id) is not None
    path = writer.path
    return lambda: FileSystemWriter(path).read_rank_record(rank, save_id=save_id) is not None


@dataclass(frozen=True)
class CommitWait:
    """How a view waits for a commit still running in the background (:mod:`._background_commit`).

    Attributes:
        pending: Whether the commit may still run (this rank's results record is still stored).
        rank: This rank, for messages.
        timeout: Seconds to wait at most (``None``: forever).
    """

    pending: Callable[[], bool]
    rank: int
    timeout: float | None


def commit_answers(committed: Metadata, *, world_size: int, location: Any,
                   read_back: Callable[[], Metadata] | None) -> list[Metadata | CommitReceipt]:
    """What the commit sends each rank: one receipt for all, or (no ``read_back``) the metadata. Coordinator; pure.

    Every rank gets the same object, so it goes out as one broadcast (a scatter
    would pad each rank's row to the longest part).
    """
    answer = committed if read_back is None else receipt_of(committed, location=location)
    return [answer] * world_size


def metadata_of_answer(answer: Metadata | CommitReceipt, *, read_back: Callable[[], Metadata] | None,
                       wait: CommitWait | None = None) -> Metadata:
    """What a rank other than the coordinator returns for the commit's ``answer``. Non-coordinators; pure.

    The metadata itself when it was sent, else a :class:`CommittedMetadataView`
    of the receipt (``wait``: the commit may still run in the background).
    """
    if not isinstance(answer, CommitReceipt):
        return answer
    assert read_back is not None, "a receipt answers only writers that read back their commit"
    return CommittedMetadataView(answer, read_back, wait=wait)


def _itself(metadata: Metadata) -> Metadata:
    """A view unpickles as the metadata it read."""
    return metadata


class CommittedMetadataView(Metadata):
    """The committed metadata of a save, read from its checkpoint when a field is first used. Non-coordinators.

    It is a :class:`.Metadata` (fields, ``==``, ``replace``, pickling behave
    as the metadata read). Reading it is :meth:`.StorageReader.read_metadata`
    of the checkpoint, once; no collectives. With ``wait`` (an async save
    whose commit runs in the background) the first use waits until the
    checkpoint holds the save while ``wait.pending()`` says the commit may
    still run.

    Args:
        receipt: The commit's receipt.
        read: Reads the checkpoint's committed metadata (a reader's ``read_metadata``).
        wait: How to wait for a commit still running; ``None``: the commit is over.
        fields: Instead of the three above, the fields of a metadata (``dataclasses.replace`` of a view makes
            one so): that metadata, nothing read.

    Raises (on first use):
        CheckpointNotFoundError: the checkpoint now holds another save, or none
            (names the checkpoint and both save ids); with ``wait``, once the
            commit is over without the save (it failed, or a later save replaced it).
        CollectiveTimeoutError: with ``wait``, the commit still ran after ``wait.timeout`` seconds.
    """

    # pylint: disable=super-init-not-called  # the fields come from the checkpoint, on first use
    def __init__(self, receipt: CommitReceipt | None = None, read: Callable[[], Metadata] | None = None, *,
                 wait: CommitWait | None = None, **fields: Any) -> None:
        object.__setattr__(self, "_receipt", receipt)
        object.__setattr__(self, "_read", read)
        object.__setattr__(self, "_wait", wait)
        object.__setattr__(self, "_loaded", Metadata(**fields) if fields else None)  # dataclasses.replace(view)
        object.__setattr__(self, "_lock", threading.Lock())

    def __getattribute__(self, name: str) -> Any:
        if name in _FIELDS:
            return getattr(object.__getattribute__(self, "committed")(), name)
        return object.__getattribute__(self, name)

    def committed(self) -> Metadata:
        """The committed metadata (read on the first call). Any rank.

        Raises:
            CheckpointNotFoundError: the checkpoint now holds another save, or none.
            CollectiveTimeoutError: the background commit did not end in time.
        """
        loaded = object.__getattribute__(self, "_loaded")
        if loaded is not None:
            return loaded
        receipt: CommitReceipt = object.__getattribute__(self, "_receipt")
        read: Callable[[], Metadata] = object.__getattribute__(self, "_read")
        wait: CommitWait | None = object.__getattribute__(self, "_wait")
        with object.__getattribute__(self, "_lock"):
            loaded = object.__getattribute__(self, "_loaded")
            if loaded is None:
                loaded = _read_committed(receipt, read) if wait is None else _await_committed(receipt, read, wait)
                object.__setattr__(self, "_loaded", loaded)
        return loaded

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CommittedMetadataView):
            other = other.committed()
        return self.committed() == other

    __hash__ = None  # type: ignore[assignment]  # as Metadata's (its dict field is unhashable)

    def __repr__(self) -> str:
        return repr(self.committed())

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickled and copied as the metadata read
        return _itself, (self.committed(),)

    def replace(self, **changes: Any) -> Metadata:
        """A copy of the committed metadata with ``changes`` applied. Any rank."""
        return self.committed().replace(**changes)


def _read_committed(receipt: CommitReceipt, read: Callable[[], Metadata]) -> Metadata:
    """The metadata of the receipt's save, whose commit is over: read once, refused if replaced."""
    try:
        loaded = read()
    except (CheckpointNotFoundError, IncompleteCheckpointError) as exc:
        raise CheckpointNotFoundError(
            f"the metadata of save {receipt.save_id} of checkpoint {receipt.location} is gone ({exc}): "
            "the checkpoint was deleted after this save committed. Keep the metadata the coordinator "
            "returns, or read it with dcp.read_metadata before the checkpoint is replaced"
        ) from exc
    found = loaded.storage_meta.save_id
    if found != receipt.save_id:
        raise CheckpointNotFoundError(
            f"the metadata of save {receipt.save_id} of checkpoint {receipt.location} is gone: a later "
            f"save ({found}) replaced it before this rank used the metadata save() returned. Use the "
            "metadata right after the save, or read the checkpoint again with dcp.read_metadata"
        )
    return loaded


def _read_if_committed(read: Callable[[], Metadata]) -> Metadata | None:
    """The checkpoint's committed metadata, or ``None`` while it holds none."""
    try:
        return read()
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        return None


def _await_committed(receipt: CommitReceipt, read: Callable[[], Metadata], wait: CommitWait) -> Metadata:
    """The metadata of the receipt's save once its background commit wrote it; refused if it never will.

    Each look first asks whether the commit may still run, then reads the
    metadata: the commit writes the metadata before it removes the records,
    so metadata without the save, read after the commit was over, is final.
    While the commit runs, the metadata is read on the first look and then
    every :data:`_REREAD_SECONDS` only (a record its commit failed to remove
    delays the answer by that much, not until the timeout).
    """
    deadline = None if wait.timeout is None else time.monotonic() + wait.timeout
    pause, last_read = _POLL_FIRST, None
    while True:
        running = wait.pending()
        now = time.monotonic()
        if running and last_read is not None and now - last_read < _REREAD_SECONDS:
            found = None  # not read again yet
        else:
            last_read = now
            found = _read_if_committed(read)
            if found is not None and found.storage_meta.save_id == receipt.save_id:
                return found
        if not running:
            holds = "no committed save" if found is None else f"save {found.storage_meta.save_id}"
            raise CheckpointNotFoundError(
                f"rank {wait.rank}: the metadata async_save returned for save {receipt.save_id} of checkpoint "
                f"{receipt.location} is not there: its background commit on rank 0 is over and the checkpoint holds "
                f"{holds}. Either that commit failed (this step is not saved: the next collective step, e.g. "
                "dcp.load, the next save or CheckpointManager.wait(), raises its cause on every rank; save the step "
                "again once it is fixed) or a later save replaced the checkpoint (use the metadata before the next "
                "save, or read the checkpoint again with dcp.read_metadata)"
            )
        if deadline is not None and time.monotonic() >= deadline:
            raise CollectiveTimeoutError(
                f"rank {wait.rank}: the metadata async_save returned for save {receipt.save_id} of checkpoint "
                f"{receipt.location} was used, but its background commit on rank 0 was still not over after "
                f"{wait.timeout:g} s (rank 0 died or is stuck; this rank's results record is still stored). "
                "HP_CKPT_COLLECTIVE_TIMEOUT sets the wait"
            )
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX)
