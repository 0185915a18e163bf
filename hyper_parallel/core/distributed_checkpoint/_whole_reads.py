"""Small whole reads of a load plan kept as columns: no :class:`ReadItem` each until someone asks for the items.

Most reads of a state of thousands of Parameters are the same: a whole host
target, stored as one chunk of its shape, read whole straight into the
target's memory. :class:`.StandardLoadPlanner` keeps those of at most
:data:`SMALL_WHOLE_BYTES` as columns (:class:`WholeReads`: key, chunk
offsets and sizes, target view) in a :class:`WholeReadPlan`, and the
filesystem reader reads them file by file from the columns (one header
comparison per file, one ``preadv`` per run of adjacent chunks). The plan is
a :class:`LoadPlan` like any other: its ``items`` are made on first access
(the same ReadItems the planner would have listed, in the same order), so a
custom reader, a planner hook or a caller inspecting the plan sees every
region; pickled, it is a plain :class:`LoadPlan`.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, ReadItem

__all__ = ["SMALL_WHOLE_BYTES", "WholeReads", "WholeReadPlan", "whole_read_item"]

#: Whole chunks up to this size (one flat checksum block) are small: read many per system call.
SMALL_WHOLE_BYTES = 1 << 20

_new_object = object.__new__
_set_attribute = object.__setattr__
_set_fqn, _set_offset, _set_index = MetadataIndex.fqn.__set__, MetadataIndex.offset.__set__, MetadataIndex.index.__set__
_TENSOR = LoadItemType.TENSOR


def whole_read_item(fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], position: int = 0) -> ReadItem:
    """``ReadItem(LoadItemType.TENSOR, index, zero, index, zero, sizes)`` with ``index = MetadataIndex(fqn,
    offsets, position)``: a whole chunk into a whole piece (the target's piece ``position``, the key's only
    chunk), so one index names both (its ``index`` hint is left out of equality). Both records are built at about
    half their frozen ``__init__``'s cost (neither class has a ``__post_init__`` to skip). Pure."""
    index = _new_object(MetadataIndex)
    _set_fqn(index, fqn)
    _set_offset(index, offsets)
    _set_index(index, position)
    zero = offsets if not any(offsets) else (0,) * len(sizes)
    item = _new_object(ReadItem)
    _set_attribute(item, "__dict__", {"type": _TENSOR, "dest_index": index, "dest_offsets": zero,
                                      "storage_index": index, "storage_offsets": zero, "lengths": sizes})
    return item


class WholeReads:
    """The small whole reads of one plan, one row each: ``(key, chunk offsets, chunk sizes, target view)``.

    Each row: the key is stored as one chunk at those offsets of those sizes, the key's whole tensor, at
    most :data:`SMALL_WHOLE_BYTES`; the view is the target's memory, writable, C-contiguous, of the stored
    dtype and of the chunk's shape, filled by reading the chunk's bytes into it
    (nothing else to do for it: the planner's ``acquire_tensor`` would return it, its ``apply_tensor``
    would do nothing). Built by the planner's ``build_local_plan``; read by the reader (any thread).

    Args:
        owner: The planner that built the rows: a reader reads them straight into ``views`` only when it
            reads for this planner (another one, e.g. a planner wrapping it, is asked for each item). Held
            weakly: the planner holds these rows (its ``whole_reads``), and a cycle between them would keep
            every record of a load (its entries, its metadata) alive until the next garbage collection, which
            then walked and freed them at about 1.5 us per tensor of the load.
        direct: The owner's ``direct_targets()`` map: the items made from these rows are entered there,
            so a reader of the items reads them straight into their targets too.
    """

    __slots__ = ("rows", "_owner", "_direct")

    def __init__(self, owner: Any, direct: dict[int, tuple[ReadItem, np.ndarray]]) -> None:
        self.rows: list[tuple[str, tuple[int, ...], tuple[int, ...], np.ndarray]] = []
        self._owner = weakref.ref(owner) if owner is not None else None
        self._direct = direct

    @property
    def owner(self) -> Any:
        """The planner that built the rows (``None``: none, or it is gone)."""
        return self._owner() if self._owner is not None else None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def fqns(self) -> list[str]:
        """The key of each row."""
        return [row[0] for row in self.rows]

    @property
    def views(self) -> list[np.ndarray]:
        """The target view of each row."""
        return [row[3] for row in self.rows]

    def read_items(self, rows: Any = None) -> list[ReadItem]:
        """The :class:`ReadItem` of each row (of ``rows``, an iterable of row numbers; default all), each entered
        in the planner's direct targets with its view."""
        direct = self._direct
        items = []
        for fqn, offsets, sizes, view in self.rows if rows is None else (self.rows[row] for row in rows):
            item = whole_read_item(fqn, offsets, sizes)
            direct[id(item)] = (item, view)
            items.append(item)
        return items


