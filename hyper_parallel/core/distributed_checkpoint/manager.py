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
number; with ``best_fn`` the best ones by metric), the newest committed step,
the step just saved, and every step ever promised "keep forever"
(``keep_every_n_steps``, ``keep_time_interval_seconds``), and removes
uncommitted step directories older than the newest committed step, except
the one this manager is writing. Those promises and the metrics live in
``<root>/manager.json`` (see ``_manager_record``), so a manager re-created
with another policy keeps them.

Steps only move forward: saving a step at or below the newest committed
one is refused (``force=True`` overwrites an existing step on purpose). A step directory whose save lease is live
(another manager or process saving it right now) is never deleted.

With an object-store root (``s3://bucket/prefix``) each step is a prefix;
see :mod:`._object_steps` for how steps are listed and deleted there.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Iterator, Mapping

from hyper_parallel.core.distributed_checkpoint.api import load as dcp_load
from hyper_parallel.core.distributed_checkpoint.api import read_metadata
from hyper_parallel.core.distributed_checkpoint.api import save as dcp_save
from hyper_parallel.core.distributed_checkpoint.async_checkpoint import AsyncSaveHandle
from hyper_parallel.core.distributed_checkpoint.async_checkpoint import async_save as dcp_async_save
from hyper_parallel.core.distributed_checkpoint._background_commit import settle_background_commits
from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointValueError,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import METADATA_FILE, FileSystemWriter
from hyper_parallel.core.distributed_checkpoint._manager_record import (
    ManagerPolicy,
    ManagerRecord,
    StepRecord,
    _Session,
    locked_record,
)
from hyper_parallel.core.distributed_checkpoint._save_lease import live_lease_in
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import FsspecWriter, is_object_url
from hyper_parallel.core.distributed_checkpoint._object_steps import ObjectStepRoot

__all__ = ["CheckpointManager"]

_LOG = logging.getLogger(__name__)
_STEP_DIGITS = 8
_DELETING = ".deleting-"


def _positive_or_none(name: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise CheckpointValueError(f"{name} must be a positive int or None, got {value!r}")
    return value


def _seconds_or_none(name: str, value: float | None) -> float | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
    ):
        raise CheckpointValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return None if value is None else float(value)


class CheckpointManager:
    """Saves numbered steps under ``root`` and keeps only the ones asked for.

    Args:
        root: Directory holding one checkpoint directory per step (created on first save), or
            an object-store URL (``s3://bucket/prefix``) holding one prefix per step.
        max_to_keep: Keep the newest (with ``best_fn``: the best) this many
            committed steps, as MindSpore keeps 5; ``None`` keeps all. The
            newest committed step is always kept (it is what a resume loads).
        save_interval_steps: ``save`` writes only steps divisible by it (unless
            forced). ``None``: every step, unless ``save_interval_seconds`` is set.
        save_interval_seconds: ``save`` writes a step once at least this many
            seconds passed since the last save (or since the manager was made),
            by rank 0's clock. With both intervals, either one triggers a save.
        keep_every_n_steps: Also keep forever every step divisible by it.
        keep_time_interval_seconds: Also keep forever one step per this many
            seconds (a committed step saved at least that long after the
            previous kept-forever one).
        best_fn: ``metrics -> float`` ranking steps for ``max_to_keep``: the
            best ones are kept instead of the newest. Steps saved without
            metrics rank last.
        best_mode: ``"max"`` (higher is better) or ``"min"``.
        async_save: Save with :func:`async_save`: ``save`` returns once the state is staged.
        step_prefix: Step directory names are ``<step_prefix><step:08d>``.
        writer_options: Keyword arguments of :class:`FileSystemWriter` for every
            save (``sync_files``, ``thread_count``, ``compression``, ...).

    Raises:
        CheckpointValueError: A setting out of range, or a prefix that is not a plain name.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 5,
        save_interval_steps: int | None = None,
        save_interval_seconds: float | None = None,
        keep_every_n_steps: int | None = None,
        keep_time_interval_seconds: float | None = None,
        best_fn: Callable[[dict[str, Any]], float] | None = None,
        best_mode: str = "max",
        async_save: bool = False,
        step_prefix: str = "step_",
        writer_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(step_prefix, str) or not step_prefix or step_prefix.startswith(".") or (
            "/" in step_prefix or os.sep in step_prefix
        ):
            raise CheckpointValueError(f"step_prefix must be a plain name not starting with '.', got {step_prefix!r}")
        self._objects: ObjectStepRoot | None = None
        if is_object_url(root):
            self._objects = ObjectStepRoot(str(root), METADATA_FILE)
            self.root: Path | str = self._objects.url
            self._memory_record = ManagerRecord()
        else:
            self.root = Path(os.fspath(root))
        self.max_to_keep = _positive_or_none("max_to_keep", max_to_keep)
        self.save_interval_seconds = _seconds_or_none("save_interval_seconds", save_interval_seconds)
        self.save_interval_steps = _positive_or_none("save_interval_steps", save_interval_steps)
        if self.save_interval_steps is None and self.save_interval_seconds is None:
            self.save_interval_steps = 1
        self.keep_every_n_steps = _positive_or_none("keep_every_n_steps", keep_every_n_steps)
        self.keep_time_interval_seconds = _seconds_or_none("keep_time_interval_seconds", keep_time_interval_seconds)
        if best_mode not in ("max", "min"):
            raise CheckpointValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
        if best_fn is not None and not callable(best_fn):
            raise CheckpointValueError(f"best_fn must be callable (metrics -> float), got {type(best_fn).__name__}")
        self.best_fn = best_fn
        self.best_mode = best_mode
        self.writer_options = dict(writer_options or {})
        self._writer_class = FsspecWriter if self._objects is not None else FileSystemWriter
        if self.writer_options:
            self._writer_class(self.root, **self.writer_options)  # refuse unknown or bad options now, not at a save
        self.async_save = bool(async_save)
        self.policy = ManagerPolicy(
            max_to_keep=self.max_to_keep,
            keep_every_n_steps=self.keep_every_n_steps,
            keep_time_interval_seconds=self.keep_time_interval_seconds,
            best_mode=best_mode if best_fn is not None else None,
        )
        self.step_prefix = step_prefix
        self._pattern = re.compile(re.escape(step_prefix) + r"(\d+)")
        self._handle: AsyncSaveHandle | None = None
        self._writing: int | None = None  # the step this manager is saving, hidden from listings
        self._verified: dict[int, object] = {}  # step -> stat (or object tag) of its checked metadata
        self._committing: tuple[int, dict[str, Any] | None] | None = None  # step and metrics awaiting retention
        self._last_save = time.monotonic()

    @contextlib.contextmanager
    def _record_session(self) -> Iterator[_Session]:
        """The manager record under its lock; for an object-store root, this process's record in memory."""
        if self._objects is None:
            with locked_record(self.root) as session:
                yield session
            return
        session = _Session(self._memory_record)
        yield session
        self._memory_record = session.record

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

    def should_save(self, step: int) -> bool:
        """Tell whether ``save(step, ...)`` would write (the intervals say so). All ranks call it.

        With ``save_interval_seconds`` rank 0 decides by its clock and
        broadcasts the answer, so every rank agrees.
        """
        if self.save_interval_steps is not None and step % self.save_interval_steps == 0:
            return True
        if self.save_interval_seconds is None:
            return False
        dist = DistWrapper(use_dist=True)
        return dist.broadcast(
            "save interval", lambda: time.monotonic() - self._last_save >= self.save_interval_seconds
        )

    def save(
        self,
        step: int,
        state_dict: dict[str, Any],
        *,
        force: bool = False,
        metrics: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> bool:
        """Save ``state_dict`` as ``step`` if the intervals say so. All ranks call it.

        Any earlier async save is finished (committed, then retention) first.
        With ``async_save`` the call returns once the state is staged; the step
        commits at the next ``save``, ``wait`` or ``close``. Otherwise it
        commits before returning and retention runs.

        Steps only move forward: a step at or below the newest committed one
        is refused unless ``force``.

        Args:
            step: A non-negative training step.
            state_dict: The state to save (see :func:`save`).
            force: Save even off the interval, and overwrite a committed
                ``step`` (the old checkpoint stays intact until the new one commits).
            metrics: JSON values describing this step (ranked by ``best_fn``),
                kept in the root's record.
            **kwargs: Passed on to :func:`save` / :func:`async_save` (``planner``, ...).

        Returns:
            Whether a checkpoint was saved (started, with ``async_save``).

        Raises:
            CheckpointValueError: A bad step, or ``step`` is not after the
                newest committed step (and not ``force``).
            CheckpointError: On every rank, if the save (or the previous async one) failed.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointValueError(f"step must be a non-negative int, got {step!r}")
        if metrics is not None and not isinstance(metrics, dict):
            raise CheckpointValueError(f"metrics must be a dict of JSON values or None, got {type(metrics).__name__}")
        if not force and not self.should_save(step):
            return False
        self.wait()
        committed = self.all_steps()
        if not force and step in committed:
            raise CheckpointValueError(
                f"step {step} already has a committed checkpoint in {self.directory(step)}; "
                "pass force=True to overwrite it"
            )
        if not force and committed and step < committed[-1]:
            raise CheckpointValueError(
                f"step {step} is below the newest committed step {committed[-1]} in {self.root}: steps only move "
                f"forward (a resumed run continues after {committed[-1]}); pass force=True to write it anyway"
            )
        self._last_save = time.monotonic()
        if self.writer_options and "storage_writer" not in kwargs:
            kwargs["storage_writer"] = self._writer_class(self.directory(step), **self.writer_options)
        self._writing = step
        self._committing = (step, metrics)
        try:
            if self.async_save:
                self._handle = dcp_async_save(state_dict, checkpoint_id=self.directory(step), **kwargs)
                return True
            dcp_save(state_dict, checkpoint_id=self.directory(step), **kwargs)
        except BaseException:
            self._committing = None
            raise
        finally:
            if self._handle is None:
                self._writing = None
        self._apply_retention()
        return True

    def wait(self) -> None:
        """Finish the in-flight async save: write, commit, then retention. All ranks call it.

        Does nothing without one. A failed save is raised once (on every
        rank); its directory stays uncommitted and is cleaned up later. The
        commit runs in the background; this waits for its outcome on every
        rank (a failed commit raises everywhere) before retention.
        """
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            handle.result()
            settle_background_commits()
        except BaseException:
            self._committing = None
            raise
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
        """Record the step just committed, delete what retention drops, on rank 0. All ranks.

        The gather after it is the barrier.
        """
        dist = DistWrapper(use_dist=True)
        committing, self._committing = self._committing, None

        def retain() -> None:
            if dist.is_coordinator:
                self._retain_on_coordinator(committing)

        dist.agree("checkpoint retention", retain)

    def _promised_forever(self, step: int, now: float, steps: dict[int, StepRecord]) -> bool:
        if self.keep_every_n_steps is not None and step % self.keep_every_n_steps == 0:
            return True
        if self.keep_time_interval_seconds is None:
            return False
        last = max((r.saved_at for s, r in steps.items() if r.keep_forever and s != step), default=None)
        return last is None or now - last >= self.keep_time_interval_seconds

    def _bounded_keep(self, committed: list[int], steps: dict[int, StepRecord]) -> set[int]:
        """The steps ``max_to_keep`` keeps: the newest, or the best by ``best_fn``."""
        if self.max_to_keep is None:
            return set(committed)
        if self.best_fn is None:
            return set(committed[-self.max_to_keep :])
        scored = []
        for step in committed:
            metrics = steps[step].metrics if step in steps else None
            if metrics is not None:
                value = float(self.best_fn(metrics))
                scored.append((value if self.best_mode == "max" else -value, step))
        scored.sort(reverse=True)  # best first; a tie keeps the newer step
        return {step for _, step in scored[: self.max_to_keep]}

    def _retain_on_coordinator(self, committing: tuple[int, dict[str, Any] | None] | None) -> None:
        with self._record_session() as record:
            committed, uncommitted = self._scan()
            if not committed:
                return
            if record.record.policy is not None and record.record.policy != self.policy:
                _LOG.warning(
                    "rank 0: %s was managed with %s, now %s; steps promised 'keep forever' earlier stay",
                    self.root, record.record.policy, self.policy,
                )
            steps = {s: r for s, r in record.record.steps.items() if s in committed}
            now = time.time()
            just_saved = None
            if committing is not None and committing[0] in committed:
                just_saved, metrics = committing
                old = steps.get(just_saved)
                forever = self._promised_forever(just_saved, now, steps) or (old is not None and old.keep_forever)
                steps[just_saved] = StepRecord(saved_at=now, keep_forever=forever, metrics=metrics)
            keep = self._bounded_keep(committed, steps) | {committed[-1]}
            keep.update(s for s, r in steps.items() if r.keep_forever)
            if just_saved is not None:
                keep.add(just_saved)
            if self.keep_every_n_steps is not None:
                keep.update(s for s in committed if s % self.keep_every_n_steps == 0)
            doomed = [s for s in committed if s not in keep] + [s for s in uncommitted if s < committed[-1]]
            for step in doomed:
                if self._objects is not None:  # no lease there: the scan already skipped steps that may be in flight
                    self._objects.delete(self._name(step))
                    self._verified.pop(step, None)
                    steps.pop(step, None)
                    continue
                holder = live_lease_in(self.directory(step))
                if holder is not None:  # another manager or process is saving this step right now
                    _LOG.info("rank 0: keeping %s: a save holds it (%s)", self.directory(step), holder.describe())
                    continue
                self._delete(self.directory(step))
                self._verified.pop(step, None)
                steps.pop(step, None)
            record.update(policy=self.policy, steps=steps)
        if self._objects is not None:
            return
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
