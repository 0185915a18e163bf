"""The verify pass of a filesystem load: every stored byte a plan needs is hashed before any byte lands.

:class:`VerifyPass` is the half of :class:`~.filesystem_reader.FileSystemReader`
that checks a load plan before the read pass copies anything: each touched
file's header (through the reader's ``_open_source``) and, with checksums on,
the checksum of every block or tile the plan's regions touch
(:mod:`._verify_reads`). Regions that the page cache would read wastefully (a
narrow column split of a file read without readahead, or any region on object
storage) are read once into private buffers within ``max_inflight_bytes`` per
I/O thread and kept for the read pass (:mod:`._reader_reads`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from hyper_parallel.core.distributed_checkpoint._device_reads import MAX_PAGE_AMPLIFICATION, page_amplification
from hyper_parallel.core.distributed_checkpoint._format.byte_ranges import box_runs
from hyper_parallel.core.distributed_checkpoint._format.checksum import ALGORITHM
from hyper_parallel.core.distributed_checkpoint._read_items import ColumnRow
from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource, read_runs_verified, read_tiles
from hyper_parallel.core.distributed_checkpoint._read_priming import PRIME_MIN_BYTES, page_cached, prime
from hyper_parallel.core.distributed_checkpoint._verify_reads import RegionCheck, hash_taken, verify_regions
from hyper_parallel.core.distributed_checkpoint._verify_share import WindowShare
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import StorageInfo
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, ReadItem
from hyper_parallel.platform.dtypes import numpy_dtype

__all__ = ["VerifyPass", "check_within", "kept_rows", "leading_rows"]


def check_within(path: Any, file_size: int, fqn: str, info: StorageInfo) -> None:
    """Refuse an item whose stored bytes end past its data file's end."""
    if info.offset + info.length > file_size:
        raise CorruptCheckpointError(
            f"data file {path} is truncated: key '{fqn}' needs bytes {info.offset}..{info.offset + info.length} "
            f"but the file has {file_size}"
        )


def kept_rows(kept: np.ndarray, item: ReadItem) -> int:
    """Leading rows of ``item``'s region a private buffer holds (all of a 0-d region)."""
    return kept.shape[0] if kept.ndim else (item.lengths[0] if item.lengths else 0)


def leading_rows(item: ReadItem, rows: int) -> ReadItem:
    """``item`` cut to its first ``rows`` rows (the whole item if it has as many)."""
    if not item.lengths or rows == item.lengths[0]:
        return item
    return dataclasses.replace(item, lengths=(rows,) + tuple(item.lengths[1:]))


def _rows_after(check: RegionCheck, rows: int) -> RegionCheck:
    """The part of ``check``'s region after its first ``rows`` rows."""
    return dataclasses.replace(check, offsets=(check.offsets[0] + rows,) + tuple(check.offsets[1:]),
                               lengths=(check.lengths[0] - rows,) + tuple(check.lengths[1:]))


