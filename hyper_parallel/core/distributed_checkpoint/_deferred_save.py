"""An async save of one rank whose layout is new: planned after it returns, from its snapshot.

The first async save of a job (and any save whose layout changed) has no
cached plan. With several ranks the plan is a collective step and stays in
the blocking part. Without collectives (one process, ``no_dist``,
``use_collectives=False``) nobody waits for it: the blocking part only takes
the snapshot, and the plan (local plan, merge, metadata) is made afterwards
from that snapshot, never from the caller's tensors, which may change as soon
as ``async_save`` returns:

- ``staging="copy"``: every whole tensor was copied into the arena while the
  layout was described (:mod:`._stage_copies`); the blocking part waits for
  these copies. The background thread plans from the copies, then writes and
  commits;
- ``staging="fork"``: the blocking part forks; the writer process plans from
  its copy-on-write view of memory, writes, and sends the plan back with its
  write results; the background thread keeps the plan and commits.

Either way the plan is kept in the plan cache, so the next save of the same
layout takes the cached fast path. A state with pieces of sharded tensors,
tensors in device memory or a planner or writer this module cannot vouch for
is planned in the blocking part as before (:func:`deferred_request` returns
``None``). Errors of planning (an invalid plan) are then raised by
``result()``, as write errors are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hyper_parallel.core.distributed_checkpoint._async_queue import AsyncRequest
from hyper_parallel.core.distributed_checkpoint._fork_writer import fork_run
from hyper_parallel.core.distributed_checkpoint._stage_copies import EarlyCopies, arena_bytes
from hyper_parallel.core.distributed_checkpoint._staging import StagedSavePlanner, StagingPool
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import StorageWriter, WriteResult

__all__ = ["DeferredPlan", "PlannedSave", "deferred_request"]


@dataclass(frozen=True)
class PlannedSave:
    """What a one-rank save's planning made (picklable: a forked writer sends it back).

    Attributes:
        plan: This rank's final plan.
        metadata: The metadata.
        all_final: Every rank's final plan (this rank's).
        local_plans: Every rank's local plan (this rank's).
        sources: The leaf of each item of ``plan`` (``None`` for values).
    """

    plan: SavePlan
    metadata: Metadata
    all_final: list[SavePlan]
    local_plans: list[SavePlan]
    sources: tuple[Any, ...]


@dataclass(frozen=True)
class DeferredPlan:
    """A save without collectives whose layout is new: planned later, off the blocking part of an async save.

    The caller snapshots the state first (:meth:`.StandardSavePlanner.snapshot_leaves`),
    then calls :attr:`make` (on a background thread, or in a forked writer)
    and :attr:`adopt` (in this process) with its result.

    Attributes:
        writer: The storage writer (set up: the lease is held).
        planner: The planner (configured; the layout described).
        layout: This rank's layout (:class:`.LayoutDescription`).
        make: Builds the plan and the metadata; no collective, no side effect outside the planner
            (on failure the caller aborts the writer).
        adopt: Keeps a :class:`PlannedSave` in the plan cache; returns the planned :class:`._engine.SaveSession`.
    """

    writer: StorageWriter
    planner: SavePlanner
    layout: Any
    make: Callable[[], PlannedSave]
    adopt: Callable[[PlannedSave], Any]


#: Commits a planned session with this rank's write results (``_engine.commit_save`` for one rank).
Commit = Callable[[Any, Callable[[], list[WriteResult]]], Metadata]


def deferred_request(deferred: DeferredPlan, *, early: EarlyCopies | None, pool: StagingPool, commit: Commit,
                     finalize: Callable[[Any, BaseException | None], Any],
                     prefault: Callable[[int], None] | None = None) -> AsyncRequest | None:
    """The request that plans, writes and commits ``deferred`` (a :class:`DeferredPlan`). Caller's thread.

    Args:
        deferred: The save, planned up to its layout.
        early: This save's early copies (``staging="copy"``), or ``None`` (``staging="fork"``).
        pool: The staging pool holding the early copies.
        commit: Commits a planned session with the results of a write.
        finalize: The request's finalize function.
        prefault: With a fork: called first by the background function with the arena bytes a
            copying save of this layout needs (``staging="auto"``; best effort, it never raises).

    Returns:
        ``None`` when the plan must be made now (see the module docstring).
    """
    planner: StandardSavePlanner = deferred.planner  # only plans of this planner are cached, hence deferred
    arrays = dict(planner.leaf_arrays)  # every whole tensor in host memory, as the layout pass met it
    if deferred.layout.pieces != len(arrays):  # pieces of sharded tensors, or tensors in device memory
        return None
    writer = deferred.writer
    if early is not None:
        if early.placed.keys() != arrays.keys():  # pragma: no cover - one rank copies every leaf it meets early
            return None
        early.wait()  # the snapshot: every tensor's bytes at the call

        def plan_write_commit() -> Metadata:
            try:
                snapshot = early.snapshot(arrays)
                if snapshot is None:  # pragma: no cover - the early copies are the layout pass's own leaves
                    raise CheckpointError("async save: an early copy is missing from the staging arena; save again")
                planner.snapshot_leaves(snapshot)
                session = deferred.adopt(deferred.make())
            except BaseException:
                writer.abort()
                raise
            items = session.plan.items
            staged = StagedSavePlanner(planner, pool.stage(items, planner.get_data, lambda: planner.leaf_names(items),
                                                           early))
            return commit(session, lambda: writer.write_data(session.plan, staged).result())

        return AsyncRequest(async_fn=plan_write_commit, finalize_fns=(finalize,))
    if not _plans_purely(writer):
        return None

    def in_child() -> tuple[list[WriteResult], Any]:  # the forked writer: its memory is the snapshot
        planner.snapshot_leaves(arrays)
        planned = deferred.make()
        return writer.write_data(planned.plan, planner).result(), planned

    wait = fork_run(in_child, writer, rank=0)
    layout = deferred.layout

    def commit_child() -> Metadata:
        if prefault is not None:  # while the child writes: the next save copies into backed memory
            prefault(arena_bytes(layout.tensor_bytes, layout.pieces))
        try:
            results, planned = wait()
            session = deferred.adopt(planned)
        except BaseException:
            writer.abort()
            raise
        return commit(session, lambda: results)

    return AsyncRequest(async_fn=commit_child, finalize_fns=(finalize,))


def _plans_purely(writer: Any) -> bool:
    """Whether ``writer``'s plan steps keep no state (a forked writer may run them: the filesystem writers)."""
    cls = type(writer)
    return (cls.prepare_local_plan is FileSystemWriter.prepare_local_plan
            and cls.prepare_global_plan is FileSystemWriter.prepare_global_plan)
