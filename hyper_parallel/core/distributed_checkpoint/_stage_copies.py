"""Whole tensors copied into the staging arena while the save is still planned, and where each is placed.

:class:`EarlyCopies` starts copying whole tensors into the arena as soon
as the layout pass (:func:`._save_layout.describe_layout`) meets them, in
leaf order, while the caller's thread goes on planning (digest round, merge,
metadata): when the plan is known, the items whose leaf was copied early are
staged already, and only the rest is copied then. The copies themselves run
on the staging threads (:class:`._copy_threads.Copier`); the small leaves'
places are kept from one save to the next (:class:`SmallRun`).

Which leaves are copied early: every whole tensor in a job of one rank (it
writes everything); with several ranks only the leaves this rank wrote in its
previous save (with an unchanged layout, exactly the ones it writes now; a
rank never copies replicas another rank writes). An early copy holds the
bytes the tensor had during the call, so using it is correct whatever the
plan turns out to be; a leaf copied for nothing only costs its copy.

The large leaves expected from the previous save (or announced by
``prepare_async_save``) are copied *ahead*: as the call begins, before the
state is even flattened (a few milliseconds of Python at 2,000 tensors,
during which nothing was copied before). The layout pass then adopts such a
copy only for the leaf of the same name whose host array is the very array
copied (the same numpy view of the same memory); any other leaf is copied
as it is met, and a copy ahead that no leaf adopts is dropped (:attr:`EarlyCopies.missed`).
"""

from __future__ import annotations

import operator
import weakref
from itertools import accumulate, compress
from typing import Any, Callable, Iterable

import numpy as np

from hyper_parallel.core.distributed_checkpoint._copy_threads import LEAD_BYTES, SMALL_COPY_BYTES, Copier

__all__ = ["ALIGN", "EarlyCopies", "SmallRun", "arena_bytes", "round_up"]

#: Items are placed in the arena at offsets aligned to this many bytes.
ALIGN = 64


