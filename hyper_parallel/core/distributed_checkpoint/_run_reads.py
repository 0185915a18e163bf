"""Reading byte runs of a stored chunk: as stored, or verified by their checksums.

The reader (:mod:`.filesystem_reader`) decides what to read; these functions
do the reading. Flat block checksums are verified by reading every block a
run touches; tile checksums (see :mod:`.checksum`) by reading the tiles a
region touches, one row slab at a time. Buffers come from a per-thread
scratch pool, so the extra memory stays at the in-flight bound.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint._device_reads import read_runs_exact
from hyper_parallel.core.distributed_checkpoint._format.byte_ranges import Runs, box_runs
from hyper_parallel.core.distributed_checkpoint._format.checksum import (
    bad_blocks,
    digest,
    flat_count,
    flat_expected,
    grid_shape,
)
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import StorageInfo
from hyper_parallel.core.distributed_checkpoint.planner import ReadItem

__all__ = ["FileSource", "read_runs", "read_runs_verified", "read_tiles", "run_rows", "scratch", "release_scratch",
           "HUGE_PAGE_BYTES", "huge_page_buffer"]


class FileSource:
    """Byte source of one open data file: positioned reads with ``preadv``.

    The object backend's :class:`._object_io.RangedSource` has the same
    methods (ranged GETs), so every read below works on either.

    Attributes:
        fd: The open file.
        exact: The file is read without readahead; scattered runs go through
            :func:`._device_reads.read_runs_exact` (set by the reader).
        ahead: The thread reading a cold file ahead of the verify pass, told of its progress
            (:class:`._read_priming.ReadAhead`; set by the reader when it primes the file).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.exact = False
        self.ahead: Any = None

    def readinto(self, buffer: np.ndarray, offset: int) -> int:
        """Fill ``buffer`` from byte ``offset``; return the bytes got (short at the end of the file)."""
        return os.preadv(self.fd, [buffer], offset)

    def read_rows(self, rows: list[np.ndarray], offsets: list[int]) -> int:
        """Fill each ``rows[i]`` from byte ``offsets[i]``; return the bytes got."""
        got = 0
        for row, offset in zip(rows, offsets):
            got += os.preadv(self.fd, [row], offset)
        return got

    def readinto_many(self, buffers: list[np.ndarray], offset: int) -> int:
        """Fill ``buffers`` (contiguous arrays of any dtype) one after the other from consecutive bytes at
        ``offset``; return the bytes got."""
        return os.preadv(self.fd, buffers, offset)


def read_runs(
    source: FileSource, path: Path, fqn: str, info: StorageInfo, runs: Runs, target: np.ndarray, *,
    exact: bool = False,
) -> int:
    """Fill ``target`` (``uint8``, one row per run) with the runs as stored; return the bytes read.

    ``exact`` (a :class:`FileSource` read without readahead): scattered runs go through
    :func:`._device_reads.read_runs_exact` (the device reads about the runs' bytes only).
    """
    if exact and runs.starts.size > 1:
        read_runs_exact(source.fd, path, fqn, info.offset + runs.starts, runs.length, target)
        return runs.total
    starts = runs.starts.tolist()
    got = source.read_rows([target[position] for position in range(len(starts))],
                           [info.offset + start for start in starts])
    if got != runs.total:
        raise CorruptCheckpointError(f"data file {path} is truncated while reading key '{fqn}'")
    return runs.total


