"""Test helper: make files cold (their clean pages dropped from the page cache, no root needed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

__all__ = ["evict"]


def evict(paths: Iterable[Path]) -> None:
    """Write back and drop the pages of ``paths`` from the page cache."""
    for data in paths:
        fd = os.open(data, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
