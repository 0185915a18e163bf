"""Writing a checkpoint to object storage (``s3://bucket/prefix``) through fsspec.

The objects are the same as the files of a checkpoint directory: safetensors
data objects named ``r<rank>_<counter>.<save id>.safetensors`` (built by the
same code as :class:`.FileSystemWriter`, so a save's data objects never share a
name with another save's) and the JSON metadata object, written last: its
presence is the commit.

On S3 the commit is a conditional PUT: ``If-None-Match: *`` when no metadata
existed as the save began, ``If-Match: <ETag seen then>`` otherwise. A second
save that committed in between makes the store refuse it; this save then
removes its own data objects and raises :class:`.ConcurrentSaveError`. After
a commit the data objects the superseded metadata listed are deleted, and the
leftovers of saves that can no longer commit (killed ones: data objects,
results records, multipart uploads present as this save began; see
:mod:`._object_garbage`), never another live save's.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any

from hyper_parallel.core.distributed_checkpoint._format.checksum import DEFAULT_BLOCK_BYTES
from hyper_parallel.core.distributed_checkpoint._format.indexed_storage import IndexedStorage
from hyper_parallel.core.distributed_checkpoint._index_objects import IndexObjects
from hyper_parallel.core.distributed_checkpoint._index_plan import check_stored_indexes, written_files
from hyper_parallel.core.distributed_checkpoint._format.rank_index import IndexRecord
from hyper_parallel.core.distributed_checkpoint._format.metadata_json import (
    metadata_from_json,
    metadata_to_json,
    save_id_of,
)
from hyper_parallel.core.distributed_checkpoint._object_garbage import (
    Leftovers,
    leftovers_at_start,
    owner_of,
    sweep,
)
from hyper_parallel.core.distributed_checkpoint._save_id import new_save_id
from hyper_parallel.core.distributed_checkpoint._object_io import (
    DEFAULT_CONNECTIONS,
    DEFAULT_PART_BYTES,
    ObjectLocation,
    ObjectSink,
    PreconditionFailed,
    Tagged,
    get_with_tag,
    put_if,
    remove_objects,
)
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointValueError,
    CheckpointIOError,
    ConcurrentSaveError,
    UnsafeCheckpointError,
)
from hyper_parallel.core.distributed_checkpoint._data_writing import FileJob
from hyper_parallel.core.distributed_checkpoint._writer_records import record_name
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import MAX_RECORD_BYTES, FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.metadata import FSSPEC_BACKEND_NAME, S3_BACKEND_NAME, Metadata
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointId, WriteResult

__all__ = ["FsspecWriter", "is_object_url"]


def is_object_url(checkpoint_id: object) -> bool:
    """True for a URL with a protocol other than ``file`` (``s3://bucket/prefix``)."""
    if not isinstance(checkpoint_id, str) or "://" not in checkpoint_id:
        return False
    return not checkpoint_id.startswith("file://")


class FsspecWriter(ObjectLocation, FileSystemWriter):
    """Writes a checkpoint to object storage (S3, OBS, MinIO...) through fsspec.

    Data objects stream as multipart uploads: ``part_bytes`` parts, up to
    ``connections`` uploading at once per object, so memory stays at about
    ``(connections + 1) * part_bytes`` per data object whatever the state
    size. ``thread_count`` objects per rank are written at once.

    Args:
        path: ``s3://bucket/prefix`` (any fsspec URL).
        filesystem: An fsspec filesystem to use instead of one built from
            ``path`` and ``storage_options``.
        thread_count: Data objects (and writer threads) per rank; ``None``:
            as :class:`.FileSystemWriter`.
        connections: Part uploads in flight per data object.
        part_bytes: Multipart part size (at least 5 MiB on S3).
        checksum_block_bytes: Block size of the stored checksums.
        compression: ``None`` or ``"zstd"``, as :class:`.FileSystemWriter`.
        compression_level: zstd level.
        tile_checksums: As :class:`.FileSystemWriter`.
        **storage_options: Passed to fsspec (``endpoint_url``, ``key``,
            ``secret``, ``client_kwargs``...); by default s3fs reads the usual
            ``AWS_*`` environment variables.
    """

    def __init__(
        self,
        path: CheckpointId,
        *,
        filesystem: Any = None,
        thread_count: int | None = None,
        connections: int = DEFAULT_CONNECTIONS,
        part_bytes: int = DEFAULT_PART_BYTES,
        checksum_block_bytes: int = DEFAULT_BLOCK_BYTES,
        compression: str | None = None,
        compression_level: int = 3,
        tile_checksums: bool = True,
        metadata_form: str = "auto",
        **storage_options: Any,
    ) -> None:
        super().__init__(
            os.sep,  # a placeholder (reset sets the URL); absolute, so no working directory is looked up
            thread_count=thread_count,
            checksum_block_bytes=checksum_block_bytes,
            compression=compression,
            compression_level=compression_level,
            tile_checksums=tile_checksums,
            metadata_form=metadata_form,
        )
        self._set_up_location(
            filesystem=filesystem, connections=connections, part_bytes=part_bytes, storage_options=storage_options
        )
        self._seen: Tagged | None = None
        self._leftovers = Leftovers()
        self._outcome_unknown = False
        self.reset(path)

    def reset(self, checkpoint_id: CheckpointId | None = None) -> None:
        """Start a new save (new save id), optionally to a new location. All ranks."""
        self._relocate(checkpoint_id)
        self.save_id = new_save_id(rank_local=False)
        self._seen = None

    @property
    def backend_name(self) -> str:
        """The backend recorded in the metadata: ``"s3"`` on S3, ``"fsspec"`` on another fsspec filesystem. Any rank."""
        protocols = getattr(self.fs, "protocol", ())
        protocols = (protocols,) if isinstance(protocols, str) else tuple(protocols)
        return S3_BACKEND_NAME if {"s3", "s3a"} & set(protocols) else FSSPEC_BACKEND_NAME

    def set_up_storage_writer(
        self, is_coordinator: bool, *, rank: int = 0, world_size: int = 1, rank_local: bool = False
    ) -> None:
        """New save id; the committing rank notes the metadata object and the leftovers now. All ranks call it.

        What the coordinator sees here (absent, or its ETag) is what the
        commit's conditional write requires to be still true; the leftovers
        of other saves present now are deleted after the commit. With
        ``rank_local`` each rank commits ``metadata.rank<rank>.json`` of its own.

        Raises:
            CheckpointIOError: the store cannot be reached or read.
        """
        self.rank = rank
        self.rank_local = rank_local
        self.save_id = new_save_id(rank_local=rank_local)  # its kind keeps the other kind's sweep off it
        self._seen = None
        self._leftovers = Leftovers()
        self._committed = False
        self._outcome_unknown = False  # the commit failed with no answer whether the store applied it
        self._is_coordinator = is_coordinator
        if is_coordinator:
            try:
                self.fs.invalidate_cache(self.root)
                self._seen = get_with_tag(self.fs, self._object(self._metadata_name()))
            except CheckpointError:
                raise
            except Exception as exc:  # pylint: disable=broad-except
                raise CheckpointIOError(f"rank {rank}: cannot read checkpoint location {self.path}: {exc}") from exc
            # Listed after the metadata was read: a save owning any of these began before this one's commit.
            self._leftovers = leftovers_at_start(self.fs, self.root, save_id=self.save_id,
                                                 metadata_name=self._metadata_name(),
                                                 rank=rank if rank_local else None)

    def _object(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _open_data_file(self, name: str) -> ObjectSink:
        """Start the upload of data object ``name``."""
        return ObjectSink(self.fs, self._object(name), part_bytes=self.part_bytes, connections=self.connections)

    def _data_durable(self, jobs: list[FileJob]) -> None:
        """Nothing to do: a completed upload is durable."""

    def _discard(self, jobs: list[FileJob]) -> None:
        """Remove this rank's data objects of the failed save (best effort)."""
        remove_objects(self.fs, [self._object(job.name) for job in jobs])

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[list[WriteResult]]":
        """Write this rank's data objects; the returned future is already done. All ranks.

        Raises (through the future):
            CheckpointIOError: an upload failed (names the location and rank).
        """
        future = super().write_data(plan, planner)
        exc = future.exception()
        if exc is not None and not isinstance(exc, CheckpointError) and isinstance(exc, Exception):
            wrapped = CheckpointIOError(f"rank {self.rank}: writing checkpoint data to {self.path} failed: {exc}")
            wrapped.__cause__ = exc
            future = Future()
            future.set_exception(wrapped)
        return future

    def finish(
        self, metadata: Metadata, results: list[list[WriteResult]], *, background_cleanup: bool = False
    ) -> Metadata:
        """Commit: conditionally write the metadata object, then drop superseded data and leftovers. Coordinator only.

        ``background_cleanup``: the superseded data objects and the leftovers
        noted as the save began are deleted on a background thread (an async
        save's commit).

        Raises:
            ConcurrentSaveError: another save committed this location since
                this save began (this save's data objects are removed).
            CheckpointIOError: the metadata object could not be written, or
                the write failed and the metadata object cannot be read back
                (the save may have committed: its data objects are kept). A
                write that failed although the store applied it (its reply
                lost) is a commit, and returns.
            CheckpointValueError: the metadata is over ``MAX_METADATA_BYTES`` (no reader would
                accept it); nothing of this save is committed (its data objects are removed).
        """
        committed, index_files = self.indexed_metadata(self.committed_metadata(metadata, results), results)
        name = self._metadata_name()
        ours = sorted(written_files(results) | {record.file for record, _ in index_files})
        try:
            encoded = metadata_to_json(committed, source=self._object(name))
            for record, data in index_files:  # each PUT whole and durable before the metadata lists it
                self.fs.pipe_file(self._object(record.file), data)
        except CheckpointValueError:
            remove_objects(self.fs, [self._object(n) for n in ours])
            raise
        except Exception as exc:  # pylint: disable=broad-except
            remove_objects(self.fs, [self._object(n) for n in ours])
            raise CheckpointIOError(f"writing the rank indexes of checkpoint {self.path} failed: {exc}") from exc
        try:
            put_if(self.fs, self._object(name), encoded,
                   expected_tag=self._seen.tag if self._seen is not None else None)
        except PreconditionFailed as exc:
            self._undo_unless_committed(name, ours, exc, ConcurrentSaveError(
                f"checkpoint {self.path}: another save committed it while this save (save id {self.save_id}) was "
                f"running, so this save did not commit and its data objects were removed; the checkpoint holds "
                "the other save, whole. Give each save its own checkpoint_id, or wait for the other save"
            ))
        except CheckpointError as exc:
            self._undo_unless_committed(name, ours, exc, exc)
        self._committed = True
        stale = [self._object(n) for n in sorted(self._superseded_files() - set(ours))]
        leftovers, self._leftovers = self._leftovers, Leftovers()
        self.wait_cleanup()
        if not background_cleanup:
            sweep(self.fs, leftovers, stale)
            return committed
        self._cleanup = threading.Thread(target=sweep, args=(self.fs, leftovers, stale), name="hp-ckpt-cleanup",
                                         daemon=True)
        self._cleanup.start()
        return committed

    def _undo_unless_committed(self, name: str, ours: list[str], cause: Exception, error: CheckpointError) -> None:
        """After the conditional write failed: return if the store holds this save's metadata anyway, else undo.

        The store may have applied the PUT and its reply been lost (a
        connection reset, or the client's retry refused with 412 because this
        very PUT changed the object): the metadata object then lists this
        save's data objects, which must stay. Read back: this save's id there
        means it committed (return); another content means it did not
        (remove this save's data objects, raise ``error``); unreadable means
        unknown (keep them, also from :meth:`abort`; raise).
        """
        try:
            found = get_with_tag(self.fs, self._object(name))
        except Exception as exc:  # pylint: disable=broad-except
            self._outcome_unknown = True
            raise CheckpointIOError(
                f"checkpoint {self.path}: the commit of this save (save id {self.save_id}) failed ({cause}) and "
                f"{name} cannot be read back ({exc}): this save may have committed, so its data objects were kept. "
                f"Load the checkpoint to see which save it holds; save again if it is not this one"
            ) from cause
        try:
            mine = found is not None and save_id_of(found.data) == self.save_id
        except (ValueError, RecursionError):
            mine = False
        if mine:
            return
        remove_objects(self.fs, [self._object(n) for n in ours])
        if error is cause:
            raise error
        raise error from cause

    def bind_indexes(self, committed: Metadata) -> Metadata:
        """Let the indexed metadata handed to every rank read the index objects of this prefix (it pickles with
        them). Coordinator."""
        if isinstance(committed.storage_data, IndexedStorage):
            committed.storage_data.bind(self._index_objects(self.save_id))
        return committed

    def store_rank_index(self, record: IndexRecord, data: bytes) -> None:
        """PUT one index object whole (durable once the PUT returns). The rank it belongs to."""
        try:
            self.fs.pipe_file(self._object(record.file), data)
        except Exception as exc:  # pylint: disable=broad-except
            raise CheckpointIOError(f"rank {self.rank}: writing its index object {self._object(record.file)} "
                                    f"failed: {exc}") from exc

    def check_rank_indexes(self, records: list[IndexRecord]) -> None:
        """The index objects the ranks wrote have the lengths and digests they reported. Coordinator."""
        def size_of(name: str) -> int:
            try:
                return int(self.fs.size(self._object(name)))
            except FileNotFoundError as exc:
                raise OSError(str(exc)) from exc

        check_stored_indexes(records, size_of=size_of, read=lambda name: self.fs.cat_file(self._object(name)),
                             where=self.path)

    def _index_objects(self, save_id: str) -> IndexObjects:
        return IndexObjects(self.fs, root=self.root, url=self.path, metadata_file=self._metadata_name(),
                            save_id=save_id)

    def abort(self) -> None:
        """Undo a failed save: the coordinator deletes every data object and results record named with this save's id.

        All ranks call it after a failed save; it never raises, and does
        nothing after a commit, after a commit of unknown outcome (the
        metadata object could not be read back: it may list them) or on
        other ranks (each rank already removed its own objects of a failed write).
        """
        if self._committed or self._outcome_unknown or not getattr(self, "_is_coordinator", False):
            return
        try:
            self.fs.invalidate_cache(self.root)
            names = [path.rsplit("/", 1)[-1] for path in self.fs.ls(self.root, detail=False)]
        except Exception:  # pylint: disable=broad-except
            return  # nothing listed (or the store is unreachable): the next commit here sweeps them
        finally:
            self.fs.invalidate_cache(self.root)  # no later lookup may answer from this listing
        owners = {name: owner_of(name) for name in names}
        remove_objects(self.fs, [
            self._object(name) for name, owner in owners.items()
            if owner is not None and owner[0] == self.save_id and (not self.rank_local or owner[1] == self.rank)
        ])

    def write_rank_record(self, rank: int, data: bytes, *, plan: SavePlan) -> None:
        """Store ``rank``'s record as one object (a PUT is whole and durable once it returns). The rank itself.

        Raises:
            CheckpointIOError: the store refused it.
        """
        try:
            self.fs.pipe_file(self._object(record_name(self._plan_save_id(plan), rank)), data)
        except Exception as exc:  # pylint: disable=broad-except
            raise CheckpointIOError(
                f"writing the results record of rank {rank} under {self.path} failed: {exc}") from exc

    def read_rank_record(self, rank: int, *, save_id: str | None = None) -> bytes | None:
        """``rank``'s record object of ``save_id`` (default this save), or ``None``. Coordinator; a rank: its own.

        See :meth:`.StorageWriter.read_rank_record`.

        Raises:
            UnsafeCheckpointError: the record is larger than allowed.
            CheckpointIOError: the store cannot be read.
        """
        try:
            found = get_with_tag(self.fs, self._object(record_name(save_id or self.save_id, rank)))
        except Exception as exc:  # pylint: disable=broad-except
            raise CheckpointIOError(
                f"reading the results record of rank {rank} under {self.path} failed: {exc}") from exc
        if found is not None and len(found.data) > MAX_RECORD_BYTES:
            raise UnsafeCheckpointError(f"{self.path}: the results record of rank {rank} is larger than allowed")
        return None if found is None else found.data

    def remove_rank_records(self, world_size: int) -> None:
        """Delete this save's record objects (best effort, never raises). Coordinator."""
        remove_objects(self.fs, [self._object(record_name(self.save_id, rank)) for rank in range(world_size)])

    def _superseded_files(self) -> set[str]:
        """Data objects listed by the metadata this commit replaced (empty if it is unreadable)."""
        if self._seen is None:
            return set()
        try:
            old = metadata_from_json(self._seen.data, source=self._object(self._metadata_name()))
        except CheckpointError:
            return set()
        storage = old.storage_data or {}
        if not isinstance(storage, IndexedStorage):
            return {info.relative_path for info in storage.values()}
        files = {info.relative_path for info in storage.inline.values()} | {r.file for r in storage.records.values()}
        storage.bind(self._index_objects(old.storage_meta.save_id))  # type: ignore[union-attr]
        try:
            return files | {info.relative_path for info in storage.values()}
        except Exception:  # pylint: disable=broad-except  # unreadable indexes: their data objects are left
            return files

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: CheckpointId) -> bool:
        """A URL with a protocol (``s3://bucket/prefix``), other than ``file://``."""
        return is_object_url(checkpoint_id)
