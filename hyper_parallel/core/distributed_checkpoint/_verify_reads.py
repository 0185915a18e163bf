"""Verifying the stored bytes a load needs before any byte reaches a target.

A load first checks the checksum of every block or tile its regions touch
(this module; which blocks and tiles, in which windows: :mod:`._verify_windows`),
on every rank, and only then reads the regions into the
targets (:mod:`.filesystem_reader`). A corrupt byte therefore never reaches
a caller's tensor, and a load that fails on corruption leaves every target
as it was (all or nothing per load).

The bytes are hashed in windows of at most 8 MiB, in file order. A cold
load reads the next windows while one is hashed: from a file read with
kernel readahead, a window read whole is left to that readahead; every other
window (a sparse one, or any window of a file read without readahead) has
exactly its hashed ranges announced with ``POSIX_FADV_WILLNEED`` up to
32 MiB ahead of the window being hashed (see :func:`announces`). A window
of flat blocks hashed whole is read 1 MiB at a time into a scratch buffer
that stays in the core's own cache, and each piece's many small blocks are
hashed in one loop without Python per block; a slab of tiles hashed whole is
read straight into tile order (:mod:`._verify_tiles`). Of a sparse window
only its hashed ranges are read, each at its place in a scratch buffer (ranges
sharing pages in one call), so the device reads what is verified and no more.
No data file is mapped: a mapped file that another process truncates kills
the reader with ``SIGBUS``, a read only comes back short (reported as a
truncated file). The pages stay in the page cache, where the reading pass then
finds them: the load costs one hash pass (through the CPU cache) and one
copy into the targets. The reader keeps some regions instead of hashing
them here (see ``_reader_verify.VerifyPass._keep_buffer``): read once,
verified in a private buffer, copied into the target by the read pass.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from bisect import bisect_left
from operator import sub
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.checksum import digest, digests_of
from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource, scratch
from hyper_parallel.core.distributed_checkpoint._verify_share import SharedFile, WindowShare
from hyper_parallel.core.distributed_checkpoint._verify_tiles import bad_tile, bad_tile_scattered, scatters, tile_problem
from hyper_parallel.core.distributed_checkpoint._verify_windows import (
    NO_TARGET_CHANGED,
    BlockList,
    Blocks,
    RegionCheck,
    Window,
    empty_chunk,
    flat_blocks,
    flat_windows,
    tile_windows,
)
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import StorageInfo

__all__ = ["RegionCheck", "announces", "hash_taken", "lookahead_limits", "page_runs", "verify_regions"]

#: Largest window hashed at once (fits the CPU cache of common machines).
_CACHE_WINDOW = 8 << 20
#: Bytes of a flat window read and hashed at a time (whole blocks; fits the core's own cache).
_PIECE_BYTES = 1 << 20
#: Bytes announced to the kernel (``POSIX_FADV_WILLNEED``) ahead of the window being hashed, so the
#: device reads the next windows while this one is hashed (a cold load overlaps reading and hashing);
#: windows the kernel reads ahead by itself are not announced (:func:`announces`).
_LOOKAHEAD_BYTES = 32 << 20
#: Page size of the page cache (the unit the device reads a file in).
_PAGE_BYTES = mmap.PAGESIZE


@contextlib.contextmanager
def _window(source: FileSource, path: Path, window: Window) -> Iterator[memoryview]:
    """The bytes of ``window``, read into a scratch buffer at their places in the window.

    A window hashed whole is read in one call. Of a sparse window only the
    hashed ranges are read, each at its place (the bytes between them are
    left as they were: nothing hashes them), ranges whose pages touch in one
    call (:func:`page_runs`): the device reads the pages of the ranges and no
    more (the caller announced them; a file read without readahead has
    ``POSIX_FADV_RANDOM`` on its descriptor). No data file is mapped: a file
    another process truncates meanwhile gives a short read, reported as a
    truncated file, where a mapping would kill the process with ``SIGBUS``.
    A source without a file descriptor (object storage) reads the window whole.

    Raises:
        CorruptCheckpointError: the file ends inside a range read.
    """
    start, end = window.start, window.end
    array = scratch(end - start, slot=2, huge=True)
    buffer = memoryview(array)
    fd = getattr(source, "fd", None)
    if fd is None or window.whole:
        if source.readinto(array, start) != end - start:  # an object store's source fills arrays
            raise CorruptCheckpointError(f"data file {path} is truncated (bytes {start}..{end} are verified)")
        yield buffer
        return
    for low, high in page_runs(window.ranges):
        if os.preadv(fd, [buffer[low - start : high - start]], low) != high - low:
            raise CorruptCheckpointError(f"data file {path} is truncated (bytes {low}..{high} are verified)")
    yield buffer


def page_runs(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` (sorted, disjoint) merged where no whole page lies between two of them: one read each.

    A read of the merged run makes the device read the same pages as reads
    of its ranges would (every page it touches holds a byte of a range), in
    fewer calls: rows narrower than a page are read many per call.
    """
    if len(ranges) < 2:
        return list(ranges)
    bounds = np.asarray(ranges, dtype=np.int64)
    lows, highs = bounds[:, 0], bounds[:, 1]
    apart = np.flatnonzero(lows[1:] // _PAGE_BYTES > (highs[:-1] - 1) // _PAGE_BYTES + 1) + 1
    firsts = np.concatenate(([0], apart))
    lasts = np.concatenate((apart - 1, [len(ranges) - 1]))
    return list(zip(lows[firsts].tolist(), highs[lasts].tolist()))


def _bad_block(view: memoryview, window: Window, blocks: Blocks) -> int | None:
    """Index (in ``blocks``) of the first of the window's flat blocks whose digest does not match, or ``None``.

    The window's blocks are hashed in one pass over the buffer with no Python per block
    (:func:`.checksum.digests_of`); the lists of digests are compared at once.
    """
    first, stop = window.first, window.stop
    base = window.start
    got = digests_of(view, (blocks.starts[first:stop] - base).tolist(), (blocks.ends[first:stop] - base).tolist())
    return _first_bad(got, blocks, first, stop)


def _first_bad(got: list[str], blocks: Blocks, first: int, stop: int) -> int | None:
    """Index of the first of blocks ``[first:stop]`` whose digest in ``got`` does not match, or ``None``."""
    expected = blocks.digests[first:stop]
    if got == expected:
        return None
    return first + next(k for k, (mine, theirs) in enumerate(zip(got, expected)) if mine != theirs)


def _bad_block_read(fd: int, path: Path, window: Window, blocks: Blocks) -> int | None:
    """:func:`_bad_block` of a flat window hashed whole, read from ``fd`` piece by piece.

    A piece is the blocks starting in one ``_PIECE_BYTES`` step of the
    window: read into the same small buffer and hashed at once, while the
    core's own cache holds it (one read of the whole window left its first
    bytes to the shared cache before they were hashed). The window's digests
    are compared at once, at the end. The pieces are found on the file's
    block bounds as lists (:attr:`.Blocks.bounds`) by bisection, with no
    array operation per window: a piece of one block (the blocks of a large
    chunk) costs a read, a hash and a few Python steps.

    Raises:
        CorruptCheckpointError: the file ends inside the window.
    """
    first, stop = window.first, window.stop
    base = window.start
    all_starts, all_ends = blocks.bounds
    starts, ends = all_starts[first:stop], all_ends[first:stop]
    buffer = memoryview(scratch(min(window.end - base, _PIECE_BYTES + max(map(sub, ends, starts))), slot=2, huge=True))
    got: list[str] = []
    count = stop - first
    low = 0
    while low < count:
        offset = starts[low]
        # the piece: the blocks starting before the next step of the window (found by bisection, no Python per block)
        high = bisect_left(starts, base + ((offset - base) // _PIECE_BYTES + 1) * _PIECE_BYTES, low + 1, count)
        length = ends[high - 1] - offset
        piece = buffer[:length]
        if os.preadv(fd, [piece], offset) != length:
            raise CorruptCheckpointError(f"data file {path} is truncated (bytes {base}..{window.end} are verified)")
        if high == low + 1:
            got.append(digest(piece))
        else:
            got += digests_of(buffer, [start - offset for start in starts[low:high]],
                              [end - offset for end in ends[low:high]])
        low = high
    return _first_bad(got, blocks, first, stop)


def _mismatch(view: memoryview, window: Window, blocks: Blocks) -> str | None:
    """The key and the tile or bytes of ``window`` whose digest does not match, for a message; ``None`` if all do."""
    if window.slab is not None:
        return tile_problem(window.slab, bad_tile(view, window.slab))
    return _block_problem(_bad_block(view, window, blocks), blocks)


def _block_problem(bad: int | None, blocks: Blocks) -> str | None:
    """The key and bytes of flat block ``bad``, for a message; ``None`` if ``bad`` is."""
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
    announced: a sparse window's ranges are read one by one (a file read with
    readahead would fetch the gaps too when such a read missed the cache),
    and a file read without readahead (``FileSource.exact``) fetches nothing
    ahead by itself.

    Args:
        whole: The window is read whole into a buffer (its one hashed range is the whole window).
        readahead: The file is read with kernel readahead.
    """
    return not (whole and readahead)


def _announce(fd: int | None, windows: list[Window], readahead: bool) -> None:
    """Ask the kernel to start reading ``windows``' hashed ranges where :func:`announces` says so (no-op without a
    file descriptor)."""
    if fd is None or not hasattr(os, "posix_fadvise"):
        return
    for window in windows:
        if not announces(whole=window.whole, readahead=readahead):
            continue
        for low, high in window.ranges:
            os.posix_fadvise(fd, low, high - low, os.POSIX_FADV_WILLNEED)


def _hash_window(source: FileSource, path: Path, window: Window, blocks: Blocks) -> int:
    """Hash one window; return its bytes verified.

    Raises:
        CorruptCheckpointError: a mismatch (names the file, key and bytes or tile).
    """
    done = False
    fd = getattr(source, "fd", None)
    if scatters(source, window):  # read straight into tile order: no second pass to gather tiles
        done, column = bad_tile_scattered(fd, window)
        problem = tile_problem(window.slab, column)
    elif fd is not None and window.slab is None and window.whole:
        done, problem = True, _block_problem(_bad_block_read(fd, path, window, blocks), blocks)
    if not done:
        with _window(source, path, window) as view:
            problem = _mismatch(view, window, blocks)
    if problem is not None:
        raise CorruptCheckpointError(f"checksum mismatch in data file {path}, {problem}: {NO_TARGET_CHANGED}")
    return window.hashed


def _hash_windows(source: FileSource, path: Path, windows: list[Window], blocks: Blocks,
                  share: WindowShare | None = None) -> int:
    """Hash ``windows`` in file order, announcing the next ones ahead; return the bytes hashed.

    With ``share``, other I/O threads may take windows from the back meanwhile (:mod:`._verify_share`).
    """
    fd = getattr(source, "fd", None)
    readahead = not getattr(source, "exact", False)
    limits = lookahead_limits([window.end - window.start for window in windows], _LOOKAHEAD_BYTES)
    announced = 0  # windows[:announced] were announced to the kernel
    ahead = getattr(source, "ahead", None)  # a cold file's read ahead of this pass (see _read_priming)
    if share is None:
        hashed = 0
        for position, window in enumerate(windows):
            _announce(fd, windows[announced : limits[position]], readahead)
            announced = limits[position]
            hashed += _hash_window(source, path, window, blocks)
            if ahead is not None:
                ahead.advance(window.end)
        return hashed
    hashed = 0
    with share.offered(SharedFile(source, path, windows, blocks, limits)) as shared:
        while (taken := share.take_front(shared)) is not None:
            position, first, stop = taken
            _announce(fd, windows[first:stop], readahead)
            hashed += _hash_window(source, path, windows[position], blocks)
            if ahead is not None:
                ahead.advance(windows[position].end)
    return hashed


def hash_taken(shared: SharedFile, index: int, announce: bool) -> int:
    """Hash window ``index`` of a file another I/O thread verifies, announcing it first if ``announce`` (see
    :meth:`.WindowShare.help`)."""
    window = shared.windows[index]
    source = shared.source
    if announce:
        _announce(getattr(source, "fd", None), [window], not getattr(source, "exact", False))
    return _hash_window(source, shared.path, window, shared.blocks)


def verify_regions(source: FileSource, path: Path, checks: Sequence[RegionCheck], window: int, *,
                   whole: Iterable[tuple[str, StorageInfo]] = (), share: WindowShare | None = None) -> int:
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
    flat = BlockList()
    tiles_done: set[tuple[int, int, int]] = set()
    windows: list[Window] = []
    flat.add_small(path, whole)
    for check in checks:
        info = check.info
        if info.checksum is None:
            continue
        if not info.length:
            empty_chunk(path, check.fqn, info)
            continue
        if info.checksum.block_shape and check.sizes is not None:
            if info.checksum.flat_digests and math.prod(check.lengths) * check.itemsize == info.length:
                flat.add_whole(check.fqn, info)  # read whole: its flat blocks, no tile gathered (format 2.2)
            else:
                windows += tile_windows(check, tiles_done)
            continue
        indices = flat_blocks(check)
        if isinstance(indices, range):
            flat.add_whole(check.fqn, info)
        else:
            flat.add_blocks(check.fqn, info, indices.tolist())
    blocks = flat.done()
    # Windows of a few MiB: a window read into scratch stays in the CPU cache while it is hashed.
    windows += flat_windows(blocks, min(window, _CACHE_WINDOW), sorted(w.start for w in windows))
    windows.sort(key=lambda w: w.start)
    return _hash_windows(source, path, windows, blocks, share)
