"""Planning and staging an async save: the blocking part of ``async_save``.

:func:`plan_async_save` plans the save (:func:`._engine.plan_save`), takes
this rank's snapshot (staged copies in the host buffers of :data:`_POOL`, or
a forked writer process whose memory is the snapshot), and returns the
:class:`.AsyncRequest` whose background function writes it; how it commits
depends on the job (see the function). A save without collectives whose
layout is new is planned after the snapshot (:mod:`._deferred_save`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from hyper_parallel import platform
from hyper_parallel.core.distributed_checkpoint._async_queue import AsyncRequest
from hyper_parallel.core.distributed_checkpoint._background_commit import background_commit_request
from hyper_parallel.core.distributed_checkpoint._collectives import collectives_on
from hyper_parallel.core.distributed_checkpoint._deferred_save import DeferredPlan, deferred_request
from hyper_parallel.core.distributed_checkpoint._engine import SaveOptions, SaveSession, commit_save, plan_save, write_local
from hyper_parallel.core.distributed_checkpoint._fork_writer import fork_write, fork_write_and_hash
from hyper_parallel.core.distributed_checkpoint._copy_threads import gil_handoff
from hyper_parallel.core.distributed_checkpoint._stage_copies import ALIGN, EarlyCopies, arena_bytes, round_up
from hyper_parallel.core.distributed_checkpoint._save_layout import host_array
from hyper_parallel.core.distributed_checkpoint._staging import StagedSavePlanner, StagingPool, staged_views
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointIOError
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint._format.checksum import digest
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import SavePlanner, WriteItemType
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import StorageWriter, WriteResult

__all__ = ["plan_async_save", "prefault_arena", "staging_pool"]

_LOG = logging.getLogger(__name__)


#: Host buffers of ``staging="copy"``, kept for the next async save.
_POOL = StagingPool()


def staging_pool() -> StagingPool:
    """The process's staging buffers (one arena, reused by every ``staging="copy"`` save)."""
    return _POOL


def plan_async_save(
    state_dict: dict[str, Any], *, writer: StorageWriter, planner: SavePlanner, options: SaveOptions, staging: str
) -> AsyncRequest:
    """Plan and stage a save; return the request that writes and then commits it. All ranks.

    The request's background function writes this rank's data (from staged
    copies, or in a forked process whose memory is the snapshot). A save
    without collectives (one process, or ``use_collectives=False``) commits
    in the background right after writing. With several ranks and a writer
    that keeps rank records, the coordinator's background thread commits
    from every rank's results record (:mod:`._background_commit`). With a
    writer without them, the finalize function is :func:`commit_save`, a
    collective step run on the caller's thread (``result()`` or the next
    async save). The background thread never runs a collective, which could
    interleave with the training job's own.

    ``staging="auto"`` stages as ``"copy"``, except a save of one rank that
    has no staging arena yet (:func:`_auto_forks`): it takes the fork's
    copy-on-write snapshot (falling back to a copy if the system refuses the
    fork), and its background work maps and faults in the arena the next
    save copies into.
    """
    with gil_handoff():  # the copy threads take the GIL back at once while this thread plans
        return _plan_and_stage(state_dict, writer=writer, planner=planner, options=options, staging=staging)


