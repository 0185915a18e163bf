"""Staging for async saves: the state copied (or forked) so training may go on.

``async_save`` blocks only to plan and to stage: every item this rank writes
is copied into host buffers the checkpoint owns (on CPU ``asnumpy()`` shares
the tensor's memory, so a real copy is needed), or, with ``staging="fork"``,
a writer process is forked whose copy-on-write view of memory is the
snapshot. Buffers are kept and reused by the next save when the items have
the same shapes and dtypes, so steady-state staging is a plain memcpy into
memory that is already mapped.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

__all__ = ["STAGING_THREADS", "StagedSavePlanner", "StagingPool", "staged_views"]


class StagingPool:
    """Host buffers reused across saves, keyed by item, shape and dtype."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[MetadataIndex, tuple[int, ...], str, int], np.ndarray] = {}
        self.reused = 0
        self.allocated = 0

    def stage(self, items: tuple[WriteItem, ...], planner: SavePlanner) -> dict[MetadataIndex, Any]:
        """Copy every item's data into owned buffers; drop buffers no longer used.

        The copies run as raw-byte pieces on :data:`STAGING_THREADS` threads
        (numpy releases the GIL while copying), so staging runs at the
        memory bandwidth of the machine rather than of one core.
        """
        staged: dict[MetadataIndex, Any] = {}
        kept: dict[tuple[MetadataIndex, tuple[int, ...], str, int], np.ndarray] = {}
        copies: list[tuple[np.ndarray, np.ndarray]] = []
        for item in items:
            index = MetadataIndex(item.index.fqn, item.index.offset)
            data = planner.get_data(item)
            if item.type == WriteItemType.BYTE_IO:
                staged[index] = bytes(data)
                continue
            key = (index, tuple(data.shape), data.dtype.str, data.dtype.num)  # num: no slow dtype.name lookup
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


def staged_views(items: tuple[WriteItem, ...], planner: SavePlanner) -> StagedSavePlanner:
    """Serve the items' own memory (no copy): for a forked writer, whose snapshot is the fork."""
    return StagedSavePlanner(planner, {MetadataIndex(i.index.fqn, i.index.offset): planner.get_data(i) for i in items})
