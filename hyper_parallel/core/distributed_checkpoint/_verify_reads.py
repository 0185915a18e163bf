"""Verifying the stored bytes a load needs before any byte reaches a target.

A load first checks the checksum of every block or tile its regions touch
(this module), on every rank, and only then reads the regions into the
targets (:mod:`.filesystem_reader`). A corrupt byte therefore never reaches
a caller's tensor, and a load that fails on corruption leaves every target
as it was (all or nothing per load).

The bytes are hashed where they lie: a read-only ``mmap`` window of at most
``window`` bytes over the file (``MADV_RANDOM``, with ``POSIX_FADV_WILLNEED``
for exactly the ranges hashed, so the device reads what is verified and no
readahead). Hashing copies nothing; the pages stay in the page cache, where
the reading pass then finds them: the load costs one hash pass and one copy
into the targets, as reading into the target and verifying it there did.
Where a file cannot be mapped (some network filesystems), or the source is
object storage, the window is read into a scratch buffer instead. The reader
keeps some regions instead of hashing them here (see
``FileSystemReader._keep_buffer``): read once, verified in a private buffer,
copied into the target by the read pass.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.byte_ranges import box_runs
from hyper_parallel.core.distributed_checkpoint._format.checksum import digest, grid_shape
from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource, scratch
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import StorageInfo

__all__ = ["RegionCheck", "verify_regions"]

_NO_TARGET_CHANGED = "the checkpoint is corrupt; no target was changed (a load verifies every byte before it copies any)"


@dataclass(frozen=True)
class RegionCheck:
    """One region of a stored chunk whose checksum blocks must be verified.

    Attributes:
        fqn: The key (for messages).
        info: Where the chunk is stored and its checksum.
        sizes: The chunk's shape; ``None`` for values and compressed items (verified whole).
        itemsize: Bytes per element of the stored dtype.
        offsets: Start of the region inside the chunk.
        lengths: Extent of the region.
    """

    fqn: str
    info: StorageInfo
    sizes: tuple[int, ...] | None
    itemsize: int
    offsets: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()


def _flat_blocks(check: RegionCheck) -> range | np.ndarray:
    """Indices of the flat blocks the region touches."""
    block = check.info.checksum.block_bytes
    count = max(1, -(-check.info.length // block))
    if check.sizes is None or math.prod(check.lengths) * check.itemsize == check.info.length:
        return range(count)
    runs = box_runs(check.sizes, check.itemsize, check.offsets, check.lengths)
    if runs.total == 0:
        return range(0)
    marks = np.zeros(count + 1, dtype=np.int64)
    np.add.at(marks, runs.starts // block, 1)
    np.add.at(marks, (runs.starts + runs.length - 1) // block + 1, -1)
    return np.flatnonzero(np.cumsum(marks)[:-1] > 0)


@contextlib.contextmanager
def _window(source: FileSource, path: Path, start: int, end: int,
            ranges: list[tuple[int, int]]) -> Iterator[memoryview]:
    """Bytes ``[start, end)`` of the source, mapped read-only (``ranges``: the parts actually hashed).

    A source without a file descriptor (object storage), or a file that
    cannot be mapped, is read into a scratch buffer instead.
    """
    fd = getattr(source, "fd", None)
    mapped = None
    if fd is not None:
        if hasattr(os, "posix_fadvise"):
            for low, high in ranges:
                os.posix_fadvise(fd, low, high - low, os.POSIX_FADV_WILLNEED)
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            mapped = mmap.mmap(fd, end - aligned, access=mmap.ACCESS_READ, offset=aligned)
        except (OSError, ValueError):
            mapped = None
    if mapped is None:
        buffer = scratch(end - start, slot=2)
        if source.readinto(buffer, start) != end - start:
            raise CorruptCheckpointError(f"data file {path} is truncated (bytes {start}..{end} are verified)")
        yield memoryview(buffer)
        return
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    whole = memoryview(mapped)
    view = whole[start - aligned:]
    try:
        yield view
    finally:
        try:
            view.release()
            whole.release()
            mapped.close()
        except BufferError:  # a traceback still holds a view; the map closes when it is collected
            pass


@dataclass(frozen=True)
class _Block:
    """One flat checksum block to hash: absolute bytes ``[start, end)`` of the file."""

    start: int
    end: int
    digest: str
    check: RegionCheck
    index: int


#: Blocks closer than this in the file share one mapped window (thousands of small items: few maps).
_GAP_BYTES = 1 << 20


def _verify_flat(source: FileSource, path: Path, blocks: list[_Block], window: int) -> int:
    """Hash ``blocks`` (sorted by position), several per mapped window; return the bytes hashed."""
    hashed = 0
    position = 0
    while position < len(blocks):
        first = blocks[position]
        stop = position + 1
        while (stop < len(blocks) and blocks[stop].start - blocks[stop - 1].end <= _GAP_BYTES
               and blocks[stop].end - first.start <= window):
            stop += 1
        group = blocks[position:stop]
        ranges: list[tuple[int, int]] = []
        for block in group:
            if ranges and block.start <= ranges[-1][1]:
                ranges[-1] = (ranges[-1][0], max(ranges[-1][1], block.end))
            else:
                ranges.append((block.start, block.end))
        with _window(source, path, first.start, group[-1].end, ranges) as view:
            bad = next((b for b in group if digest(view[b.start - first.start : b.end - first.start]) != b.digest),
                       None)
        if bad is not None:
            raise CorruptCheckpointError(
                f"checksum mismatch in data file {path}, key '{bad.check.fqn}' (bytes {bad.start}..{bad.end}): "
                f"{_NO_TARGET_CHANGED}"
            )
        hashed += sum(b.end - b.start for b in group)
        position = stop
    return hashed


def _verify_tiles(source: FileSource, path: Path, check: RegionCheck, done: set[tuple[int, int, int]]) -> int:
    """Verify the tiles the region touches, one row slab at a time."""
    info, sizes, itemsize = check.info, check.sizes, check.itemsize
    block = info.checksum.block_shape
    rows, width = block[0], block[-1]
    grid_columns = grid_shape(sizes, block)[1]
    inner = math.prod(sizes[1:-1])
    row_bytes = inner * sizes[-1] * itemsize
    low = check.offsets or (0,) * len(sizes)
    lengths = check.lengths or sizes
    first_column, last_column = low[-1] // width, (low[-1] + lengths[-1] - 1) // width
    hashed = 0
    for slab in range(low[0] // rows, (low[0] + lengths[0] - 1) // rows + 1):
        columns = [c for c in range(first_column, last_column + 1) if (id(info), slab, c) not in done]
        if not columns:
            continue
        row_start, row_end = slab * rows, min((slab + 1) * rows, sizes[0])
        start, end = info.offset + row_start * row_bytes, info.offset + row_end * row_bytes
        col_lo = columns[0] * width * itemsize
        col_hi = min((columns[-1] + 1) * width, sizes[-1]) * itemsize
        if col_hi - col_lo == sizes[-1] * itemsize or inner * (row_end - row_start) > 4096:
            ranges = [(start, end)]
        else:  # only some columns of few rows: exactly their bytes
            ranges = [(start + r * sizes[-1] * itemsize + col_lo, start + r * sizes[-1] * itemsize + col_hi)
                      for r in range((row_end - row_start) * inner)]
        with _window(source, path, start, end, ranges) as view:
            bad = _bad_tile(view, check, slab, columns, row_end - row_start, grid_columns)
        if bad is not None:
            raise CorruptCheckpointError(
                f"checksum mismatch in data file {path}, key '{check.fqn}' (tile {slab},{bad} of the chunk at "
                f"byte {info.offset}): {_NO_TARGET_CHANGED}"
            )
        hashed += (row_end - row_start) * inner * (col_hi - col_lo)
        done.update((id(info), slab, c) for c in columns)
    return hashed


def _bad_tile(view: memoryview, check: RegionCheck, slab: int, columns: list[int], slab_rows: int,
              grid_columns: int) -> int | None:
    """The first of ``columns`` whose tile in ``slab`` does not match its digest, or ``None``."""
    sizes, itemsize, info = check.sizes, check.itemsize, check.info
    width = info.checksum.block_shape[-1]
    inner = math.prod(sizes[1:-1])
    cube = np.frombuffer(view, dtype=np.uint8, count=slab_rows * inner * sizes[-1] * itemsize)
    cube = cube.reshape(slab_rows, inner, sizes[-1] * itemsize)
    for column in columns:
        lo, hi = column * width * itemsize, min((column + 1) * width, sizes[-1]) * itemsize
        tile = scratch(slab_rows * inner * (hi - lo), slot=3).reshape(slab_rows, inner, hi - lo)
        np.copyto(tile, cube[:, :, lo:hi])
        if digest(tile.reshape(-1)) != info.checksum.digests[slab * grid_columns + column]:
            return column
    return None


def verify_regions(source: FileSource, path: Path, checks: list[RegionCheck], window: int) -> int:
    """Verify the checksum blocks of every region in ``checks`` (all in ``source``); return bytes hashed.

    Each block or tile of a chunk is hashed once, however many regions of it are read.
    Expects offsets, lengths and digest counts already checked against the
    file size and the chunk (the reader's set-up and ``check_consistency``).

    Raises:
        CorruptCheckpointError: a mismatch (names the file, key and bytes or tile).
    """
    hashed = 0
    flat: dict[tuple[int, int], _Block] = {}  # (chunk, block index) -> block: each hashed once
    tiles_done: set[tuple[int, int, int]] = set()
    for check in checks:
        info = check.info
        if info.checksum is None:
            continue
        if info.length == 0:
            if info.checksum.digests != (digest(b""),):  # the length itself may be the damage
                raise CorruptCheckpointError(
                    f"checksum mismatch in data file {path}, key '{check.fqn}': the metadata says it stores 0 "
                    f"bytes, its checksum says otherwise; {_NO_TARGET_CHANGED}"
                )
            continue
        if info.checksum.block_shape and check.sizes is not None:
            hashed += _verify_tiles(source, path, check, tiles_done)
            continue
        size = info.checksum.block_bytes
        for blk in _flat_blocks(check):
            blk = int(blk)
            start = info.offset + blk * size
            flat.setdefault((id(info), blk), _Block(start, min(start + size, info.offset + info.length),
                                                    info.checksum.digests[blk], check, blk))
    hashed += _verify_flat(source, path, sorted(flat.values(), key=lambda b: b.start), window)
    return hashed
