"""``async_save``: stage to host memory, write in the background, commit later.

``async_save`` blocks only to plan (the collective part of a save) and to copy
every item this rank writes into host buffers the checkpoint owns (on CPU
``asnumpy()`` shares the tensor's memory, so a real copy is needed). It then
returns an :class:`AsyncSaveHandle`; a background thread writes the data
files. The background never runs a collective. The commit, which needs every
rank's write results, is a collective step run on the caller's thread at
``handle.result()`` or at the next ``async_save`` (which first finishes the
previous save). ``handle.done()`` tells, without blocking or communicating,
whether this rank's background writing is over.

Staging buffers are kept and reused by the next save when the items have the
same shapes and dtypes, so steady-state staging is a plain memcpy into memory
that is already mapped.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint._gc_pause import gc_paused
from hyper_parallel.core.distributed_checkpoint.api import SaveSession, prepare_save
from hyper_parallel.core.distributed_checkpoint._async_queue import AsyncCall, AsyncCallsQueue, AsyncRequest
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint._fork_writer import fork_write
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointId, StorageWriter

__all__ = ["AsyncSaveHandle", "StagedSavePlanner", "StagingPool", "async_save", "default_queue"]


class StagingPool:
    """Host buffers reused across saves, keyed by item, shape and dtype."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[MetadataIndex, tuple[int, ...], str], np.ndarray] = {}
        self.reused = 0
        self.allocated = 0

    def stage(self, items: tuple[WriteItem, ...], planner: SavePlanner) -> dict[MetadataIndex, Any]:
        """Copy every item's data into owned buffers; drop buffers no longer used.

        The copies run as raw-byte pieces on :data:`STAGING_THREADS` threads
        (numpy releases the GIL while copying), so staging runs at the
        memory bandwidth of the machine rather than of one core.
        """
        staged: dict[MetadataIndex, Any] = {}
        kept: dict[tuple[MetadataIndex, tuple[int, ...], str], np.ndarray] = {}
        copies: list[tuple[np.ndarray, np.ndarray]] = []
        for item in items:
            index = MetadataIndex(item.index.fqn, item.index.offset)
            data = planner.get_data(item)
            if item.type == WriteItemType.BYTE_IO:
                staged[index] = bytes(data)
                continue
            key = (index, tuple(data.shape), data.dtype.str + data.dtype.name)
            buffer = self._buffers.get(key)
            if buffer is None:
                buffer = np.empty_like(data, order="C")
                self.allocated += 1
            else:
                self.reused += 1
            source = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            target = buffer.reshape(-1).view(np.uint8)
            for start in range(0, source.size, _PIECE_BYTES):
                copies.append((target[start : start + _PIECE_BYTES], source[start : start + _PIECE_BYTES]))
            kept[key] = buffer
            staged[index] = buffer
        # One task per thread, each a balanced share of the pieces: a future per
        # piece would cost more than copying thousands of small tensors.
        shares: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(max(1, STAGING_THREADS))]
        loads = [0] * len(shares)
        for pair in sorted(copies, key=lambda p: -p[1].size):
            lightest = loads.index(min(loads))
            shares[lightest].append(pair)
            loads[lightest] += pair[1].size
        busy = [share for share in shares if share]
        if len(busy) > 1:
            list(_copy_pool().map(_copy_all, busy))
        else:
            for share in busy:
                _copy_all(share)
        self._buffers = kept
        return staged


#: Threads copying into staging buffers.
STAGING_THREADS = 2
_PIECE_BYTES = 32 << 20
_COPY_POOL: ThreadPoolExecutor | None = None


