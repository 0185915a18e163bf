"""Hashing the tiles of one row slab of a tiled chunk, for the verify pass.

A tile's digest covers its elements in row-major order, while the file stores
the chunk's rows whole: a tile is strided in the file. The verify pass
(:mod:`._verify_reads`) gets each tile's bytes together one of two ways:

- :func:`bad_tile_scattered`, for a slab read whole from a local file: one
  ``preadv`` per ``IOV_MAX`` row pieces puts every row piece of the slab
  straight at its place in its tile, so the kernel's copy out of the page cache
  is the only copy. Gathering tiles out of a slab read whole instead
  (:func:`bad_tile`) copies every byte a second time: measured on the
  benchmark's many-tensor state (4 + 48 tiled matrices), that pass made the
  verify pass 1.6x its floor (reading and hashing flat blocks) on one thread.
- :func:`bad_tile`, for a slab already in memory (its ranges read into a
  buffer, or read from object storage in one request), or where ``preadv``
  cannot be called: each tile
  gathered from the slab, then hashed.

The row pieces' addresses are built with array operations once per slab shape
and scratch buffer, and handed to the C library's ``preadv`` through ``ctypes``
(which releases the GIL for the call): thousands of pieces cost no Python each.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import threading
from typing import Any, Callable

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.checksum import digest
from hyper_parallel.core.distributed_checkpoint._run_reads import scratch
from hyper_parallel.core.distributed_checkpoint._verify_windows import Slab, Window

__all__ = ["bad_tile", "bad_tile_scattered", "scatter_pieces", "scatters", "tile_problem"]

#: Row-piece lists kept per thread (slab shapes of the chunks a load verifies; each list is 16 bytes a piece).
_KEPT_PIECE_LISTS = 16
_LOCAL = threading.local()
_LIBC: list[Callable[..., int] | None] = []  # the C library's preadv, looked up at the first use


def _column_bytes(slab: Slab, column: int) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` of tile ``column`` within one row of the chunk (its last dim)."""
    check = slab.check
    width = check.info.checksum.block_shape[-1]
    return column * width * check.itemsize, min((column + 1) * width, check.sizes[-1]) * check.itemsize


def bad_tile(view: memoryview, slab: Slab) -> int | None:
    """The first of the slab's columns whose tile does not match its digest, or ``None``.

    Args:
        view: The slab's bytes (its rows, whole).
        slab: The tiles to check.
    """
    check = slab.check
    sizes, info = check.sizes, check.info
    inner = math.prod(sizes[1:-1])
    row_bytes = sizes[-1] * check.itemsize
    cube = np.frombuffer(view, dtype=np.uint8, count=slab.rows * inner * row_bytes)
    cube = cube.reshape(slab.rows, inner, row_bytes)
    for column in slab.columns:
        lo, hi = _column_bytes(slab, column)
        tile = scratch(slab.rows * inner * (hi - lo), slot=3).reshape(slab.rows, inner, hi - lo)
        np.copyto(tile, cube[:, :, lo:hi])
        if digest(tile.reshape(-1)) != info.checksum.digests[slab.slab * slab.grid_columns + column]:
            return column
    return None


def scatter_pieces(base: int, pieces: int, widths: tuple[int, ...]) -> np.ndarray:
    """The ``(address, length)`` list that reads ``pieces`` rows of tiles ``widths`` bytes wide into tile order.

    Row ``r`` of the file holds one piece of each tile in column order; tile
    ``c`` is stored from ``base`` on after the tiles before it, its pieces
    one after the other. The list is in file order, one entry per piece.

    Args:
        base: Address of the buffer the tiles go to.
        pieces: Rows of the slab (times the chunk's middle dims).
        widths: Bytes of each tile's piece of a row, in column order.

    Returns:
        Array of shape ``(pieces * len(widths), 2)`` of pointer-sized unsigned integers (``uintp``): a C
        ``struct iovec`` array (a pointer and a ``size_t``) on 32-bit systems too.
    """
    width = np.asarray(widths, dtype=np.uintp)
    tile_starts = np.zeros(len(widths), dtype=np.uintp)
    np.cumsum(width[:-1] * np.uintp(pieces), out=tile_starts[1:])
    rows = np.arange(pieces, dtype=np.uintp)[:, None]
    out = np.empty((pieces, len(widths), 2), dtype=np.uintp)
    out[:, :, 0] = np.uintp(base) + tile_starts[None, :] + rows * width[None, :]
    out[:, :, 1] = width[None, :]
    return out.reshape(-1, 2)


