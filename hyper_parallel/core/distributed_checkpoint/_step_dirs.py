"""The step directories of a :class:`.CheckpointManager`: their names, listing and deletion.

Step ``s`` lives in ``<root>/<step_prefix><s:08d>`` (steps of more than 8
digits just get wider names); only names in exactly that form count as steps.
A step is *committed* when its directory holds a metadata file that
:func:`read_metadata` accepts. A directory is deleted by first renaming it to
a hidden ``.deleting-<name>-<random>`` name, so no reader ever sees a
half-deleted step; leftovers of an interrupted deletion are swept later. Under
an object-store root each step is a prefix (see :mod:`._object_steps`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from pathlib import Path

from hyper_parallel.core.distributed_checkpoint.api import read_metadata
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError, CheckpointValueError
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import is_object_url
from hyper_parallel.core.distributed_checkpoint._object_steps import ObjectStepRoot
from hyper_parallel.core.distributed_checkpoint._save_lease import live_lease_in
from hyper_parallel.core.distributed_checkpoint.storage import local_directory

__all__ = ["StepDirectories"]

_LOG = logging.getLogger(__name__)
_STEP_DIGITS = 8
_DELETING = ".deleting-"


class StepDirectories:
    """Names, lists and deletes the step checkpoints under one root.

    Listing and deleting are for the coordinator only; naming needs no file access.

    Args:
        root: A directory, or an object-store URL (``s3://bucket/prefix``).
        step_prefix: Step directory names are ``<step_prefix><step:08d>``.
        metadata_file: Name of a checkpoint's metadata file (what makes a step committed).

    Raises:
        CheckpointValueError: ``step_prefix`` is not a plain name.
    """

    def __init__(self, root: str | os.PathLike[str], *, step_prefix: str, metadata_file: str) -> None:
        if not isinstance(step_prefix, str) or not step_prefix or step_prefix.startswith(".") or (
            "/" in step_prefix or os.sep in step_prefix
        ):
            raise CheckpointValueError(f"step_prefix must be a plain name not starting with '.', got {step_prefix!r}")
        self.step_prefix = step_prefix
        self.metadata_file = metadata_file
        self.objects: ObjectStepRoot | None = None
        if is_object_url(root):
            self.objects = ObjectStepRoot(str(root), metadata_file)
            self.root: Path | str = self.objects.url
        else:
            self.root = local_directory(root)
        self._pattern = re.compile(re.escape(step_prefix) + r"(\d+)")
        self._verified: dict[int, object] = {}  # step -> stat (or object tag) of its checked metadata

    def name(self, step: int) -> str:
        """The directory name of ``step``."""
        return f"{self.step_prefix}{step:0{_STEP_DIGITS}d}"

    def location(self, step: int) -> Path | str:
        """The checkpoint directory (or ``s3://`` id) of ``step``; no file access."""
        if self.objects is not None:
            return self.objects.location(self.name(step))
        return self.root / self.name(step)

    def step_of(self, name: str) -> int | None:
        """The step a directory name stands for, or ``None`` for any other name."""
        match = self._pattern.fullmatch(name)
        if match is None or self.name(int(match.group(1))) != name:
            return None
        return int(match.group(1))

    def scan(self, *, skip: int | None) -> tuple[list[int], list[int]]:
        """Return (committed, uncommitted) steps, sorted, without step ``skip``. Coordinator only.

        A step whose metadata does not read is left out (with a warning); a
        step's metadata is read again only when its file changed.
        """
        if self.objects is not None:
            return self._scan_objects(skip)
        committed: list[int] = []
        uncommitted: list[int] = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return committed, uncommitted
        for entry in entries:
            step = self.step_of(entry.name)
            if step is None or step == skip or not entry.is_dir():
                continue
            try:
                stat = os.stat(os.path.join(entry.path, self.metadata_file))
            except FileNotFoundError:
                uncommitted.append(step)
                continue
            signature = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if self._verified.get(step) != signature:
                try:
                    read_metadata(entry.path)
                except (CheckpointError, OSError) as exc:
                    _LOG.warning("rank 0: ignoring step directory %s: %s", entry.path, exc)
                    continue
                self._verified[step] = signature
            committed.append(step)
        self._verified = {s: sig for s, sig in self._verified.items() if s in committed}
        return sorted(committed), sorted(uncommitted)

    def _scan_objects(self, skip: int | None) -> tuple[list[int], list[int]]:
        """:meth:`scan` for an object-store root; uncommitted steps only once abandoned."""
        committed: list[int] = []
        uncommitted: list[int] = []
        for entry in self.objects.entries():
            step = self.step_of(entry.name)
            if step is None or step == skip:
                continue
            if entry.tag is None:
                if self.objects.is_abandoned(entry):
                    uncommitted.append(step)
                continue
            if self._verified.get(step) != entry.tag:
                try:
                    read_metadata(self.location(step))
                except CheckpointError as exc:
                    _LOG.warning("rank 0: ignoring step %s: %s", self.location(step), exc)
                    continue
                self._verified[step] = entry.tag
            committed.append(step)
        self._verified = {s: sig for s, sig in self._verified.items() if s in committed}
        return sorted(committed), sorted(uncommitted)

    def delete(self, step: int) -> bool:
        """Delete ``step``'s checkpoint unless a live save lease holds it. Coordinator only; never raises.

        Returns:
            ``False`` when the step was kept because another save holds it right now.
        """
        if self.objects is not None:  # no lease there: the scan already skipped steps that may be in flight
            self.objects.delete(self.name(step))
            self._verified.pop(step, None)
            return True
        path = self.location(step)
        holder = live_lease_in(path)
        if holder is not None:
            _LOG.info("rank 0: keeping %s: a save holds it (%s)", path, holder.describe())
            return False
        _delete_directory(path)
        self._verified.pop(step, None)
        return True

    def sweep_deletions(self) -> None:
        """Remove leftovers of deletions interrupted earlier. Coordinator only."""
        if self.objects is not None:
            return
        for entry in os.scandir(self.root):
            if entry.name.startswith(_DELETING + self.step_prefix) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)


def _delete_directory(path: Path) -> None:
    """Rename ``path`` to a hidden name, then remove it."""
    hidden = path.with_name(f"{_DELETING}{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, hidden)
    except FileNotFoundError:
        return
    except OSError as exc:
        _LOG.warning("rank 0: cannot delete old checkpoint %s: %s", path, exc)
        return
    try:
        shutil.rmtree(hidden)
    except OSError as exc:
        _LOG.warning("rank 0: %s left behind (removed at the next retention): %s", hidden, exc)
    else:
        _LOG.info("rank 0: deleted old checkpoint %s", path)
