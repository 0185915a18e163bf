"""Staging for async saves: the state copied (or forked) so training may go on.

``async_save`` blocks only to plan and to stage: every item this rank writes
is copied into host buffers the checkpoint owns (on CPU ``asnumpy()`` shares
the tensor's memory, so a real copy is needed), or, with ``staging="fork"``,
a writer process is forked whose copy-on-write view of memory is the
snapshot. Buffers are kept and reused by the next save when the items have
the same shapes and dtypes, so steady-state staging is a plain memcpy into
memory that is already mapped. A save that reuses the previous save's plan
(the same items) also reuses its arena offsets and staged views: the blocking
part is then one loop issuing copies.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import weakref
from typing import Any, Callable, Iterable

import numpy as np

from hyper_parallel.platform.dtypes import DTYPE_NAMES, numpy_dtype
from hyper_parallel.core.distributed_checkpoint._copy_threads import SMALL_COPY_BYTES, Copier
from hyper_parallel.core.distributed_checkpoint._stage_copies import ALIGN, EarlyCopies, SmallRun, round_up
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

__all__ = ["ARENA_HEADROOM", "StagedSavePlanner", "StagingPool", "staged_views"]


class StagingPool:
    """One arena of host memory, reused across saves, that the items are copied into.

    The arena is a single anonymous mapping advised for transparent huge
    pages (``MADV_HUGEPAGE``): first-touching fresh 4 KiB pages is what made
    a first call slow (measured on a 2-core VM: 256 MiB into fresh
    ``np.empty`` memory 0.11-0.17 s, into a huge-page mapping 0.025 s, into
    warm memory 0.016 s). Items are packed at 64-byte aligned offsets; the
    arena is kept for the next save and replaced by a larger one (with
    :data:`ARENA_HEADROOM` to spare) only when the state grows past it.

    A save begins with :meth:`early_copies`: whole tensors are copied into
    the arena while the plan is still being made (:mod:`._stage_copies`), so
    the copies (and a fresh arena's page faults, taken by the copying
    threads) overlap the planning. :meth:`stage` then copies only the items
    not copied early.

    Attributes:
        reused: Items staged into an arena already mapped by an earlier save.
        allocated: Items staged into a freshly mapped arena.
        arenas: Arenas mapped so far.
        layouts_reused: Saves whose items and early copies repeated the previous save's (views reused).
        early_copied: Whole tensors copied early (while planning).
        early_items: Items staged by an early copy.
        ahead_adopted: Early copies made ahead (as a save began, :meth:`expected`) that the save used.
        ahead_missed: Copies ahead no leaf of the save used (copied for nothing).
    """

    def __init__(self) -> None:
        self._arena: np.ndarray | None = None
        self._fresh = False
        self._items: tuple[WriteItem, ...] | None = None
        self._placed: dict[str, tuple[int, int]] = {}
        self._layout: list[tuple[MetadataIndex, WriteItem, np.ndarray | None, int]] = []
        self._early_items = 0
        self._end = 0  # arena bytes the kept layout takes (early copies and items)
        self._needed = 0  # arena bytes the previous save took, its replica snapshots included
        self._views: dict[MetadataIndex, Any] = {}
        self._written_leaves: frozenset[str] = frozenset()
        self._expected: tuple[tuple[str, weakref.ref[Any]], ...] = ()
        self._guessed_wrong = False
        self._small_run: SmallRun | None = None  # the small leaves' places of the last save (EarlyCopies)
        self.reused = 0
        self.allocated = 0
        self.arenas = 0
        self.layouts_reused = 0
        self.early_copied = 0
        self.early_items = 0
        self.ahead_adopted = 0
        self.ahead_missed = 0

    @property
    def capacity(self) -> int:
        """Bytes of the current arena (0 before the first save)."""
        return 0 if self._arena is None else int(self._arena.size)

    def release(self) -> None:
        """Drop the arena (unmapped once no staged view of it is left) and the tensors expected next.

        The next save maps a fresh arena and copies nothing ahead.
        """
        self._arena = None
        self._forget_layout()
        self._expected, self._guessed_wrong = (), False
        self._small_run = None

    def prefault(self, nbytes: int) -> None:
        """Map (if needed) an arena of at least ``nbytes`` and fault every page in. Background thread.

        Called after a first save that took a copy-on-write snapshot instead of
        copying (``staging="auto"``): the next save then copies into memory
        that is already backed, as a steady save does. Runs while no save
        stages (the next ``async_save`` waits for this save's background work).
        """
        arena, _ = self._reserve(nbytes)
        if not _populate(arena):  # pragma: no cover - kernels before 5.14 (no MADV_POPULATE_WRITE)
            arena[::mmap.PAGESIZE] = 0  # numpy fills without the GIL
        self._fresh = False  # the next save finds it mapped and backed

    def _forget_layout(self) -> None:
        self._items, self._placed, self._layout, self._views = None, {}, [], {}
        self._early_items = self._end = 0

    def early_copies(self, *, every_leaf: bool, ahead: Iterable[tuple[str, np.ndarray]] = ()) -> EarlyCopies:
        """Start a save's early copies (:class:`.EarlyCopies`). Caller's thread.

        Args:
            every_leaf: Copy every whole tensor (a job of one rank); else only
                the leaves this rank wrote in its previous save.
            ahead: Leaves to copy at once (:meth:`expected`, as host arrays).
        """
        return EarlyCopies(self._arena, None if every_leaf else self._written_leaves, self._grow,
                           minimum=0 if every_leaf else self._needed, ahead=ahead, small_run=self._small_run)

    def expect(self, leaves: Iterable[tuple[str, Any, int]], *, missed: int = 0, fresh: bool = False) -> None:
        """Remember the whole tensors the next save copies ahead: ``(leaf name, tensor, bytes)``. Any thread.

        Only tensors of at least :data:`.SMALL_COPY_BYTES` are kept, weakly.
        A save whose copies ahead were not all adopted (``missed``: the state
        changed, or another state was saved) turns copying ahead off until
        ``fresh`` expectations come (``prepare_async_save``): a wrong guess
        costs a copy for nothing.
        """
        self._guessed_wrong = (self._guessed_wrong or missed > 0) and not fresh
        expected = []
        for name, tensor, nbytes in leaves:
            if nbytes >= SMALL_COPY_BYTES:
                try:
                    expected.append((name, weakref.ref(tensor)))
                except TypeError:  # pragma: no cover - a tensor type without weak references
                    continue
        self._expected = tuple(expected)

    def expect_small(self, names: tuple[str, ...], arrays: list[np.ndarray], start: int) -> None:
        """Place the small leaves the next save is expected to meet (``prepare_async_save``). Caller's thread.

        ``arrays`` are their host arrays as the layout pass will meet them,
        placed in order from ``start`` (where the copies ahead end). A save
        meeting other arrays places its own (:class:`.SmallRun`).
        """
        self._small_run = SmallRun.place(names, arrays, start) if names else None

    def make_small_places(self) -> None:
        """Make the expected small leaves' places in the arena (a background thread, after :meth:`prefault`)."""
        run, arena = self._small_run, self._arena
        if run is not None and arena is not None and run.end <= arena.size:
            run.make_places(arena)

    def expected(self) -> list[tuple[str, Any]]:
        """The remembered large tensors that still live, in order (none while copying ahead is off)."""
        if self._guessed_wrong:
            return []
        return [(name, tensor) for name, ref in self._expected if (tensor := ref()) is not None]

    def _grow(self, nbytes: int) -> np.ndarray:
        return self._reserve(nbytes)[0]

    def _reserve(self, nbytes: int) -> tuple[np.ndarray, bool]:
        """The arena, grown to at least ``nbytes``; and whether it was already mapped by an earlier save."""
        if self._arena is not None and self._arena.size >= nbytes:
            fresh, self._fresh = self._fresh, False
            return self._arena, not fresh
        size = round_up(int(nbytes * ARENA_HEADROOM) if self._arena is not None else nbytes, _HUGE_PAGE)
        self._arena = None  # the old arena is unmapped once the last staged view of it is gone
        self._forget_layout()
        self._arena = _map_arena(max(size, _HUGE_PAGE))
        self._fresh = True
        self.arenas += 1
        return self._arena, False

    def stage(
        self,
        items: tuple[WriteItem, ...],
        data_of: Callable[[WriteItem], Any],
        leaves_of: Callable[[], tuple[str | None, ...]],
        early: EarlyCopies,
        *,
        extra_bytes: int = 0,
    ) -> dict[MetadataIndex, Any]:
        """Stage every item: its early copy, or a copy now; return the staged views. Caller's thread.

        Args:
            items: The items this rank writes.
            data_of: An item's data (``planner.get_data``); asked only for items without an early copy.
            leaves_of: The whole-tensor leaf each item is, or ``None``, in order (asked unless the
                items and early copies repeat the previous save's).
            early: This save's early copies (waited for here, also on failure).
            extra_bytes: Arena bytes to keep free after the items, for :meth:`snapshot` (sizes a new arena).

        The offsets come from the plan alone, so the copies start while the
        caller's thread is still resolving later items (batches go to
        :data:`._copy_threads.STAGING_THREADS` threads; numpy releases the GIL while
        copying). Items and early copies identical to the previous save's
        (a reused plan) are staged at the same offsets into the same views.
        """
        early.settle()  # a layout pass that did not tell the early copies (another planner) adopted none ahead
        try:
            if items is self._items and early.arena is self._arena and early.placed == self._placed:
                layout, staged, mapped = self._layout, dict(self._views), True
                self._fresh = False
                self.layouts_reused += 1
            else:
                leaves = leaves_of()
                self._written_leaves = frozenset(leaf for leaf in leaves if leaf is not None)
                layout, staged, mapped = self._plan_layout(items, leaves, early, extra_bytes)
            counted = self._copy(layout, data_of, staged)
        finally:
            early.wait()
        self._small_run = early.small_run
        self.early_copied += len(early.placed)
        self.ahead_adopted += early.adopted
        self.ahead_missed += early.missed
        self.early_items += self._early_items
        counted += self._early_items
        if mapped:
            self.reused += counted
        else:
            self.allocated += counted
        return staged

    @staticmethod
    def _copy(
        layout: list[tuple[MetadataIndex, WriteItem, np.ndarray | None, int]],
        data_of: Callable[[WriteItem], Any],
        staged: dict[MetadataIndex, Any],
    ) -> int:
        """Copy each item without an early copy; values become bytes. Returns the tensors copied."""
        copier = Copier(caller_share=True)
        counted = 0
        try:
            for index, item, target, nbytes in layout:
                data = data_of(item)
                if target is None:
                    if nbytes == _BYTES:
                        staged[index] = bytes(data)
                    else:  # _PRIVATE
                        staged[index] = np.array(data, order="C", copy=True)
                        counted += 1
                    continue
                counted += 1
                if data.nbytes != nbytes:  # pragma: no cover - a planner serving other sizes than it planned
                    staged[index] = np.array(data, order="C", copy=True)
                    continue
                copier.add(target, np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        finally:
            copier.finish()
        return counted

    def snapshot(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Copy ``arrays`` into the arena after the staged items; return the copies (flat uint8). Caller's thread.

        After :meth:`stage`, for bytes this rank must hold at the call but
        does not write (the replicas another rank writes, hashed later from
        these copies). The arena is kept large enough for them from the next
        save on; what does not fit now gets a buffer of its own.
        """
        copier = Copier(caller_share=True)
        copies: list[np.ndarray] = []
        offset, arena = self._end, self._arena
        try:
            for array in arrays:
                source = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                if arena is not None and offset + source.size <= arena.size:
                    target = arena[offset : offset + source.size]
                    copier.add(target, source)
                else:
                    target = np.array(source, copy=True)
                copies.append(target)
                offset += round_up(source.size, ALIGN)
        finally:
            copier.finish()
        self._needed = max(self._needed, offset)
        return copies

    def _plan_layout(
        self, items: tuple[WriteItem, ...], leaves: tuple[str | None, ...], early: EarlyCopies, extra_bytes: int,
    ) -> tuple[list[tuple[MetadataIndex, WriteItem, np.ndarray | None, int]], dict[MetadataIndex, Any], bool]:
        """Offsets (after the early copies) and staged views of ``items``, kept for a next save of the same items.

        The layout lists only the items to copy at staging (not those an early copy stands for).
        """
        placed: list[tuple[MetadataIndex, WriteItem, int, int]] = []
        total = early.end
        for item, leaf in zip(items, leaves):
            index = MetadataIndex(item.index.fqn, item.index.offset)
            if item.type == WriteItemType.BYTE_IO:
                placed.append((index, item, 0, _BYTES))
                continue
            spec = item.tensor_data
            nbytes = math.prod(spec.chunk.sizes) * DTYPE_NAMES.get(spec.properties.dtype, 0)
            copied = early.placed.get(leaf) if leaf is not None else None
            if copied is not None and copied[1] == nbytes:
                placed.append((index, item, copied[0], _EARLY))
                continue
            placed.append((index, item, total, nbytes))
            total += round_up(nbytes, ALIGN)
        if early.placed:  # the early copies sized the arena for every piece offered
            arena, mapped = early.arena, not self._fresh
            self._fresh = False
        else:
            arena, mapped = self._reserve(total + extra_bytes)
        self._end, self._needed = total, total + extra_bytes
        layout: list[tuple[MetadataIndex, WriteItem, np.ndarray | None, int]] = []
        views: dict[MetadataIndex, Any] = {}
        self._early_items = 0
        for index, item, offset, nbytes in placed:
            if nbytes == _BYTES:
                layout.append((index, item, None, _BYTES))
                continue
            spec = item.tensor_data
            size = math.prod(spec.chunk.sizes) * DTYPE_NAMES.get(spec.properties.dtype, 0)
            if nbytes == _EARLY:
                self._early_items += 1
            elif offset + size > arena.size:  # a grown state on a rank of several: the early copies hold the arena
                layout.append((index, item, None, _PRIVATE))
                continue
            else:
                layout.append((index, item, arena[offset : offset + size], size))
            views[index] = arena[offset : offset + size].view(numpy_dtype(spec.properties.dtype)).reshape(
                spec.chunk.sizes)
        self._items, self._placed, self._layout, self._views = items, dict(early.placed), layout, views
        return layout, dict(views), mapped


#: Marks in a staging layout: a value (bytes), an item staged by an early copy, an item given its own buffer.
#: (Early items are left out of the kept layout; their count is kept.)
_BYTES, _EARLY, _PRIVATE = -1, -2, -3


def _map_arena(nbytes: int) -> np.ndarray:
    """A fresh anonymous mapping of ``nbytes`` as uint8, advised for huge pages where the OS offers them."""
    arena = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if hasattr(mmap, "MAP_ANONYMOUS") \
        else mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            arena.madvise(mmap.MADV_HUGEPAGE)
            if hasattr(mmap, "MADV_DONTFORK"):  # a forked writer (staging="fork") never reads the arena
                arena.madvise(mmap.MADV_DONTFORK)
        except OSError:  # pragma: no cover - kernels without transparent huge pages
            pass
    return np.frombuffer(arena, dtype=np.uint8)


def _populate(arena: np.ndarray) -> bool:
    """Fault in every page of the arena (``MADV_POPULATE_WRITE``); False where the kernel cannot.

    Called through ``ctypes``, which releases the GIL for the call (the mmap
    module's ``madvise`` holds it: the caller's thread would stop meanwhile),
    in steps of :data:`_POPULATE_STEP` bytes: the kernel holds the process's
    memory-map lock while it populates, and a training thread mapping or
    unmapping memory (a large allocation) waits for it meanwhile.
    """
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):  # pragma: no cover - no C library with madvise
        return False
    start = arena.ctypes.data
    for offset in range(0, arena.size, _POPULATE_STEP):
        length = min(_POPULATE_STEP, arena.size - offset)
        if madvise(ctypes.c_void_p(start + offset), ctypes.c_size_t(length), ctypes.c_int(_MADV_POPULATE_WRITE)) != 0:
            return False  # pragma: no cover - kernels before 5.14
    return True


#: Linux's ``MADV_POPULATE_WRITE`` (5.14+), which Python 3.11's mmap module does not name.
_MADV_POPULATE_WRITE = 23
#: Bytes faulted in per ``madvise`` call (:func:`_populate`).
_POPULATE_STEP = 16 << 20
#: A grown arena is this much larger than the state that outgrew the last one.
ARENA_HEADROOM = 1.25
_HUGE_PAGE = 2 << 20


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


def staged_views(items: tuple[WriteItem, ...], sources: Iterable[Any], planner: SavePlanner) -> StagedSavePlanner:
    """Serve the items' own memory (no copy): for a forked writer, whose snapshot is the fork.

    Args:
        items: The items this rank writes.
        sources: The data of each item, in order.
        planner: The planner that planned them.
    """
    return StagedSavePlanner(
        planner, {MetadataIndex(i.index.fqn, i.index.offset): data for i, data in zip(items, sources)}
    )
