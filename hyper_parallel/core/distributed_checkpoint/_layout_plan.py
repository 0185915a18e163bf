"""A save plan that describes layout-sharded tensors by their layout, not per rank.

In a data/tensor/pipeline-parallel job every rank of a layout holds one shard
of each of its tensors, at an offset the layout and the rank determine. A
rank's plan therefore need not spell out its items: the fqn, dtype, global
shape and layout of each tensor are the same on every rank holding it, and
the rank's own box follows from its rank. :class:`LayoutSavePlan` carries

- ``table``: the pickled :class:`PlanTable`, the list of the rank's items as
  :class:`TableEntry` (fqn, dtype, shape, layout), identical bytes on every
  rank with the same state structure (so the coordinator decodes it once per
  distinct structure, not once per rank);
- ``general``: the items no layout describes (values, ``ShardedTensor``
  boxes, anything the table could not reproduce exactly), as
  :class:`.WriteItem`;
- ``digests``: the rank's replica digests (``check_replicas``), the 8
  bytes of each xxh3-64 digest, concatenated in table order.

:func:`compact_save_plan` builds it on a rank and checks that
:func:`expand_save_plan` gives back exactly the plan it came from (an item the
table would not reproduce stays general), so the coordinator may reason on
the layouts and still decide exactly what the per-rank plans would decide.
"""

from __future__ import annotations

import pickle
import sys
import zlib
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from hyper_parallel.core.distributed_checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from hyper_parallel.core.layout import Layout

__all__ = [
    "DIGEST_BYTES",
    "TableEntry",
    "PlanTable",
    "LayoutSavePlan",
    "ShardGrid",
    "shard_grid",
    "compact_save_plan",
    "expand_save_plan",
    "decode_table",
]

#: Bytes of one replica digest (xxh3-64; 16 lowercase hex digits in a :class:`.WriteItem`).
DIGEST_BYTES = 8
#: ``TableEntry.layout`` of a tensor every declaring rank holds whole.
WHOLE = -1


@dataclass(frozen=True)
class TableEntry:
    """One item of a rank's plan, as the layout describes it.

    Attributes:
        fqn: Storage key.
        dtype: Stored dtype name.
        size: Global shape.
        layout: Index into :attr:`PlanTable.layouts`; ``-1``: the rank holds
            the whole tensor (and any rank declaring it holds a replica).
        digest: The rank sends a replica digest for this item.
    """

    fqn: str
    dtype: str
    size: tuple[int, ...]
    layout: int
    digest: bool


@dataclass(frozen=True)
class PlanTable:
    """The rank-independent part of a rank's plan.

    Attributes:
        layouts: The distinct layouts of the entries.
        entries: One per item of the local plan, in order; ``None`` where
            the item is a general one (the next of ``LayoutSavePlan.general``).
    """

    layouts: tuple[Layout, ...]
    entries: tuple[TableEntry | None, ...]

    def __reduce__(self) -> tuple[Any, ...]:
        # Plain tuples (and a rank list as a range when it is one): small, and equal bytes on every rank.
        layouts = tuple(
            (layout.device_matrix, layout.tensor_map, _ranks_spec(layout.rank_list)) for layout in self.layouts
        )
        entries = tuple(
            None if e is None else (e.fqn, e.dtype, e.size, e.layout, e.digest) for e in self.entries
        )
        return (_table_from, (layouts, entries))


def _ranks_spec(ranks: tuple[int, ...]) -> range | tuple[int, ...]:
    if ranks and ranks == tuple(range(ranks[0], ranks[0] + len(ranks))):
        return range(ranks[0], ranks[0] + len(ranks))
    return ranks


def _table_from(layouts: tuple[Any, ...], entries: tuple[Any, ...]) -> PlanTable:
    """Rebuild a :class:`PlanTable` from its pickled tuples."""
    return PlanTable(
        layouts=tuple(Layout(matrix, tensor_map, None, tuple(ranks)) for matrix, tensor_map, ranks in layouts),
        entries=tuple(None if e is None else TableEntry(*e) for e in entries),
    )


@dataclass(frozen=True)
class LayoutSavePlan:
    """A local save plan in layout form (what a rank sends to the coordinator).

    Attributes:
        table: The pickled :class:`PlanTable`, zlib-compressed (:func:`decode_table`).
        general: The items the table marks ``None``, in order.
        digests: Replica digests of the entries with ``digest``, concatenated.
        storage_data: As :attr:`.SavePlan.storage_data`.
        planner_data: As :attr:`.SavePlan.planner_data`.
    """

    table: bytes
    general: tuple[WriteItem, ...]
    digests: bytes
    storage_data: Any = None
    planner_data: Any = None


