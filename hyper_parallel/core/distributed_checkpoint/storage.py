"""Abstract storage: where plans become bytes and bytes become values.

Writer call order in ``dcp.save``: ``reset`` -> ``set_up_storage_writer`` ->
``prepare_local_plan`` (all ranks) -> ``prepare_global_plan`` (coordinator) ->
``write_data`` (all ranks) -> ``finish`` (coordinator: the commit).

Reader call order in ``dcp.load``: ``reset`` -> ``read_metadata`` ->
``set_up_storage_reader`` -> ``prepare_local_plan`` (all ranks) ->
``prepare_global_plan`` (coordinator) -> ``read_data`` (all ranks).
"""

from __future__ import annotations

import abc
import os
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from hyper_parallel.core.distributed_checkpoint._format.consistency import check_consistency
from hyper_parallel.core.distributed_checkpoint._format.metadata_json import metadata_from_json, metadata_to_json
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, MetadataIndex, StorageInfo
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner

__all__ = [
    "CheckpointId",
    "is_local_path",
    "local_directory",
    "WriteResult",
    "StorageWriter",
    "StorageReader",
    "encode_metadata",
    "decode_metadata",
    "check_metadata",
]

def encode_metadata(metadata: Metadata) -> bytes:
    """The committed form of ``metadata`` (JSON, docs/format.md section 6). Coordinator, in ``finish``.

    A backend stores these bytes as its commit, after every rank's data is durable.
    """
    return metadata_to_json(metadata)


def decode_metadata(data: bytes, *, source: str = "metadata") -> Metadata:
    """Parse and check bytes made by :func:`encode_metadata`. Any rank, in ``read_metadata``.

    Args:
        data: The stored metadata.
        source: Where it came from, named in errors (a path or URL).

    Raises:
        CorruptCheckpointError / UnsafeCheckpointError: malformed or hostile metadata.
    """
    return metadata_from_json(data, source=source)


def check_metadata(metadata: Metadata, *, source: str = "metadata") -> None:
    """Check that the items and storage entries of ``metadata`` match one to one. All ranks, before planning.

    Every chunk and value has exactly one storage entry of the right length
    and digest count, and the chunks of each tensor tile it exactly.

    Raises:
        CorruptCheckpointError: the first mismatch (names ``source`` and the key).
    """
    check_consistency(metadata, source=source)


#: What callers may pass as ``checkpoint_id``.
CheckpointId = Union[str, os.PathLike]


def is_local_path(checkpoint_id: object) -> bool:
    """Whether ``checkpoint_id`` names a local path: any ``os.PathLike``, or a non-empty string without ``://``."""
    if isinstance(checkpoint_id, os.PathLike):
        return True
    return isinstance(checkpoint_id, str) and bool(checkpoint_id) and "://" not in checkpoint_id


def local_directory(checkpoint_id: CheckpointId) -> Path:
    """The absolute path of a local checkpoint id, resolved against the working directory once, when given.

    Any rank; no file access. A relative id names the directory it named when the save, load or manager was
    set up: a script that changes its working directory later (before an async save's background writing, or
    between two saves of a manager) neither writes into nor deletes steps of another directory of that name.
    Symlinks are kept (not resolved).

    Raises:
        CheckpointValueError: the id is relative and the working directory no longer exists (names the id).
    """
    given = os.fspath(checkpoint_id)
    try:
        return Path(os.path.abspath(given))
    except FileNotFoundError as exc:  # os.getcwd() of a deleted directory
        raise CheckpointValueError(
            f"checkpoint id {given!r} is relative, but this process's working directory no longer exists: pass "
            "an absolute path") from exc


@dataclass(frozen=True)
class WriteResult:
    """Where one written item landed.

    Attributes:
        index: The item written.
        size_in_bytes: Bytes written for it.
        storage_data: File, offset, length and checksum.
    """

    index: MetadataIndex
    size_in_bytes: int
    storage_data: StorageInfo


