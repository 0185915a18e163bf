"""Writing a checkpoint directory: safetensors data files, then the commit.

Each rank writes its items into its own data files, named from the rank, a
counter and the save id (never from tensor names). A file's safetensors
header is computed from the plan before any byte is written, and every tensor
is then streamed from its own memory straight to its offset: no second copy of
the state. Several I/O threads write several files at once.

The commit (:meth:`FileSystemWriter.finish`, coordinator only) writes the JSON
metadata to a temporary name, fsyncs it and renames it over ``metadata.json``:
its presence is the commit. Data files of an earlier save to the same
directory stay untouched until then, so a crash at any moment leaves either
the old checkpoint or the new one, complete.

Racing saves: the coordinator holds the directory's save lease and checks,
compare-and-swap style, before it commits (:mod:`._commit_guard`); after the
commit it deletes only the files of the save it replaced
(:mod:`._commit_cleanup`). How items become data files: :mod:`._data_writing`;
the directory and lease set-up: :mod:`._writer_set_up`; the rank records of a
multi-rank async save: :mod:`._writer_records`; the metadata forms:
:mod:`._writer_index_form`.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from hyper_parallel.core.distributed_checkpoint._commit_cleanup import (
    DATA_FILE_PATTERN,
    committed_save_id,
    garbage_files,
    remove_files,
)
from hyper_parallel.core.distributed_checkpoint._commit_guard import check_commit, clean_up_after_commit
from hyper_parallel.core.distributed_checkpoint._file_ops import (
    OS_FILE_OPS,
    FileOps,
    fsync_directory,
    write_atomically,
)
from hyper_parallel.core.distributed_checkpoint._metadata_form import check_metadata_form
from hyper_parallel.core.distributed_checkpoint._index_plan import IndexPlan, RankIndexPlan
from hyper_parallel.core.distributed_checkpoint._options import check_option
from hyper_parallel.core.distributed_checkpoint._save_id import new_save_id
from hyper_parallel.core.distributed_checkpoint._writer_index_form import MAX_RECORD_BYTES, IndexFormWriting
from hyper_parallel.core.distributed_checkpoint._data_file import LocalDataFile
from hyper_parallel.core.distributed_checkpoint._data_writing import (
    AUTO_THREAD_BYTES,
    DATA_ALIGNMENT,
    FileJob,
    drop_pages_in_background,
    file_jobs,
    write_data_file,
    zstd_module,
)
from hyper_parallel.core.distributed_checkpoint._format.checksum import DEFAULT_BLOCK_BYTES
from hyper_parallel.core.distributed_checkpoint._save_lease import DEFAULT_LEASE_TIMEOUT, SaveLease
from hyper_parallel.core.distributed_checkpoint._writer_records import RankRecordFiles
from hyper_parallel.core.distributed_checkpoint._writer_set_up import DirectorySetUp
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointExistsError,
    CheckpointIOError,
    CheckpointValueError,
)
from hyper_parallel.core.distributed_checkpoint.metadata import BACKEND_NAME, Metadata
from hyper_parallel.core.distributed_checkpoint._format.metadata_json import metadata_to_json
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import (
    CheckpointId,
    StorageWriter,
    WriteResult,
    is_local_path,
    local_directory,
)

__all__ = [
    "AUTO_THREAD_BYTES",
    "MAX_RECORD_BYTES",
    "DATA_ALIGNMENT",
    "METADATA_FILE",
    "DATA_FILE_PATTERN",
    "FileSystemPlanData",
    "FileSystemWriter",
    "rank_metadata_file",
    "write_atomically",
    "fsync_directory",
]

#: Name of the committed metadata of a collective save.
METADATA_FILE = "metadata.json"


def rank_metadata_file(rank: int) -> str:
    """Name of the rank-local metadata written with ``use_collectives=False``."""
    return f"metadata.rank{rank:05d}.json"


@dataclass(frozen=True)
class FileSystemPlanData:
    """The storage data of a final save plan: what the coordinator tells every rank.

    Attributes:
        save_id: The coordinator's save id; every rank names its data files with it.
        index: Set when the save commits the indexed form with each rank writing its own index file
            (:mod:`._index_plan`): what this rank's index lists.
    """

    save_id: str
    index: RankIndexPlan | None = None


class FileSystemWriter(DirectorySetUp, RankRecordFiles, IndexFormWriting, StorageWriter):
    """Writes a checkpoint into a local or shared-filesystem directory.

    Args:
        path: The checkpoint directory (created if missing).
        sync_files: fsync data files, metadata and directory (durability).
        thread_count: Data files (and I/O threads) per rank; ``None`` (default):
            2 when the rank writes at least :data:`AUTO_THREAD_BYTES`, else 1
            (two streams overlap hashing with writing; small saves stay one file).
        checksum_block_bytes: Block size of the stored checksums.
        compression: ``None`` (default) or ``"zstd"``: each item compressed
            on its own. Compressed items are stored as ``U8`` arrays, so the
            files stay readable safetensors containers but hold compressed
            bytes, not tensors; loading reads whole items.
        compression_level: zstd level.
        tile_checksums: Checksum 2-D and larger chunks by tiles (row slabs x
            column groups), so loads of some columns verify without reading
            whole rows. ``False``: flat blocks only.
        drop_page_cache: Once the data files are durable, tell the kernel
            their pages are not needed (``POSIX_FADV_DONTNEED``, on a
            background thread: it takes about 0.1 s per GiB), so a large save
            does not push the training job's own files out of the page cache.
        lease_timeout: Seconds after its last heartbeat at which the save lease
            of a process on another host counts as stale (see
            :mod:`._save_lease`; a lease of this host is judged by its process).
        auto_thread_bytes: With ``thread_count=None``, a rank writing at least
            this many bytes uses 2 files and threads (default
            :data:`AUTO_THREAD_BYTES`).
        file_ops: The file-system operations the writer performs (default:
            the operating system's). Tests pass a recording one to replay
            power cuts.
        metadata_form: ``"auto"`` (default): one ``metadata.json`` listing
            every stored chunk, unless that would be large (about 225 bytes
            per chunk, 19 per further checksum digest, over 64 MiB, e.g. every Parameter sharded over every rank
            of a large job), then the indexed form: grid tensors by their grid,
            their chunks' entries in one small index file per rank
            (docs/format.md section 12.1). ``"inline"`` or ``"indexed"``:
            that form whatever the size. Rank-local metadata
            (``use_collectives=False``) is always in-line.

    Raises:
        CheckpointValueError: an option of the wrong type or out of range (names it).
    """

    def __init__(
        self,
        path: CheckpointId,
        *,
        sync_files: bool = True,
        thread_count: int | None = None,
        checksum_block_bytes: int = DEFAULT_BLOCK_BYTES,
        compression: str | None = None,
        compression_level: int = 3,
        tile_checksums: bool = True,
        drop_page_cache: bool = True,
        lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
        auto_thread_bytes: int = AUTO_THREAD_BYTES,
        file_ops: FileOps | None = None,
        metadata_form: str = "auto",
    ) -> None:
        self.metadata_form = check_metadata_form(metadata_form)
        check_option("thread_count", thread_count, int, minimum=1, optional=True)
        check_option("checksum_block_bytes", checksum_block_bytes, int, minimum=1)
        check_option("compression_level", compression_level, int)
        check_option("lease_timeout", lease_timeout, float, minimum=0.0)
        if compression not in (None, "zstd"):
            raise CheckpointValueError(f"compression must be None or 'zstd', got {compression!r}")
        if compression:
            zstd_module()
        self.path = local_directory(path)
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.checksum_block_bytes = checksum_block_bytes
        self.rank_local = False
        self.compression = compression
        self.compression_level = compression_level
        self.tile_checksums = tile_checksums
        self.drop_page_cache = drop_page_cache
        self.lease_timeout = float(lease_timeout)
        self._lease: SaveLease | None = None
        self._base: tuple[int, ...] | None = None  # the committed metadata seen at set-up (lstat signature)
        self._created_directory = False
        self._unsynced_parents: list[Path] = []
        self._committed = False
        self.auto_thread_bytes = auto_thread_bytes
        self.file_ops = file_ops or OS_FILE_OPS
        self._cleanup: threading.Thread | None = None
        self._page_drop: threading.Thread | None = None
        self.rank = 0
        self.save_id = new_save_id(rank_local=False)
        #: The holders of the indexed form decided at plan time (coordinator; :meth:`use_index_plan`).
        self.index_plan: IndexPlan | None = None

    @property
    def backend_name(self) -> str:
        """The backend this writer records in the metadata (``"filesystem"``). Any rank; no file access."""
        return BACKEND_NAME

    def reset(self, checkpoint_id: CheckpointId | None = None) -> None:
        """Start a new save (new save id), optionally to a new path. All ranks."""
        if checkpoint_id is not None:
            self.path = local_directory(checkpoint_id)
        self.save_id = new_save_id(rank_local=False)

    def set_up_storage_writer(
        self, is_coordinator: bool, *, rank: int = 0, world_size: int = 1, rank_local: bool = False
    ) -> None:
        """Create the directory (every rank may; exist is fine). All ranks call it.

        With ``rank_local`` (``save(..., use_collectives=False)`` in a job of
        several ranks) this rank commits ``metadata.rank<rank>.json`` and its
        after-commit cleanup touches only its own data files.

        Every save gets a new save id here (the coordinator's is handed to all
        ranks with the plan), so a writer used for several saves never writes
        over the data files of a checkpoint it committed before.

        Raises:
            CheckpointExistsError: the path exists and is not a directory.
            CheckpointIOError: the directory cannot be created or written.
        """
        self.rank = rank
        self.rank_local = rank_local
        self.save_id = new_save_id(rank_local=rank_local)
        self.index_plan = None
        self._committed = False
        self._created_directory = False
        if self.path.exists() and not self.path.is_dir():
            raise CheckpointExistsError(
                f"checkpoint path {self.path} exists and is not a directory; choose another checkpoint_id"
            )
        self._set_up_directory(is_coordinator=is_coordinator)

    def _metadata_name(self) -> str:
        return rank_metadata_file(self.rank) if self.rank_local else METADATA_FILE

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Return the plan unchanged: file names are given by the coordinator. All ranks call it."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give every plan the coordinator's save id (:class:`FileSystemPlanData`). Coordinator only."""
        return [replace(plan, storage_data=FileSystemPlanData(save_id=self.save_id)) for plan in plans]

    def _plan_save_id(self, plan: SavePlan) -> str:
        """The save id ``plan`` carries (:class:`FileSystemPlanData`), else this writer's. Any rank."""
        return plan.storage_data.save_id if isinstance(plan.storage_data, FileSystemPlanData) else self.save_id

    def _jobs(self, plan: SavePlan) -> list[FileJob]:
        self.save_id = self._plan_save_id(plan)
        return file_jobs(plan.items, rank=self.rank, save_id=self.save_id, thread_count=self.thread_count,
                         auto_thread_bytes=self.auto_thread_bytes)

    def _write_file(self, job: FileJob, planner: SavePlanner) -> list[WriteResult]:
        return write_data_file(
            job, planner, self._open_data_file, save_id=self.save_id, compression=self.compression,
            compression_level=self.compression_level, block_bytes=self.checksum_block_bytes,
            tiles=self.tile_checksums,
        )

    def _open_data_file(self, name: str) -> LocalDataFile:
        """Open data file ``name`` of this save for streaming (the object backend opens an upload)."""
        # The pages are dropped after the whole save is durable, off its critical path (_drop_pages_later).
        return LocalDataFile(self.path / name, self.file_ops, sync=self.sync_files, drop_page_cache=False)

    def _data_durable(self, jobs: list[FileJob]) -> None:
        """Make the names of the data files just written durable (fsync the directory); then let their pages go."""
        if self.sync_files:
            fsync_directory(self.path, self.file_ops)
            if self.drop_page_cache:
                self._drop_pages_later([self.path / job.name for job in jobs])

    def _drop_pages_later(self, paths: list[Path]) -> None:
        """Let the pages of ``paths`` go, on a background thread; at most one such thread per writer runs."""
        self.wait_page_drop()
        self._page_drop = drop_pages_in_background(paths, self.file_ops)

    def wait_page_drop(self) -> None:
        """Wait until the page cache advice of the last save's data files is given. Any rank."""
        thread, self._page_drop = self._page_drop, None
        if thread is not None:
            thread.join()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[list[WriteResult]]":
        """Write this rank's items durably; the returned future is already done. All ranks.

        On failure this rank's data files of this save are removed (nothing
        references them, and on a full disk they hold the space).

        Raises (through the future):
            CheckpointIOError: a write or fsync failed (disk full, I/O error).
        """
        future: Future[list[WriteResult]] = Future()
        self._created_directory = False  # writing began: a failure leaves the directory to the next save
        jobs: list[FileJob] = []
        try:
            while self._unsynced_parents:  # the checkpoint directory's own entry first (set_up_storage_writer)
                self.file_ops.fsync_directory(self._unsynced_parents.pop(0))
            jobs = self._jobs(plan)
            if len(jobs) <= 1:
                chunks = [self._write_file(job, planner) for job in jobs]
            else:
                with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="hp-ckpt-write") as pool:
                    chunks = list(pool.map(lambda job: self._write_file(job, planner), jobs))
            if jobs:
                self._data_durable(jobs)
            future.set_result([result for chunk in chunks for result in chunk])
        except OSError as exc:
            self._discard(jobs)
            future.set_exception(
                CheckpointIOError(f"rank {self.rank}: writing checkpoint data in {self.path} failed: {exc}")
            )
        except BaseException as exc:  # pylint: disable=broad-except
            self._discard(jobs)
            future.set_exception(exc)
        return future

    def _discard(self, jobs: list[FileJob]) -> None:
        for job in jobs:
            try:
                self.file_ops.unlink(self.path / job.name)
            except OSError:
                pass  # a later save of this directory removes it as stale

    def finish(
        self, metadata: Metadata, results: list[list[WriteResult]], *, background_cleanup: bool = False
    ) -> Metadata:
        """Commit: write the metadata atomically, then drop the files of the replaced save. Coordinator only.

        Args:
            metadata: The coordinator's metadata (without storage data).
            results: Every rank's write results, in rank order.
            background_cleanup: Delete the replaced save's files on a
                background thread (an async save's commit runs on the
                training thread); :meth:`wait_cleanup` waits for it.

        Raises:
            ConcurrentSaveError: another save took the lease or committed to this id since
                :meth:`set_up_storage_writer` (names it); nothing of this save is committed.
            CheckpointIOError: the metadata cannot be written.
            CheckpointValueError: the metadata is over ``MAX_METADATA_BYTES`` (no reader would
                accept it); nothing of this save is committed.
        """
        committed, index_files = self.indexed_metadata(self.committed_metadata(metadata, results), results)
        name = self._metadata_name()
        encoded = metadata_to_json(committed, source=str(self.path / name))
        replaced = check_commit(self.path, name, lease=self._lease, base=self._base, save_id=self.save_id)
        if self._lease is not None and replaced:
            self._lease.record_base(replaced)
        failure: CheckpointIOError | None = None
        try:  # the rank indexes are durable before the metadata that lists them (abort removes them)
            for record, data in index_files:
                write_atomically(self.path / record.file, data, sync=self.sync_files, tag=self.save_id,
                                 ops=self.file_ops)
        except OSError as exc:
            raise CheckpointIOError(f"writing the rank indexes of checkpoint {self.path} failed: {exc}") from exc
        try:
            write_atomically(
                self.path / name, encoded, sync=self.sync_files, tag=self.save_id, ops=self.file_ops
            )
        except OSError as exc:
            failure = CheckpointIOError(f"committing checkpoint {self.path} failed: {exc}")
            failure.__cause__ = exc
            if committed_save_id(self.path / name) != self.save_id:
                raise failure from exc
            # The rename happened (syncing its directory failed): committed, clean up, then report.
        self._committed = True
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.committed = True
        # The replaced save's files are garbage once the new metadata is durable.
        # An async save's commit deletes them off the caller's path (unlinking
        # large files takes time); the lease is held until they are gone.
        self.wait_cleanup()
        stale = self._stale_files(replaced)
        if not background_cleanup or failure is not None:
            clean_up_after_commit(stale, lease, self.file_ops.unlink)
            if failure is not None:
                raise failure
            return committed
        self._cleanup = threading.Thread(
            target=clean_up_after_commit, args=(stale, lease, self.file_ops.unlink), name="hp-ckpt-cleanup", daemon=True
        )
        self._cleanup.start()
        return committed

    def abort(self) -> None:
        """Undo a failed save: delete its files, release its lease, remove the directory if planning failed.

        A save that fails before writing (a refused value, a bad layout)
        removes the directory it created, if still empty.

        All ranks call it after a failed save (``save``, ``async_save`` and
        ``CheckpointManager`` do); it never raises, and does nothing after a commit.
        """
        if self._committed:
            return
        lease, self._lease = self._lease, None
        if lease is not None:  # coordinator: every rank's files of this save are written (or discarded) by now
            remove_files(
                garbage_files(self.path, {self.save_id}, rank=self.rank if self.rank_local else None),
                unlink=self.file_ops.unlink,
            )
            lease.release()
        if self._created_directory:
            try:
                self.path.rmdir()  # only if empty
            except OSError:
                pass
            self._created_directory = False

    def wait_cleanup(self) -> None:
        """Wait until the files of older saves are deleted. Coordinator."""
        if self._cleanup is not None:
            self._cleanup.join()
            self._cleanup = None

    def _stale_files(self, replaced: str | None) -> list[Path]:
        """Files of the replaced save (``replaced`` is its save id): data files and temporary files.

        With rank-local metadata only this rank's files are candidates.
        """
        if not replaced or replaced == self.save_id:
            return []
        return garbage_files(self.path, {replaced}, rank=self.rank if self.rank_local else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: CheckpointId) -> bool:
        """Any local path string or ``os.PathLike`` is a filesystem checkpoint id."""
        return is_local_path(checkpoint_id)