@dataclass(frozen=True)
class ShardGrid:
    """Which shard of a layout every rank holds.

    Attributes:
        splits: Shards per tensor dim.
        shard_of_rank: For every global rank below ``len``, the row-major
            index of its shard in the grid, ``-1`` for ranks not in the layout.
        replicas: Ranks holding each shard.
    """

    splits: tuple[int, ...]
    shard_of_rank: np.ndarray
    replicas: int


def shard_grid(layout: Layout, world_size: int) -> ShardGrid:
    """The shard of every rank of ``layout`` (vectorised over the mesh). Any rank."""
    matrix = layout.device_matrix
    positions = np.arange(int(np.prod(matrix, dtype=np.int64)), dtype=np.int64)
    coordinates = np.unravel_index(positions, matrix) if matrix else ()
    splits = layout.splits_per_dim()
    flat = np.zeros(len(positions), dtype=np.int64)
    for dim in range(len(layout.tensor_map)):
        value = np.zeros(len(positions), dtype=np.int64)
        for mesh_dim in layout.mesh_dims(dim):
            value = value * matrix[mesh_dim] + coordinates[mesh_dim]
        flat = flat * splits[dim] + value
    ranks = np.asarray(layout.rank_list, dtype=np.int64)
    shard_of_rank = np.full(max(world_size, int(ranks.max()) + 1 if len(ranks) else 0), -1, dtype=np.int64)
    shard_of_rank[ranks] = flat
    count = max(1, int(np.prod(splits, dtype=np.int64)))
    return ShardGrid(splits=splits, shard_of_rank=shard_of_rank, replicas=len(ranks) // count)


def _item(entry: TableEntry, offsets: tuple[int, ...], sizes: tuple[int, ...], digest: str | None) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(entry.fqn, offsets),
        type=WriteItemType.TENSOR if sizes == entry.size else WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=entry.dtype),
            size=entry.size,
            replica_digest=digest,
        ),
    )


