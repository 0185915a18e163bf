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
pass saw (same device, inode and size): :meth:`KeptFiles.check_reopened`
checks every such file before the read pass writes any target, and
:meth:`KeptFiles.reopen` again when it opens one. All descriptors are closed
by :meth:`KeptFiles.close_all` (the reader's ``finish_load``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointNotFoundError

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
        self._lock = threading.Lock()

    def get(self, relative_path: str) -> tuple[FileSource, int] | None:
        """The kept source of a data file and the file's size, or ``None``."""
        return self._open.get(relative_path)

    def keep(self, relative_path: str, source: FileSource, path: Path, fqn: str, stat: Any) -> bool:
        """Keep ``source`` (a first pass's open file) for the read pass, unless :attr:`cap` files are kept;
        return whether it is kept (if not, the caller closes it and its identity is noted for the reopen)."""
        with self._lock:
            if len(self._open) < self.cap:
                self._open[relative_path] = (source, stat.st_size)
                return True
            self._seen[relative_path] = (path, fqn, (stat.st_dev, stat.st_ino, stat.st_size))
        return False

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

    def check_reopened(self, checkpoint: Any) -> None:
        """Check that every file beyond the cap is still the one its first pass checked. Before the read pass.

        Raises:
            CheckpointNotFoundError: a file was deleted or replaced (names it; no target was changed).
        """
        for relative_path, (path, fqn, identity) in list(self._seen.items()):
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                stat = None
            if stat is None or (stat.st_dev, stat.st_ino, stat.st_size) != identity:
                raise self._vanished(relative_path, fqn, checkpoint, checked=True)

    def close_all(self) -> None:
        """Close every kept descriptor and forget the load's files. After the load."""
        with self._lock:
            sources = list(self._open.values())
            self._open.clear()
            self._seen.clear()
        for source, _ in sources:
            os.close(source.fd)

    def _vanished(self, relative_path: str, fqn: str, checkpoint: Any, *, checked: bool) -> CheckpointNotFoundError:
        state = ("no target was changed" if checked else
                 "targets of this load's other files may hold new values already")
        return CheckpointNotFoundError(
            f"data file {relative_path} (key '{fqn}') of checkpoint {checkpoint} was deleted or replaced by "
            f"another file after this load checked it ({state}); a load keeps at most {self.cap} data files open "
            "(a quarter of the open-file limit) and reopens the others by name. Load it again, or raise the "
            "open-file limit (ulimit -n) so that every file of the load stays open"
        )
