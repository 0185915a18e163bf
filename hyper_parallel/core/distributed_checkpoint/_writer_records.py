"""The filesystem writer's rank records: hidden files ``.<save id>.rank<r>.results`` in the directory.

:class:`RankRecordFiles` is the part of :class:`.FileSystemWriter` that stores
the per-rank results records of a multi-rank async save (what a record holds
and how the coordinator waits for them: :mod:`._rank_records`).
:class:`.FsspecWriter` overrides its storage calls with objects of the same
names (:func:`record_name`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from hyper_parallel.core.distributed_checkpoint._commit_cleanup import remove_files
from hyper_parallel.core.distributed_checkpoint._file_ops import FileOps, write_atomically
from hyper_parallel.core.distributed_checkpoint._safe_files import read_regular
from hyper_parallel.core.distributed_checkpoint._writer_index_form import MAX_RECORD_BYTES
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointIOError
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan

__all__ = ["RankRecordFiles", "record_name"]


def record_name(save_id: str, rank: int) -> str:
    """The name of ``rank``'s results record of save ``save_id`` (a hidden file or object). Any rank; pure."""
    return f".{save_id}.rank{rank:05d}.results"


class RankRecordFiles:
    """The rank-record methods of the filesystem writer (see the module docstring).

    The writer sets ``path``, ``save_id`` and ``file_ops``, and gives
    ``_plan_save_id(plan)``: the save id a final plan carries.
    """

    path: Path
    save_id: str
    file_ops: FileOps
    _plan_save_id: Callable[[SavePlan], str]

    def supports_rank_records(self) -> bool:
        """Records are hidden files ``.<save id>.rank<r>.results`` in the directory. Any rank."""
        return True

    def _record_path(self, rank: int, save_id: str | None = None) -> Path:
        return self.path / record_name(save_id or self.save_id, rank)

    def write_rank_record(self, rank: int, data: bytes, *, plan: SavePlan) -> None:
        """Write ``rank``'s record atomically (temporary file, rename), named by the plan's save id. The rank itself.

        No ``fsync``: the record is written after this rank's data files are
        durable and is only a message to the coordinator's commit; a record
        lost in a crash means no commit, and after the commit it is deleted.

        Raises:
            CheckpointIOError: it cannot be written.
        """
        save_id = self._plan_save_id(plan)
        try:
            write_atomically(self._record_path(rank, save_id), data, sync=False, tag=save_id, ops=self.file_ops)
        except OSError as exc:
            raise CheckpointIOError(f"writing the results record of rank {rank} in {self.path} failed: {exc}") from exc

    def read_rank_record(self, rank: int, *, save_id: str | None = None) -> bytes | None:
        """``rank``'s record of ``save_id`` (default this save), or ``None`` while absent. Coordinator; a rank: its own.

        A regular file of bounded size (see :meth:`.StorageWriter.read_rank_record`).

        Raises:
            UnsafeCheckpointError: the name holds something else than a regular file, or too much.
            CheckpointIOError: it cannot be read.
        """
        try:
            return read_regular(self._record_path(rank, save_id), limit=MAX_RECORD_BYTES)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointIOError(f"reading the results record of rank {rank} in {self.path} failed: {exc}") from exc

    def remove_rank_records(self, world_size: int) -> None:
        """Delete the records of this save (regular files only; logs the rest). Coordinator."""
        remove_files([self._record_path(rank) for rank in range(world_size)], unlink=self.file_ops.unlink)
