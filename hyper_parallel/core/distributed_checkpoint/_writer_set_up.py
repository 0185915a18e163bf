"""Setting up a save's directory: make it (durably), hold its save lease, note the committed metadata.

:class:`DirectorySetUp` is the part of :class:`.FileSystemWriter` that
:meth:`.FileSystemWriter.set_up_storage_writer` runs on every rank: each rank
makes the directory (or finds it); the coordinator then takes the directory's
save lease (:mod:`._save_lease`), notes the signature of the committed
metadata its commit will compare against (:mod:`._commit_guard`) and deletes
the files of a save whose process died holding the lease.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from hyper_parallel.core.distributed_checkpoint._commit_guard import drop_dead_save, file_signature
from hyper_parallel.core.distributed_checkpoint._file_ops import FileOps, make_directories
from hyper_parallel.core.distributed_checkpoint._save_lease import SaveLease
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointIOError

__all__ = ["DirectorySetUp"]

#: Times a save makes its directory again if another rank's abort removes it meanwhile (set-up).
_DIRECTORY_ATTEMPTS = 3


class DirectorySetUp:
    """The directory and lease set-up of the filesystem writer (see the module docstring).

    The writer sets ``path``, ``rank``, ``rank_local``, ``save_id``,
    ``sync_files``, ``file_ops``, ``lease_timeout`` and the set-up state below,
    and gives ``_metadata_name()``: the name its commit writes.
    """

    path: Path
    rank: int
    rank_local: bool
    save_id: str
    sync_files: bool
    file_ops: FileOps
    lease_timeout: float
    _metadata_name: Callable[[], str]
    #: The lease this writer holds (coordinator), until its save commits or aborts.
    _lease: SaveLease | None
    #: The committed metadata seen at set-up (lstat signature).
    _base: tuple[int, ...] | None
    #: Whether this save made the directory (abort removes it while still empty).
    _created_directory: bool
    #: Parents whose new entries :meth:`.FileSystemWriter.write_data` makes durable before any commit.
    _unsynced_parents: list[Path]

    def _set_up_directory(self, *, is_coordinator: bool) -> None:
        """Make the directory; the coordinator also takes the lease. Every rank (see the module docstring).

        Raises:
            CheckpointIOError: the directory cannot be created or written, or the lease cannot be taken.
        """
        # The new entries are made durable by write_data, before any commit: off the blocking part of an async save.
        self._unsynced_parents = []
        for attempt in range(_DIRECTORY_ATTEMPTS):
            # Another rank's abort of a save that failed in planning removes the directory it made, if still
            # empty, and may do so just after this rank made or found it: then it is made again.
            last = attempt == _DIRECTORY_ATTEMPTS - 1
            self._make_directory(is_coordinator=is_coordinator)
            if not self.path.is_dir() and not last:
                continue
            if not os.access(self.path, os.W_OK):
                raise CheckpointIOError(f"checkpoint directory {self.path} is not writable (rank {self.rank})")
            if is_coordinator:
                try:
                    self._take_lease()
                except CheckpointIOError as exc:
                    if last or not isinstance(exc.__cause__, FileNotFoundError) or self.path.is_dir():
                        raise
                    continue
            return

    def _make_directory(self, *, is_coordinator: bool) -> None:
        """Create the directory and its missing parents (durably with ``sync_files``). Any rank."""
        try:
            if make_directories(self.file_ops, self.path, sync=self.sync_files, deferred=self._unsynced_parents):
                self._created_directory = True
            elif self.sync_files and is_coordinator and self.path.parent not in self._unsynced_parents:
                # A directory left by an earlier (crashed) save may not be durable yet.
                self._unsynced_parents.append(self.path.parent)
        except OSError as exc:
            raise CheckpointIOError(f"cannot create checkpoint directory {self.path}: {exc}") from exc

    def _take_lease(self) -> None:
        """Hold the directory's save lease; note the committed metadata; drop a dead save's files. Coordinator."""
        if self._lease is not None and not self._lease.released.is_set():
            self._lease.release()  # this writer's earlier save never finished nor aborted
        name = self._metadata_name()
        self._lease, broken = SaveLease.acquire(self.path, name, self.save_id, timeout=self.lease_timeout)
        self._base = file_signature(self.path / name)
        if broken is not None:
            drop_dead_save(self.path, name, broken, save_id=self.save_id,
                           rank=self.rank if self.rank_local else None, unlink=self.file_ops.unlink)
