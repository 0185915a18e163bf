"""Which stored bytes a load's verify pass hashes, grouped into the windows it hashes at once.

The reader describes each region to verify (:class:`RegionCheck`, or a
small whole chunk as ``(key, chunk)``); this module turns them into the
flat checksum blocks of a file (:class:`Blocks`: parallel arrays, one entry
per block, so thousands of small chunks cost a few array operations) and the
tile slabs of tiled chunks, each block or tile once, and groups them into
windows of a few MiB in file order (:func:`flat_windows`,
:func:`tile_windows`). :mod:`._verify_reads` reads and hashes the windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.byte_ranges import box_runs
from hyper_parallel.core.distributed_checkpoint._format.checksum import digest, flat_count, grid_shape
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import StorageInfo

__all__ = ["BlockList", "Blocks", "GAP_BYTES", "NO_TARGET_CHANGED", "RegionCheck", "Slab", "Window", "empty_chunk",
           "flat_blocks", "flat_windows", "tile_windows"]

NO_TARGET_CHANGED = "the checkpoint is corrupt; no target was changed (a load verifies every byte before it copies any)"
#: Blocks closer than this in the file share one window (thousands of small items: few reads).
GAP_BYTES = 1 << 20


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


def flat_blocks(check: RegionCheck) -> range | np.ndarray:
    """Indices of the flat blocks the region touches (a ``range`` when it covers the whole chunk)."""
    block = check.info.checksum.block_bytes
    count = flat_count(check.info.length, block)
    if check.sizes is None or math.prod(check.lengths) * check.itemsize == check.info.length:
        return range(count)
    runs = box_runs(check.sizes, check.itemsize, check.offsets, check.lengths)
    if runs.total == 0:
        return np.zeros(0, dtype=np.int64)
    marks = np.zeros(count + 1, dtype=np.int64)
    np.add.at(marks, runs.starts // block, 1)
    np.add.at(marks, (runs.starts + runs.length - 1) // block + 1, -1)
    return np.flatnonzero(np.cumsum(marks)[:-1] > 0)


@dataclass(frozen=True)
class Blocks:
    """The flat checksum blocks of one file a load verifies, sorted by position (one entry per block).

    Parallel sequences, so that thousands of small chunks cost a few array
    operations, not an object each.

    Attributes:
        starts: First byte of each block in the file (``int64``, sorted).
        ends: End of each block (``int64``).
        digests: Expected digest of each block.
        keys: The key each block belongs to (for messages).
    """

    starts: np.ndarray
    ends: np.ndarray
    digests: Sequence[str]
    keys: Sequence[str]

    @cached_property
    def bounds(self) -> tuple[list[int], list[int]]:
        """``starts`` and ``ends`` as lists of ints, made once per file: a window read piece by piece slices them
        (a few array operations per window cost more than its Python, about 7% of a warm verify pass's CPU)."""
        return self.starts.tolist(), self.ends.tolist()


@dataclass(frozen=True)
class Slab:
    """The tiles of one row slab of a tiled chunk that a load touches.

    Attributes:
        check: The region (chunk, key) the tiles belong to.
        slab: Row index of the slab in the tile grid.
        columns: Column indices of the tiles to verify.
        rows: Rows of the chunk in the slab.
        grid_columns: Tiles per slab in the chunk's grid.
    """

    check: RegionCheck
    slab: int
    columns: tuple[int, ...]
    rows: int
    grid_columns: int


@dataclass(frozen=True)
class Window:
    """Bytes ``[start, end)`` of a file hashed at once: flat blocks or one slab of tiles.

    Attributes:
        start: First byte of the window.
        end: End of the window.
        ranges: The parts of the window actually hashed (announced to the kernel ahead).
        first: Index of the window's first flat block in the file's :class:`Blocks`.
        stop: End of the window's flat blocks (``first == stop``: none).
        slab: The tiles in the window (instead of blocks).
        hashed: Bytes the window verifies.
    """

    start: int
    end: int
    ranges: tuple[tuple[int, int], ...]
    first: int = 0
    stop: int = 0
    slab: Slab | None = None
    hashed: int = 0

    @property
    def whole(self) -> bool:
        """Whether every byte of the window is hashed (one range: the window itself)."""
        return self.ranges == ((self.start, self.end),)


def flat_windows(blocks: Blocks, window: int, others: Sequence[int] = ()) -> list[Window]:
    """Group ``blocks`` (sorted by position) into windows of at most ``window`` bytes.

    Blocks less than ``GAP_BYTES`` apart share a window, unless one of
    ``others`` (sorted starts of windows hashed apart, tile slabs) lies in the
    gap: those bytes are read by their own window, and a window with a gap is
    sparse (only its ranges read, announced page by page). The work
    is a few array operations per window, none per block.
    """
    starts, ends = blocks.starts, blocks.ends
    count = starts.size
    if not count:
        return []
    reach = np.maximum.accumulate(ends)  # end of the bytes covered so far (blocks never overlap in a sound file)
    fresh = np.ones(count, dtype=bool)  # block k starts a new hashed range (a gap before it)
    fresh[1:] = starts[1:] > reach[:-1]
    apart = np.zeros(count, dtype=bool)  # block k must start a new window
    apart[1:] = starts[1:] - reach[:-1] > GAP_BYTES
    if len(others):
        marks = np.asarray(others, dtype=np.int64)
        apart[1:] |= np.searchsorted(marks, reach[:-1]) < np.searchsorted(marks, starts[1:])
    forced = np.flatnonzero(apart)
    hashed = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(ends - starts, out=hashed[1:])
    windows = []
    position = 0
    while position < count:
        following = int(np.searchsorted(forced, position, side="right"))
        stop = int(forced[following]) if following < forced.size else count
        fitting = int(np.searchsorted(reach, int(starts[position]) + window, side="right"))
        stop = max(position + 1, min(stop, fitting))
        heads = np.flatnonzero(fresh[position + 1 : stop]) + position + 1
        first = [position] + heads.tolist()
        last = (heads - 1).tolist() + [stop - 1]
        ranges = tuple(zip(starts[first].tolist(), reach[last].tolist()))
        windows.append(Window(start=ranges[0][0], end=ranges[-1][1], ranges=ranges, first=position, stop=stop,
                               hashed=int(hashed[stop] - hashed[position])))
        position = stop
    return windows


def tile_windows(check: RegionCheck, done: set[tuple[int, int, int]]) -> list[Window]:
    """One window per row slab of the tiles the region touches (tiles in ``done`` are skipped, then added)."""
    info, sizes, itemsize = check.info, check.sizes, check.itemsize
    block = info.checksum.block_shape
    rows, width = block[0], block[-1]
    grid_columns = grid_shape(sizes, block)[1]
    inner = math.prod(sizes[1:-1])
    row_bytes = inner * sizes[-1] * itemsize
    low = check.offsets or (0,) * len(sizes)
    lengths = check.lengths or sizes
    first_column, last_column = low[-1] // width, (low[-1] + lengths[-1] - 1) // width
    windows = []
    for slab in range(low[0] // rows, (low[0] + lengths[0] - 1) // rows + 1):
        columns = tuple(c for c in range(first_column, last_column + 1) if (id(info), slab, c) not in done)
        if not columns:
            continue
        row_start, row_end = slab * rows, min((slab + 1) * rows, sizes[0])
        start, end = info.offset + row_start * row_bytes, info.offset + row_end * row_bytes
        col_lo = columns[0] * width * itemsize
        col_hi = min((columns[-1] + 1) * width, sizes[-1]) * itemsize
        if col_hi - col_lo == sizes[-1] * itemsize or inner * (row_end - row_start) > 4096:
            ranges: tuple[tuple[int, int], ...] = ((start, end),)
        else:  # only some columns of few rows: exactly their bytes
            ranges = tuple((start + r * sizes[-1] * itemsize + col_lo, start + r * sizes[-1] * itemsize + col_hi)
                           for r in range((row_end - row_start) * inner))
        windows.append(Window(start=start, end=end, ranges=ranges,
                               slab=Slab(check=check, slab=slab, columns=columns, rows=row_end - row_start,
                                          grid_columns=grid_columns),
                               hashed=(row_end - row_start) * inner * (col_hi - col_lo)))
        done.update((id(info), slab, c) for c in columns)
    return windows


def empty_chunk(path: Path, fqn: str, info: StorageInfo) -> None:
    """Refuse a chunk stored in 0 bytes whose checksum is not that of no bytes (the length itself may be the damage)."""
    if info.checksum.digests != (digest(b""),):
        raise CorruptCheckpointError(
            f"checksum mismatch in data file {path}, key '{fqn}': the metadata says it stores 0 "
            f"bytes, its checksum says otherwise; {NO_TARGET_CHANGED}"
        )


class BlockList:
    """The flat blocks of one file collected for hashing, each (chunk, block) once; :meth:`done` sorts them."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.digests: list[str] = []
        self.keys: list[str] = []
        self.whole: set[int] = set()  # id() of the chunks listed whole
        self.partial: dict[int, tuple[str, StorageInfo, set[int]]] = {}  # id(chunk) -> key, chunk, blocks

    def add_whole(self, fqn: str, info: StorageInfo) -> None:
        """Every flat block of the chunk ``info`` (non-empty; a flat checksum, or tiles with ``flat_digests``)."""
        if id(info) in self.whole:
            return
        self.whole.add(id(info))
        checksum, offset, length = info.checksum, info.offset, info.length
        block = checksum.block_bytes
        expected = checksum.flat_digests or checksum.digests
        if length <= block:  # the usual small chunk: one block
            self.starts.append(offset)
            self.ends.append(offset + length)
            self.digests.append(expected[0])
            self.keys.append(fqn)
            return
        count = -(-length // block)
        starts = range(offset, offset + length, block)
        self.starts.extend(starts)
        self.ends.extend(min(start + block, offset + length) for start in starts)
        self.digests.extend(expected[:count])
        self.keys.extend([fqn] * count)

    def add_small(self, path: Path, chunks: Iterable[tuple[str, StorageInfo]]) -> None:
        """Every flat block of each ``(key, chunk)`` (a flat checksum, tiles with ``flat_digests``, or none); the
        usual chunk of one block costs a few list appends."""
        whole, starts, ends, digests, keys = self.whole, self.starts, self.ends, self.digests, self.keys
        for fqn, info in chunks:
            checksum = info.checksum
            if checksum is None:
                continue
            length = info.length
            if 0 < length <= checksum.block_bytes and id(info) not in whole:
                whole.add(id(info))
                starts.append(info.offset)
                ends.append(info.offset + length)
                digests.append((checksum.flat_digests or checksum.digests)[0])
                keys.append(fqn)
            elif length:
                self.add_whole(fqn, info)
            else:
                empty_chunk(path, fqn, info)

    def add_blocks(self, fqn: str, info: StorageInfo, indices: Sequence[int]) -> None:
        """Blocks ``indices`` of the chunk ``info`` (a part of it is read)."""
        entry = self.partial.setdefault(id(info), (fqn, info, set()))
        entry[2].update(indices)

    def done(self) -> Blocks:
        """The blocks, sorted by position."""
        for key, (fqn, info, indices) in self.partial.items():
            if key in self.whole:
                continue
            block = info.checksum.block_bytes
            for index in sorted(indices):
                start = info.offset + index * block
                self.starts.append(start)
                self.ends.append(min(start + block, info.offset + info.length))
                self.digests.append(info.checksum.digests[index])
                self.keys.append(fqn)
        starts = np.array(self.starts, dtype=np.int64)
        ends = np.array(self.ends, dtype=np.int64)
        if starts.size > 1 and bool((starts[1:] < starts[:-1]).any()):
            order = np.argsort(starts, kind="stable")
            rank = order.tolist()
            return Blocks(starts=starts[order], ends=ends[order], digests=[self.digests[i] for i in rank],
                           keys=[self.keys[i] for i in rank])
        return Blocks(starts=starts, ends=ends, digests=self.digests, keys=self.keys)
