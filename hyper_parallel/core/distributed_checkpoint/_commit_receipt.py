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
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Callable

from hyper_parallel.core.distributed_checkpoint._fsspec_reader import FsspecReader
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import FsspecWriter
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointNotFoundError, IncompleteCheckpointError
from hyper_parallel.core.distributed_checkpoint.filesystem_reader import FileSystemReader
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.storage import StorageWriter

__all__ = ["CommitReceipt", "CommittedMetadataView", "commit_answers", "metadata_reader_of", "receipt_of"]

_FIELDS = frozenset(f.name for f in dataclasses.fields(Metadata))


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


def commit_answers(committed: Metadata, *, world_size: int, location: Any,
                   read_back: Callable[[], Metadata] | None) -> list[Metadata | CommitReceipt]:
    """What the commit sends each rank: one receipt for all, or (no ``read_back``) the metadata. Coordinator; pure.

    Every rank gets the same object, so it goes out as one broadcast (a scatter
    would pad each rank's row to the longest part).
    """
    answer = committed if read_back is None else receipt_of(committed, location=location)
    return [answer] * world_size


def _itself(metadata: Metadata) -> Metadata:
    """A view unpickles as the metadata it read."""
    return metadata


class CommittedMetadataView(Metadata):
    """The committed metadata of a save, read from its checkpoint when a field is first used. Non-coordinators.

    It is a :class:`.Metadata` (fields, ``==``, ``replace``, pickling behave
    as the metadata read). Reading it is :meth:`.StorageReader.read_metadata`
    of the checkpoint, once; no collectives.

    Args:
        receipt: The commit's receipt.
        read: Reads the checkpoint's committed metadata (a reader's ``read_metadata``).

    Raises (on first use):
        CheckpointNotFoundError: the checkpoint now holds another save, or none
            (names the checkpoint and both save ids).
    """

    # pylint: disable=super-init-not-called  # the fields come from the checkpoint, on first use
    def __init__(self, receipt: CommitReceipt, read: Callable[[], Metadata]) -> None:
        object.__setattr__(self, "_receipt", receipt)
        object.__setattr__(self, "_read", read)
        object.__setattr__(self, "_loaded", None)
        object.__setattr__(self, "_lock", threading.Lock())

    def __getattribute__(self, name: str) -> Any:
        if name in _FIELDS:
            return getattr(object.__getattribute__(self, "committed")(), name)
        return object.__getattribute__(self, name)

    def committed(self) -> Metadata:
        """The committed metadata (read on the first call). Any rank.

        Raises:
            CheckpointNotFoundError: the checkpoint now holds another save, or none.
        """
        loaded = object.__getattribute__(self, "_loaded")
        if loaded is not None:
            return loaded
        receipt: CommitReceipt = object.__getattribute__(self, "_receipt")
        with object.__getattribute__(self, "_lock"):
            loaded = object.__getattribute__(self, "_loaded")
            if loaded is None:
                try:
                    loaded = object.__getattribute__(self, "_read")()
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
