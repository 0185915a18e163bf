"""Copies into staging memory on the staging threads: batched, and the small ones kept off the caller's way.

:class:`Copier` hands batches of copies to :data:`STAGING_THREADS` threads
(numpy releases the GIL while copying); the caller's thread may copy a share
itself. Copies of less than :data:`SMALL_COPY_BYTES` are held back while the
caller's thread runs Python, then handed out in runs the caller's thread
takes back when it is idle. :func:`gil_handoff` lets the threads take the
GIL back quickly while the caller's thread runs Python. Where the copies go
(the staging arena, places decided while the save is planned) is
:mod:`._stage_copies`'s business.
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from concurrent.futures import Future
from contextlib import contextmanager
from itertools import accumulate
from typing import Iterator

import numpy as np

from hyper_parallel.core.distributed_checkpoint._lazy_pool import lazy_executor

__all__ = ["LEAD_BYTES", "SMALL_COPY_BYTES", "STAGING_THREADS", "Copier", "gil_handoff"]

#: Threads copying into staging buffers.
STAGING_THREADS = 2
_PIECE_BYTES = 32 << 20
#: Copies smaller than this are held back while the caller's thread runs Python (:class:`Copier`); only larger
#: leaves are copied ahead (:class:`._stage_copies.EarlyCopies`).
SMALL_COPY_BYTES = 1 << 20
#: Bytes of a save's first early copy that the caller's thread copies itself (:class:`Copier`'s ``lead_bytes``):
#: about what one thread copies while an idle staging thread wakes up.
LEAD_BYTES = 8 << 20
#: The interpreter's switch interval while an async save stages (:func:`gil_handoff`).
_HANDOFF_SECONDS = 1e-4
#: Bytes of copies handed to a staging thread at a time.
_BATCH_BYTES = 8 << 20
#: Runs the small copies are handed to the threads in (:meth:`Copier.release_small`).
_SMALL_RUNS = 4 * STAGING_THREADS
#: A staging thread copies a large piece this many bytes at a time (one ``memcpy`` each). Copies between the
#: core's L2 size and glibc's non-temporal threshold (here 1 MiB and 288 MiB) run its vector loop, whose stores
#: first read every target line (write-allocate); below the L2 size ``rep movsb`` writes whole lines without
#: reading them. Measured on the 2-core VM (one process alternating both, medians of 7), against 32 MiB steps:
#: the 1 GiB state of 1,799 Parameters, copies alone 0.79x, the async save's blocking part 0.79-0.96x; the 1 GiB
#: state of 16 matrices, copies alone 0.88x, blocking part 0.61-0.74x (256 KiB and 1 MiB steps gained less).
_COPY_BYTES = 512 << 10


def _copy_all(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copy each ``(target, source)``; a flat one of more than :data:`_COPY_BYTES` in steps of that many bytes.

    The steps are two numpy calls (every other step, as rows of a 2-d view
    numpy cannot merge into one ``memcpy``), each made without the GIL: one
    call per step took the GIL back every 25 us, and while the caller's
    thread ran Python (planning) each took turns with it, both slowed (a
    steady save of 1,799 Parameters, alternating processes: 1.27x -> 1.07x a
    memcpy; with the small copies on the caller's thread too,
    :meth:`._stage_copies.EarlyCopies.wait`: 1.18x -> 1.00x).
    """
    for target, source in pairs:
        size = source.size
        if size <= _COPY_BYTES or source.ndim != 1 or source.itemsize != 1 or not (
                source.flags.c_contiguous and target.flags.c_contiguous):
            np.copyto(target, source)
            continue
        rows = size // _COPY_BYTES
        whole = rows * _COPY_BYTES
        if rows > 1:
            target_rows = target[:whole].reshape(rows, _COPY_BYTES)
            source_rows = source[:whole].reshape(rows, _COPY_BYTES)
            np.copyto(target_rows[0::2], source_rows[0::2])
            np.copyto(target_rows[1::2], source_rows[1::2])
        else:
            np.copyto(target[:whole], source[:whole])
        if whole < size:
            np.copyto(target[whole:], source[whole:])


