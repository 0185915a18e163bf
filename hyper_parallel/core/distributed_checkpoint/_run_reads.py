"""Reading byte runs of a stored chunk into a target (verified beforehand by :mod:`._verify_reads`).

The reader (:mod:`.filesystem_reader`) decides what to read; these functions
do the reading. Buffers come from a per-thread scratch pool, so the extra
memory stays at the in-flight bound.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from hyper_parallel.core.distributed_checkpoint._device_reads import read_runs_exact
from hyper_parallel.core.distributed_checkpoint._format.byte_ranges import Runs
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import StorageInfo

__all__ = ["read_runs", "run_rows", "scratch", "release_scratch"]


def read_runs(
    fd: int, path: Path, fqn: str, info: StorageInfo, runs: Runs, target: np.ndarray, *, exact: bool = False
) -> int:
    """Fill ``target`` (``uint8``, one row per run) with the runs as stored; return the bytes read.

    ``exact``: ``fd`` reads without readahead; scattered runs then go through
    :func:`._device_reads.read_runs_exact` (the device reads about the runs' bytes only).
    """
    length = runs.length
    if exact and runs.starts.size > 1:
        read_runs_exact(fd, path, fqn, info.offset + runs.starts, length, target)
        return runs.total
    for position, start in enumerate(runs.starts.tolist()):
        got = os.preadv(fd, [target[position]], info.offset + start)
        if got != length:
            raise CorruptCheckpointError(f"data file {path} is truncated while reading key '{fqn}'")
    return runs.total


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


def scratch(nbytes: int, slot: int = 0) -> np.ndarray:
    """A per-thread reusable ``uint8`` buffer of ``nbytes`` (grown on demand).

    Reusing it keeps the reader's extra memory at the in-flight bound instead
    of leaving freed buffers to the allocator. ``slot`` separates buffers in
    use at the same time.
    """
    buffers = getattr(SCRATCH, "buffers", None)
    if buffers is None:
        buffers = SCRATCH.buffers = {}
    buffer = buffers.get(slot)
    if buffer is None or buffer.size < nbytes:
        buffer = buffers[slot] = np.empty(max(nbytes, 1), dtype=np.uint8)
    return buffer[:nbytes]


def release_scratch() -> None:
    """Drop this thread's scratch buffers (after a load)."""
    SCRATCH.buffers = None