def _preadv() -> Callable[..., int] | None:
    """The C library's ``preadv`` (``None`` where it cannot be called), looked up once."""
    if not _LIBC:
        function = None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
        except (OSError, TypeError):  # pragma: no cover - no C library to load this way
            libc = None
        if ctypes.sizeof(ctypes.c_size_t) != ctypes.sizeof(ctypes.c_void_p):  # pragma: no cover - no such ABI here
            libc = None  # the piece lists (pointer-sized pairs) would not be a struct iovec array
        for name in ("preadv64", "preadv"):  # preadv64 takes a 64-bit offset on 32-bit systems too
            function = getattr(libc, name, None)
            if function is not None:
                function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
                function.restype = ctypes.c_ssize_t
                break
        _LIBC.append(function)
    return _LIBC[0]


def _iov_max() -> int:
    """Most pieces one ``preadv`` takes."""
    try:
        return max(1, min(os.sysconf("SC_IOV_MAX"), 1024))
    except (AttributeError, OSError, ValueError):  # pragma: no cover - no sysconf name
        return 16


def _pieces_for(buffer: np.ndarray, pieces: int, widths: tuple[int, ...]) -> np.ndarray:
    """:func:`scatter_pieces` into ``buffer``, kept per thread for the next slab of the same shape."""
    kept = getattr(_LOCAL, "pieces", None)
    if kept is None:
        kept = _LOCAL.pieces = {}
    key = (buffer.ctypes.data, pieces, widths)
    found = kept.get(key)
    if found is None:
        if len(kept) >= _KEPT_PIECE_LISTS:
            kept.clear()
        found = kept[key] = scatter_pieces(buffer.ctypes.data, pieces, widths)
    return found


def bad_tile_scattered(fd: int, window: Window) -> tuple[bool, int | None]:
    """Read the slab of ``window`` straight into tile order and hash each tile; no copy but the kernel's.

    Args:
        fd: The open data file.
        window: A tile window read whole (``window.slab`` set, its one range the slab) whose
            columns are every column of the chunk's tile grid.

    Returns:
        ``(done, column)``: ``done`` is false when the slab could not be read so (no ``preadv``
        in the C library, or a short read: the caller then reads it whole, which also reports
        a truncated file); ``column`` is the first column whose tile does not match its digest.
    """
    preadv = _preadv()
    if preadv is None:
        return False, None
    slab = window.slab
    check = slab.check
    inner = math.prod(check.sizes[1:-1])
    spans = [_column_bytes(slab, column) for column in slab.columns]
    widths = tuple(hi - lo for lo, hi in spans)
    pieces = slab.rows * inner
    buffer = scratch(window.end - window.start, slot=2, huge=True)
    iovecs = _pieces_for(buffer, pieces, widths)
    step = _iov_max()
    offset = window.start
    for first in range(0, len(iovecs), step):
        part = iovecs[first : first + step]
        wanted = int(part[:, 1].sum())
        while True:
            got = preadv(fd, part.ctypes.data, len(part), offset)
            if got >= 0 or ctypes.get_errno() != errno.EINTR:
                break
        if got != wanted:
            return False, None
        offset += wanted
    digests = check.info.checksum.digests
    base = slab.slab * slab.grid_columns
    start = 0
    for column, width in zip(slab.columns, widths):
        size = width * pieces
        if digest(memoryview(buffer[start : start + size])) != digests[base + column]:
            return True, column
        start += size
    return True, None


def scatters(source: Any, window: Window) -> bool:
    """Whether :func:`bad_tile_scattered` takes ``window``: a whole slab of every tile column, from a file."""
    slab = window.slab
    return (slab is not None and window.whole and getattr(source, "fd", None) is not None
            and len(slab.columns) == slab.grid_columns)


def tile_problem(slab: Slab, column: int | None) -> str | None:
    """The key and tile of a mismatch in ``slab`` at ``column``, for a message; ``None`` if ``column`` is."""
    if column is None:
        return None
    return f"key '{slab.check.fqn}' (tile {slab.slab},{column} of the chunk at byte {slab.check.info.offset})"
