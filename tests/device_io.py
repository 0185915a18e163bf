"""Device reads of this process (``/proc/self/io`` read_bytes) and dropping files from the page cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

__all__ = ["read_bytes", "drop_cache", "device_counts", "fewest_device_bytes"]


def read_bytes() -> int:
    """Bytes this process caused the storage devices to read so far (readahead included)."""
    with open("/proc/self/io", encoding="ascii") as handle:
        return int(dict(line.split(": ") for line in handle.read().splitlines())["read_bytes"])


def drop_cache(directory: Path) -> None:
    """Drop the files of ``directory`` from the page cache (after an fsync: works for files this test wrote)."""
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def device_counts(directory: Path) -> bool:
    """Whether a cold read of this directory's files shows in read_bytes (not on tmpfs)."""
    path = next(directory.glob("*.safetensors"))
    drop_cache(directory)
    before = read_bytes()
    path.read_bytes()
    return read_bytes() - before >= path.stat().st_size // 2


def fewest_device_bytes(directory: Path, load: Callable[[], None], tries: int = 2) -> int:
    """The fewest device bytes of ``tries`` cold runs of ``load`` (``directory`` dropped from the cache before each).

    Pages may leave the page cache between a load's verify pass and its read pass
    for reasons outside the load: another process dropping the cache system-wide
    (``/proc/sys/vm/drop_caches``, as ``scripts/benchmark.py`` does as root), or this
    VM's DAMON pageout of page cache it judges cold. That only adds reads, so the
    fewer is the load's own figure.
    """
    counts = []
    for _ in range(tries):
        drop_cache(directory)
        before = read_bytes()
        load()
        counts.append(read_bytes() - before)
    return min(counts)
