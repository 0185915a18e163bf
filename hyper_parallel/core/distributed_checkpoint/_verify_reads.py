"""Verifying the stored bytes a load needs before any byte reaches a target.

A load first checks the checksum of every block or tile its regions touch
(this module), on every rank, and only then reads the regions into the
targets (:mod:`.filesystem_reader`). A corrupt byte therefore never reaches
a caller's tensor, and a load that fails on corruption leaves every target
as it was (all or nothing per load).

The bytes are hashed in windows of at most 8 MiB, in file order. A cold
load reads the next windows while one is hashed: from a file read with
kernel readahead, a window read whole is left to that readahead; every other
window (a sparse one, or any window of a file read without readahead) has
exactly its hashed ranges announced with ``POSIX_FADV_WILLNEED`` up to
32 MiB ahead of the window being hashed (see :func:`announces`). A window hashed whole is read into a cache-sized scratch
buffer and hashed there (measured faster than mapping it: page faults); a
sparse one is mapped read-only with ``MADV_RANDOM``, so the device reads what
is verified and no readahead. The pages stay in the page cache, where the
reading pass then finds them: the load costs one hash pass (through the CPU
cache) and one copy into the targets. The reader
keeps some regions instead of hashing them here (see
``_reader_verify.VerifyPass._keep_buffer``): read once, verified in a private buffer,
copied into the target by the read pass.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.byte_ranges import box_runs
from hyper_parallel.core.distributed_checkpoint._format.checksum import digest, digests_of, grid_shape
from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource, scratch
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import StorageInfo

__all__ = ["PRIME_MIN_BYTES", "RegionCheck", "announces", "lookahead_limits", "page_cached", "prime", "verify_regions"]

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
    """Indices of the flat blocks the region touches (a ``range`` when it covers the whole chunk)."""
    block = check.info.checksum.block_bytes
    count = max(1, -(-check.info.length // block))
    if check.sizes is None or math.prod(check.lengths) * check.itemsize == check.info.length:
        return range(count)
    runs = box_runs(check.sizes, check.itemsize, check.offsets, check.lengths)
    if runs.total == 0:
        return np.zeros(0, dtype=np.int64)
    marks = np.zeros(count + 1, dtype=np.int64)
    np.add.at(marks, runs.starts // block, 1)
    np.add.at(marks, (runs.starts + runs.length - 1) // block + 1, -1)
    return np.flatnonzero(np.cumsum(marks)[:-1] > 0)


@contextlib.contextmanager
def _window(source: FileSource, path: Path, window: _Window) -> Iterator[memoryview]:
    """The bytes of ``window`` in the source.

    Read into a scratch buffer, or mapped read-only when sparse (a file that
    cannot be mapped, or a source without a file descriptor, is read).
    """
    fd = getattr(source, "fd", None)
    mapped = None
    start, end = window.start, window.end
    if fd is not None and not window.whole:  # the caller announced ``window.ranges`` to the kernel (POSIX_FADV_WILLNEED)
        # A sparse window is mapped and faults page by page without read-around, so the device
        # reads only the ranges announced. A window hashed whole is read into a cache-sized
        # scratch buffer instead: measured faster than mapping it (page faults; tiles are gathered
        # from it), 94-99 ms against 131-153 ms per GiB of tiles on this VM.
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            mapped = mmap.mmap(fd, end - aligned, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=aligned)
        except (OSError, ValueError):
            mapped = None
        if mapped is not None and hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
            mapped.madvise(mmap.MADV_RANDOM)
    if mapped is None:
        buffer = scratch(end - start, slot=2)
        if source.readinto(buffer, start) != end - start:
            raise CorruptCheckpointError(f"data file {path} is truncated (bytes {start}..{end} are verified)")
        yield memoryview(buffer)
        return
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
class _Blocks:
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


@dataclass(frozen=True)
class _Slab:
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
class _Window:
    """Bytes ``[start, end)`` of a file hashed at once: flat blocks or one slab of tiles.

    Attributes:
        start: First byte of the window.
        end: End of the window.
        ranges: The parts of the window actually hashed (announced to the kernel ahead).
        first: Index of the window's first flat block in the file's :class:`_Blocks`.
        stop: End of the window's flat blocks (``first == stop``: none).
        slab: The tiles in the window (instead of blocks).
        hashed: Bytes the window verifies.
    """

    start: int
    end: int
    ranges: tuple[tuple[int, int], ...]
    first: int = 0
    stop: int = 0
    slab: _Slab | None = None
    hashed: int = 0

    @property
    def whole(self) -> bool:
        """Whether every byte of the window is hashed (one range: the window itself)."""
        return self.ranges == ((self.start, self.end),)


#: Largest window hashed at once (fits the CPU cache of common machines).
_CACHE_WINDOW = 8 << 20
#: Blocks closer than this in the file share one window (thousands of small items: few reads).
_GAP_BYTES = 1 << 20
#: Bytes announced to the kernel (``POSIX_FADV_WILLNEED``) ahead of the window being hashed, so the
#: device reads the next windows while this one is hashed (a cold load overlaps reading and hashing);
#: windows the kernel reads ahead by itself are not announced (:func:`announces`).
_LOOKAHEAD_BYTES = 32 << 20


#: Bytes of a cold file read ahead by :func:`prime` while its verify pass is prepared.
_PRIME_BYTES = 32 << 20
#: Files needing fewer bytes are not primed (their preparation is short).
PRIME_MIN_BYTES = 16 << 20
#: Unit of a priming read (and the throwaway buffer of its fallback, read into many times over).
_PRIME_PIECE = 256 << 10


def prime(source: FileSource, start: int, end: int) -> bool:
    """Start the device on the first bytes a cold file's load needs while its verify pass is prepared.

    Checking a file's header and building the windows of thousands of
    chunks takes milliseconds in which the device would idle: a helper
    thread reads up to ``_PRIME_BYTES`` from ``start`` into the page cache
    (``sendfile`` to the null device: read as any sequential read is, with
    readahead in large folios, but copied nowhere), where the verify pass
    finds them.
    Nothing is done for a file read without readahead (a resharded load
    reads exactly what it needs, announced) or for fewer than
    ``PRIME_MIN_BYTES`` needed. The caller tells a cold file first
    (:func:`page_cached`: a warm load is not primed). The thread reads
    from its own duplicate of the file descriptor and closes it.

    Args:
        source: The open data file (a :class:`FileSource` read with readahead).
        start: First byte the load needs.
        end: End of the last byte the load needs.

    Returns:
        Whether a priming read was started.
    """
    fd = getattr(source, "fd", None)
    if fd is None or getattr(source, "exact", False) or end - start < PRIME_MIN_BYTES:
        return False
    count = -(-min(end - start, _PRIME_BYTES) // _PRIME_PIECE)
    threading.Thread(target=_prime_read, args=(os.dup(fd), start, count), name="hp-ckpt-prime", daemon=True).start()
    return True


def page_cached(source: FileSource, offset: int) -> bool:
    """Whether byte ``offset`` of ``source`` is in the page cache (``True`` where that cannot be told).

    One non-blocking read of one byte (``RWF_NOWAIT``), which the kernel
    refuses when the byte would have to come from the device.
    """
    fd = getattr(source, "fd", None)
    flag = getattr(os, "RWF_NOWAIT", None)
    if fd is None or flag is None or not hasattr(os, "preadv"):
        return True
    try:
        return os.preadv(fd, [bytearray(1)], offset, flag) > 0
    except BlockingIOError:
        return False
    except OSError:
        return True


def _prime_read(fd: int, start: int, count: int) -> None:
    """Bring ``count`` pieces of ``_PRIME_PIECE`` bytes from ``start`` into the page cache; close ``fd``.

    ``sendfile`` to the null device reads the pages as an ordinary read does
    (readahead, large folios) without copying them anywhere; where it is
    missing or refused, one ``preadv`` over a small throwaway buffer.
    """
    try:
        length = count * _PRIME_PIECE
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                done = 0
                while done < length:
                    sent = os.sendfile(null, fd, start + done, length - done)
                    if sent <= 0:
                        break
                    done += sent
            finally:
                os.close(null)
        except (AttributeError, OSError):
            piece = np.empty(_PRIME_PIECE, dtype=np.uint8)
            os.preadv(fd, [piece] * count, start)
    except OSError:  # only a hint: the verify pass reads (and reports) for real
        pass
    finally:
        os.close(fd)


def _flat_windows(blocks: _Blocks, window: int, others: Sequence[int] = ()) -> list[_Window]:
    """Group ``blocks`` (sorted by position) into windows of at most ``window`` bytes.

    Blocks less than ``_GAP_BYTES`` apart share a window (the gap is read
    along), unless one of ``others`` (sorted starts of windows hashed apart,
    tile slabs) lies in the gap: those bytes are read by their own window, and
    a window with a gap is sparse (mapped, announced page by page). The work
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
    apart[1:] = starts[1:] - reach[:-1] > _GAP_BYTES
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
        windows.append(_Window(start=ranges[0][0], end=ranges[-1][1], ranges=ranges, first=position, stop=stop,
                               hashed=int(hashed[stop] - hashed[position])))
        position = stop
    return windows