def _fitting_rows(check: RegionCheck, item: ReadItem, room: int) -> int:
    """Leading rows of a tiled region that fit ``room`` bytes and end on a slab edge of its tile grid; 0 if none.

    Flat-verified regions are kept whole or not at all (their blocks cut across rows).
    """
    info = check.info
    if room <= 0 or check.sizes is None or info.checksum is None or not info.checksum.block_shape:
        return 0
    row_bytes = math.prod(item.lengths[1:]) * check.itemsize
    slab = info.checksum.block_shape[0]
    first = item.storage_offsets[0]
    end = (first + room // max(row_bytes, 1)) // slab * slab
    return max(0, min(end - first, item.lengths[0] - 1))


class VerifyPass:
    """The verify half of :class:`~.filesystem_reader.FileSystemReader` (a mixin; all ranks run it).

    Uses the reader's ``metadata``, ``_items`` (:class:`._read_items.ItemIndex`),
    ``verify_checksums``, ``max_inflight_bytes``, ``thread_count``, the
    private-buffer state ``_kept``, ``_kept_bytes`` and ``_kept_lock``, the
    list ``_aheads`` of priming threads (ended by ``finish_load``), its
    ``_open_source``, and the plan's whole reads kept as columns (``_columns``).
    """

    def _verify_group(self, files: list[tuple[str, list[ReadItem]]], share: WindowShare | None = None) -> int:
        """Verify ``files`` (this I/O thread's); return the bytes hashed.

        With ``share`` (several I/O threads), the windows of these files are
        offered to the other threads, and this thread then hashes windows of
        theirs until every file is verified (:mod:`._verify_share`).
        """
        if share is None:
            return self._verify_files(files, None)
        try:
            total = self._verify_files(files, share)
        except BaseException:
            share.fail()
            raise
        finally:
            share.owner_done()
        return total + share.help(hash_taken)

    def _verify_files(self, files: list[tuple[str, list[ReadItem]]], share: WindowShare | None) -> int:
        total = 0
        for relative_path, items in files:
            with self._open_source(relative_path, items) as (source, path, size):  # checks the file's header
                if not self.verify_checksums:
                    continue
                whole, rest = self._small_flat(source, size, items)
                # The plan's whole reads kept as columns: small whole chunks with flat checksums (or none), inside
                # the file (the header check proved both).
                if not self._columns_verified:
                    whole.extend((row.fqn, row.info) for row in self._columns.get(relative_path, ()))
                checked = [(item, self._region_check(path, size, item)) for item in rest]
                if isinstance(source, FileSource) and not source.exact:
                    # Read with readahead: no region gains from a private buffer (see _keep_priority).
                    total += verify_regions(source, path, [check for _, check in checked], self.max_inflight_bytes,
                                            whole=whole, share=share)
                    continue
                checks = []
                regions = [(self._keep_priority(check, item, source), item, check) for item, check in checked]
                # The regions the page cache would read most wastefully get the private budget first
                # (the sort is stable: file order among equals).
                for priority, item, check in sorted(regions, key=lambda entry: -entry[0]):
                    kept = self._keep_buffer(check, item) if priority else None
                    if kept is None:
                        checks.append(check)
                        continue
                    rows = kept_rows(kept, item)
                    total += self._read_kept(source, path, check, leading_rows(item, rows), kept)
                    with self._kept_lock:
                        self._kept[item] = kept
                    if item.lengths and rows < item.lengths[0]:  # the rest of the region is verified in place
                        checks.append(_rows_after(check, rows))
                total += verify_regions(source, path, checks, self.max_inflight_bytes, whole=whole, share=share)
        return total

    def _prime(self, source: Any, file_size: int, items: list[ReadItem], columns: Sequence[ColumnRow] = ()) -> None:
        """Start the device on the bytes ``items`` and the plan's ``columns`` rows need of a file just opened (see
        :func:`._read_priming.prime`).

        Called once per file and load, before its header is checked: the
        device reads while the header check and the verify pass's windows
        are prepared, then ahead of the windows hashed (``source.ahead``,
        told of each window by the verify pass, stopped when the file is
        closed). Files smaller than the priming threshold are skipped
        without looking at their items, and so is a file whose first item's
        bytes are cached (a warm load: one probe).
        """
        if file_size < PRIME_MIN_BYTES or not isinstance(source, FileSource) or source.exact:
            return
        facts_of = self._items.facts
        if page_cached(source, facts_of(items[0]).info.offset if items else columns[0].offset):
            return
        infos = [facts_of(item).info for item in items] + [row.info for row in columns]
        source.ahead = prime(source, min(info.offset for info in infos),
                             max(info.offset + info.length for info in infos))
        if source.ahead is not None:
            self._aheads.append(source.ahead)  # ended by finish_load

    def _small_flat(self, source: Any, file_size: int, items: list[ReadItem]
                    ) -> tuple[list[tuple[str, StorageInfo]], list[ReadItem]]:
        """Split a file's items into the small whole chunks with flat block digests, as ``(key, chunk)``, and the rest.

        The former (most of a state's Parameters) are verified in place without a
        :class:`RegionCheck` each: :attr:`._read_items.ItemFacts.small` already
        holds what :meth:`_region_check` checks (known algorithm, length of the
        chunk's sizes), the header check found them inside the file, and the
        page cache never reads them wastefully (whole chunks). A source
        without a page cache (object storage) takes them all the other way.
        """
        if not isinstance(source, FileSource):
            return [], items
        whole: list[tuple[str, StorageInfo]] = []
        rest: list[ReadItem] = []
        facts_of = self._items.facts
        for item in items:
            facts = facts_of(item)
            info = facts.info
            checksum = info.checksum
            if (facts.small and (checksum is None or not checksum.block_shape or checksum.flat_digests)
                    and info.offset + info.length <= file_size):
                whole.append((item.storage_index.fqn, info))
            else:
                rest.append(item)
        return whole, rest

    def _read_kept(self, source: FileSource, path: Path, check: RegionCheck, item: ReadItem, kept: np.ndarray) -> int:
        """Read ``item``'s region into the private buffer ``kept``, verifying every block or tile it touches."""
        checksum = check.info.checksum
        if checksum.block_shape and not (checksum.flat_digests and kept.nbytes == check.info.length):
            return read_tiles(source, path, check.fqn, check.info, check.sizes, kept.dtype, item, kept,
                              exact=source.exact)
        runs = box_runs(check.sizes, check.itemsize, tuple(item.storage_offsets), tuple(item.lengths))
        rows = kept.reshape(-1).view(np.uint8).reshape(runs.starts.size, runs.length)
        return read_runs_verified(source, path, check.fqn, check.info, runs, rows, self.max_inflight_bytes)

    def _keep_priority(self, check: RegionCheck, item: ReadItem, source: FileSource) -> float:
        """How much a private buffer saves for ``item``'s region: 0 for none, else the device reads saved.

        Regions that gain: tiled regions of a file read with exact device reads
        whose rows share pages with bytes not needed (a narrow column split:
        the page cache would read whole pages, ``O_DIRECT`` reads only the
        region but skips the page cache, so the bytes would be read twice),
        and every tensor region of a source without a page cache (object
        storage). The value is the page amplification avoided (object storage: 1).
        """
        info = check.info
        if check.sizes is None or info.checksum is None or not math.prod(item.lengths):
            return 0.0
        if not isinstance(source, FileSource):
            return 1.0
        if not source.exact or not info.checksum.block_shape or item.lengths[-1] == check.sizes[-1]:
            return 0.0  # whole rows: contiguous pages, the page cache wastes nothing
        sample = (min(item.lengths[0], 256),) + tuple(item.lengths[1:])  # the first rows tell the pattern
        runs = box_runs(check.sizes, check.itemsize, tuple(item.storage_offsets), sample)
        waste = page_amplification(info.offset + runs.starts, runs.length)
        return waste if waste > MAX_PAGE_AMPLIFICATION else 0.0

    def _keep_buffer(self, check: RegionCheck, item: ReadItem) -> np.ndarray | None:
        """A private buffer for the region of ``item``, within ``max_inflight_bytes`` per I/O thread; else ``None``.

        Its bytes are read once, verified, and kept until the read pass copies
        them into the target (see :meth:`_keep_priority` for which regions).
        When the whole region does not fit what is left of the budget, a tiled
        region gets a buffer for its leading rows up to a slab edge of its tile
        grid (so no tile is read both ways); the caller verifies the other rows
        in place.
        """
        nbytes = math.prod(item.lengths) * check.itemsize
        shape = tuple(item.lengths)
        with self._kept_lock:  # max_inflight_bytes per I/O thread
            room = self.max_inflight_bytes * self.thread_count - self._kept_bytes
            if nbytes > room:
                rows = _fitting_rows(check, item, room)
                if not rows:
                    return None
                shape = (rows,) + shape[1:]
                nbytes = math.prod(shape) * check.itemsize
            self._kept_bytes += nbytes
        stored = self.metadata.state_dict_metadata[check.fqn]
        return np.empty(shape, dtype=numpy_dtype(stored.properties.dtype))

    def _region_check(self, path: Path, file_size: int, item: ReadItem) -> RegionCheck:
        """What to verify for ``item``, after checking it fits its file and chunk."""
        fqn = item.storage_index.fqn
        facts = self._items.facts(item)
        info = facts.info
        check_within(path, file_size, fqn, info)
        if info.checksum is not None and info.checksum.algorithm != ALGORITHM:
            raise CorruptCheckpointError(f"key '{fqn}': unknown checksum algorithm {info.checksum.algorithm!r}")
        if info.compression is not None or item.type == LoadItemType.BYTE_IO or facts.sizes is None:
            return RegionCheck(fqn=fqn, info=info, sizes=None, itemsize=1)
        chunk_sizes, itemsize = facts.sizes, facts.itemsize
        if info.length != math.prod(chunk_sizes) * itemsize:
            raise CorruptCheckpointError(
                f"key '{fqn}': stored length {info.length} does not match chunk sizes {list(chunk_sizes)}"
            )
        return RegionCheck(fqn=fqn, info=info, sizes=chunk_sizes, itemsize=itemsize,
                           offsets=tuple(item.storage_offsets), lengths=tuple(item.lengths))