class Copier:
    """Copies handed to the staging threads in batches of about :data:`_BATCH_BYTES`.

    Copies of less than :data:`SMALL_COPY_BYTES` are held back until
    :meth:`release_small` or :meth:`finish`: each needs the GIL to start and
    end, so a thread copying them while the caller's thread runs Python (the
    layout pass) would mostly wait for the GIL. They are then handed to the
    threads in runs of about equal bytes, queued after the large copies
    handed before; :meth:`finish` takes back every run no thread has begun
    and copies it on the caller's thread, idle there anyway, while the
    threads copy the large ones without the GIL (a steady async save of one
    rank reaches :meth:`finish` long before the large copies end: its 1,747
    small copies of 8-16 KiB no longer come last, ~3 ms of two threads taking
    turns for the GIL; with several ranks the threads may copy them while
    the caller's thread waits in a collective).

    Args:
        caller_share: The caller's thread copies every ``STAGING_THREADS + 1``-th
            batch itself (when it has nothing else to do meanwhile).
        lead_bytes: The caller's thread copies the first this many bytes of the first large copy itself, right
            after handing the rest to the threads: a staging thread idle since the last save starts copying
            0.5-1 ms after it is handed work (measured on the 2-core VM: woken, it waits for a core and the GIL),
            time in which nothing was copied before.
    """

    def __init__(self, *, caller_share: bool, lead_bytes: int = 0) -> None:
        self._caller_share = caller_share
        self._lead = lead_bytes
        self._pending: list[Future[None]] = []
        self._batch: list[tuple[np.ndarray, np.ndarray]] = []
        self._batch_bytes = 0
        self._small: list[tuple[np.ndarray, np.ndarray]] = []
        self._small_sizes: list[int] = []
        self._released: list[tuple[Future[None], list[tuple[np.ndarray, np.ndarray]]]] = []  # small runs handed out
        self._turn = 0

    def add(self, target: np.ndarray, source: np.ndarray) -> None:
        """Copy the uint8 array ``source`` into ``target`` (same size), soon."""
        nbytes = source.size
        if nbytes < SMALL_COPY_BYTES:
            self._small.append((target, source))
            self._small_sizes.append(nbytes)
            return
        lead, self._lead = min(self._lead, nbytes), 0
        if lead:
            self.add(target[lead:], source[lead:])
            if self._batch:
                self._flush()  # the threads wake while the caller's thread copies the lead
            _copy_all([(target[:lead], source[:lead])])
            return
        for start in range(0, nbytes, _PIECE_BYTES):
            self._batch.append((target[start : start + _PIECE_BYTES], source[start : start + _PIECE_BYTES]))
            self._batch_bytes += min(_PIECE_BYTES, nbytes - start)
            if self._batch_bytes >= _BATCH_BYTES:
                self._flush()

    def drop_lead(self) -> None:
        """Copy no lead on the caller's thread from now on (see ``lead_bytes``)."""
        self._lead = 0

    def _flush(self) -> None:
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        self._turn += 1
        if self._caller_share and self._turn % (STAGING_THREADS + 1) == 0:
            _copy_all(batch)
        else:
            self._pending.append(self._start(batch))

    @staticmethod
    def _start(batch: list[tuple[np.ndarray, np.ndarray]]) -> Future[None]:
        return lazy_executor("stage", STAGING_THREADS).submit(_copy_all, batch)

    def add_small(self, pairs: list[tuple[np.ndarray, np.ndarray]], sizes: list[int]) -> None:
        """Hold the copies ``pairs`` (``(target, source)`` of one dtype and shape, each under
        :data:`SMALL_COPY_BYTES`, of ``sizes`` bytes)."""
        self._small.extend(pairs)
        self._small_sizes.extend(sizes)

    def _split_small(self, shares: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """The held small copies in ``shares`` runs of about equal bytes (in order); none are held after."""
        small, ends = self._small, list(accumulate(self._small_sizes))
        self._small, self._small_sizes = [], []
        share = max(1, -(-ends[-1] // shares)) if ends else 1
        cuts = [0] + [bisect_left(ends, share * part) for part in range(1, shares)] + [len(small)]
        return [small[start:stop] for start, stop in zip(cuts, cuts[1:]) if stop > start]

    def release_small(self) -> None:
        """Hand the held small copies to the threads now, in :data:`_SMALL_RUNS` runs (the caller's thread stops
        running Python soon); :meth:`finish` copies those no thread has begun."""
        if self._small:
            for run in self._split_small(_SMALL_RUNS):
                self._released.append((self._start(run), run))

    def finish(self) -> None:
        """Copy what is left on the caller's thread and wait for every copy (re-raises a copy's error).

        What is left: the last batch, and every small run no thread has begun (taken back from the threads).
        """
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        self.release_small()
        taken = [run for future, run in self._released if future.cancel()]
        pending = self._pending + [future for future, _ in self._released if not future.cancelled()]
        self._pending, self._released = [], []
        try:
            _copy_all(batch)
            for run in taken:
                _copy_all(run)
        finally:
            for future in pending:
                future.result()


@contextmanager
def gil_handoff() -> Iterator[None]:
    """Let the copying threads take the GIL back quickly while the body runs. Caller's thread.

    A thread whose copy ended waits for the GIL while another thread runs
    Python, up to the interpreter's switch interval (5 ms by default): a
    copy thread then progressed at about a sixth of its speed during the
    layout pass (measured: 64 MiB in 20 ms of the caller's Python, 320 MiB
    with a 0.1 ms interval, 390 MiB alone). The interval is lowered for the
    blocking part of an async save and restored after.
    """
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, _HANDOFF_SECONDS))
    try:
        yield
    finally:
        sys.setswitchinterval(previous)