def _starts_within(starts: list[int], low: int, high: int) -> bool:
    """Whether one of ``starts`` (sorted) lies in ``[low, high)``."""
    index = bisect.bisect_left(starts, low)
    return index < len(starts) and starts[index] < high


def _tile_windows(check: RegionCheck, done: set[tuple[int, int, int]]) -> list[_Window]:
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
        windows.append(_Window(start=start, end=end, ranges=ranges,
                               slab=_Slab(check=check, slab=slab, columns=columns, rows=row_end - row_start,
                                          grid_columns=grid_columns),
                               hashed=(row_end - row_start) * inner * (col_hi - col_lo)))
        done.update((id(info), slab, c) for c in columns)
    return windows


def _bad_tile(view: memoryview, slab: _Slab) -> int | None:
    """The first of the slab's columns whose tile does not match its digest, or ``None``."""
    check = slab.check
    sizes, itemsize, info = check.sizes, check.itemsize, check.info
    width = info.checksum.block_shape[-1]
    inner = math.prod(sizes[1:-1])
    cube = np.frombuffer(view, dtype=np.uint8, count=slab.rows * inner * sizes[-1] * itemsize)
    cube = cube.reshape(slab.rows, inner, sizes[-1] * itemsize)
    for column in slab.columns:
        lo, hi = column * width * itemsize, min((column + 1) * width, sizes[-1]) * itemsize
        tile = scratch(slab.rows * inner * (hi - lo), slot=3).reshape(slab.rows, inner, hi - lo)
        np.copyto(tile, cube[:, :, lo:hi])
        if digest(tile.reshape(-1)) != info.checksum.digests[slab.slab * slab.grid_columns + column]:
            return column
    return None


