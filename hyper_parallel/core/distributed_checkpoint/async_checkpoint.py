"""``async_save``: stage to host memory, write and commit in the background.

``async_save`` blocks only to plan (the collective part of a save) and to
stage the items this rank writes (:mod:`._staging`); a save without
collectives whose layout is not cached is planned after it returns, from
its snapshot (:mod:`._deferred_save`). It then returns an
:class:`AsyncSaveHandle`; a background thread writes the data files. The
background never runs a collective. A save without collectives (one
process, ``no_dist``, or ``use_collectives=False``) commits on that thread
right after writing. With several ranks and a writer keeping rank records
(the filesystem and fsspec writers), every rank records its write results
in the storage and the coordinator's background thread commits from them
(:mod:`._background_commit`): either way the step is durable once the
writing is over, even if ``result()`` is never called. ``result()`` then
only waits for this rank's writing and runs one short collective step; a
failed background commit is raised on every rank by the next collective
step. With a writer without rank records, the commit is the same
collective step as a sync save's (:func:`._engine.commit_save`), run at
``handle.result()`` or at the next ``async_save``. ``handle.done()`` tells,
without blocking or communicating, whether this rank's background work is
over.

The work itself is the registered save strategy's
(:meth:`.strategies.SaveStrategyBase.async_save`): it returns an
:class:`AsyncRequest` that this module's :class:`AsyncCallsQueue` runs.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import numpy as np

from hyper_parallel import platform

from hyper_parallel.core.distributed_checkpoint._async_queue import AsyncCall, AsyncCallsQueue, AsyncRequest
from hyper_parallel.core.distributed_checkpoint._async_engine import prefault_arena, staging_pool
from hyper_parallel.core.distributed_checkpoint._collectives import collectives_on
from hyper_parallel.core.distributed_checkpoint._engine import SaveOptions
from hyper_parallel.core.distributed_checkpoint._flatten import flatten_state_dict
from hyper_parallel.core.distributed_checkpoint._gc_pause import gc_paused
from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import LayoutArgument
from hyper_parallel.core.distributed_checkpoint._save_layout import host_array, plain_tensor
from hyper_parallel.core.distributed_checkpoint._copy_threads import SMALL_COPY_BYTES
from hyper_parallel.core.distributed_checkpoint._stage_copies import ALIGN, arena_bytes, round_up
from hyper_parallel.core.distributed_checkpoint._storage_choice import writer_for
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.planner import SavePlanner
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointId, StorageWriter
from hyper_parallel.core.distributed_checkpoint.strategies import save_strategy
from hyper_parallel.platform.tensor import is_tensor, shared_view

__all__ = ["AsyncSaveHandle", "async_save", "default_queue", "finish_async_saves_using", "prepare_async_save"]


_QUEUE: AsyncCallsQueue | None = None
_QUEUE_LOCK = threading.Lock()


def default_queue() -> AsyncCallsQueue:
    """The process-wide queue of async saves (created on first use)."""
    global _QUEUE  # pylint: disable=global-statement
    with _QUEUE_LOCK:
        if _QUEUE is None:
            _QUEUE = AsyncCallsQueue()
        return _QUEUE


def finish_async_saves_using(writer: StorageWriter, *, collective: bool) -> None:
    """Finish (commit) this process's async save that still uses ``writer``, if any. All ranks call it.

    A storage writer holds one save's state (its save id, the committed
    metadata it saw, its leftovers): a second save given the same writer
    object while an async save still writes with it would overwrite that
    state under it. ``dcp.save`` calls this first (``async_save`` already
    finishes an earlier async save before it starts). With several ranks this
    is the same collective step as ``handle.result()``: every rank reaches it
    in the same ``dcp.save`` call.

    Args:
        writer: The storage writer of the save about to start.
        collective: That save runs collectives (every rank is here). ``False`` refuses to finish a
            collective async save (its ``result()`` step needs every rank) instead of waiting alone.

    Raises:
        CheckpointError: that async save failed and its failure was not
            raised to the caller yet (so it is never lost).
        ConcurrentSaveError: not ``collective`` and that async save is a collective one (names it and the fix).
    """
    if _QUEUE is not None:
        _QUEUE.finish_calls_using(writer, collective=collective)


class AsyncSaveHandle:
    """The future of one async save.

    With several ranks ``result()`` and the next ``async_save`` run a
    collective step: every rank must call them at the same point of its
    program.
    """

    def __init__(self, call: AsyncCall) -> None:
        self._call = call

    def done(self) -> bool:
        """True when this rank's background work is over (no blocking, no communication).

        On the coordinator, and without collectives, the commit is then
        over too (committed or failed); on other ranks of a writer with rank
        records, this rank's results record is stored. ``result()`` then
        only runs one short collective step.
        """
        return self._call.background_done()

    def result(self, timeout: float | None = None) -> Metadata:
        """Wait for this rank's writing, then share every rank's outcome; return the metadata. All ranks call it.

        With several ranks and a writer with rank records, the commit runs in
        the coordinator's background thread and no rank waits for it here:
        the metadata returned is the one being committed, and a failed commit
        is raised on every rank by the next collective step (the next save
        or load, ``CheckpointManager.wait``). Otherwise this returns after
        the commit. On ranks other than the coordinator, with the filesystem
        and fsspec writers, the metadata is read from the checkpoint when a
        field is first used: that first use waits for the commit, and raises
        ``CheckpointNotFoundError`` if the commit failed or a later save
        replaced the checkpoint.

        Args:
            timeout: Seconds to wait for this rank's background writing.

        Raises:
            TimeoutError: the background writing did not end within ``timeout``.
            CheckpointError: on every rank, if any rank's writing (or the commit, when it runs
                here) failed (names the ranks).
        """
        if not self._call.finalized() and not self._call.wait(timeout):
            raise TimeoutError(f"async save still writing after {timeout} s")
        return self._call.finalize()


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: CheckpointId | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    remove_redundancy: bool = True,
    save_to_minimum_rank: bool = False,
    staging: str = "copy",
    strategy_file: LayoutArgument = None,
    check_replicas: bool = True,
) -> AsyncSaveHandle:
    """Save ``state_dict`` in the background. All ranks call it.

    Returns once the state is planned and staged (a save without
    collectives whose layout is not cached is planned afterwards, from the
    staged snapshot): the caller may change or delete its tensors; the
    checkpoint keeps the values at call time. A previous async save is
    finished (committed) first; a save without collectives in a job of
    several ranks (``no_dist`` or ``use_collectives=False``) cannot finish a
    pending collective one (its ``result()`` needs every rank) and fails at
    once with :class:`ConcurrentSaveError` naming it: call ``result()`` on
    every rank first.

    Args:
        staging: ``"copy"`` (default): copy the state into reused host
            buffers (mapped on the first save, kept for the next), written by
            a background thread. ``"fork"`` (POSIX): fork a writer process
            whose copy-on-write view of memory is the snapshot; the caller
            blocks only for planning and the fork, but while the child writes,
            every page the caller then changes (the next training step) is
            copied by the kernel at a page fault: measured at 14-43x a memcpy
            of those pages on the CI machine, a stall moved into training.
            ``"auto"``: as ``"copy"``, except that a save of one rank (one
            process, ``no_dist`` or ``use_collectives=False``) that has no
            staging buffers yet (the first of the process) takes ``"fork"``'s
            snapshot when that is safe (POSIX, the filesystem writer, the
            standard planner), and its background work maps and faults in the
            buffers the next save copies into.
        Others: as :func:`dcp.save`.

    Returns:
        An :class:`AsyncSaveHandle`; ``result()`` commits and returns the metadata.
    """
    if staging not in ("auto", "copy", "fork"):
        raise CheckpointValueError(f"staging must be 'auto', 'copy' or 'fork', got {staging!r}")
    if staging == "fork" and not hasattr(os, "fork"):
        raise CheckpointValueError("staging='fork' needs a POSIX system; use staging='copy'")
    gate = threading.Event()  # set as the call returns: its background work starts then (see _gated)
    try:
        with _ASYNC_LOCK:  # one async save at a time, whichever thread calls: the staging buffers are shared
            return _async_save_locked(
                state_dict,
                checkpoint_id=checkpoint_id,
                storage_writer=storage_writer,
                planner=planner,
                options=SaveOptions(
                    no_dist=no_dist,
                    use_collectives=use_collectives,
                    remove_redundancy=remove_redundancy,
                    save_to_minimum_rank=save_to_minimum_rank,
                    strategy_file=strategy_file,
                ),
                staging=staging,
                check_replicas=check_replicas,
                gate=gate,
            )
    finally:
        gate.set()


_ASYNC_LOCK = threading.RLock()
_LOG = logging.getLogger(__name__)


def _tensor_bytes(value: Any) -> int:
    """Host bytes of a tensor leaf (a DTensor's local shard), 0 for a value that is not a tensor. Caller's thread.

    A MindSpore tensor in host memory is looked up as a save's layout pass
    looks it up (:func:`.platform.tensor.shared_view`): its numpy view is
    made now and kept while the tensor and its memory live, so the first
    save's layout pass finds it (``asnumpy()`` costs several microseconds
    per tensor the first time, more for bfloat16).
    """
    local = value.to_local() if hasattr(value, "to_local") else value
    if isinstance(local, np.ndarray):
        return local.nbytes
    view = shared_view(local) if is_tensor(local) else None
    if view is not None:
        return view.nbytes
    nbytes = getattr(local, "nbytes", None)
    return int(nbytes) if isinstance(nbytes, (int, np.integer)) else 0


def prepare_async_save(state_dict: dict[str, Any]) -> "Future[int]":
    """Map and fault in, in the background, the host buffers a first ``async_save`` of ``state_dict`` copies into.

    Any rank, no collectives. The first async save of a process otherwise
    maps fresh memory and takes its page faults inside the call, where they
    count against training (on a VM whose host backs memory lazily: 5-20x a
    memcpy of the state). Call it once the state exists, well before the
    first save; :class:`.CheckpointCallback` does at train begin. The buffers
    are sized for every tensor of ``state_dict`` on this rank (what a save of
    one rank stages; with several ranks a rank stages at most that). An
    ``async_save`` that starts while they are being faulted in waits for them.

    On the caller's thread, before it returns, it also looks up every
    tensor's host memory once (a numpy view, kept while the tensor and its
    memory live, as saves and loads keep it), so the first save's layout
    pass costs what a steady save's does; the layout pass itself is made
    here too, so a first save of the state as it is now skips it as a
    steady save does (:mod:`._layout_memo`). A tensor replaced, reshaped or
    added after this call is looked up again by the save, which stays exact.

    Returns:
        A future of the buffers' size in bytes. It never fails: if the
        memory cannot be had, the first save maps its buffers itself (a
        warning is logged).
    """
    flat = flatten_state_dict(state_dict)
    sizes = {name: _tensor_bytes(value) for name, value in flat.values.items()}
    nbytes = arena_bytes(sum(sizes.values()), len(sizes))  # as a first save needs
    pool = staging_pool()
    # The first save copies these at once, before its layout pass meets them (_stage_copies, "copied ahead"),
    # and places the small ones after them as placed here.
    pool.expect(((name, value, sizes[name]) for name, value in flat.values.items() if plain_tensor(value)),
                fresh=True)
    _expect_small(flat.values)
    _describe_now(state_dict)
    future: Future[int] = Future()

    def prefault() -> None:
        with _ASYNC_LOCK:  # no async save stages meanwhile: it waits for the buffers
            error = prefault_arena(nbytes) if nbytes > pool.capacity else None
            if error is not None:
                _LOG.warning("prepare_async_save: no staging buffers of %d bytes (%s); the first async save "
                             "maps its own", nbytes, error)
            else:
                pool.make_small_places()
            future.set_result(pool.capacity)

    threading.Thread(target=prefault, name="hp-ckpt-prepare-staging", daemon=True).start()
    return future


def _describe_now(state_dict: dict[str, Any]) -> None:
    """Make the layout pass of a save of ``state_dict`` by one rank now, for the first save to recall it.

    Best effort: a state the pass refuses is left for the save to report.
    """
    planner = StandardSavePlanner()
    try:
        planner.configure_planner(state_dict)
        planner.describe_layout()
    except Exception:  # pylint: disable=broad-except
        _LOG.debug("prepare_async_save: no layout pass made ahead", exc_info=True)


def _expect_small(values: dict[str, Any]) -> None:
    """Place, for the first save, the small whole tensors in host memory as its layout pass will meet them.

    In leaf order, after the large ones it copies ahead (:meth:`.StagingPool.expect_small`).
    """
    names: list[str] = []
    arrays: list[np.ndarray] = []
    start = 0
    for name, value in values.items():
        array = host_array(value) if plain_tensor(value) else None
        if array is None:
            continue
        if array.nbytes >= SMALL_COPY_BYTES:
            start += round_up(array.nbytes, ALIGN)
        else:
            names.append(name)
            arrays.append(array)
    staging_pool().expect_small(tuple(names), arrays, start)


@gc_paused
def _async_save_locked(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: CheckpointId | None,
    storage_writer: StorageWriter | None,
    planner: SavePlanner | None,
    options: SaveOptions,
    staging: str,
    check_replicas: bool,
    gate: threading.Event,
) -> AsyncSaveHandle:
    queue = default_queue()
    collective = collectives_on(no_dist=options.no_dist, use_collectives=options.use_collectives)
    queue.maybe_finalize_async_calls(blocking=True, collective=collective)
    writer = writer_for(checkpoint_id, storage_writer)
    request = save_strategy().async_save(
        state_dict,
        storage_writer=writer,
        planner=planner or StandardSavePlanner(check_replicas=check_replicas),
        options=options,
        staging=staging,
    )
    return AsyncSaveHandle(queue.schedule_async_request(_gated(request, gate), uses=writer, all_ranks=collective))


def _gated(request: AsyncRequest, gate: threading.Event) -> AsyncRequest:
    """``request`` whose background function first waits for ``gate`` (set when ``async_save`` returns).

    The background function plans (a first save) or writes in Python at
    once. Started while the caller's thread still has to run Python to
    return, it held the GIL for up to one switch interval (5 ms by default)
    each time the caller's thread wanted it back: measured 9-11 ms of a
    first call's blocking part. Gated, it starts once the call is over.
    """
    work = request.async_fn

    def after_the_call(*args: Any) -> Any:
        gate.wait()
        return work(*args)

    return replace(request, async_fn=after_the_call)