def round_up(value: int, unit: int) -> int:
    """``value`` rounded up to a multiple of ``unit``."""
    return -(-value // unit) * unit


def arena_bytes(tensor_bytes: int, pieces: int) -> int:
    """Arena bytes that hold ``pieces`` tensors of ``tensor_bytes`` in all, each at an :data:`ALIGN` boundary."""
    return tensor_bytes + pieces * ALIGN


class SmallRun:
    """The small leaves of a save as :class:`EarlyCopies` placed them, in order (kept for the next save).

    Holds the leaves' host arrays weakly (a state dropped between saves is
    freed) and, per arena, typed views of their places, which reference
    arena memory only. A leaf of a dtype unknown to numpy (``isbuiltin`` 0)
    is copied as unsigned integers of its item size, so no copy calls the
    dtype's own functions; a registered one (MindSpore's bfloat16 has
    ``isbuiltin`` 2) is copied with its own dtype, bit-exact. Empty leaves
    are not copied.

    Attributes:
        names: Leaf names, in the order met.
        start: Arena offset of the first.
        offsets: Arena offset of each.
        sizes: Bytes of each.
        end: Arena offset after the last (aligned).
    """

    def __init__(self, *, names: tuple[str, ...], arrays: list[np.ndarray], start: int, offsets: list[int],
                 sizes: list[int], end: int) -> None:
        self.names, self.start, self.offsets, self.sizes, self.end = names, start, offsets, sizes, end
        # Per leaf: the dtype its copy uses (None: its own) and the dtype and shape of its place; None: empty.
        self._kinds = [_kind(array) if array.size else None for array in arrays]
        self._copied = [at for at, kind in enumerate(self._kinds) if kind is not None]
        self._empty = [at for at, kind in enumerate(self._kinds) if kind is None]
        self._refs = [weakref.ref(arrays[at]) for at in self._copied]
        # The dtype and shape each copied array had: the very array object may be retyped or reshaped in
        # place (``a.dtype = ...``, ``a.shape = ...``), which its places (typed views) must follow.
        self._forms = list(map(_FORM, [arrays[at] for at in self._copied]))
        self._arena: np.ndarray | None = None
        self._targets: list[np.ndarray] = []

    @classmethod
    def place(cls, names: tuple[str, ...], arrays: list[np.ndarray], start: int) -> "SmallRun":
        """The run of ``arrays`` (named ``names``, at least one) placed in order from arena offset ``start``."""
        sizes = [array.nbytes for array in arrays]
        offsets = list(accumulate((round_up(size, ALIGN) for size in sizes[:-1]), initial=start))
        return cls(names=names, arrays=arrays, start=start, offsets=offsets, sizes=sizes,
                   end=offsets[-1] + round_up(sizes[-1], ALIGN))

    def repeats(self, names: tuple[str, ...], arrays: list[np.ndarray], start: int) -> bool:
        """Whether ``arrays`` (named ``names``) are the very arrays of this run, to be placed from ``start``.

        An empty leaf (whose view is made anew each time) only has to stay empty. The very array must
        still have its dtype and shape (an array retyped or reshaped in place is placed anew).
        """
        if start != self.start or names != self.names or len(arrays) != len(self._kinds):
            return False
        copied = arrays if not self._empty else [arrays[at] for at in self._copied]
        return (all(map(operator.is_, copied, [ref() for ref in self._refs]))
                and list(map(_FORM, copied)) == self._forms
                and all(arrays[at].size == 0 for at in self._empty))

    def make_places(self, arena: np.ndarray) -> None:
        """Make the typed views of the places in ``arena`` (kept until another arena is given)."""
        if arena is not self._arena:
            kinds, offsets, sizes = self._kinds, self.offsets, self.sizes
            self._targets = [arena[offsets[at] : offsets[at] + sizes[at]].view(kinds[at][1]).reshape(kinds[at][2])
                             for at in self._copied]
            self._arena = arena

    def copies(self, arena: np.ndarray,
               arrays: list[np.ndarray]) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[int]]:
        """``(place in arena, source)`` and bytes of each non-empty leaf of ``arrays`` (this run's arrays).

        The places are made once per arena.
        """
        self.make_places(arena)
        kinds, sizes = self._kinds, self.sizes
        sources = [arrays[at] if kinds[at][0] is None else arrays[at].view(kinds[at][0]) for at in self._copied]
        return list(zip(self._targets, sources)), [sizes[at] for at in self._copied]


def _kind(array: np.ndarray) -> tuple[np.dtype | None, np.dtype, tuple[int, ...]]:
    """How a non-empty small leaf is copied: the dtype its copy views it as (``None``: its own), and the dtype
    and shape of its place."""
    if array.dtype.isbuiltin:
        return None, array.dtype, array.shape
    same_size = _SAME_SIZE[array.dtype.itemsize]
    return same_size, same_size, array.shape


#: An array's dtype and shape (what its place in the arena is typed and shaped by).
_FORM = operator.attrgetter("dtype", "shape")
#: Unsigned integer dtype of each item size (copies of a dtype numpy does not define).
_SAME_SIZE = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