def _bad_block(view: memoryview, window: _Window, blocks: _Blocks) -> int | None:
    """Index (in ``blocks``) of the first of the window's flat blocks whose digest does not match, or ``None``.

    The window's blocks are hashed in one pass over the buffer with no Python per block
    (:func:`.checksum.digests_of`); the lists of digests are compared at once.
    """
    first, stop = window.first, window.stop
    base = window.start
    got = digests_of(view, (blocks.starts[first:stop] - base).tolist(), (blocks.ends[first:stop] - base).tolist())
    expected = blocks.digests[first:stop]
    if got == expected:
        return None
    return first + next(k for k, (mine, theirs) in enumerate(zip(got, expected)) if mine != theirs)


def _mismatch(view: memoryview, window: _Window, blocks: _Blocks) -> str | None:
    """The key and the tile or bytes of ``window`` whose digest does not match, for a message; ``None`` if all do."""
    if window.slab is not None:
        column = _bad_tile(view, window.slab)
        if column is None:
            return None
        return (f"key '{window.slab.check.fqn}' (tile {window.slab.slab},{column} of the chunk at byte "
                f"{window.slab.check.info.offset})")
    bad = _bad_block(view, window, blocks)
    if bad is None:
        return None
    return f"key '{blocks.keys[bad]}' (bytes {int(blocks.starts[bad])}..{int(blocks.ends[bad])})"