def read_runs_verified(
    source: FileSource, path: Path, fqn: str, info: StorageInfo, runs: Runs, target: np.ndarray, max_inflight_bytes: int
) -> int:
    """Fill ``target`` with the runs, reading and verifying the whole flat checksum blocks they touch (of a flat
    checksum, or a tiled one's ``flat_digests``).

    Blocks are read in segments of at most ``max_inflight_bytes``; an item
    read whole goes straight into the target and is verified in place.
    Expects metadata that passed ``check_consistency`` (the reader's set-up).
    Returns the bytes read from storage.
    """
    checksum = info.checksum
    block = checksum.block_bytes
    expected = flat_expected(checksum)  # a tiled chunk's flat blocks (format 2.2; the reader sends no 2.1 one)
    nblocks = flat_count(info.length, block)  # digest count checked by _format.metadata_json.check_consistency
    if runs.starts.size == 1 and runs.length == info.length and target[0].flags.c_contiguous:
        # The whole item: read straight into the target, verify it in place.
        got = source.readinto(target[0], info.offset)
        if got != info.length:
            raise CorruptCheckpointError(f"data file {path} is truncated while reading key '{fqn}'")
        bad = bad_blocks(memoryview(target[0]), checksum, None, 1)
        if bad:
            raise CorruptCheckpointError(
                f"checksum mismatch in data file {path}, key '{fqn}' (bytes {info.offset + bad[0] * block}.."
                f"{info.offset + min((bad[0] + 1) * block, info.length)}): the checkpoint is corrupt"
            )
        return info.length
    starts = runs.starts
    first = starts // block
    last = (starts + runs.length - 1) // block
    marks = np.zeros(nblocks + 1, dtype=np.int64)
    np.add.at(marks, first, 1)
    np.add.at(marks, last + 1, -1)
    touched = np.flatnonzero(np.cumsum(marks)[:-1] > 0)
    per_segment = max(1, max_inflight_bytes // block)
    segments: list[tuple[int, int]] = []
    for blk in touched.tolist():
        if segments and segments[-1][1] == blk and blk - segments[-1][0] < per_segment:
            segments[-1] = (segments[-1][0], blk + 1)
        else:
            segments.append((blk, blk + 1))
    read = 0
    length = runs.length
    for first_block, end_block in segments:
        seg_start = first_block * block
        seg_end = min(end_block * block, info.length)
        buffer = scratch(seg_end - seg_start, slot=1)
        got = source.readinto(buffer, info.offset + seg_start)
        if got != buffer.size:
            raise CorruptCheckpointError(f"data file {path} is truncated while reading key '{fqn}'")
        read += got
        for blk in range(first_block, end_block):
            lo = blk * block - seg_start
            if digest(memoryview(buffer[lo : lo + block])) != expected[blk]:
                raise CorruptCheckpointError(
                    f"checksum mismatch in data file {path}, key '{fqn}' (bytes {info.offset + blk * block}.."
                    f"{info.offset + min((blk + 1) * block, info.length)}): the checkpoint is corrupt"
                )
        lo_run = int(np.searchsorted(starts, seg_start - length, side="right"))
        hi_run = int(np.searchsorted(starts, seg_end, side="left"))
        for position in range(lo_run, hi_run):
            start = int(starts[position])
            ov_start, ov_end = max(start, seg_start), min(start + length, seg_end)
            if ov_start >= ov_end:
                continue
            target[position, ov_start - start : ov_end - start] = buffer[ov_start - seg_start : ov_end - seg_start]
    return read


def read_tiles(
    source: FileSource,
    path: Path,
    fqn: str,
    info: StorageInfo,
    sizes: tuple[int, ...],
    stored_dtype: np.dtype,
    item: ReadItem,
    dest: np.ndarray,
    *,
    exact: bool = False,
) -> int:
    """Read the checksum tiles the region touches, verify each, copy the region out.

    One row slab of tiles at a time (bounded memory); only the column
    groups the region needs are read.
    """
    # Tile shape and digest count were checked against the chunk by _format.metadata_json.check_consistency.
    block = info.checksum.block_shape
    itemsize = stored_dtype.itemsize
    rows, width = block[0], block[-1]
    grid_columns = grid_shape(sizes, block)[1]
    low, lengths = item.storage_offsets, item.lengths
    first_column, last_column = low[-1] // width, (low[-1] + lengths[-1] - 1) // width
    column_start = first_column * width
    column_end = min((last_column + 1) * width, sizes[-1])
    inner = math.prod(sizes[1:-1])
    count = 0
    for slab in range(low[0] // rows, (low[0] + lengths[0] - 1) // rows + 1):
        row_start = slab * rows
        box_offsets = (row_start,) + (0,) * (len(sizes) - 2) + (column_start,)
        box_lengths = (min(rows, sizes[0] - row_start),) + tuple(sizes[1:-1]) + (column_end - column_start,)
        runs = box_runs(sizes, itemsize, box_offsets, box_lengths)
        buffer = scratch(runs.total).reshape(runs.starts.size, runs.length)
        count += read_runs(source, path, fqn, info, runs, buffer, exact=exact)
        cube = buffer.reshape(box_lengths[0], inner, (column_end - column_start) * itemsize)
        for column in range(first_column, last_column + 1):
            start = (column * width - column_start) * itemsize
            stop = (min((column + 1) * width, sizes[-1]) - column_start) * itemsize
            part = cube[:, :, start:stop]
            tile = scratch(part.size, slot=2)  # reused: no allocation per tile
            np.copyto(tile.reshape(part.shape), part)
            if digest(tile) != info.checksum.digests[slab * grid_columns + column]:
                raise CorruptCheckpointError(
                    f"checksum mismatch in data file {path}, key '{fqn}' (tile {slab},{column} of the chunk "
                    f"at offset {list(item.storage_index.offset)}): the checkpoint is corrupt"
                )
        box = buffer.view(stored_dtype).reshape(box_lengths)
        lo = [max(a, b) for a, b in zip(low, box_offsets)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(low, lengths, box_offsets, box_lengths)]
        stored = box[tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, box_offsets))]
        target = dest[tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, low))]
        np.copyto(target, stored, casting="unsafe")
    return count


