"""``CheckpointManager``: numbered steps under one root directory, with retention.

Layout on disk: step ``s`` is the checkpoint directory
``<root>/<step_prefix><s:08d>`` (``step_00000120`` for step 120; steps of more
than 8 digits just get wider names). Only names in exactly that form count as
steps. A step is *committed* when its directory holds a ``metadata.json`` that
:func:`read_metadata` accepts; a directory without one is a save that crashed
or is still running. Directories being deleted are first renamed to hidden
``.deleting-<name>-<random>`` names, so no reader ever sees a half-deleted step.

Protocol: every public method is called by all ranks at the same point of
the program (like ``save`` and ``load``). Listing and deleting happen on the
coordinator (rank 0) only; the listing is broadcast, so every rank gets the
same answer and the same errors. Retention runs only after a new step is
committed: it keeps the newest ``max_to_keep`` committed steps (by step
number) plus every step divisible by ``keep_every_n_steps``, and removes
uncommitted step directories older than the newest committed step, except
the one this manager is writing. A step directory whose save lease is live
(another manager or process saving it right now) is never deleted.

With an object-store root (``s3://bucket/prefix``) each step is a prefix;
see :mod:`._object_steps` for how steps are listed and deleted there.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from hyper_parallel.core.distributed_checkpoint.api import load as dcp_load
from hyper_parallel.core.distributed_checkpoint.api import read_metadata
from hyper_parallel.core.distributed_checkpoint.api import save as dcp_save
from hyper_parallel.core.distributed_checkpoint.async_checkpoint import AsyncSaveHandle
from hyper_parallel.core.distributed_checkpoint.async_checkpoint import async_save as dcp_async_save
from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointValueError,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import METADATA_FILE
from hyper_parallel.core.distributed_checkpoint._save_lease import live_lease_in
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import is_object_url
from hyper_parallel.core.distributed_checkpoint._object_steps import ObjectStepRoot

__all__ = ["CheckpointManager"]

_LOG = logging.getLogger(__name__)
_STEP_DIGITS = 8
_DELETING = ".deleting-"


def _positive_or_none(name: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise CheckpointValueError(f"{name} must be a positive int or None, got {value!r}")
    return value


class CheckpointManager:
    """Saves numbered steps under ``root`` and keeps only the ones asked for.

    Args:
        root: Directory holding one checkpoint directory per step (created on first save), or
            an object-store URL (``s3://bucket/prefix``) holding one prefix per step.
        max_to_keep: Keep the newest this many committed steps; ``None`` keeps all.
        save_interval_steps: ``save`` writes only steps divisible by it (unless forced).
        keep_every_n_steps: Also keep forever every step divisible by it.
        async_save: Save with :func:`async_save`: ``save`` returns once the state is staged.
        step_prefix: Step directory names are ``<step_prefix><step:08d>``.

    Raises:
        CheckpointValueError: A setting out of range, or a prefix that is not a plain name.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        keep_every_n_steps: int | None = None,
        async_save: bool = False,
        step_prefix: str = "step_",
    ) -> None:
        if not isinstance(step_prefix, str) or not step_prefix or step_prefix.startswith(".") or (
            "/" in step_prefix or os.sep in step_prefix
        ):
            raise CheckpointValueError(f"step_prefix must be a plain name not starting with '.', got {step_prefix!r}")
        self._objects: ObjectStepRoot | None = None
        if is_object_url(root):
            self._objects = ObjectStepRoot(str(root), METADATA_FILE)
            self.root: Path | str = self._objects.url
        else:
            self.root = Path(os.fspath(root))
        self.max_to_keep = _positive_or_none("max_to_keep", max_to_keep)
        self.save_interval_steps = _positive_or_none("save_interval_steps", save_interval_steps) or 1
        self.keep_every_n_steps = _positive_or_none("keep_every_n_steps", keep_every_n_steps)
        self.async_save = bool(async_save)
        self.step_prefix = step_prefix
        self._pattern = re.compile(re.escape(step_prefix) + r"(\d+)")
        self._handle: AsyncSaveHandle | None = None
        self._writing: int | None = None  # the step this manager is saving, hidden from listings
        self._verified: dict[int, object] = {}  # step -> stat (or object tag) of its checked metadata

    def directory(self, step: int) -> Path | str:
        """Return the checkpoint directory (or ``s3://`` id) of ``step`` (no file access). Any rank."""
        if self._objects is not None:
            return self._objects.location(self._name(step))
        return self.root / self._name(step)

    def _name(self, step: int) -> str:
        return f"{self.step_prefix}{step:0{_STEP_DIGITS}d}"

    def _step_of(self, name: str) -> int | None:
        match = self._pattern.fullmatch(name)
        if match is None or self._name(int(match.group(1))) != name:
            return None
        return int(match.group(1))

    def _scan(self) -> tuple[list[int], list[int]]:
        """Return (committed, uncommitted) steps, sorted, without the step being written. Coordinator."""
        if self._objects is not None:
            return self._scan_objects()
        committed: list[int] = []
        uncommitted: list[int] = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return committed, uncommitted
        for entry in entries:
            step = self._step_of(entry.name)
            if step is None or step == self._writing or not entry.is_dir():
                continue
            try:
                stat = os.stat(os.path.join(entry.path, METADATA_FILE))
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

    def _scan_objects(self) -> tuple[list[int], list[int]]:
        """:meth:`_scan` for an object-store root; uncommitted steps only once abandoned. Coordinator."""
        committed: list[int] = []
        uncommitted: list[int] = []
        for entry in self._objects.entries():
            step = self._step_of(entry.name)
            if step is None or step == self._writing:
                continue
            if entry.tag is None:
                if self._objects.is_abandoned(entry):
                    uncommitted.append(step)
                continue
            if self._verified.get(step) != entry.tag:
                try:
                    read_metadata(self.directory(step))
                except CheckpointError as exc:
                    _LOG.warning("rank 0: ignoring step %s: %s", self.directory(step), exc)
                    continue
                self._verified[step] = entry.tag
            committed.append(step)
        self._verified = {s: sig for s, sig in self._verified.items() if s in committed}
        return sorted(committed), sorted(uncommitted)

    def all_steps(self) -> list[int]:
        """Return the committed steps, ascending. All ranks call it (rank 0 lists, then broadcasts).

        A step whose save is still in flight is not listed.
        """
        dist = DistWrapper(use_dist=True)
        return dist.broadcast("list checkpoint steps", lambda: self._scan()[0])

    def latest_step(self) -> int | None:
        """Return the newest committed step, or ``None``. All ranks call it."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state_dict: dict[str, Any], *, force: bool = False) -> bool:
        """Save ``state_dict`` as ``step`` if the interval says so. All ranks call it.

        Any earlier async save is finished (committed, then retention) first.
        With ``async_save`` the call returns once the state is staged; the step
        commits at the next ``save``, ``wait`` or ``close``. Otherwise it
        commits before returning and retention runs.

        Args:
            step: A non-negative training step.
            state_dict: The state to save (see :func:`save`).
            force: Save even off the interval, and overwrite a committed
                ``step`` (the old checkpoint stays intact until the new one commits).

        Returns:
            Whether a checkpoint was saved (started, with ``async_save``).

        Raises:
            CheckpointValueError: A bad step, or ``step`` is already committed and not ``force``.
            CheckpointError: On every rank, if the save (or the previous async one) failed.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointValueError(f"step must be a non-negative int, got {step!r}")
        if not force and step % self.save_interval_steps != 0:
            return False
        self.wait()
        if not force and step in self.all_steps():
            raise CheckpointValueError(
                f"step {step} already has a committed checkpoint in {self.directory(step)}; "
                "pass force=True to overwrite it"
            )
        self._writing = step
        try:
            if self.async_save:
                self._handle = dcp_async_save(state_dict, checkpoint_id=self.directory(step))
                return True
            dcp_save(state_dict, checkpoint_id=self.directory(step))
        finally:
            if self._handle is None:
                self._writing = None
        self._apply_retention()
        return True

    def wait(self) -> None:
        """Finish the in-flight async save: write, commit, then retention. All ranks call it.

        Does nothing without one. A failed save is raised once (on every
        rank); its directory stays uncommitted and is cleaned up later.
        """
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            handle.result()
        finally:
            self._writing = None
        self._apply_retention()

    def load(self, state_dict: dict[str, Any], step: int | None = None, **kwargs: Any) -> int:
        """Load ``step`` (default: the latest committed) into ``state_dict`` in place. All ranks call it.

        Args:
            state_dict: Targets, as for :func:`load`.
            step: The step to load; ``None`` for the latest committed one.
            **kwargs: Passed on to :func:`load` (``planner``, ``storage_reader``, ...).

        Returns:
            The step loaded.

        Raises:
            CheckpointNotFoundError: No committed step under ``root`` (or no such step).
            CheckpointError: As :func:`load`.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint in {self.root} (looked for {self.step_prefix}<step> "
                    f"directories holding {METADATA_FILE}); save a step first or check the root"
                )
        elif step == self._writing:
            self.wait()
        dcp_load(state_dict, checkpoint_id=self.directory(step), **kwargs)
        return step

    def close(self) -> None:
        """Finish any in-flight async save. All ranks call it."""
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _apply_retention(self) -> None:
        """Delete what retention drops, on rank 0; the gather after it is the barrier. All ranks."""
        dist = DistWrapper(use_dist=True)

        def retain() -> None:
            if dist.is_coordinator:
                self._retain_on_coordinator()

        dist.all_gather("checkpoint retention", retain)

    def _retain_on_coordinator(self) -> None:
        committed, uncommitted = self._scan()
        if not committed:
            return
        keep = set(committed if self.max_to_keep is None else committed[-self.max_to_keep :])
        if self.keep_every_n_steps is not None:
            keep.update(s for s in committed if s % self.keep_every_n_steps == 0)
        doomed = [s for s in committed if s not in keep] + [s for s in uncommitted if s < committed[-1]]
        if self._objects is not None:  # no leases on object storage: the scan skipped steps that may be in flight
            for step in doomed:
                self._objects.delete(self._name(step))
                self._verified.pop(step, None)
            return
        for step in doomed:
            holder = live_lease_in(self.directory(step))
            if holder is not None:  # another manager or process is saving this step right now
                _LOG.info("rank 0: keeping %s: a save holds it (%s)", self.directory(step), holder.describe())
                continue
            self._delete(self.directory(step))
            self._verified.pop(step, None)
        for entry in os.scandir(self.root):  # leftovers of deletions interrupted earlier
            if entry.name.startswith(_DELETING + self.step_prefix) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)

    @staticmethod
    def _delete(path: Path) -> None:
        """Rename ``path`` to a hidden name, then remove it. Coordinator only."""
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