def _plan_and_stage(
    state_dict: dict[str, Any], *, writer: StorageWriter, planner: SavePlanner, options: SaveOptions, staging: str
) -> AsyncRequest:
    """:func:`plan_async_save` (see there). All ranks."""
    alone = options.no_dist or not options.use_collectives or platform.get_world_size() <= 1
    forked_first = staging == "auto" and alone and _auto_forks(writer, planner)
    mode = "fork" if forked_first else ("copy" if staging == "auto" else staging)
    # In a job of several ranks the replicas are hashed from the snapshot in the background (by the forked
    # writer, or the background thread from the staged copies) and the coordinator compares them before it
    # commits (_background_commit): the blocking part hashes nothing.
    later = (type(planner) is StandardSavePlanner  # pylint: disable=unidiomatic-typecheck
             and planner.check_replicas and writer.supports_rank_records()
             and collectives_on(no_dist=options.no_dist, use_collectives=options.use_collectives))
    if type(planner) is StandardSavePlanner:  # pylint: disable=unidiomatic-typecheck
        planner.digest_replicas_later(later)
    early = None
    if mode == "copy":  # tensors are copied into the arena while the plan is made (_stage_copies)
        early = _POOL.early_copies(every_leaf=alone, ahead=_copies_ahead(planner, options))
    try:
        session = plan_save(state_dict, writer=writer, planner=planner, options=options, listener=early,
                            may_defer=True)
        if early is not None:
            _expect_next(planner, early)
        if isinstance(session, DeferredPlan):  # one rank, a new layout: planned after the snapshot (_deferred_save)
            request = _deferred_or_none(session, early, forked_first)
            if request is not None:
                return request
            session = _plan_now(session)
    except BaseException:
        if early is not None:
            early.abandon()
        raise
    background: list[Callable[[], list[WriteResult]]] = []
    replicas: list[Any] = []  # the replica digests a forked writer made (``later``)

    def copy_step(copies: EarlyCopies) -> None:
        items = session.plan.items
        pieces = session.planner.later_replicas if later else None
        held = _held_replicas(items, pieces) if pieces else []
        staged = StagedSavePlanner(session.planner, _POOL.stage(
            items, session.planner.get_data, lambda: _leaves(items, session.planner), copies,
            extra_bytes=sum(round_up(pieces[at][2].nbytes, ALIGN) for at in held)))
        if pieces is None:
            background.append(lambda: write_local(session, staged))
            return
        held_copies = dict(zip(held, _POOL.snapshot([pieces[at][2] for at in held])))

        def write_and_hash() -> list[WriteResult]:
            results = write_local(session, staged)
            snapshot = _replica_snapshot(pieces, staged.staged, held_copies)
            replicas.append(tuple((fqn, offsets, digest(memoryview(copy))) for fqn, offsets, copy in snapshot))
            return results

        background.append(write_and_hash)

    def stage_step() -> None:
        if early is not None:  # mode "copy"
            copy_step(early)
            return
        items = session.plan.items  # mode "fork": the forked writer's memory is the snapshot
        views = staged_views(items, _sources(items, session.planner), session.planner)
        if later:  # the forked writer also hashes the replicas of its snapshot
            background.append(fork_write_and_hash(session.writer, session.plan, views, session.planner.replica_digests,
                                                  rank=session.dist.rank, replicas=replicas))
        elif forked_first:
            try:
                background.append(_then_prefault(fork_write(session.writer, session.plan, views,
                                                            rank=session.dist.rank), lambda: _item_bytes(items)))
            except CheckpointIOError:  # the system refused the fork (no memory for the child): copy instead
                copy_step(_POOL.early_copies(every_leaf=True))
        else:
            background.append(fork_write(session.writer, session.plan, views, rank=session.dist.rank))

    try:
        session.dist.agree("stage", stage_step)
    except BaseException:
        if early is not None:
            early.abandon()
        session.writer.abort()
        raise

    if not session.dist.use_dist:
        # No other rank takes part in the commit: the background thread commits right after writing,
        # so the step is durable as soon as done() is true, whether or not result() is ever called.
        write = background[0]

        def write_and_commit() -> Metadata:
            # The write runs inside the commit step, so a failed write aborts the save like any step.
            return commit_save(session, write, step="async write and commit")

        return AsyncRequest(async_fn=write_and_commit, finalize_fns=(_committed,))

    if session.writer.supports_rank_records():
        return background_commit_request(dist=session.dist, writer=session.writer, plan=session.plan,
                                         metadata=session.metadata, write=background[0],
                                         replicas=(lambda: replicas[0] if replicas else ()) if later else None)

    def commit(results: list[WriteResult], error: BaseException | None) -> Metadata:
        def local_results() -> list[WriteResult]:
            if error is not None:
                raise error
            return results

        return commit_save(session, local_results, step="async write and commit", background_cleanup=True)

    return AsyncRequest(async_fn=background[0], finalize_fns=(commit,))


def _held_replicas(items: tuple[Any, ...], pieces: list[tuple[str, tuple[int, ...], Any]]) -> list[int]:
    """Positions in ``pieces`` (``later_replicas`` entries) of the replicas this rank holds but does not write."""
    written = {(item.index.fqn, item.index.offset) for item in items}
    return [at for at, piece in enumerate(pieces) if (piece[0], piece[1]) not in written]


def _replica_snapshot(pieces: list[tuple[str, tuple[int, ...], Any]], staged: dict[MetadataIndex, Any],
                      held: dict[int, np.ndarray]) -> list[tuple[str, tuple[int, ...], np.ndarray]]:
    """Each replica piece's bytes at the call (flat uint8): its copy in ``held`` (by position), else its staged item."""
    found = []
    for at, (fqn, offsets, _) in enumerate(pieces):
        copy = held.get(at)
        if copy is None:
            copy = np.ascontiguousarray(staged[MetadataIndex(fqn, offsets)]).reshape(-1).view(np.uint8)
        found.append((fqn, offsets, copy))
    return found


def _copies_ahead(planner: SavePlanner, options: SaveOptions) -> Iterator[tuple[str, np.ndarray]]:
    """The host arrays of the large tensors this save is expected to copy (:meth:`.StagingPool.expected`).

    Only for the standard planner, whose layout pass tells the early copies
    the leaves it meets, and without a strategy file (which may give the
    leaves other tensors). Looked up one by one as the early copies take
    them: the first copy starts after one lookup, not after all of them
    (52 lookups, ~0.3 ms, in the state of 1,799 Parameters).
    """
    if type(planner) is not StandardSavePlanner or options.strategy_file is not None:  # pylint: disable=unidiomatic-typecheck
        return
    for name, tensor in _POOL.expected():
        array = host_array(tensor)
        if array is not None:
            yield name, array