def run_rows(region: np.ndarray, runs: Runs, stored_dtype: np.dtype) -> np.ndarray | None:
    """A ``uint8`` (runs, run bytes) view of ``region`` to read straight into, or ``None``.

    Possible when the target has the stored dtype and each run is contiguous
    in the target's memory (the rows may be strided).
    """
    if region.dtype != stored_dtype or runs.length % region.itemsize:
        return None
    view = region.view()
    try:
        view.shape = (runs.starts.size, runs.length // region.itemsize)
    except AttributeError:
        return None
    if view.shape[1] > 1 and view.strides[1] != region.itemsize:
        return None
    if not view.flags.writeable:
        return None
    return view.view(np.uint8)


SCRATCH = threading.local()


#: Size of a transparent huge page (x86-64 and arm64 with 4 KiB base pages).
HUGE_PAGE_BYTES = 2 << 20


def huge_page_buffer(nbytes: int) -> np.ndarray:
    """A fresh ``uint8`` buffer of ``nbytes``: an anonymous mapping advised for transparent huge pages.

    The kernel backs each whole huge page inside the mapping with one
    (``MADV_HUGEPAGE``; no effect where the OS offers none) and the rest
    with small pages, so the buffer never takes more memory than ``nbytes``.
    Unmapped when the array is freed.
    """
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # pragma: no cover - no anonymous mappings on this platform
        return np.empty(nbytes, dtype=np.uint8)
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE, or a kernel without them
        mapped.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapped, dtype=np.uint8)


def scratch(nbytes: int, slot: int = 0, *, huge: bool = False) -> np.ndarray:
    """A per-thread reusable ``uint8`` buffer of ``nbytes`` (grown on demand).

    Reusing it keeps the reader's extra memory at the in-flight bound instead
    of leaving freed buffers to the allocator. ``slot`` separates buffers in
    use at the same time. ``huge``: a new buffer of a huge page or more is a
    :func:`huge_page_buffer` (the verify pass's: the kernel's scatter read of
    a slab of tiles, 1 KiB row pieces into 8 tiles, took 12-18% less CPU into
    huge pages than into 4 KiB pages on this VM).
    """
    buffers = getattr(SCRATCH, "buffers", None)
    if buffers is None:
        buffers = SCRATCH.buffers = {}
    buffer = buffers.get(slot)
    if buffer is None or buffer.size < nbytes:
        size = max(nbytes, 1)
        buffer = buffers[slot] = huge_page_buffer(size) if huge and size >= HUGE_PAGE_BYTES else np.empty(
            size, dtype=np.uint8)
    return buffer[:nbytes]


def release_scratch() -> None:
    """Drop this thread's scratch buffers (after a load)."""
    SCRATCH.buffers = None