def lookahead_limits(sizes: list[int], lookahead: int) -> list[int]:
    """For each window, how many windows are announced once it is being hashed.

    Window ``i`` itself and the windows after it that start within
    ``lookahead`` bytes past its end are announced; each window once, in order.

    Args:
        sizes: Byte size of each window, in hashing order.
        lookahead: Bytes announced ahead of the window being hashed.

    Returns:
        ``limits[i]``: windows ``[:limits[i]]`` are announced while window ``i`` is hashed (non-decreasing).
    """
    before = [0]  # before[i]: bytes of the windows before window i
    for size in sizes:
        before.append(before[-1] + size)
    limits = []
    limit = 0
    for position in range(len(sizes)):
        while limit < len(sizes) and (limit <= position or before[limit] < before[position + 1] + lookahead):
            limit += 1
        limits.append(limit)
    return limits


def announces(*, whole: bool, readahead: bool) -> bool:
    """Whether a window's hashed ranges are announced ahead with ``POSIX_FADV_WILLNEED``.

    Not for a window read whole (one ``pread`` of all its bytes) from a file
    the kernel reads ahead: that readahead already fetches the next windows
    while one is hashed, in page-cache folios of up to 2 MiB. Announced a
    window at a time, ``POSIX_FADV_WILLNEED`` fills the cache with single
    4 KiB pages instead (measured on Linux 6.18: 232 of 256 MiB, against 216
    of 256 MiB in 2 MiB folios by readahead), which made the device pass
    1.3-1.7x slower than plain reads and the read pass's copy out of the page
    cache 4x slower (2 files of 512 MiB: 0.197 s against 0.047 s). Every other window is
    announced: a sparse window is mapped without read-around, and a file read
    without readahead (``FileSource.exact``) fetches nothing ahead by itself.

    Args:
        whole: The window is read whole into a buffer (its one hashed range is the whole window).
        readahead: The file is read with kernel readahead.
    """
    return not (whole and readahead)


def _announce(fd: int | None, windows: list[_Window], readahead: bool) -> None:
    """Ask the kernel to start reading ``windows``' hashed ranges where :func:`announces` says so (no-op without a
    file descriptor)."""
    if fd is None or not hasattr(os, "posix_fadvise"):
        return
    for window in windows:
        if not announces(whole=window.whole, readahead=readahead):
            continue
        for low, high in window.ranges:
            os.posix_fadvise(fd, low, high - low, os.POSIX_FADV_WILLNEED)


def _hash_windows(source: FileSource, path: Path, windows: list[_Window], blocks: _Blocks) -> int:
    """Hash ``windows`` in file order, announcing the next ones ahead; return the bytes hashed."""
    fd = getattr(source, "fd", None)
    readahead = not getattr(source, "exact", False)
    limits = lookahead_limits([window.end - window.start for window in windows], _LOOKAHEAD_BYTES)
    announced = 0  # windows[:announced] were announced to the kernel
    hashed = 0
    for position, window in enumerate(windows):
        _announce(fd, windows[announced : limits[position]], readahead)
        announced = limits[position]
        with _window(source, path, window) as view:
            problem = _mismatch(view, window, blocks)
        if problem is not None:
            raise CorruptCheckpointError(f"checksum mismatch in data file {path}, {problem}: {_NO_TARGET_CHANGED}")
        hashed += window.hashed
    return hashed


def _empty_chunk(path: Path, fqn: str, info: StorageInfo) -> None:
    """Refuse a chunk stored in 0 bytes whose checksum is not that of no bytes (the length itself may be the damage)."""
    if info.checksum.digests != (digest(b""),):
        raise CorruptCheckpointError(
            f"checksum mismatch in data file {path}, key '{fqn}': the metadata says it stores 0 "
            f"bytes, its checksum says otherwise; {_NO_TARGET_CHANGED}"
        )


