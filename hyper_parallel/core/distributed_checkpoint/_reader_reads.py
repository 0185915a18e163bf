"""The read pass of a filesystem load: verified regions copied from the data files into the targets.

:class:`ReadPass` is the half of :class:`~.filesystem_reader.FileSystemReader`
that lands bytes, after the verify pass (:mod:`._reader_verify`) checked them:
runs of small whole items in one call (:func:`._read_items.read_small_whole`),
every other region as byte runs read straight into the target's memory where
dtype and layout allow (:mod:`._run_reads`), in pieces of at most
``max_inflight_bytes``; compressed items whole, then decompressed.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from itertools import compress
from operator import attrgetter, not_
from pathlib import Path

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.byte_ranges import Runs, box_runs, split_box
from hyper_parallel.core.distributed_checkpoint._read_items import ItemFacts, read_columns, read_small_whole, stored_dtype
from hyper_parallel.core.distributed_checkpoint._reader_verify import kept_rows, leading_rows
from hyper_parallel.core.distributed_checkpoint._whole_reads import whole_read_item
from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource, read_runs, run_rows, scratch
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError, CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import StorageInfo, TensorStorageMetadata
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlanner, ReadItem
from hyper_parallel.platform.dtypes import DTYPE_NAMES, numpy_dtype

__all__ = ["ReadPass"]

#: Whether an item is a small whole chunk (:attr:`._read_items.ItemFacts.small`; a C getter).
_SMALL = attrgetter("small")


class ReadPass:
    """The read half of :class:`~.filesystem_reader.FileSystemReader` (a mixin; all ranks run it).

    Uses the reader's ``metadata``, ``_items``, ``verify_checksums``,
    ``max_inflight_bytes``, the verify pass's kept buffers (``_kept``,
    ``_kept_bytes``, ``_kept_lock``), ``_region_check``, ``_open_source``, and
    the plan's whole reads kept as columns (``_columns``: data file -> rows;
    ``_split``: the plan they came from).
    """

    def _read_groups(self, work: list[list[tuple[str, list[ReadItem]]]], planner: LoadPlanner) -> int:
        """Read the items of every group of files; return the bytes read (verified ones not counted again).

        The large items start first, one I/O thread per group, and this
        thread meanwhile reads the small whole chunks of every file, many per
        call (:func:`._read_items.read_small_whole`): their Python runs while
        the large reads copy with the GIL released. Runs after every check of
        the plan passed (the verify pass). On an error, the reads in flight
        end before it is raised (no thread writes into a target afterwards).
        """
        small_files: list[tuple[str, list[ReadItem], list[ReadItem], list[ItemFacts]]] = []
        large_work: list[list[tuple[str, list[ReadItem], list[ReadItem]]]] = []
        for group in work:
            large_group = []
            for relative_path, items in group:
                facts = self._items.facts_list(items)
                flags = list(map(_SMALL, facts))
                small = list(compress(items, flags))
                if small or relative_path in self._columns:  # the plan's whole reads kept as columns are small
                    small_files.append((relative_path, items, small, list(compress(facts, flags))))
                if len(small) < len(items):
                    large_group.append((relative_path, items, list(compress(items, map(not_, flags)))))
            if large_group:
                large_work.append(large_group)
        if not large_work or (len(large_work) == 1 and not small_files):  # nothing to overlap
            return sum(self._read_small(entry, planner) for entry in small_files) + sum(
                self._read_large(group, planner) for group in large_work)
        pool = ThreadPoolExecutor(max_workers=len(large_work), thread_name_prefix="hp-ckpt-read")
        try:
            futures = [pool.submit(self._read_large, group, planner) for group in large_work]
            total = sum(self._read_small(entry, planner) for entry in small_files)
            return total + sum(future.result() for future in futures)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _read_small(self, entry: tuple[str, list[ReadItem], list[ReadItem], list[ItemFacts]],
                    planner: LoadPlanner) -> int:
        """Read the small whole chunks ``entry`` names of one file (``(file, its items, the small ones, their
        facts)``), and the plan's whole reads of it kept as columns."""
        relative_path, items, small, facts = entry
        with self._open_source(relative_path, items) as (source, path, size):
            columns = self._columns.get(relative_path)
            total = 0
            if columns and planner is self._column_source.owner:  # read for the planner that made them
                total = read_columns(source, path, columns, verified=self.verify_checksums)
            elif columns:  # another planner (one wrapping it, say) is asked for each target: as items
                small = small + [whole_read_item(row.fqn, (0,) * len(row.stored.size), row.stored.size)
                                 for row in columns]
                facts = None
            count, rest = read_small_whole(source, path, size, small, self._items, planner,
                                           verified=self.verify_checksums, facts=facts)
            total += count
            for item, dest in rest:  # not batched after all (their target is not contiguous, say)
                total += self._read_item(source, path, size, item, planner, dest)
        return total

    def _read_large(self, group: list[tuple[str, list[ReadItem], list[ReadItem]]], planner: LoadPlanner) -> int:
        """Read the other items of a group of files (``(file, its items, the ones to read)``), one by one."""
        total = 0
        for relative_path, items, large in group:
            with self._open_source(relative_path, items) as (source, path, size):
                for item in large:
                    total += self._read_item(source, path, size, item, planner)
        return total

    def _read_item(
        self, source: FileSource, path: Path, file_size: int, item: ReadItem, planner: LoadPlanner, dest: np.ndarray | None = None
    ) -> int:
        fqn = item.storage_index.fqn
        check = self._region_check(path, file_size, item)
        info = check.info
        if info.compression is not None:
            return self._read_compressed(source, path, fqn, info, item, planner)
        if item.type == LoadItemType.BYTE_IO:
            buffer = np.empty((1, info.length), dtype=np.uint8)
            runs = Runs(starts=np.zeros(1 if info.length else 0, dtype=np.int64), length=info.length)
            count = self._fill(source, path, fqn, info, runs, buffer)
            planner.apply_bytes(item, buffer.tobytes())
            return count
        stored = self.metadata.state_dict_metadata.get(fqn)
        if check.sizes is None:
            raise CorruptCheckpointError(f"key '{fqn}' is read as a tensor but stored as a value")
        chunk_sizes, itemsize = check.sizes, check.itemsize
        if dest is None:
            dest = planner.acquire_tensor(item)
        with self._kept_lock:
            kept = self._kept.pop(item, None)
            self._kept_bytes -= kept.nbytes if kept is not None else 0
        skip = 0  # leading rows of the region read by the verify pass
        if kept is not None:  # verified and read by the verify pass
            skip = kept_rows(kept, item)
            np.copyto(dest[:skip] if dest.ndim else dest, kept, casting="unsafe")
            if skip == (item.lengths[0] if item.lengths else 0):
                planner.apply_tensor(item, dest)
                return 0
        rest = leading_rows(item, item.lengths[0] - skip).lengths if skip else item.lengths
        dtype = stored_dtype(stored.properties.dtype)
        count = 0
        # Pieces of at most max_inflight_bytes: a cast or scattered target never
        # needs a staging buffer larger than that, whatever the tensor size.
        for sub_offsets, sub_lengths in split_box(rest, itemsize, self.max_inflight_bytes):
            sub_offsets = (sub_offsets[0] + skip,) + tuple(sub_offsets[1:]) if skip else sub_offsets
            offsets = tuple(o + s for o, s in zip(item.storage_offsets, sub_offsets))
            runs = box_runs(chunk_sizes, itemsize, offsets, sub_lengths)
            if runs.total == 0:
                continue
            region = dest[tuple(slice(o, o + n) for o, n in zip(sub_offsets, sub_lengths))] if dest.ndim else dest
            rows = run_rows(region, runs, dtype)
            if rows is not None:
                count += self._fill(source, path, fqn, info, runs, rows)
                continue
            staging = scratch(runs.total).reshape(runs.starts.size, runs.length)
            count += self._fill(source, path, fqn, info, runs, staging)
            np.copyto(region, staging.view(dtype).reshape(sub_lengths), casting="unsafe")
        planner.apply_tensor(item, dest)
        return count

    def _read_compressed(
        self, source: FileSource, path: Path, fqn: str, info: StorageInfo, item: ReadItem, planner: LoadPlanner
    ) -> int:
        """Read, verify and decompress a whole compressed item, then apply its region."""
        stored_bytes = np.empty((1, info.length), dtype=np.uint8)
        runs = Runs(starts=np.zeros(1 if info.length else 0, dtype=np.int64), length=info.length)
        count = self._fill(source, path, fqn, info, runs, stored_bytes)
        raw_length = info.raw_length or 0
        try:
            import zstandard  # pylint: disable=import-outside-toplevel

            raw = zstandard.ZstdDecompressor().decompress(stored_bytes.tobytes(), max_output_size=raw_length)
        except ImportError as exc:
            raise CheckpointValueError("this checkpoint is zstd-compressed: pip install zstandard") from exc
        except zstandard.ZstdError as exc:
            raise CorruptCheckpointError(f"data file {path}, key '{fqn}': zstd data does not decompress ({exc})") from exc
        if len(raw) != raw_length:
            raise CorruptCheckpointError(
                f"data file {path}, key '{fqn}': decompressed {len(raw)} bytes, metadata says {raw_length}"
            )
        if item.type == LoadItemType.BYTE_IO:
            planner.apply_bytes(item, raw)
            return count
        stored = self.metadata.state_dict_metadata.get(fqn)
        if not isinstance(stored, TensorStorageMetadata):
            raise CorruptCheckpointError(f"key '{fqn}' is read as a tensor but stored as a value")
        chunk_sizes = self._items.chunk_sizes(stored, item.storage_index)
        if raw_length != math.prod(chunk_sizes) * DTYPE_NAMES[stored.properties.dtype]:
            raise CorruptCheckpointError(f"key '{fqn}': raw length {raw_length} does not match its chunk")
        chunk = np.frombuffer(raw, dtype=numpy_dtype(stored.properties.dtype)).reshape(chunk_sizes)
        region = chunk[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))] if chunk.ndim else chunk
        dest = planner.acquire_tensor(item)
        np.copyto(dest, region, casting="unsafe")
        planner.apply_tensor(item, dest)
        return count

    def _fill(self, source: FileSource, path: Path, fqn: str, info: StorageInfo, runs: Runs, target: np.ndarray) -> int:
        """Fill ``target`` (``uint8``, one row per run) with the runs (verified before); return bytes read.

        Verified bytes are in the page cache already (the verify pass put
        them there): they are read from it, never again from the device.
        """
        if runs.total == 0:
            return 0
        verified = self.verify_checksums and info.checksum is not None
        count = read_runs(source, path, fqn, info, runs, target, exact=source.exact and not verified)
        return 0 if verified else count  # verified bytes were counted by the verify pass
