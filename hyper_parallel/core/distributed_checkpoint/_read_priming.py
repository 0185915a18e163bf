"""Priming a cold data file: the device reads a load's first bytes while the reader prepares.

Opening a file for a load is followed by milliseconds of work before its
first window is read (its header is checked against the metadata, the verify
pass builds its windows): :func:`prime` has a helper thread bring the first
needed bytes into the page cache meanwhile, so the device does not idle.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource

__all__ = ["PRIME_MIN_BYTES", "page_cached", "prime"]

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
