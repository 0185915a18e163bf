"""Priming a cold data file: the device reads a load's bytes ahead of the verify pass.

Opening a file for a load is followed by milliseconds of work before its
first window is read (its header is checked against the metadata, the verify
pass builds its windows): :func:`prime` has a helper thread bring the first
needed bytes into the page cache meanwhile, so the device does not idle. The
same thread then keeps reading ahead of the verify pass (:class:`ReadAhead`),
at most ``_FOLLOW_LEAD`` bytes past the last window hashed, so that the device
never waits for the hashing thread: a verify thread delayed by other work on
the CPU (this machine's 2 cores are shared) would otherwise leave the device
idle once the kernel's readahead window is read.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource

__all__ = ["PRIME_MIN_BYTES", "ReadAhead", "page_cached", "prime"]

#: Bytes of a cold file read ahead by :func:`prime` while its verify pass is prepared.
_PRIME_BYTES = 32 << 20
#: Files needing fewer bytes are not primed (their preparation is short).
PRIME_MIN_BYTES = 16 << 20
#: Unit of a priming read (and the throwaway buffer of its fallback, read into many times over).
_PRIME_PIECE = 256 << 10
#: After the first ``_PRIME_BYTES``, bytes read ahead of the verify pass's last hashed window at most
#: (page cache, not process memory; small against any page cache, so nothing read ahead is evicted unread).
_FOLLOW_LEAD = 64 << 20
#: Unit of a read ahead of the verify pass.
_FOLLOW_STEP = 4 << 20


class ReadAhead:
    """How far the verify pass hashed a primed file, for the thread that reads ahead of it.

    The verify pass calls :meth:`advance` after each window it hashes in file
    order and :meth:`stop` when it leaves the file (done, failed, or a load
    without checksums, which only checks the header).

    Args:
        start: First byte the load needs.
        end: End of the last byte the load needs.
    """

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.reached = start  # bytes before this were hashed
        self.stopped = False
        self.thread: threading.Thread | None = None  # the thread reading ahead (set by prime)
        self._cond = threading.Condition()

    def advance(self, offset: int) -> None:
        """The verify pass hashed the file's bytes up to ``offset``."""
        with self._cond:
            if offset > self.reached:
                self.reached = offset
                self._cond.notify_all()

    def stop(self) -> None:
        """The verify pass left the file: nothing more is read ahead (a read in progress ends)."""
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def finish(self) -> None:
        """Stop, and wait until the thread ended its read in progress and closed its descriptor. After the load
        (the reader's ``finish_load``): a load leaves no thread or descriptor behind, also when it failed while
        the first bytes were still being read."""
        self.stop()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def wait_room(self, position: int) -> bool:
        """Wait until ``position`` is within ``_FOLLOW_LEAD`` of the bytes hashed; ``False`` once stopped."""
        with self._cond:
            while not self.stopped and position >= self.reached + _FOLLOW_LEAD:
                self._cond.wait()
            return not self.stopped


def prime(source: FileSource, start: int, end: int) -> ReadAhead | None:
    """Start the device on the bytes a cold file's load needs, ahead of its verify pass.

    Checking a file's header and building the windows of thousands of
    chunks takes milliseconds in which the device would idle: a helper
    thread reads up to ``_PRIME_BYTES`` from ``start`` into the page cache
    (``sendfile`` to the null device: read as any sequential read is, with
    readahead in large folios, but copied nowhere), where the verify pass
    finds them, and then keeps reading up to ``end`` as long as it is less
    than ``_FOLLOW_LEAD`` bytes ahead of the verify pass (the returned
    :class:`ReadAhead`; without calls to its ``advance`` it stops there).
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
        The progress record the verify pass updates, or ``None`` when no priming read was started.
    """
    fd = getattr(source, "fd", None)
    if fd is None or getattr(source, "exact", False) or end - start < PRIME_MIN_BYTES:
        return None
    count = -(-min(end - start, _PRIME_BYTES) // _PRIME_PIECE)
    ahead = ReadAhead(start, end)
    ahead.thread = threading.Thread(target=_prime_read, args=(os.dup(fd), start, count, ahead),
                                    name="hp-ckpt-prime", daemon=True)
    ahead.thread.start()
    return ahead


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


def _prime_read(fd: int, start: int, count: int, ahead: ReadAhead | None = None) -> None:
    """Bring ``count`` pieces of ``_PRIME_PIECE`` bytes from ``start`` into the page cache, then (with ``ahead``)
    the rest of ``ahead``'s range while the verify pass is near; close ``fd``."""
    try:
        position = start + count * _PRIME_PIECE
        _fetch(fd, start, count * _PRIME_PIECE)
        while ahead is not None and position < ahead.end and ahead.wait_room(position):
            step = min(_FOLLOW_STEP, ahead.end - position)
            _fetch(fd, position, step)
            position += step
    except OSError:  # only a hint: the verify pass reads (and reports) for real
        pass
    finally:
        os.close(fd)


def _fetch(fd: int, start: int, length: int) -> None:
    """Bring ``length`` bytes from ``start`` into the page cache.

    ``sendfile`` to the null device reads the pages as an ordinary read does
    (readahead, large folios) without copying them anywhere; where it is
    missing or refused, ``preadv`` over a small throwaway buffer.
    """
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
        os.preadv(fd, [piece] * -(-length // _PRIME_PIECE), start)
