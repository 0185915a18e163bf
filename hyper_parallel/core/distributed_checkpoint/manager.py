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
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Mapping

import numpy as np

from hyper_parallel.core.distributed_checkpoint.api import load as dcp_load
from hyper_parallel.core.distributed_checkpoint.api import save as dcp_save
from hyper_parallel.core.distributed_checkpoint.async_checkpoint import AsyncSaveHandle
from hyper_parallel.core.distributed_checkpoint.async_checkpoint import async_save as dcp_async_save
from hyper_parallel.core.distributed_checkpoint._background_commit import settle_background_commits
from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointNotFoundError, CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import METADATA_FILE, FileSystemWriter
from hyper_parallel.core.distributed_checkpoint._manager_record import (
    ManagerPolicy,
    StepRecord,
    _Session,
    locked_record,
    object_record,
    record_name,
)
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import FsspecWriter
from hyper_parallel.core.distributed_checkpoint._retention import plan_retention, promised_forever
from hyper_parallel.core.distributed_checkpoint._step_dirs import StepDirectories

__all__ = ["CheckpointManager"]

_LOG = logging.getLogger(__name__)


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


def _json_value(value: Any, where: str, step: int) -> Any:
    """``value`` as a JSON value: numpy scalars, 0-d arrays and one-element tensors as Python numbers."""
    if isinstance(value, dict):
        return {str(k): _json_value(v, f"{where}.{k}", step) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v, f"{where}[{i}]", step) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    array = value.asnumpy() if hasattr(value, "asnumpy") else value
    if isinstance(array, (np.generic, np.ndarray)) and np.size(array) == 1 and array.dtype.kind in "biuf":
        return array.reshape(()).item()
    raise CheckpointValueError(
        f"step {step}: metrics {where} is a {type(value).__name__}, not a JSON value (number, str, bool, None, "
        "list, dict); pass it as a Python number (float(loss)). Nothing was saved"
    )


def _json_metrics(metrics: dict[str, Any], step: int) -> dict[str, Any]:
    """``metrics`` with JSON values only, checked before the save (they are recorded after its commit)."""
    return {str(key): _json_value(value, f"'{key}'", step) for key, value in metrics.items()}