class _BlockList:
    """The flat blocks of one file collected for hashing, each (chunk, block) once; :meth:`done` sorts them."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.digests: list[str] = []
        self.keys: list[str] = []
        self.whole: set[int] = set()  # id() of the chunks listed whole
        self.partial: dict[int, tuple[str, StorageInfo, set[int]]] = {}  # id(chunk) -> key, chunk, blocks

    def add_whole(self, fqn: str, info: StorageInfo) -> None:
        """Every block of the chunk ``info`` (non-empty, flat checksum)."""
        if id(info) in self.whole:
            return
        self.whole.add(id(info))
        checksum, offset, length = info.checksum, info.offset, info.length
        block = checksum.block_bytes
        if length <= block:  # the usual small chunk: one block
            self.starts.append(offset)
            self.ends.append(offset + length)
            self.digests.append(checksum.digests[0])
            self.keys.append(fqn)
            return
        count = -(-length // block)
        starts = range(offset, offset + length, block)
        self.starts.extend(starts)
        self.ends.extend(min(start + block, offset + length) for start in starts)
        self.digests.extend(checksum.digests[:count])
        self.keys.extend([fqn] * count)

    def add_small(self, path: Path, chunks: Iterable[tuple[str, StorageInfo]]) -> None:
        """Every block of each ``(key, chunk)``; the usual chunk of one block costs a few list appends."""
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
                digests.append(checksum.digests[0])
                keys.append(fqn)
            elif length:
                self.add_whole(fqn, info)
            else:
                _empty_chunk(path, fqn, info)

    def add_blocks(self, fqn: str, info: StorageInfo, indices: Sequence[int]) -> None:
        """Blocks ``indices`` of the chunk ``info`` (a part of it is read)."""
        entry = self.partial.setdefault(id(info), (fqn, info, set()))
        entry[2].update(indices)

    def done(self) -> _Blocks:
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
            return _Blocks(starts=starts[order], ends=ends[order], digests=[self.digests[i] for i in rank],
                           keys=[self.keys[i] for i in rank])
        return _Blocks(starts=starts, ends=ends, digests=self.digests, keys=self.keys)


def verify_regions(source: FileSource, path: Path, checks: Sequence[RegionCheck], window: int, *,
                   whole: Iterable[tuple[str, StorageInfo]] = ()) -> int:
    """Verify the checksum blocks of every region in ``checks`` (all in ``source``); return bytes hashed.

    Each block or tile of a chunk is hashed once, however many regions of it
    are read. The windows are hashed in file order, and the device reads the
    next ones (up to ``_LOOKAHEAD_BYTES`` announced, or the kernel's
    readahead; see :func:`announces`) while one is hashed.
    Expects offsets, lengths and digest counts already checked against the
    file size and the chunk (the reader's set-up and ``check_consistency``).

    Args:
        source: The open data file.
        path: Its name, for messages.
        checks: Regions to verify.
        window: Bound on the bytes hashed at once (``max_inflight_bytes``; at most 8 MiB are).
        whole: ``(key, chunk)`` of chunks verified whole that have flat block checksums (or none): the
            thousands of small chunks of a state, taken without a :class:`RegionCheck` each.

    Raises:
        CorruptCheckpointError: a mismatch (names the file, key and bytes or tile).
    """
    flat = _BlockList()
    tiles_done: set[tuple[int, int, int]] = set()
    windows: list[_Window] = []
    flat.add_small(path, whole)
    for check in checks:
        info = check.info
        if info.checksum is None:
            continue
        if not info.length:
            _empty_chunk(path, check.fqn, info)
            continue
        if info.checksum.block_shape and check.sizes is not None:
            windows += _tile_windows(check, tiles_done)
            continue
        indices = _flat_blocks(check)
        if isinstance(indices, range):
            flat.add_whole(check.fqn, info)
        else:
            flat.add_blocks(check.fqn, info, indices.tolist())
    blocks = flat.done()
    # Windows of a few MiB: a window read into scratch stays in the CPU cache while it is hashed.
    windows += _flat_windows(blocks, min(window, _CACHE_WINDOW), sorted(w.start for w in windows))
    windows.sort(key=lambda w: w.start)
    return _hash_windows(source, path, windows, blocks)
