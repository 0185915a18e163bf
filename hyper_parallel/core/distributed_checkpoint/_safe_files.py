"""Opening files of a checkpoint directory without trusting what is there.

A checkpoint directory may hold anything under the names the library reads:
a FIFO (``open`` would block forever), a symlink to ``/dev/zero`` (a read
never ends), a directory, or a huge file. These helpers open only regular
files (``lstat`` first, then ``O_NOFOLLOW | O_NONBLOCK`` and an ``fstat`` of
the opened descriptor, which must be the same file) and read at most a
given number of bytes.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Callable

from hyper_parallel.core.distributed_checkpoint.errors import UnsafeCheckpointError

__all__ = ["describe_mode", "open_regular", "read_regular", "remove_regular"]

_LOG = logging.getLogger(__name__)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def describe_mode(mode: int) -> str:
    """A short name of a file type (``"a directory"``, ``"a FIFO"``, ...)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path, *, limit: int) -> int:
    """Open ``path`` read-only if it is a regular file of at most ``limit`` bytes; return the descriptor.

    Raises:
        FileNotFoundError: ``path`` does not exist (any more).
        UnsafeCheckpointError: ``path`` is not a regular file, or is larger than ``limit``.
        OSError: the file cannot be opened.
    """
    before = os.lstat(path)
    if not stat.S_ISREG(before.st_mode):
        raise UnsafeCheckpointError(f"{path} is {describe_mode(before.st_mode)}, not a regular file; refused")
    fd = os.open(path, _OPEN_FLAGS)
    try:
        after = os.fstat(fd)
        if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise UnsafeCheckpointError(f"{path} was replaced while being opened; refused")
        if after.st_size > limit:
            raise UnsafeCheckpointError(f"{path} holds {after.st_size} bytes, more than the {limit} allowed; refused")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path, *, limit: int) -> bytes:
    """Return the bytes of regular file ``path`` (at most ``limit``; see :func:`open_regular`)."""
    fd = open_regular(path, limit=limit)
    try:
        chunks = []
        total = 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # the file grew after the fstat
                raise UnsafeCheckpointError(f"{path} grew past the {limit} bytes allowed while being read; refused")
        return b"".join(chunks)
    finally:
        os.close(fd)


def remove_regular(path: Path, *, unlink: Callable[[Path], None] = os.unlink) -> bool:
    """Delete ``path`` with ``unlink`` if it is a regular file (a symlink is not followed); log anything else.

    Returns:
        Whether a file was removed. Never raises: the caller's commit already happened.
    """
    try:
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            _LOG.warning("checkpoint cleanup: %s is %s; left alone", path, describe_mode(mode))
            return False
        unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        _LOG.warning("checkpoint cleanup: cannot remove %s: %s", path, exc)
        return False