def _box(entry: TableEntry, layout: Layout | None, shard: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Offsets and sizes of shard ``shard`` (row-major grid index) of the entry's tensor."""
    if layout is None:
        return (0,) * len(entry.size), entry.size
    splits = layout.splits_per_dim()
    local = tuple(s // n for s, n in zip(entry.size, splits))
    offsets = [0] * len(splits)
    for dim in range(len(splits) - 1, -1, -1):
        shard, index = divmod(shard, splits[dim])
        offsets[dim] = index * local[dim]
    return tuple(offsets), local


def compact_save_plan(
    plan: SavePlan, layouts: Mapping[MetadataIndex, Layout | None], *, rank: int, world_size: int
) -> LayoutSavePlan | SavePlan:
    """Describe ``plan``'s layout items by their layout. All ranks (each its own plan).

    Args:
        plan: This rank's local plan.
        layouts: The items the planner may describe by layout: a DTensor's
            layout, or ``None`` for a tensor this rank holds whole.
        rank: This rank.
        world_size: Number of ranks.

    Returns:
        The layout form, or ``plan`` itself when no item has a layout.
    """
    if not layouts:
        return plan
    layout_ids: dict[Layout, int] = {}
    grids: dict[int, tuple[Layout, int]] = {}
    entries: list[TableEntry | None] = []
    general: list[WriteItem] = []
    digests: list[bytes] = []
    for item in plan.items:
        entry, digest = _entry_of(item, layouts, layout_ids, grids, rank, world_size)
        entries.append(entry)
        if entry is None:
            general.append(item)
        elif digest is not None:
            digests.append(bytes.fromhex(digest))
    if len(general) == len(entries):
        return plan
    ordered = sorted(layout_ids, key=layout_ids.get)
    table = PlanTable(layouts=tuple(ordered), entries=tuple(entries))
    return LayoutSavePlan(
        table=zlib.compress(pickle.dumps(table, protocol=pickle.HIGHEST_PROTOCOL), 1),
        general=tuple(general),
        digests=b"".join(digests),
        storage_data=plan.storage_data,
        planner_data=plan.planner_data,
    )


def _canonical(layout: Layout) -> Layout:
    """A fresh copy without alias names, so equal layouts pickle to equal bytes on every rank."""
    return Layout(
        tuple(layout.device_matrix),
        tuple(tuple(e) if isinstance(e, tuple) else e for e in layout.tensor_map),
        None,
        tuple(layout.rank_list),
    )


def _is_hex_digest(digest: str) -> bool:
    """A 16-digit lowercase hex digest (what the byte form gives back exactly)."""
    try:
        return len(digest) == 2 * DIGEST_BYTES and bytes.fromhex(digest).hex() == digest
    except ValueError:
        return False


def _entry_of(
    item: WriteItem,
    layouts: Mapping[MetadataIndex, Layout | None],
    layout_ids: dict[Layout, int],
    grids: dict[int, tuple[Layout, int]],
    rank: int,
    world_size: int,
) -> tuple[TableEntry | None, str | None]:
    """The table entry reproducing ``item`` exactly, or ``(None, None)``."""
    data = item.tensor_data
    key = MetadataIndex(item.index.fqn, item.index.offset)
    if data is None or key not in layouts:
        return None, None
    digest = data.replica_digest
    if digest is not None and not _is_hex_digest(digest):
        return None, None
    layout = layouts[key]
    shard = 0
    index = WHOLE
    if layout is not None:
        known = grids.get(id(layout))
        if known is None:
            canonical = _canonical(layout)
            index = layout_ids.setdefault(canonical, len(layout_ids))
            grid = shard_grid(canonical, world_size)
            if rank >= len(grid.shard_of_rank) or grid.shard_of_rank[rank] < 0:
                return None, None
            known = (layout, index, int(grid.shard_of_rank[rank]))
            grids[id(layout)] = known
        _, index, shard = known
    size = tuple(int(s) for s in data.size)
    entry = TableEntry(fqn=item.index.fqn, dtype=sys.intern(data.properties.dtype), size=size, layout=index,
                       digest=digest is not None)
    if layout is not None and (not size or any(s == 0 for s in size)):
        return None, None  # zero-size shards share offsets: the general path decides
    offsets, sizes = _box(entry, layout, shard)
    if not _reproduces(item, entry, offsets, sizes):
        return None, None
    return entry, digest


def _reproduces(item: WriteItem, entry: TableEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    """``_item(entry, offsets, sizes, digest) == item``, field by field without building it (planning speed).

    The digest is the item's own; ``test_layout_merge`` checks that expanding a compacted plan gives it back.
    """
    data = item.tensor_data
    chunk = data.chunk
    return (
        type(item) is WriteItem  # pylint: disable=unidiomatic-typecheck
        and type(data) is TensorWriteData  # pylint: disable=unidiomatic-typecheck
        and item.bytes_io_data is None
        and item.type is (WriteItemType.TENSOR if sizes == entry.size else WriteItemType.SHARD)
        and item.index.fqn == entry.fqn
        and tuple(item.index.offset) == offsets and type(item.index.offset) is tuple
        and type(chunk) is ChunkStorageMetadata and chunk.offsets == offsets and chunk.sizes == sizes
        and type(chunk.offsets) is tuple and type(chunk.sizes) is tuple
        and data.size == entry.size and type(data.size) is tuple
        and data.properties == TensorProperties(dtype=entry.dtype)
    )


def decode_table(blob: bytes) -> PlanTable:
    """The :class:`PlanTable` of ``LayoutSavePlan.table``. Any rank."""
    return pickle.loads(zlib.decompress(blob))


def expand_save_plan(plan: LayoutSavePlan | SavePlan, *, rank: int) -> SavePlan:
    """The :class:`.SavePlan` ``plan`` describes for ``rank`` (the plan it was built from). Any rank."""
    if isinstance(plan, SavePlan):
        return plan
    table = decode_table(plan.table)
    world = max((max(layout.rank_list) for layout in table.layouts), default=rank) + 1
    shards = [int(shard_grid(layout, max(world, rank + 1)).shard_of_rank[rank]) for layout in table.layouts]
    general = iter(plan.general)
    digests = plan.digests
    position = 0
    items = []
    for entry in table.entries:
        if entry is None:
            items.append(next(general))
            continue
        digest = None
        if entry.digest:
            digest = digests[position : position + DIGEST_BYTES].hex()
            position += DIGEST_BYTES
        layout = table.layouts[entry.layout] if entry.layout != WHOLE else None
        offsets, sizes = _box(entry, layout, shards[entry.layout] if layout is not None else 0)
        items.append(_item(entry, offsets, sizes, digest))
    return SavePlan(items=tuple(items), storage_data=plan.storage_data, planner_data=plan.planner_data)
