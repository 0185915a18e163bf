"""The verify pass's windows shared between a rank's I/O threads, so that they finish together.

Each I/O thread verifies the data files dealt to it (one thread per file
when a rank reads two files on two threads), hashing each file's windows in
file order from the front. Files cost unequal time even when they hold equal
bytes (a bfloat16 tile has twice the row pieces of a float32 one), so a
thread done with its own files hashes the windows left at the back of
another thread's file (:meth:`WindowShare.help`) instead of idling: the
verify pass then ends when the last window is hashed, not when the slowest
file is. With fewer files than threads (a rank reading one file), the other
threads only help. A file's owner keeps its source open until every window taken from
it is hashed. A mismatch found by any thread stops the others at their next
window (the load fails; no target was changed).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

__all__ = ["SharedFile", "WindowShare"]


class SharedFile:
    """The windows of one open data file, taken from the front by its owner and from the back by helpers.

    Attributes:
        source: The open file (read with positioned reads: safe from several threads).
        path: Its name, for messages.
        windows: Its windows, in file order.
        blocks: Its flat blocks (:class:`._verify_windows.Blocks`).
        limits: Windows ``[:limits[i]]`` are announced to the kernel once the owner hashes window ``i``
            (:func:`._verify_reads.lookahead_limits`).
        announced: Windows ``[:announced]`` were announced by the owner; a helper announces a window it takes
            past them itself (each window is announced once).
        front: Windows ``[:front]`` are taken by the owner.
        back: Windows ``[back:]`` are taken by helpers.
        helpers: Windows of the file being hashed by other threads right now.
    """

    def __init__(self, source: Any, path: Any, windows: list[Any], blocks: Any, limits: list[int]) -> None:
        self.source, self.path, self.windows, self.blocks = source, path, windows, blocks
        self.limits = limits
        self.announced = 0
        self.front = 0
        self.back = len(windows)
        self.helpers = 0


class WindowShare:
    """The files of one verify pass whose windows any of its I/O threads may hash (all on one rank).

    Args:
        owners: The I/O threads that verify files of their own (each calls :meth:`owner_done` once).
    """

    def __init__(self, owners: int) -> None:
        self._cond = threading.Condition()
        self._files: list[SharedFile] = []
        self._owners = owners
        self.failed = False

    def take_front(self, shared: SharedFile) -> tuple[int, int, int] | None:
        """The next window of ``shared`` for its owner, or ``None`` when none is left (or a thread failed).

        Returns:
            ``(index, first, stop)``: the window, and the windows ``[first:stop]`` the owner announces now
            (those up to its lookahead limit that no helper took).
        """
        with self._cond:
            if self.failed or shared.front >= shared.back:
                return None
            index = shared.front
            shared.front += 1
            first = shared.announced
            shared.announced = max(first, min(shared.limits[index], shared.back))
            return index, first, shared.announced

    @contextlib.contextmanager
    def offered(self, shared: SharedFile) -> Iterator[SharedFile]:
        """Let other threads take windows of ``shared`` while the owner hashes it (the ``with`` body).

        On leaving, no more windows are taken, and the owner waits until those
        taken are hashed: only then may it close the file. A failure in the
        body stops the other threads at their next window.
        """
        with self._cond:
            self._files.append(shared)
            self._cond.notify_all()
        try:
            yield shared
        except BaseException:
            self.fail()
            raise
        finally:
            with self._cond:
                shared.back = shared.front
                self._files.remove(shared)
                while shared.helpers:
                    self._cond.wait()

    def fail(self) -> None:
        """A thread failed: the others stop at their next window."""
        with self._cond:
            self.failed = True
            self._cond.notify_all()

    def owner_done(self) -> None:
        """An owner verified all its files (or failed): helpers stop waiting for it."""
        with self._cond:
            self._owners -= 1
            self._cond.notify_all()

    def help(self, hash_window: Callable[[SharedFile, int, bool], int]) -> int:
        """Hash windows from the back of the file with the most windows left, until no owner is left.

        Called by a thread after its own files (and :meth:`owner_done`).

        Args:
            hash_window: Called as ``hash_window(shared, index, announce)``: hashes window ``index`` of a file,
                announcing it first if ``announce`` (raises on a mismatch); returns the bytes hashed.

        Returns:
            The bytes this thread hashed for others.
        """
        total = 0
        while True:
            with self._cond:
                while True:
                    if self.failed:
                        return total
                    shared = max(self._files, key=_left, default=None)
                    if shared is not None and _left(shared):
                        break
                    if not self._owners:
                        return total
                    self._cond.wait()
                shared.back -= 1
                index = shared.back
                shared.helpers += 1
                announce = index >= shared.announced
            try:
                total += hash_window(shared, index, announce)
            except BaseException:
                self.fail()
                raise
            finally:
                with self._cond:
                    shared.helpers -= 1
                    self._cond.notify_all()


def _left(shared: SharedFile) -> int:
    """Windows of ``shared`` nobody took yet (none of a file read ahead by its priming thread).

    A cold file that is read ahead of its owner (``source.ahead``, see
    :mod:`._read_priming`) is left to its owner: the device, not the CPU,
    limits it, and a second reader far from the first on the same open file
    would disturb the kernel's readahead of it.
    """
    if getattr(shared.source, "ahead", None) is not None:
        return 0
    return shared.back - shared.front