def _refuse_rank_local(kwargs: Mapping[str, Any]) -> None:
    """Refuse ``use_collectives=False`` / ``no_dist=True`` in a job of several ranks. All ranks (no communication).

    A manager's step is committed by its ``metadata.json``: a save without collectives writes each rank's own
    metadata instead (``no_dist``: every process as rank 0 of its own world, into the same directory), so its
    steps would never be listed, loaded by a resume or pruned.
    """
    option = "no_dist=True" if kwargs.get("no_dist") else (
        "use_collectives=False" if kwargs.get("use_collectives", True) is False else None)
    if option is None:
        return
    dist = DistWrapper(use_dist=True)
    if dist.world_size > 1:
        raise CheckpointValueError(
            f"rank {dist.rank}: CheckpointManager.save with {option} in a job of {dist.world_size} ranks commits no "
            "step the manager counts (a step is committed by its metadata.json, which a save without collectives "
            "does not write): it would never be listed, resumed or pruned. Call save without it; nothing was written"
        )


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
            metrics, or whose ``best_fn`` value is NaN, rank last: newest
            first, they fill the places the scored steps leave free.
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
        self._steps = StepDirectories(root, step_prefix=step_prefix, metadata_file=METADATA_FILE)
        self._objects = self._steps.objects
        self.root: Path | str = self._steps.root
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
        self._handle: AsyncSaveHandle | None = None
        self._writing: int | None = None  # the step this manager is saving, hidden from listings
        self._committing: tuple[int, dict[str, Any] | None] | None = None  # step and metrics awaiting retention
        self._prune = True  # whether the retention after that step deletes what the policy drops
        self._last_save = time.monotonic()

    def _record_session(self) -> contextlib.AbstractContextManager[_Session]:
        """The manager record under its lock; for an object-store root, its record object."""
        name = record_name(self.step_prefix)
        if self._objects is None:
            return locked_record(self.root, name)
        return object_record(self._objects.fs, self._objects.root, self._objects.url, name)

    def directory(self, step: int) -> Path | str:
        """Return the checkpoint directory (or ``s3://`` id) of ``step`` (no file access). Any rank."""
        return self._steps.location(step)

    def _scan(self) -> tuple[list[int], list[int]]:
        """Return (committed, uncommitted) steps, sorted, without the step being written. Coordinator."""
        return self._steps.scan(skip=self._writing)

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
        prune: bool = True,
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
                kept in the root's record; numpy scalars, 0-d arrays and
                one-element tensors are recorded as Python numbers.
            prune: ``False``: once this step commits, retention records it but
                deletes nothing (a state that may be bad never costs an
                earlier step); the next save's retention prunes as usual.
            **kwargs: Passed on to :func:`save` / :func:`async_save` (``planner``, ...).

        Returns:
            Whether a checkpoint was saved (started, with ``async_save``).

        Raises:
            CheckpointValueError: A bad step or metrics (before anything is
                written), or ``step`` is not after the newest committed step
                (and not ``force``).
            CheckpointError: On every rank, if the save (or the previous async one) failed.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointValueError(f"step must be a non-negative int, got {step!r}")
        if metrics is not None and not isinstance(metrics, dict):
            raise CheckpointValueError(f"metrics must be a dict of JSON values or None, got {type(metrics).__name__}")
        metrics = None if metrics is None else _json_metrics(metrics, step)
        if metrics is not None and self.best_fn is not None:
            try:
                float(self.best_fn(metrics))
            except Exception as exc:  # the user's function; raised in retention, after the commit, otherwise
                raise CheckpointValueError(
                    f"step {step}: best_fn(metrics) failed on {metrics!r} ({type(exc).__name__}: {exc}); pass the "
                    "metrics best_fn ranks by. Nothing was saved"
                ) from exc
        _refuse_rank_local(kwargs)
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
        self._prune = bool(prune)
        if step not in committed:
            self._record_ahead(step, metrics, committed)
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

    def _record_ahead(self, step: int, metrics: dict[str, Any] | None, committed: list[int]) -> None:
        """Start ``step``'s fresh record entry (its metrics, its keep-forever promise) before its save starts, on
        rank 0 (no communication; a failure only warns). Only for a step not in ``committed`` (the committed
        steps now).

        An async step commits at the next ``save`` / ``wait`` / ``close``, or when the process exits; recorded
        only at its retention, a step committed at exit (no ``close``) kept no metrics, and best-k retention of
        the next run ranked it last: the best step could be deleted; nor its keep-forever promise
        (``keep_every_n_steps``, ``keep_time_interval_seconds``, decided now against the committed steps'
        records), so the next run's retention deleted a step the policy keeps forever. An entry left by an
        earlier step of this number (deleted, or rolled back by a resumed run) is replaced: its promise was not
        made to this save. Without metrics, promise or such an entry nothing is written. An entry of a step that
        never commits is ignored (only committed steps are ranked or count as kept forever); its retention
        records it again, with the promise decided afresh.
        """
        if not DistWrapper(use_dist=True).is_coordinator:
            return
        try:
            with self._record_session() as record:
                now, done = time.time(), set(committed)
                forever = promised_forever(self.policy, step, now,
                                           {s: r for s, r in record.record.steps.items() if s in done})
                if metrics is None and not forever and step not in record.record.steps:
                    return
                entry = StepRecord(saved_at=now, keep_forever=forever, metrics=metrics)
                record.update(steps={**record.record.steps, step: entry})
        except Exception as exc:  # pylint: disable=broad-except  # retention records it (and reports) later
            _LOG.warning("rank 0: could not record step %d before saving it: %s", step, exc)

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

    def _delete_after(self, step: int) -> list[int]:
        """Delete the committed steps above ``step``; return them. All ranks (rank 0 deletes, then broadcasts).

        For steps saved with ``force`` below newer ones that an abandoned run left (``CheckpointCallback``'s
        ``exception_save`` steps after a resume from an earlier step): kept, the newest by number stayed what a
        resume loads, and what retention keeps, instead of the step just saved.
        """
        dist = DistWrapper(use_dist=True)

        def drop() -> list[int]:
            deleted = []
            with self._record_session() as record:
                steps = dict(record.record.steps)
                for later in self._scan()[0]:
                    if later > step and self._steps.delete(later):
                        steps.pop(later, None)
                        deleted.append(later)
                record.update(steps=steps)
            self._steps.sweep_deletions()
            return deleted

        return dist.broadcast("drop abandoned steps", drop)

    def _apply_retention(self) -> None:
        """Record the step just committed, delete what retention drops, on rank 0. All ranks.

        The gather after it is the barrier.
        """
        dist = DistWrapper(use_dist=True)
        committing, self._committing = self._committing, None
        prune, self._prune = self._prune, True

        def retain() -> None:
            if dist.is_coordinator:
                self._retain_on_coordinator(committing, prune)

        dist.agree("checkpoint retention", retain)

    def _retain_on_coordinator(self, committing: tuple[int, dict[str, Any] | None] | None, prune: bool) -> None:
        with self._record_session() as record:
            committed, uncommitted = self._scan()
            if not committed:
                return
            if record.record.policy is not None and record.record.policy != self.policy:
                _LOG.warning(
                    "rank 0: %s was managed with %s, now %s; steps promised 'keep forever' earlier stay",
                    self.root, record.record.policy, self.policy,
                )
            plan = plan_retention(
                self.policy, best_fn=self.best_fn, committed=committed, uncommitted=uncommitted,
                recorded=record.record.steps, committing=committing, now=time.time(),
            )
            steps = dict(plan.steps)
            record.update(policy=self.policy, steps=dict(steps))
            # The step just saved (its metrics, a keep-forever promise) is recorded before anything is deleted: a
            # crash while deleting leaves records of deleted steps (ignored), never a kept step without its record.
            record.flush()
            for step in plan.doomed if prune else ():
                if self._steps.delete(step):
                    steps.pop(step, None)
            record.update(steps=steps)
        self._steps.sweep_deletions()