class EarlyCopies:
    """Whole tensors copied into the arena while the save is planned. Caller's thread.

    Places: the copies ahead first, then the other large tensors as the
    layout pass meets them, then (when it is over) the small ones in the
    order met, whose copies wait for the pass's end anyway (:class:`Copier`;
    the caller's thread makes those no thread has begun in :meth:`wait`).
    A save whose large tensors are the ones the previous save copied (ahead)
    thus repeats its places, and staging reuses its layout.

    Args:
        arena: The arena as mapped now (``None``: none yet; copies wait for :meth:`described`).
        wanted: Leaf names to copy (``None``: every whole tensor).
        reserve: Maps an arena of at least the given bytes (when the one at hand is too small).
        minimum: Arena bytes the save will need at least (several ranks: what the previous save took).
        ahead: ``(leaf name, host array)`` of leaves expected in this save, copied at once (see the module
            docstring); only wanted ones are.

    Attributes:
        placed: Leaf name -> ``(offset, nbytes)`` of its early copy in :attr:`arena`.
        end: Bytes of the arena the early copies take (aligned).
        arena: The arena holding the early copies.
        adopted: Copies ahead the layout pass adopted.
        missed: Copies ahead no leaf adopted (known after :meth:`described`).
    """

    def __init__(
        self,
        arena: np.ndarray | None,
        wanted: frozenset[str] | None,
        reserve: Callable[[int], np.ndarray],
        *,
        minimum: int = 0,
        ahead: Iterable[tuple[str, np.ndarray]] = (),
        small_run: SmallRun | None = None,
    ) -> None:
        self.arena = arena
        self._minimum = minimum
        self.placed: dict[str, tuple[int, int]] = {}
        self._large: dict[str, None] = {}  # the names _place gave a place (copies ahead, large leaves), in order
        self.end = 0
        self._wanted = wanted
        self._reserve = reserve
        self._arrays: list[tuple[str, int, np.ndarray]] = []
        self._issued = 0  # early copies issued so far (the first ones in leaf order)
        self._copier = Copier(caller_share=False, lead_bytes=LEAD_BYTES)
        self._done = False
        self._ahead: dict[str, np.ndarray] = {}
        self._small_names: list[str] = []  # small leaves met, placed by described()
        self._small_arrays: list[np.ndarray] = []
        self.small_run = small_run
        self.adopted = 0
        self.missed = 0
        try:
            for name, array in ahead:  # copied as each is known (ahead may look them up one by one)
                if wanted is None or name in wanted:
                    self._ahead[name] = array
                    self._place(name, array)
        except BaseException:
            self.abandon()  # no copy is left running into the arena
            raise

    def leaf(self, name: str, array: np.ndarray) -> None:
        """Place a whole tensor's C-contiguous data (the layout pass meets it); copy it if the arena fits."""
        if self._wanted is not None and name not in self._wanted:
            return
        if self._ahead:
            expected = self._ahead.pop(name, None)
            if expected is array:  # copied ahead from this very view: adopted
                self.adopted += 1
                return
            if expected is not None:
                self.missed += 1
                if expected.nbytes == array.nbytes:
                    self._copy_again(name, array)
                    return
        if array.nbytes < SMALL_COPY_BYTES:  # placed after the large ones, when the pass is over (see the class)
            self._small_names.append(name)
            self._small_arrays.append(array)
            return
        self._place(name, array)

    def leaves(self, names: list[str], arrays: list[np.ndarray], nbytes: list[int]) -> None:
        """:meth:`leaf` of each, in order (``nbytes``: each one's bytes): a layout pass repeating the last one's.

        The small ones are held in one step when none of them was copied ahead
        (the large ones are still met one by one, to adopt their copies ahead).
        """
        large = [size >= SMALL_COPY_BYTES for size in nbytes]
        small = list(compress(names, map(operator.not_, large)))
        if self._wanted is not None or not self._ahead.keys().isdisjoint(small):
            for name, array in zip(names, arrays):
                self.leaf(name, array)
            return
        for name, array in compress(zip(names, arrays), large):
            self.leaf(name, array)
        self._small_names.extend(small)
        self._small_arrays.extend(compress(arrays, map(operator.not_, large)))

    def _place(self, name: str, array: np.ndarray) -> None:
        """Give ``array`` the next place in the arena, under ``name``; copy it now if the arena fits."""
        source = array.reshape(-1).view(np.uint8)
        offset = self.end
        self.end = offset + round_up(source.size, ALIGN)
        self.placed[name] = (offset, source.size)
        self._large[name] = None
        self._arrays.append((name, offset, source))
        if self.arena is not None and self._issued == len(self._arrays) - 1 and self.end <= self.arena.size:
            self._copier.add(self.arena[offset : offset + source.size], source)
            self._issued += 1

    def _copy_again(self, name: str, array: np.ndarray) -> None:
        """Copy ``array`` into the place of ``name``'s stale copy ahead (of its size), once that copy is over.

        Keeps the places (and the arena's size) of a save whose Parameters were replaced by new ones.
        """
        self._copier.finish()  # the stale copy may still be in flight into that place
        offset = self.placed[name][0]
        source = array.reshape(-1).view(np.uint8)
        at = next(at for at, entry in enumerate(self._arrays) if entry[0] == name and entry[1] == offset)
        self._arrays[at] = (name, offset, source)
        if at < self._issued:  # else described() copies it with the others not issued yet
            self._copier.add(self.arena[offset : offset + source.size], source)

    def described(self, layout: Any) -> None:
        """The layout pass is over (``layout``: its :class:`.LayoutDescription`).

        Makes the arena large enough and copies what is not copied yet: in a
        job of one rank, which writes every piece it offers, for every piece
        (the page faults of a fresh arena are then taken by the copying
        threads while the plan is made); with several ranks, which write a
        part only, for the early copies (the other items of a grown state get
        buffers of their own at staging).
        """
        small = self._small_arrays
        run = self._place_small()
        self.settle()
        if not self.placed:
            return
        needed = max(self.end, arena_bytes(layout.tensor_bytes, layout.pieces)) if self._wanted is None \
            else max(self.end, self._minimum)
        if self.arena is None or self.arena.size < needed:
            self._copier.finish()  # nothing may still be copying into the arena that is replaced
            self.arena = self._reserve(needed)
            self._issued = 0
            # A fresh arena's pages are faulted in by the copies: the caller's thread copying a lead into it made an
            # unprepared first save of 1,799 Parameters 2.1x -> 3.9x a memcpy (paired, 6 each); the threads take it all.
            self._copier.drop_lead()
        for name, offset, source in self._arrays[self._issued :]:
            if self.placed.get(name, (None,))[0] == offset:  # not a place given up (a copy ahead replaced or missed)
                self._copier.add(self.arena[offset : offset + source.size], source)
        self._issued = len(self._arrays)
        self._arrays = []
        if run is not None:
            self._copier.add_small(*run.copies(self.arena, small))
        self._copier.release_small()

    def _place_small(self) -> SmallRun | None:
        """Place the small leaves met, in order, after the others; ``None`` if none was met.

        A save meeting the very arrays the previous one placed at the same
        offset (a steady save of the same state) takes its places, and its
        copy list while the arena is the same, instead of placing each leaf.
        """
        names, arrays = tuple(self._small_names), self._small_arrays
        self._small_names, self._small_arrays = [], []
        if not names:
            return None
        run = self.small_run
        if run is None or not run.repeats(names, arrays, self.end):
            run = SmallRun.place(names, arrays, self.end)
        self.placed.update(zip(names, zip(run.offsets, run.sizes)))
        self.end = run.end
        self.small_run = run
        return run

    def large_placed(self) -> list[tuple[str, int]]:
        """``(leaf name, bytes)`` of the large leaves with an early copy (copies ahead adopted included), in order."""
        placed = self.placed
        return [(name, placed[name][1]) for name in self._large if name in placed]

    def settle(self) -> None:
        """Give up the copies ahead no leaf adopted (their places stay unused); count them in :attr:`missed`."""
        for name in self._ahead:
            del self.placed[name]
        self.missed += len(self._ahead)
        self._ahead = {}

    def snapshot(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The early copies as arrays shaped like ``arrays`` (leaf name -> its source), after :meth:`wait`.

        ``None`` when a leaf of ``arrays`` has no early copy of its size.
        """
        views: dict[str, np.ndarray] = {}
        arena = self.arena
        for name, array in arrays.items():
            placed = self.placed.get(name)
            if arena is None or placed is None or placed[1] != array.nbytes:
                return None
            views[name] = arena[placed[0] : placed[0] + placed[1]].view(array.dtype).reshape(array.shape)
        return views

    def wait(self) -> None:
        """Wait for every early copy (re-raises a copy's error). Idempotent."""
        if not self._done:
            self._done = True
            self._arrays = []
            self._copier.finish()

    def abandon(self) -> None:
        """Wait for the copies in flight, ignoring their errors (the save failed anyway)."""
        try:
            self.wait()
        except Exception:  # pylint: disable=broad-except
            pass

