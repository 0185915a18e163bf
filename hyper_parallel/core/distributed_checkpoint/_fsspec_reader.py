"""Reading a checkpoint from object storage (``s3://bucket/prefix``) through fsspec.

Everything but where the bytes come from is :class:`.FileSystemReader`'s:
the same plan of byte runs per region (resharding included), the same
checksum verification. Each run (or whole checksum block, when verifying) is
one ranged GET; a rank's GETs go out ``connections`` at a time, and ranges
larger than ``part_bytes`` are split into parts fetched at once.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

from hyper_parallel.core.distributed_checkpoint._format.indexed_storage import IndexedStorage
from hyper_parallel.core.distributed_checkpoint._format.metadata_json import metadata_from_json
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import is_object_url
from hyper_parallel.core.distributed_checkpoint._index_objects import IndexObjects
from hyper_parallel.core.distributed_checkpoint._metadata_file import rank_local_names, uncommitted_message
from hyper_parallel.core.distributed_checkpoint._object_io import (
    DEFAULT_CONNECTIONS,
    DEFAULT_PART_BYTES,
    ObjectLocation,
    RangedSource,
    get_with_tag,
)
from hyper_parallel.core.distributed_checkpoint._read_items import read_small_whole
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_reader import (
    DEFAULT_MAX_INFLIGHT_BYTES,
    MAX_METADATA_BYTES,
    FileSystemReader,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import rank_metadata_file
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlanner, ReadItem
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointId

__all__ = ["FsspecReader"]


class FsspecReader(ObjectLocation, FileSystemReader):
    """Reads a checkpoint from object storage (S3, OBS, MinIO...) through fsspec.

    Args:
        path: ``s3://bucket/prefix`` (any fsspec URL).
        filesystem: An fsspec filesystem to use instead of one built from
            ``path`` and ``storage_options``.
        verify_checksums: Verify the checksum of every block read.
        thread_count: Data objects read at once per rank.
        connections: Ranged GETs in flight per reading thread.
        part_bytes: Ranges larger than this are fetched as parts at once.
        max_inflight_bytes: Bound on the bytes one thread buffers at once.
        metadata_file: Name of the metadata object (default ``metadata.json``).
        **storage_options: Passed to fsspec (``endpoint_url``, ``key``...);
            by default s3fs reads the usual ``AWS_*`` environment variables.

    Attributes:
        bytes_fetched: Bytes received from the store by this reader's GETs.
    """

    def __init__(
        self,
        path: CheckpointId,
        *,
        filesystem: Any = None,
        verify_checksums: bool = True,
        thread_count: int = 2,
        connections: int = DEFAULT_CONNECTIONS,
        part_bytes: int = DEFAULT_PART_BYTES,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        metadata_file: str | None = None,
        **storage_options: Any,
    ) -> None:
        super().__init__(
            os.sep,  # a placeholder (reset sets the URL); absolute, so no working directory is looked up
            verify_checksums=verify_checksums,
            thread_count=thread_count,
            max_inflight_bytes=max_inflight_bytes,
            metadata_file=metadata_file,
        )
        self._set_up_location(
            filesystem=filesystem, connections=connections, part_bytes=part_bytes, storage_options=storage_options
        )
        self.bytes_fetched = 0
        self._count_lock = threading.Lock()
        self.reset(path)

    def reset(self, checkpoint_id: CheckpointId | None = None) -> None:
        """Start a new load, optionally from another location. All ranks."""
        self._relocate(checkpoint_id)
        self.metadata_file = self._configured_metadata_file
        self.metadata = None
        self.bytes_read = 0
        self.bytes_fetched = 0

    def has_object(self, name: str) -> bool:
        """True if object ``name`` exists under the checkpoint's prefix. Any rank."""
        try:
            return bool(self.fs.exists(f"{self.root}/{name}"))
        except Exception as exc:  # pylint: disable=broad-except
            raise CheckpointIOError(f"cannot reach checkpoint {self.path}: {exc}") from exc

    def read_metadata(self, *, rank: int | None = None) -> Metadata:
        """Read and check the committed metadata object. Any rank; no collectives.

        Args:
            rank: Set when this rank loads on its own: its rank-local
                ``metadata.rank<rank>.json`` is read if there is one.

        Raises:
            CheckpointNotFoundError: nothing is stored under the prefix.
            IncompleteCheckpointError: objects but no committed metadata.
            CorruptCheckpointError / UnsafeCheckpointError: malformed or hostile metadata.
            CheckpointIOError: the store cannot be reached.
        """
        try:
            if rank is not None and self.has_object(rank_metadata_file(rank)):
                self.metadata_file = rank_metadata_file(rank)
        except CheckpointIOError:
            pass  # reported below, when the metadata itself is read
        location = f"{self.path}/{self.metadata_file}"
        try:
            self.fs.invalidate_cache(self.root)
            tagged = get_with_tag(self.fs, f"{self.root}/{self.metadata_file}")
            exists = tagged is not None or bool(self.fs.exists(self.root))
        except CheckpointError:
            raise
        except Exception as exc:  # pylint: disable=broad-except
            raise CheckpointIOError(f"cannot read checkpoint {self.path}: {exc}") from exc
        if not exists:
            raise CheckpointNotFoundError(f"checkpoint {self.path} does not exist (no object under that prefix)")
        if tagged is None:
            raise IncompleteCheckpointError(uncommitted_message(self.path, self.metadata_file, self._rank_local()))
        if len(tagged.data) > MAX_METADATA_BYTES:
            raise UnsafeCheckpointError(
                f"{location}: metadata of {len(tagged.data)} bytes is larger than allowed; refused")
        metadata = metadata_from_json(tagged.data, source=location)
        if isinstance(metadata.storage_data, IndexedStorage):
            metadata.storage_data.bind(IndexObjects(self.fs, root=self.root, url=self.path,
                                                    metadata_file=self.metadata_file,
                                                    save_id=metadata.storage_meta.save_id))
        return metadata

    def _rank_local(self) -> list[str]:
        """The rank-local metadata objects under the prefix (a save with ``use_collectives=False``), sorted."""
        try:
            names = [str(name).rstrip("/").rsplit("/", 1)[-1] for name in self.fs.ls(self.root, detail=False)]
        except Exception:  # pylint: disable=broad-except  # only a hint: the plain message then
            return []
        return rank_local_names(names, self.metadata_file)

    def resolve(self, relative_path: str, fqn: str) -> str:  # type: ignore[override]  # object path, not a Path
        """Return the data object's path, refusing names that leave the prefix.

        Raises:
            UnsafeCheckpointError: an absolute name or one with ``/`` or ``..``.
        """
        if not relative_path or "/" in relative_path or "\\" in relative_path or relative_path in (".", ".."):
            raise UnsafeCheckpointError(
                f"key '{fqn}': data object {relative_path!r} is not a plain name inside checkpoint {self.path}; refused"
            )
        return f"{self.root}/{relative_path}"

    def _replaced(self) -> bool:
        """True when the metadata this load started from is no longer the committed one."""
        if self.metadata is None:
            return False
        try:
            tagged = get_with_tag(self.fs, f"{self.root}/{self.metadata_file}")
            if tagged is None:
                return True
            current = metadata_from_json(tagged.data)
        except Exception:  # pylint: disable=broad-except
            return False
        return current.storage_meta.save_id != self.metadata.storage_meta.save_id

    def _read_groups(self, work: list[list[tuple[str, list[ReadItem]]]], planner: LoadPlanner) -> int:
        """Read the groups of objects, one reading thread per group; return the bytes read."""
        if len(work) <= 1:
            return sum(self._read_group(group, planner) for group in work)
        with ThreadPoolExecutor(max_workers=len(work), thread_name_prefix="hp-ckpt-read") as pool:
            return sum(pool.map(lambda group: self._read_group(group, planner), work))

    def _read_group(self, files: list[tuple[str, list[ReadItem]]], planner: LoadPlanner) -> int:
        """Read the files of one reading thread; the items of a file go ``connections`` at a time.

        A GET waits for the network, not for this process: reading several
        items of an object at once keeps ``connections`` requests in flight
        even when each item is one range.
        """
        total = 0
        with ThreadPoolExecutor(max_workers=self.connections, thread_name_prefix="hp-ckpt-get") as pool:
            for relative_path, items in files:
                with self._open_source(relative_path, items) as (source, path, size):
                    count, rest = read_small_whole(source, path, size, items, self._items, planner,
                                                   verified=self.verify_checksums)
                    futures = [pool.submit(self._read_item, source, path, size, item, planner, dest)
                               for item, dest in rest]
                    total += count + sum(future.result() for future in futures)
        return total

    @contextmanager
    def _open_source(self, relative_path: str, items: list[ReadItem]) -> Iterator[tuple[RangedSource, str, int]]:
        """The data object's ranged reader, its URL for messages, its size."""
        fqn = items[0].storage_index.fqn
        path = self.resolve(relative_path, fqn)
        url = f"{self.path}/{relative_path}"
        try:
            size = int(self.fs.info(path)["size"])
        except FileNotFoundError:
            if self._replaced():
                raise CheckpointNotFoundError(
                    f"checkpoint {self.path} was deleted or replaced by another save while loading (data object "
                    f"{relative_path} of key '{fqn}' is gone); load it again"
                ) from None
            raise CorruptCheckpointError(
                f"key '{fqn}': data object {relative_path} (listed in {self.metadata_file}) is missing from {self.path}"
            ) from None
        source = RangedSource(self.fs, path, size, part_bytes=self.part_bytes, connections=self.connections)
        try:
            self._check_header(source, url, size, relative_path, items)
            yield source, url, size
        except CheckpointError:
            raise
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"checkpoint {self.path}: data object {relative_path} of key '{fqn}' vanished while loading "
                f"(deleted or replaced by another save); load it again"
            ) from exc
        except Exception as exc:  # pylint: disable=broad-except
            raise CheckpointIOError(f"reading {url} (key '{fqn}') failed: {exc}") from exc
        finally:
            with self._count_lock:
                self.bytes_fetched += source.bytes_fetched

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: CheckpointId) -> bool:
        """A URL with a protocol (``s3://bucket/prefix``), other than ``file://``."""
        return is_object_url(checkpoint_id)