def _expect_next(planner: SavePlanner, early: EarlyCopies) -> None:
    """Remember the tensors this save copied early, for the next save to copy ahead (after the layout pass)."""
    flat = getattr(planner, "flat", None)
    if flat is None or not early.placed:
        _POOL.expect((), missed=early.missed)
        return
    values = flat.values
    _POOL.expect(((name, values[name], nbytes) for name, nbytes in early.large_placed()), missed=early.missed)


def _auto_forks(writer: StorageWriter, planner: SavePlanner) -> bool:
    """Whether a one-rank ``staging="auto"`` save takes a fork's snapshot: no arena yet, and a fork is safe.

    Safe: POSIX, the built-in filesystem writer (file I/O only in the child)
    and the standard planner (every tensor resolved to a numpy view first).
    """
    return (_POOL.capacity == 0 and hasattr(os, "fork")
            and type(writer) is FileSystemWriter  # pylint: disable=unidiomatic-typecheck
            and type(planner) is StandardSavePlanner)  # pylint: disable=unidiomatic-typecheck


def _then_prefault(wait: Callable[[], Any], nbytes: Callable[[], int]) -> Callable[[], Any]:
    """``wait`` (for a forked writer) after mapping and faulting in the next save's arena. Background thread."""

    def prefault_then_wait() -> Any:
        prefault_arena(nbytes())
        return wait()

    return prefault_then_wait


def prefault_arena(nbytes: int) -> Exception | None:
    """:meth:`.StagingPool.prefault` of the pool, best effort: the error if it failed, else ``None``.

    A failure only leaves the next save to map its own arena. Background thread.
    """
    try:
        _POOL.prefault(nbytes)
    except Exception as exc:  # pylint: disable=broad-except
        _LOG.debug("pre-faulting the staging arena failed", exc_info=True)
        return exc
    return None


def _item_bytes(items: tuple[Any, ...]) -> int:
    """Arena bytes that stage ``items`` with every whole tensor copied early (as a one-rank save does)."""
    sizes = [item.tensor_storage_size() for item in items if item.type != WriteItemType.BYTE_IO]
    return arena_bytes(sum(sizes), len(sizes))


def _deferred_or_none(deferred: DeferredPlan, early: EarlyCopies | None, forked_first: bool) -> AsyncRequest | None:
    """:func:`._deferred_save.deferred_request`; the writer is aborted if taking the snapshot fails.

    ``forked_first`` (``staging="auto"``, no arena yet): the snapshot is a
    fork, whose background work first faults in the next save's arena; a
    refused fork falls back to copying every whole tensor now.
    """

    def request(copies: EarlyCopies | None) -> AsyncRequest | None:
        return deferred_request(deferred, early=copies, pool=_POOL, finalize=_committed,
                                commit=lambda planned, write: commit_save(planned, write, step="async write and commit"),
                                prefault=prefault_arena if forked_first else None)

    try:
        if not forked_first:
            return request(early)
        try:
            return request(None)
        except CheckpointIOError:  # the system refused the fork (no memory for the child): copy instead
            return request(_copy_now(deferred))
    except BaseException:
        deferred.writer.abort()
        raise


def _copy_now(deferred: DeferredPlan) -> EarlyCopies:
    """Copy every whole tensor the layout pass met into the arena (what a one-rank copy save does early)."""
    copies = _POOL.early_copies(every_leaf=True)
    for name, array in deferred.planner.leaf_arrays.items():
        copies.leaf(name, array)
    copies.described(deferred.layout)
    return copies


def _plan_now(deferred: DeferredPlan) -> SaveSession:
    """Make a deferred plan at once (a state :mod:`._deferred_save` cannot snapshot). Caller's thread."""
    try:
        return deferred.adopt(deferred.make())
    except BaseException:
        deferred.writer.abort()
        raise


def _sources(items: tuple[Any, ...], planner: SavePlanner) -> Iterable[Any]:
    """The data of each item, in order: one loop over a reused plan's leaves for the standard planner."""
    if isinstance(planner, StandardSavePlanner):
        return planner.stage_arrays(items)
    return (planner.get_data(item) for item in items)


def _leaves(items: tuple[Any, ...], planner: SavePlanner) -> tuple[str | None, ...]:
    """The whole-tensor leaf each item is, for the standard planner (whose early copies can stand for it)."""
    if isinstance(planner, StandardSavePlanner):
        return planner.leaf_names(items)
    return (None,) * len(items)


def _committed(metadata: Metadata, error: BaseException | None) -> Metadata:
    """Finalize of an async save committed in the background: hand over its metadata or its error."""
    if error is not None:
        raise error
    return metadata