def _copy_all(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for target, source in pairs:
        np.copyto(target, source)


def _copy_pool() -> ThreadPoolExecutor:
    global _COPY_POOL  # pylint: disable=global-statement
    if _COPY_POOL is None:
        _COPY_POOL = ThreadPoolExecutor(max_workers=STAGING_THREADS, thread_name_prefix="hp-ckpt-stage")
    return _COPY_POOL


class StagedSavePlanner(SavePlanner):
    """Serves the staged copies to the writer; planning was done by ``inner``."""

    def __init__(self, inner: SavePlanner, staged: dict[MetadataIndex, Any]) -> None:
        self.inner = inner
        self.staged = staged

    def configure_planner(self, state_dict: dict[str, Any], **kwargs: Any) -> None:  # pragma: no cover - unused
        """Planning already happened on the inner planner."""
        raise NotImplementedError("StagedSavePlanner only serves staged data")

    def build_local_plan(self) -> SavePlan:  # pragma: no cover - unused
        """Planning already happened on the inner planner."""
        raise NotImplementedError("StagedSavePlanner only serves staged data")

    def build_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:  # pragma: no cover
        """Planning already happened on the inner planner."""
        raise NotImplementedError("StagedSavePlanner only serves staged data")

    def finalize_plan(self, plan: SavePlan) -> SavePlan:
        """Accept the plan."""
        return plan

    def get_data(self, item: WriteItem) -> np.ndarray | bytes:
        """Return the staged copy of ``item``. Called by the writer (background thread)."""
        return self.staged[MetadataIndex(item.index.fqn, item.index.offset)]


_QUEUE: AsyncCallsQueue | None = None
_POOL = StagingPool()
_QUEUE_LOCK = threading.Lock()


def default_queue() -> AsyncCallsQueue:
    """The process-wide queue of async saves (created on first use)."""
    global _QUEUE  # pylint: disable=global-statement
    with _QUEUE_LOCK:
        if _QUEUE is None:
            _QUEUE = AsyncCallsQueue()
        return _QUEUE


class AsyncSaveHandle:
    """The future of one async save.

    ``result()`` and the next ``async_save`` run the commit, a collective
    step: every rank must call them at the same point of its program.
    """

    def __init__(self, call: AsyncCall, session: SaveSession) -> None:
        self._call = call
        self._session = session

    def done(self) -> bool:
        """True when this rank's background writing is over (no blocking, no communication).

        ``result()`` then only runs the short commit step.
        """
        return self._call.background_done()

    def result(self, timeout: float | None = None) -> Metadata:
        """Wait for the writing, commit (collective), return the metadata. All ranks call it.

        Args:
            timeout: Seconds to wait for this rank's background writing.

        Raises:
            TimeoutError: the background writing did not end within ``timeout``.
            CheckpointError: on every rank, if any rank failed (names the ranks).
        """
        if not self._call.finalized() and not self._call.wait(timeout):
            raise TimeoutError(f"async save still writing after {timeout} s")
        self._session = None  # the state dict and plan are no longer needed
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
) -> AsyncSaveHandle:
    """Save ``state_dict`` in the background. All ranks call it.

    Returns once the state is planned and staged: the caller may change or
    delete its tensors; the checkpoint keeps the values at call time. A
    previous async save is finished (committed) first.

    Args:
        staging: ``"copy"`` (default): copy the state into reused host
            buffers, written by a background thread. ``"fork"`` (POSIX): fork
            a writer process whose copy-on-write view of memory is the
            snapshot; the caller blocks only for planning and the fork.
        Others: as :func:`dcp.save`.

    Returns:
        An :class:`AsyncSaveHandle`; ``result()`` commits and returns the metadata.
    """
    if staging not in ("copy", "fork"):
        raise CheckpointValueError(f"staging must be 'copy' or 'fork', got {staging!r}")
    if staging == "fork" and not hasattr(os, "fork"):
        raise CheckpointValueError("staging='fork' needs a POSIX system; use staging='copy'")
    with _ASYNC_LOCK:  # one async save at a time, whichever thread calls: the staging buffers are shared
        return _async_save_locked(
            state_dict,
            checkpoint_id=checkpoint_id,
            storage_writer=storage_writer,
            planner=planner,
            no_dist=no_dist,
            use_collectives=use_collectives,
            remove_redundancy=remove_redundancy,
            save_to_minimum_rank=save_to_minimum_rank,
            staging=staging,
        )


_ASYNC_LOCK = threading.RLock()


@gc_paused
def _async_save_locked(state_dict: dict[str, Any], *, staging: str, **kwargs: Any) -> AsyncSaveHandle:
    queue = default_queue()
    queue.maybe_finalize_async_calls(blocking=True)
    session = prepare_save(
        state_dict,
        **kwargs,
    )
    if hasattr(session.writer, "background_cleanup"):
        session.writer.background_cleanup = True  # the commit runs on the caller's thread
    holder: dict[str, Any] = {}

    def stage_step() -> None:
        if staging == "copy":
            staged = _POOL.stage(session.plan.items, session.planner)
            planner = StagedSavePlanner(session.planner, staged)
            holder["background"] = lambda: session.writer.write_data(session.plan, planner).result()
        else:
            views = {MetadataIndex(i.index.fqn, i.index.offset): session.planner.get_data(i) for i in session.plan.items}
            planner = StagedSavePlanner(session.planner, views)
            holder["background"] = fork_write(session.writer, session.plan, planner, rank=session.dist.rank)

    try:
        session.dist.all_gather("stage", stage_step)
    except BaseException:
        session.writer.abort()
        raise
    background = holder["background"]

    def commit(results: Any, error: BaseException | None) -> Metadata:
        def local_results() -> Any:
            if error is not None:
                raise error
            return results

        def finish(all_results: list[Any]) -> list[Metadata]:
            committed = session.writer.finish(session.metadata, all_results)
            return [committed] * len(all_results)

        try:
            return session.dist.reduce_scatter("async write and commit", local_results, finish)
        except BaseException:
            session.writer.abort()
            raise

    call = queue.schedule_async_request(AsyncRequest(async_fn=background, finalize_fns=(commit,)))
    return AsyncSaveHandle(call, session)
