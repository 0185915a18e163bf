"""The data files a filesystem load opened in its first pass, kept open for its read pass.

A load opens each data file in its first pass (the header check, and with
checksums on the verify pass) and reads it again in the read pass. Another
process may delete or replace the file in between: a ``CheckpointManager``'s
retention removing an old step, or a save to the same checkpoint id that
commits and removes the previous save's data files. The read pass therefore
reads through the descriptor the first pass opened (POSIX keeps a deleted
file's bytes while a descriptor is open), so it lands exactly the bytes that
were verified, and a load that failed nowhere else completes.

Descriptors are bounded by :func:`keep_cap` (a share of the ``RLIMIT_NOFILE``
soft limit). A file opened beyond the cap is closed after its first pass and
reopened by name in the read pass, where it must still be the file the first
pass saw (same device, inode and size): :meth:`KeptFiles.check_before_read`
checks every such file before the read pass writes any target, and
:meth:`KeptFiles.reopen` again when it opens one. All descriptors are closed
by :meth:`KeptFiles.close_all` (the reader's ``finish_load``).

A descriptor does not help against a file written to in place (the same
inode: ``open(name, "r+b")``, ``dd conv=notrunc``): the read pass would read
the new bytes. Every file's size and modification time (``st_mtime_ns``) are
noted when the first pass opens it and compared after each pass used it
(:meth:`KeptFiles.check_unchanged`) and for every file before the read pass
(:meth:`KeptFiles.check_before_read`); a difference fails the load with a
:class:`CorruptCheckpointError` naming the file. Caught before the read pass,
no target changed; caught after it read the file, targets may hold bytes
that were not verified (the message says so). Writes that keep the
modification time (a writer resetting it with ``utime``, or one landing
within the filesystem's timestamp tick of the file's previous write) are not
seen. Deleting or renaming the file changes neither (only ``st_ctime``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["KeptFiles", "MAX_KEPT_FILES", "keep_cap"]

#: Most data files one load keeps open, whatever the open-file limit.
MAX_KEPT_FILES = 4096
#: The share of the ``RLIMIT_NOFILE`` soft limit a load may keep open (the rest stays for the process).
_LIMIT_SHARE = 4


def keep_cap() -> int:
    """How many data files a load keeps open: a quarter of the ``RLIMIT_NOFILE`` soft limit, at most
    :data:`MAX_KEPT_FILES` (256 under the common limit of 1024)."""
    try:
        import resource  # pylint: disable=import-outside-toplevel  # POSIX only

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 256
    if soft == resource.RLIM_INFINITY or soft < 0:
        return MAX_KEPT_FILES
    return min(MAX_KEPT_FILES, soft // _LIMIT_SHARE)


class KeptFiles:
    """The open data files of one load (a part of :class:`~.filesystem_reader.FileSystemReader`; all ranks).

    Attributes:
        cap: Most files kept open (set at each load's set-up by :func:`keep_cap`).
    """

    def __init__(self) -> None:
        self.cap = 0
        self._open: dict[str, tuple[FileSource, int]] = {}  # data file -> (its source from the first pass, size)
        self._seen: dict[str, tuple[Path, str, tuple[int, int, int]]] = {}  # beyond the cap: (path, key, identity)
        self._stamps: dict[str, tuple[int, int]] = {}  # data file -> (size, st_mtime_ns) when first opened
        self._keys: dict[str, str] = {}  # kept data file -> a key it holds (for messages)
        self._lock = threading.Lock()

    def get(self, relative_path: str) -> tuple[FileSource, int] | None:
        """The kept source of a data file and the file's size, or ``None``."""
        return self._open.get(relative_path)

    def keep(self, relative_path: str, source: FileSource, path: Path, fqn: str, stat: Any) -> bool:
        """Keep ``source`` (a first pass's open file) for the read pass, unless :attr:`cap` files are kept;
        return whether it is kept (if not, the caller closes it and its identity is noted for the reopen).
        ``stat`` is the file's ``fstat`` at that open: its size and modification time are what the later checks
        compare with."""
        with self._lock:
            self._stamps[relative_path] = (stat.st_size, stat.st_mtime_ns)
            if len(self._open) < self.cap:
                self._open[relative_path] = (source, stat.st_size)
                self._keys[relative_path] = fqn
                return True
            self._seen[relative_path] = (path, fqn, (stat.st_dev, stat.st_ino, stat.st_size))
        return False

    def check_unchanged(self, relative_path: str, fd: int, fqn: str, checkpoint: Any, *, landed: bool) -> None:
        """Check that the data file open as ``fd`` was not written to since the first pass opened it (its size
        and modification time). After each pass used the file.

        Args:
            relative_path: The data file.
            fd: A descriptor of it.
            fqn: A key it holds (for the message).
            checkpoint: The checkpoint directory (for the message).
            landed: The read pass read the file into targets already.

        Raises:
            CorruptCheckpointError: it was written to (names it, and what state the targets are in).
        """
        noted = self._stamps.get(relative_path)
        if noted is None:  # not opened by a first pass of this load (a direct read_data): nothing to compare
            return
        stat = os.fstat(fd)
        if (stat.st_size, stat.st_mtime_ns) != noted:
            raise self._modified(relative_path, fqn, checkpoint, landed=landed)

    def reopen(self, relative_path: str, path: Path, fqn: str, checkpoint: Any) -> int:
        """Open a data file beyond the cap again by name; return its descriptor.

        Raises:
            CheckpointNotFoundError: it was deleted, or is another file than the one the first pass checked.
        """
        noted = self._seen.get(relative_path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            fd = -1
        if noted is None:  # not seen by a first pass of this load: nothing to compare (a direct read_data)
            if fd < 0:
                raise self._vanished(relative_path, fqn, checkpoint, checked=False)
            return fd
        if fd >= 0:
            stat = os.fstat(fd)
            if (stat.st_dev, stat.st_ino, stat.st_size) == noted[2]:
                return fd
            os.close(fd)
        raise self._vanished(relative_path, fqn, checkpoint, checked=False)

    def check_before_read(self, checkpoint: Any) -> None:
        """Check that every file beyond the cap is still the one its first pass checked, and that no file was
        written to since then. Before the read pass (one ``stat`` per file).

        Raises:
            CheckpointNotFoundError: a file beyond the cap was deleted or replaced (names it; no target was
                changed).
            CorruptCheckpointError: a file was written to in place (names it; no target was changed).
        """
        for relative_path, (path, fqn, identity) in list(self._seen.items()):
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                stat = None
            if stat is None or (stat.st_dev, stat.st_ino, stat.st_size) != identity:
                raise self._vanished(relative_path, fqn, checkpoint, checked=True)
            if stat.st_mtime_ns != self._stamps[relative_path][1]:
                raise self._modified(relative_path, fqn, checkpoint, landed=False)
        for relative_path, (source, _) in list(self._open.items()):
            self.check_unchanged(relative_path, source.fd, self._keys[relative_path], checkpoint, landed=False)

    def close_all(self) -> None:
        """Close every kept descriptor and forget the load's files. After the load."""
        with self._lock:
            sources = list(self._open.values())
            self._open.clear()
            self._seen.clear()
            self._stamps.clear()
            self._keys.clear()
        for source, _ in sources:
            os.close(source.fd)

    @staticmethod
    def _modified(relative_path: str, fqn: str, checkpoint: Any, *, landed: bool) -> CorruptCheckpointError:
        state = ("targets of this load may already hold bytes of it that were never verified, and other targets "
                 "new values: do not use them" if landed else "no target was changed")
        return CorruptCheckpointError(
            f"data file {relative_path} (key '{fqn}') of checkpoint {checkpoint} was written to (its size or "
            f"modification time changed) after this load opened and checked it ({state}). A committed checkpoint's "
            "data files are never written again: find what writes into the checkpoint, then load it again (and "
            "verify it, hp-ckpt verify, if the writes may have changed it)"
        )

    def _vanished(self, relative_path: str, fqn: str, checkpoint: Any, *, checked: bool) -> CheckpointNotFoundError:
        state = ("no target was changed" if checked else
                 "targets of this load's other files may hold new values already")
        return CheckpointNotFoundError(
            f"data file {relative_path} (key '{fqn}') of checkpoint {checkpoint} was deleted or replaced by "
            f"another file after this load checked it ({state}); a load keeps at most {self.cap} data files open "
            "(a quarter of the open-file limit) and reopens the others by name. Load it again, or raise the "
            "open-file limit (ulimit -n) so that every file of the load stays open"
        )
