"""Reading scattered byte runs of a file without the device reading more.

A resharded load reads parts of stored rows (a column split of a row-split
chunk). Through the page cache every read costs whole 4 KiB pages plus the
kernel's readahead window (8 MiB on this project's test machine), so the
device reads about twice the bytes needed, or the whole file. This module
reads a set of runs so that the device reads about the runs' own bytes:

- runs whose pages are (nearly) all needed: the page cache, with the caller's
  file description in ``POSIX_FADV_RANDOM`` mode (no readahead) and one
  ``POSIX_FADV_WILLNEED`` per contiguous page range issued before the reads,
  so the device gets every request at once instead of one small synchronous
  read after another;
- narrow runs (pages shared with bytes not needed, rows of a few KiB split in
  two): ``O_DIRECT`` reads of the runs rounded to 512-byte sectors, on a few
  threads so that the device sees several requests at once. Where
  ``O_DIRECT`` is refused (tmpfs, some network filesystems) the page cache
  path is used.

Which path a set of runs takes is decided by :func:`page_amplification`
against :data:`MAX_PAGE_AMPLIFICATION`.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np

from hyper_parallel.core.distributed_checkpoint._lazy_pool import lazy_executor
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError

__all__ = [
    "MAX_PAGE_AMPLIFICATION",
    "PAGE_BYTES",
    "SECTOR_BYTES",
    "page_amplification",
    "read_runs_exact",
]

#: Page size of the page cache.
PAGE_BYTES = 4096
#: Alignment of ``O_DIRECT`` reads (the logical sector size of common devices).
SECTOR_BYTES = 512
#: Runs whose touched pages hold more than this share of unneeded bytes are read with ``O_DIRECT``.
MAX_PAGE_AMPLIFICATION = 1.05
#: Largest single ``O_DIRECT`` read (several merged runs).
_DIRECT_READ_BYTES = 8 << 20
#: Threads issuing ``O_DIRECT`` reads at once (the device's queue depth, not CPU work).
_DIRECT_THREADS = 8
_LOCAL = threading.local()


def _ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge increasing ``[start, end)`` ranges that touch or overlap; return merged starts and ends."""
    if starts.size == 0:
        return starts, ends
    running_end = np.maximum.accumulate(ends)
    breaks = np.flatnonzero(starts[1:] > running_end[:-1]) + 1
    lo = starts[np.concatenate(([0], breaks))]
    hi = running_end[np.concatenate((breaks - 1, [starts.size - 1]))]
    return lo, hi


def page_amplification(starts: np.ndarray, length: int) -> float:
    """Bytes of the pages that the runs ``[s, s + length)`` (absolute, increasing) touch / bytes of the runs."""
    if starts.size == 0 or length == 0:
        return 1.0
    first = starts // PAGE_BYTES
    last = (starts + length + PAGE_BYTES - 1) // PAGE_BYTES
    lo, hi = _ranges(first, last)
    return float((hi - lo).sum() * PAGE_BYTES) / float(starts.size * length)


def read_runs_exact(fd: int, path: Path, fqn: str, starts: np.ndarray, length: int, target: np.ndarray) -> None:
    """Fill row ``i`` of ``target`` (``uint8``, one row per run) with bytes ``[starts[i], starts[i] + length)``.

    ``starts`` are absolute file offsets, increasing. ``fd`` should be in
    ``POSIX_FADV_RANDOM`` mode (the reader sets it for files it reads in part).

    Raises:
        CorruptCheckpointError: the file ends before a run (names file and key).
    """
    if starts.size == 0 or length == 0:
        return
    if starts.size > 1 and page_amplification(starts, length) > MAX_PAGE_AMPLIFICATION:
        if _read_direct(fd, path, fqn, starts, length, target):
            return
    first = (starts // PAGE_BYTES) * PAGE_BYTES
    lo, hi = _ranges(first, starts + length)
    if hasattr(os, "posix_fadvise"):
        for start, end in zip(lo.tolist(), hi.tolist()):
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
    for position, start in enumerate(starts.tolist()):
        if os.preadv(fd, [target[position]], start) != length:
            raise CorruptCheckpointError(f"data file {path} is truncated while reading key '{fqn}'")


def _aligned_buffer(nbytes: int) -> memoryview:
    """A per-thread page-aligned buffer of at least ``nbytes`` (``O_DIRECT`` needs aligned memory)."""
    buffer = getattr(_LOCAL, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        size = max(nbytes, 1 << 20)
        buffer = _LOCAL.buffer = mmap.mmap(-1, size + (-size % PAGE_BYTES))
    return memoryview(buffer)


def _open_direct(fd: int) -> int:
    """A new ``O_DIRECT`` descriptor of the file open as ``fd`` (the same file, even if deleted since), or -1.

    Opens ``/proc/self/fd/<fd>`` (Linux): never another file that took the
    name meanwhile. Without ``/proc`` or ``O_DIRECT``, or where the
    filesystem refuses it: -1 (the caller reads through ``fd``).
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | flag)
    except OSError:
        return -1


def _read_direct(source_fd: int, path: Path, fqn: str, starts: np.ndarray, length: int, target: np.ndarray) -> bool:
    """Read the runs of the file open as ``source_fd`` with ``O_DIRECT`` at sector granularity; ``False`` if the
    filesystem refuses it."""
    fd = _open_direct(source_fd)
    if fd < 0:
        return False
    try:
        lo = (starts // SECTOR_BYTES) * SECTOR_BYTES
        hi = -(-(starts + length) // SECTOR_BYTES) * SECTOR_BYTES
        # Merge runs whose sectors touch, up to _DIRECT_READ_BYTES per read.
        groups: list[tuple[int, int, int, int]] = []  # (read start, read end, first run, end run)
        group_lo, group_hi, first = int(lo[0]), int(hi[0]), 0
        lo_list, hi_list = lo.tolist(), hi.tolist()
        for run in range(1, starts.size):
            if lo_list[run] <= group_hi and hi_list[run] - group_lo <= _DIRECT_READ_BYTES:
                group_hi = max(group_hi, hi_list[run])
                continue
            groups.append((group_lo, group_hi, first, run))
            group_lo, group_hi, first = lo_list[run], hi_list[run], run
        groups.append((group_lo, group_hi, first, int(starts.size)))
        start_list = starts.tolist()

        def read(share: list[tuple[int, int, int, int]]) -> bool:
            for read_lo, read_hi, run_lo, run_hi in share:
                buffer = _aligned_buffer(read_hi - read_lo)
                try:
                    got = os.preadv(fd, [buffer[: read_hi - read_lo]], read_lo)
                except OSError:
                    return False  # misaligned for this device: the caller falls back
                if got < start_list[run_hi - 1] + length - read_lo:
                    raise CorruptCheckpointError(f"data file {path} is truncated while reading key '{fqn}'")
                view = np.frombuffer(buffer, dtype=np.uint8)
                for run in range(run_lo, run_hi):
                    offset = start_list[run] - read_lo
                    target[run] = view[offset : offset + length]
            return True

        if len(groups) < 4 * _DIRECT_THREADS:
            return read(groups)
        shares = [groups[i::_DIRECT_THREADS] for i in range(_DIRECT_THREADS)]
        return all(list(lazy_executor("direct", _DIRECT_THREADS).map(read, shares)))
    finally:
        os.close(fd)