class WholeReadPlan(LoadPlan):
    """A :class:`LoadPlan` whose small whole reads are columns (:class:`WholeReads`); ``items`` made on access.

    ``items`` lists every region: the other items (``rest``) and one ReadItem per whole read, in the order
    the planner met them (``rest_positions``: the position of each other item among all). Made once, on
    first access; equal to (and hashed as) a :class:`LoadPlan` of the same fields. Pickles as a plain
    :class:`LoadPlan` (the columns hold target memory).

    Args:
        items: Given (``dataclasses.replace``), the plan's every item: no column then.
        storage_data: As :class:`LoadPlan`'s.
        planner_data: As :class:`LoadPlan`'s.
        rest: The items that are not whole reads, in order.
        rest_positions: The position of each of ``rest`` in ``items``.
        whole: The whole reads.
    """

    def __init__(self, items: tuple[ReadItem, ...] | None = None, storage_data: Any = None, planner_data: Any = None,
                 *, rest: tuple[ReadItem, ...] = (), rest_positions: tuple[int, ...] = (),
                 whole: WholeReads | None = None) -> None:  # pylint: disable=super-init-not-called
        if items is not None or whole is None:
            rest = tuple(items or ())
            rest_positions, whole = tuple(range(len(rest))), WholeReads(None, {})
        _set_attribute(self, "rest", rest)
        _set_attribute(self, "rest_positions", rest_positions)
        _set_attribute(self, "whole", whole)
        _set_attribute(self, "storage_data", storage_data)
        _set_attribute(self, "planner_data", planner_data)
        _set_attribute(self, "_items", None)

    @property
    def items(self) -> tuple[ReadItem, ...]:  # type: ignore[override]
        """Every region of the plan (made on first access, then kept)."""
        made = self._items
        if made is None:
            made = _set_items(self)
        return made

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LoadPlan):
            return NotImplemented
        return (self.items, self.storage_data, self.planner_data) == (
            other.items, other.storage_data, other.planner_data)

    def __hash__(self) -> int:
        return hash((self.items, self.storage_data, self.planner_data))

    def __repr__(self) -> str:
        return f"WholeReadPlan(items={self.items!r}, storage_data={self.storage_data!r}, " \
               f"planner_data={self.planner_data!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return LoadPlan, (self.items, self.storage_data, self.planner_data)

    def without(self, ids: set[int]) -> "WholeReadPlan":
        """This plan without the other items whose ``id`` is in ``ids`` (the columns kept, items not made)."""
        rest: list[ReadItem] = []
        positions: list[int] = []
        removed = 0  # items left out so far (each before every later item)
        for position, item in zip(self.rest_positions, self.rest):
            if id(item) in ids:
                removed += 1
                continue
            rest.append(item)
            positions.append(position - removed)
        return WholeReadPlan(rest=tuple(rest), rest_positions=tuple(positions), whole=self.whole,
                             storage_data=self.storage_data, planner_data=self.planner_data)


def _set_items(plan: WholeReadPlan) -> tuple[ReadItem, ...]:
    whole = iter(plan.whole.read_items())
    merged: list[ReadItem] = []
    for position, item in zip(plan.rest_positions, plan.rest):
        while len(merged) < position:
            merged.append(next(whole))
        merged.append(item)
    merged.extend(whole)
    made = tuple(merged)
    _set_attribute(plan, "_items", made)
    return made
