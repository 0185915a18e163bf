"""What a commit may delete: the files of the saves it replaced, nothing else.

After a save commits, the files of the committed save it superseded are
garbage, and so are those of a dead save whose stale lease it broke (see
:mod:`._save_lease`). Files are picked by the save id in their names (data
files ``r<rank>_<counter>.<save id>.safetensors``, temporary files
``.<name>.<save id>.partial``), never by "not referenced": a save still
writing next door (another rank's rank-local save) is never touched.

Nothing in the directory is trusted: metadata is read only from a regular
file (no FIFO, symlink or device), at most :data:`MAX_CLEANUP_METADATA_BYTES`,
and a malformed one only means its files are not deleted (logged). Only
regular files are removed; nothing here raises, since the commit already
happened.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Callable

from hyper_parallel.core.distributed_checkpoint._format.metadata_json import save_id_from_head, save_id_of
from hyper_parallel.core.distributed_checkpoint._safe_files import open_regular, remove_regular
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError

__all__ = ["DATA_FILE_PATTERN", "MAX_CLEANUP_METADATA_BYTES", "committed_save_id", "garbage_files", "remove_files"]

#: Data file names: ``r<rank>_<counter>.<save id>.safetensors``, and a rank's storage index of an indexed
#: checkpoint, ``r<rank>_index.<save id>.json`` (docs/format.md section 12.1): group 1 the rank, group 3 the
#: save id, so every cleanup, sweep and tool treats index files exactly as data files. The rank is padded to at
#: least 5 digits and the counter to at least 3 (``{rank:05d}``, ``{counter:03d}``): rank 100000 and up, or a
#: 1000th file of a rank, have more (once left out, their files were never swept).
DATA_FILE_PATTERN = re.compile(
    r"^r(\d{5,})_(\d{3,}(?=\.[0-9a-f]{12}\.safetensors$)|index(?=\.[0-9a-f]{12}\.json$))\.([0-9a-f]{12})\."
    r"(?:safetensors|json)$")
#: Metadata larger than this is not read by the cleanup (its files are then left alone).
MAX_CLEANUP_METADATA_BYTES = 1 << 30
_LOG = logging.getLogger(__name__)


def committed_save_id(path: Path) -> str | None:
    """The save id of the committed metadata ``path``; ``None`` if absent or unreadable (logged)."""
    try:
        fd = open_regular(path, limit=MAX_CLEANUP_METADATA_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, CheckpointError) as exc:
        _LOG.warning("checkpoint cleanup: cannot read %s (%s); the files it references are left alone", path, exc)
        return None
    try:
        head = os.pread(fd, 4096, 0)
        save_id = save_id_from_head(head)
        if save_id is not None:
            return save_id
        size = os.fstat(fd).st_size
        save_id = save_id_of(os.pread(fd, size, 0) if size > len(head) else head)
        if save_id is not None:
            return save_id
        _LOG.warning("checkpoint cleanup: %s names no save id; the files it references are left alone", path)
    except (OSError, ValueError, RecursionError, MemoryError) as exc:
        _LOG.warning("checkpoint cleanup: %s is not readable metadata (%s); its files are left alone",
                     path, type(exc).__name__)
    finally:
        os.close(fd)
    return None


def garbage_files(directory: Path, save_ids: set[str], *, rank: int | None = None) -> list[Path]:
    """Data, temporary and results-record files of ``save_ids`` in ``directory`` (of ``rank`` only, if given)."""
    wanted = {i for i in save_ids if i}
    if not wanted:
        return []
    found = []
    try:
        entries = list(os.scandir(directory))
    except OSError as exc:
        _LOG.warning("checkpoint cleanup: cannot list %s: %s", directory, exc)
        return []
    for entry in entries:
        name = entry.name
        match = DATA_FILE_PATTERN.match(name)
        if match:
            if match.group(3) in wanted and (rank is None or int(match.group(1)) == rank):
                found.append(Path(entry.path))
        elif name.startswith(".") and name.endswith(".partial") and name.split(".")[-2] in wanted:
            found.append(Path(entry.path))
        elif name.startswith(".") and name.endswith(".results") and name.split(".")[1] in wanted and rank is None:
            found.append(Path(entry.path))  # a rank's results record of a multi-rank async save
    return found


def remove_files(paths: list[Path], *, unlink: Callable[[Path], None] = os.unlink) -> None:
    """Delete the regular files among ``paths`` with ``unlink``; log the rest. Never raises."""
    for path in paths:
        remove_regular(path, unlink=unlink)