class StorageWriter(abc.ABC):
    """Writes the items of a save plan and commits the checkpoint."""

    @abc.abstractmethod
    def reset(self, checkpoint_id: CheckpointId | None = None) -> None:
        """Start a new save, optionally to a new location. All ranks call it."""

    @abc.abstractmethod
    def set_up_storage_writer(
        self, is_coordinator: bool, *, rank: int = 0, world_size: int = 1, rank_local: bool = False
    ) -> None:
        """Prepare the destination for a new save. All ranks call it.

        Args:
            is_coordinator: Whether this rank commits.
            rank: This rank.
            world_size: Number of ranks saving together.
            rank_local: This rank saves on its own in a job of several ranks
                (``use_collectives=False``): its commit must record only its
                own items, under a name of its own, and must not disturb
                other ranks' checkpoints in the same place.
        """

    @abc.abstractmethod
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Adjust this rank's plan for storage. All ranks call it."""

    @abc.abstractmethod
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Assign storage (file names) to every rank's plan. Coordinator only."""

    @abc.abstractmethod
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[list[WriteResult]]":
        """Write every item of this rank's final plan durably. All ranks call it."""

    @abc.abstractmethod
    def finish(
        self, metadata: Metadata, results: list[list[WriteResult]], *, background_cleanup: bool = False
    ) -> Metadata:
        """Commit: record where everything is, atomically. Coordinator only.

        Until this returns, a reader must not see the new checkpoint; once it
        returns, the checkpoint is complete and durable.

        Args:
            metadata: The metadata built by the planner (no storage data yet).
            results: Every rank's write results, in rank order.
            background_cleanup: Work after the commit (e.g. deleting what an
                older save at the same id left) may run off the caller's
                thread; an async save's commit asks for it.

        Returns:
            The committed metadata (with storage data).
        """

    def abort(self) -> None:  # noqa: B027 - optional hook, nothing to undo by default
        """Undo a save that failed before its commit (its files, its lease). All ranks call it.

        ``save``, ``async_save`` and ``CheckpointManager`` call it on every rank
        when any step failed; it must not raise. The default does nothing.
        """

    def supports_rank_records(self) -> bool:
        """Whether the rank-record methods below work (then a multi-rank ``async_save`` commits in the background).

        A backend without them still works: its multi-rank async saves commit
        in ``result()`` through a collective step. Any rank.
        """
        return False

    def write_rank_record(self, rank: int, data: bytes, *, plan: SavePlan) -> None:
        """Store ``data`` as ``rank``'s results record of the save ``plan`` belongs to, whole or not at all.

        Called by rank ``rank`` itself, on its background thread, after its
        data is durable; ``plan`` is its final plan (its storage data names
        the save, as for ``write_data``). The coordinator must never read a
        partial record; the record itself need not survive a crash.

        Raises:
            NotImplementedError: the backend keeps no records (see :meth:`supports_rank_records`).
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no rank records")

    def read_rank_record(self, rank: int, *, save_id: str | None = None) -> bytes | None:
        """``rank``'s results record of this save, or ``None`` while not stored. Coordinator; a rank: its own.

        ``save_id`` names another save than the writer's current one (a rank
        other than the coordinator looks whether its own record is still
        stored: the coordinator removes the records once its commit is over).

        Raises:
            NotImplementedError: the backend keeps no records.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no rank records")

    def remove_rank_records(self, world_size: int) -> None:  # noqa: B027 - nothing stored by default
        """Delete every rank's record of the current save; never raises. Coordinator, after commit or failure."""

    def committed_metadata(self, metadata: Metadata, results: list[list[WriteResult]]) -> Metadata:
        """The metadata :meth:`finish` commits for ``results``, without storing anything. Coordinator.

        A multi-rank ``async_save`` returns it from ``result()`` while the
        commit may still run in the background (backends with rank records).

        Raises:
            NotImplementedError: the backend keeps no rank records.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no rank records")

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: CheckpointId) -> bool:
        """Tell whether this writer can handle ``checkpoint_id``."""


class StorageReader(abc.ABC):
    """Reads the metadata and the regions of a load plan."""

    @abc.abstractmethod
    def reset(self, checkpoint_id: CheckpointId | None = None) -> None:
        """Start a new load, optionally from a new location. All ranks call it."""

    @abc.abstractmethod
    def read_metadata(self, *, rank: int | None = None) -> Metadata:
        """Read and check the committed metadata. Any rank; no collectives.

        Args:
            rank: Set when this rank loads on its own (``use_collectives=False``
                in a job of several ranks): read the metadata this rank
                committed on its own, if there is one, else the shared one.

        Raises:
            CheckpointNotFoundError: nothing at the checkpoint id.
            IncompleteCheckpointError: no committed metadata.
        """

    @abc.abstractmethod
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        """Take the metadata before planning. All ranks call it."""

    @abc.abstractmethod
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Adjust this rank's plan for storage. All ranks call it."""

    @abc.abstractmethod
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Adjust every rank's plan. Coordinator only."""

    def verify_data(self, plan: LoadPlan) -> "Future[None]":
        """Check every stored byte ``plan`` needs, writing no target. All ranks call it.

        ``load`` calls it on every rank before any ``read_data``, so a load
        that fails on corruption leaves every target as it was. The default
        returns a done future: a reader without a separate check must verify
        inside ``read_data`` before a byte reaches a target.
        """
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @abc.abstractmethod
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        """Read every region of this rank's plan into the planner. All ranks call it."""

    def finish_load(self) -> None:  # noqa: B027 - optional hook, nothing kept by default
        """Drop what this reader kept for the load that just ended (it succeeded or failed). All ranks call it.

        ``load`` calls it last, still inside the load's pause of the cyclic
        garbage collector, so a reader the caller keeps (``storage_reader=``)
        does not hand the collector thousands of per-load records to walk.
        """

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: CheckpointId) -> bool:
        """Tell whether this reader can handle ``checkpoint_id``."""
