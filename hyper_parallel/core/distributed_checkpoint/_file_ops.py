"""The file-system operations a save performs, in one replaceable object.

:class:`FileSystemWriter` never calls ``os`` to change the disk: it opens,
writes, syncs, renames, unlinks and creates directories through a
:class:`FileOps`. The default runs each call on the operating system.
:class:`RecordingFileOps` runs them too and keeps a log of every call
(:class:`FileOp`, with the bytes of each write), from which the power-loss
tests build the crash states the file system allows (``tests/fault``).
The compound operations built on them live here too: writing a whole
buffer (:func:`write_all`) and replacing a file atomically
(:func:`write_atomically`: temporary file, fsync, rename, directory fsync).

Durability rules the writer follows (and the tests check): a file's bytes
are durable after ``fsync`` of the file; a name created, renamed or removed
in a directory is durable after ``fsync`` of that directory; a directory the
save creates is durable after ``fsync`` of its parent.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "FileOp",
    "FileOps",
    "RecordingFileOps",
    "OS_FILE_OPS",
    "make_directories",
    "write_all",
    "write_atomically",
    "fsync_directory",
]

_WRITE_CHUNK = 1 << 30


class FileOps:
    """Runs file-system operations on the operating system. Any thread may call it."""

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        """``os.open``: return a file descriptor."""
        return os.open(path, flags, mode)

    def write(self, fd: int, data: memoryview | bytes) -> int:
        """``os.write`` at the current position: return the bytes written."""
        return os.write(fd, data)

    def writev(self, fd: int, buffers: list[memoryview]) -> int:
        """``os.writev`` (the buffers one after another) at the current position: return the bytes written."""
        if not hasattr(os, "writev"):  # pragma: no cover - every POSIX system has it
            return os.write(fd, b"".join(buffers))
        return os.writev(fd, buffers)

    def pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> int:
        """``os.pwrite`` at ``offset``: return the bytes written."""
        return os.pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        """Make the file's bytes and size durable."""
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        """Make the file's bytes durable (and its size, if it changed)."""
        os.fdatasync(fd)

    def close(self, fd: int) -> None:
        """Close a descriptor from :meth:`open`."""
        os.close(fd)

    def replace(self, source: Path, target: Path) -> None:
        """Rename ``source`` over ``target`` atomically."""
        os.replace(source, target)

    def unlink(self, path: Path) -> None:
        """Remove a file (``FileNotFoundError`` when it is not there)."""
        os.unlink(path)

    def mkdir(self, path: Path) -> None:
        """Create one directory (``FileExistsError`` when it is there)."""
        os.mkdir(path)

    def fsync_directory(self, path: Path) -> None:
        """Make the names created, renamed or removed in directory ``path`` durable."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        """Ask the device to start writing ``length`` bytes from ``offset`` now; no effect on durability.

        ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` where the C library has it
        (Linux), else nothing. A later ``fsync`` then waits only for what is
        still unwritten; what a power cut keeps of unsynced bytes is as before.
        """
        function = _sync_file_range()
        if function is not None:
            function(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # an error only means no early writeback

    def drop_cache(self, fd: int) -> None:
        """Tell the kernel the file's (clean) pages are not needed; no effect on durability."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE: list = []


def _sync_file_range():
    """libc's ``sync_file_range`` (looked up once, on first use), or ``None`` where it is missing."""
    if not _SYNC_FILE_RANGE:
        function = None
        try:
            import ctypes  # pylint: disable=import-outside-toplevel

            function = ctypes.CDLL(None, use_errno=True).sync_file_range
            function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            function.restype = ctypes.c_int
        except (OSError, AttributeError):  # not Linux, or no such symbol
            function = None
        _SYNC_FILE_RANGE.append(function)
    return _SYNC_FILE_RANGE[0]


#: The operations of every writer not given others.
OS_FILE_OPS = FileOps()


@dataclass(frozen=True)
class FileOp:
    """One recorded file-system operation.

    Attributes:
        kind: ``"create"`` (a new file), ``"truncate"`` (an existing file opened
            with ``O_TRUNC``), ``"write"``, ``"fsync"``, ``"fdatasync"``,
            ``"rename"``, ``"unlink"``, ``"mkdir"`` or ``"fsync_dir"``.
        path: The file or directory (the source of a rename).
        target: The target of a rename.
        offset: Byte offset of a write.
        data: The bytes of a write.
        thread: Name of the thread that made the call.
    """

    kind: str
    path: Path
    target: Path | None = None
    offset: int = 0
    data: bytes = b""
    thread: str = field(default="", compare=False)


class RecordingFileOps(FileOps):
    """Runs every operation on the OS and records it in :attr:`log` (in call order).

    Only operations that succeeded are recorded. Several writer threads may
    share one recorder; the log is then one order the calls really happened in.
    """

    def __init__(self) -> None:
        self.log: list[FileOp] = []
        self._paths: dict[int, Path] = {}
        self._lock = threading.Lock()

    def _record(self, kind: str, path: Path, **fields: object) -> None:
        self.log.append(FileOp(kind, Path(path), thread=threading.current_thread().name, **fields))

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        with self._lock:
            existed = os.path.exists(path)
            fd = super().open(path, flags, mode)
            self._paths[fd] = Path(path)
            if flags & os.O_CREAT and not existed:
                self._record("create", path)
            elif flags & os.O_TRUNC:
                self._record("truncate", path)
            return fd

    def write(self, fd: int, data: memoryview | bytes) -> int:
        with self._lock:
            offset = os.lseek(fd, 0, os.SEEK_CUR)
            written = super().write(fd, data)
            self._record("write", self._paths[fd], offset=offset, data=bytes(memoryview(data)[:written]))
            return written

    def writev(self, fd: int, buffers: list[memoryview]) -> int:
        with self._lock:
            offset = os.lseek(fd, 0, os.SEEK_CUR)
            written = super().writev(fd, buffers)
            data = b"".join(bytes(b) for b in buffers)[:written]
            self._record("write", self._paths[fd], offset=offset, data=data)
            return written

    def pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> int:
        with self._lock:
            written = super().pwrite(fd, data, offset)
            self._record("write", self._paths[fd], offset=offset, data=bytes(memoryview(data)[:written]))
            return written

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        with self._lock:
            self._record("fsync", self._paths[fd])

    def fdatasync(self, fd: int) -> None:
        super().fdatasync(fd)
        with self._lock:
            self._record("fdatasync", self._paths[fd])

    def close(self, fd: int) -> None:
        with self._lock:
            super().close(fd)
            self._paths.pop(fd, None)

    def replace(self, source: Path, target: Path) -> None:
        with self._lock:
            super().replace(source, target)
            self._record("rename", source, target=Path(target))

    def unlink(self, path: Path) -> None:
        with self._lock:
            super().unlink(path)
            self._record("unlink", path)

    def mkdir(self, path: Path) -> None:
        with self._lock:
            super().mkdir(path)
            self._record("mkdir", path)

    def fsync_directory(self, path: Path) -> None:
        super().fsync_directory(path)
        with self._lock:
            self._record("fsync_dir", path)


def make_directories(ops: FileOps, path: Path, *, sync: bool, deferred: list[Path] | None = None) -> bool:
    """Create ``path`` and its missing parents; with ``sync`` make each new entry durable.

    A directory created by a save must survive a power cut once the save
    returns: each new directory's parent is fsynced after the directory was
    made (the new directory's own entries are synced by the writer later).

    Args:
        ops: The file operations.
        path: The directory.
        sync: Make each new entry durable.
        deferred: With ``sync``, collect the parents to fsync here instead
            of fsyncing them now (the writer syncs them before its commit).

    Returns:
        True when this call created ``path`` itself.
    """
    missing: list[Path] = []
    current = Path(path)
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    created = False
    for directory in reversed(missing):
        try:
            ops.mkdir(directory)
        except FileExistsError:
            if not directory.is_dir():
                raise
            created = False
            continue  # another rank made it; it makes its own entry durable
        created = True
        if sync and deferred is not None:
            deferred.append(directory.parent)
        elif sync:
            ops.fsync_directory(directory.parent)
    return created


def write_all(fd: int, view: memoryview, ops: FileOps) -> None:
    """Write all of ``view`` at ``fd``'s position (in chunks, retrying short writes)."""
    position = 0
    while position < len(view):
        written = ops.write(fd, view[position : position + _WRITE_CHUNK])
        if written <= 0:
            raise OSError("short write")
        position += written


def fsync_directory(path: Path, ops: FileOps = OS_FILE_OPS) -> None:
    """Make the entries of directory ``path`` durable."""
    ops.fsync_directory(path)


def write_atomically(
    path: Path, data: bytes, *, sync: bool = True, tag: str | None = None, ops: FileOps = OS_FILE_OPS
) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename.

    Readers see either the old file or the whole new one. The temporary file
    (``.<name>.<tag>.partial``, a random tag by default) is removed on failure.
    With ``sync`` the file's bytes are durable before the rename and the
    rename is durable (directory fsync) before returning.
    """
    partial = path.with_name(f".{path.name}.{tag or uuid.uuid4().hex[:8]}.partial")
    try:
        fd = ops.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, memoryview(data), ops)
            if sync:
                ops.fsync(fd)
        finally:
            ops.close(fd)
        ops.replace(partial, path)
    except BaseException:
        try:
            ops.unlink(partial)
        except OSError:
            pass  # never created, or a later save sweeps it
        raise
    if sync:
        ops.fsync_directory(path.parent)
