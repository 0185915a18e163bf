"""Test helper: make files cold (their clean pages dropped from the page cache, no root needed), or keep pages
cached."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from pathlib import Path
from typing import Iterable, Iterator

__all__ = ["evict", "pinned"]


def evict(paths: Iterable[Path]) -> None:
    """Write back and drop the pages of ``paths`` from the page cache."""
    for data in paths:
        fd = os.open(data, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    for name in ("mlock", "munmap"):
        getattr(libc, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


@contextlib.contextmanager
def pinned(path: Path, offsets: Iterable[int]) -> Iterator[None]:
    """Keep the pages of ``path`` holding the bytes at ``offsets`` in the page cache while inside.

    The pages are read and locked (``mlock`` of a shared read-only mapping of
    the file: the page cache's own pages, one per offset, well under the
    usual locked-memory limit), so memory pressure from other processes
    cannot evict them; leaving unmaps the file, which unlocks them.
    """
    libc = _libc()
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if base is None or base == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            for page in sorted({offset - offset % mmap.PAGESIZE for offset in offsets}):
                if libc.mlock(base + page, mmap.PAGESIZE):
                    raise OSError(ctypes.get_errno(), f"mlock of {path} at byte {page} failed")
            yield
        finally:
            libc.munmap(base, size)
    finally:
        os.close(fd)
