"""The coordinator's merge of layout-form save plans, per layout instead of per rank.

:func:`merge_layout_plans` takes every rank's plan (a
:class:`.LayoutSavePlan`, or a plain :class:`.SavePlan`) and decides exactly
what :func:`.build_global_save_plan` decides on the expanded plans (which
rank writes which chunk, the metadata), without building an object per rank
and item:

- ranks sending the same table bytes share one decoded table;
- a tensor described by a layout on every rank of that layout is *regular*:
  its chunks are the layout's even grid (:class:`.GridChunks`, which covers
  the tensor exactly by construction), the holders of each chunk are the
  ranks of one replica group, replica digests are compared column-wise with
  numpy, and the rank written by each chunk is chosen by the same greedy rule
  (largest first, to the least-loaded holder, lowest rank on ties) with one
  lazily refreshed heap per holder group instead of a scan over the holders
  (:mod:`._layout_writers`);
- general items (values, ``ShardedTensor`` boxes) go through the per-item
  code of :mod:`._global_plan`.

Anything else (a tensor declared differently by different ranks, a layout
some of whose ranks do not declare the tensor, any validation problem) falls
back to expanding every plan and running :func:`.build_global_save_plan`, so
errors read exactly as before. The result is each rank's final plan as a
bitmask over its own local plan, the form the engine scatters.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from hyper_parallel.core.distributed_checkpoint._gc_pause import paused_gc
from hyper_parallel.core.distributed_checkpoint._global_plan import (
    build_global_save_plan,
    check_replicas_of,
    describe_general,
)
from hyper_parallel.core.distributed_checkpoint._grid_chunks import GridChunks
from hyper_parallel.core.distributed_checkpoint._layout_writers import ChunkWriters, RegularTensor
from hyper_parallel.core.distributed_checkpoint._layout_plan import (
    DIGEST_BYTES,
    WHOLE,
    LayoutSavePlan,
    PlanTable,
    decode_table,
    expand_save_plan,
    shard_grid,
)
from hyper_parallel.core.distributed_checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, WriteItem

__all__ = ["LayoutMergeStats", "MERGE_STATS", "merge_layout_plans", "keep_masks"]


@dataclass
class LayoutMergeStats:
    """Counts of this process's merges of layout-form plans (for tests and benchmarks).

    Attributes:
        by_layout: Merges decided per layout.
        fell_back: Merges that expanded the plans and ran the per-item merge.
    """

    by_layout: int = 0
    fell_back: int = 0


#: This process's counts.
MERGE_STATS = LayoutMergeStats()


class _Irregular(Exception):
    """Internal: the plans need the general merge."""


def keep_masks(local_plans: list[SavePlan], final_plans: list[SavePlan]) -> list[bytes]:
    """Each rank's final plan as a bitmask over its local plan. Coordinator.

    The final items are a subsequence of the local ones (the same objects):
    each is matched to the first unmatched local position holding it.
    """
    masks = []
    for local, final in zip(local_plans, final_plans):
        mask = bytearray((len(local.items) + 7) // 8)
        position = 0
        for item in final.items:
            while local.items[position] is not item:
                position += 1
            mask[position // 8] |= 1 << (position % 8)
            position += 1
        masks.append(bytes(mask))
    return masks


def merge_layout_plans(
    plans: list[LayoutSavePlan | SavePlan],
    *,
    remove_redundancy: bool = True,
    save_to_minimum_rank: bool = False,
    planner_data: Any = None,
) -> tuple[list[bytes], Metadata]:
    """Merge every rank's plan into each rank's keep mask and the metadata. Coordinator only.

    Returns:
        Per rank, the bitmask (bit ``i`` of byte ``i // 8``, little-endian)
        of the items of its local plan it writes; and the metadata, equal to
        what :func:`.build_global_save_plan` returns for the expanded plans.

    Raises:
        PlanValidationError: As :func:`.build_global_save_plan`.
    """
    with paused_gc():
        try:
            merged = _Merge(plans, remove_redundancy, save_to_minimum_rank).run(planner_data)
            MERGE_STATS.by_layout += 1
            return merged
        except _Irregular:
            MERGE_STATS.fell_back += 1
        expanded = [expand_save_plan(plan, rank=rank) for rank, plan in enumerate(plans)]
        final, metadata = build_global_save_plan(
            expanded,
            remove_redundancy=remove_redundancy,
            save_to_minimum_rank=save_to_minimum_rank,
            planner_data=planner_data,
        )
        return keep_masks(expanded, final), metadata


@dataclass(frozen=True)
class _GeneralPlan:
    """The general items of one rank, by position in its local plan (what _global_plan's checks index)."""

    items: dict[int, WriteItem]


class _Merge:  # pylint: disable=too-many-instance-attributes
    """One merge: tables, regular tensors, general items, writers, masks."""

    def __init__(self, plans: list[LayoutSavePlan | SavePlan], remove_redundancy: bool, save_to_minimum: bool):
        self.plans = plans
        self.world = len(plans)
        self.remove_redundancy = remove_redundancy
        self.save_to_minimum = save_to_minimum
        self.tables: list[PlanTable] = []
        self.table_ranks: list[list[int]] = []
        self.rank_table = np.full(self.world, -1, dtype=np.int64)
        self.tensors: dict[str, RegularTensor] = {}
        self.grids: dict[Any, Any] = {}
        self.declared: dict[tuple[int, ...], np.ndarray] = {}
        self.regular: set[tuple[int, int]] = set()
        self.general: dict[int, _GeneralPlan] = {}
        self.general_positions: list[list[int]] = []  # per table, the positions of its general slots

    # ------------------------------------------------------------------ reading the plans

    def _read_tables(self) -> None:
        known: dict[tuple[int, int], int] = {}
        blobs: list[bytes] = []
        for rank, plan in enumerate(self.plans):
            if not isinstance(plan, LayoutSavePlan):
                continue
            blob = plan.table
            key = (len(blob), xxhash.xxh3_64_intdigest(blob))
            table = known.get(key)
            if table is None or blobs[table] != blob:
                if table is not None:
                    raise _Irregular  # a digest collision: never mind speed
                table = known[key] = len(blobs)
                blobs.append(blob)
                self.table_ranks.append([])
            self.table_ranks[table].append(rank)
            self.rank_table[rank] = table
        canonical: dict[Any, Any] = {}
        for table_id, blob in enumerate(blobs):
            table: PlanTable = decode_table(blob)
            layouts = [canonical.setdefault(layout, layout) for layout in table.layouts]
            self.tables.append(table)
            self.general_positions.append([p for p, entry in enumerate(table.entries) if entry is None])
            column = 0
            for position, entry in enumerate(table.entries):
                if entry is None:
                    continue
                layout = layouts[entry.layout] if entry.layout != WHOLE else None
                found = self.tensors.get(entry.fqn)
                if found is None:
                    found = self.tensors[entry.fqn] = RegularTensor(entry.fqn, entry.dtype, entry.size, layout,
                                                                    entry.digest)
                elif (found.dtype, found.size, found.digest) != (entry.dtype, entry.size, entry.digest) or (
                    found.layout is not layout
                ):
                    raise _Irregular
                if found.tables and found.tables[-1] == table_id:
                    raise _Irregular  # declared twice by one rank
                found.tables.append(table_id)
                found.positions.append(position)
                found.columns.append(column if entry.digest else -1)
                column += entry.digest
            for rank in self.table_ranks[table_id]:
                if len(self.plans[rank].digests) != column * DIGEST_BYTES:
                    raise _Irregular

    def _read_general(self) -> dict[str, list[tuple[int, int]]]:
        """Every general item as holders of (fqn, offset), in rank then position order."""
        groups: dict[tuple[str, tuple[int, ...]], list[tuple[int, int]]] = defaultdict(list)
        for rank, plan in enumerate(self.plans):
            if isinstance(plan, LayoutSavePlan):
                if not plan.general:
                    continue
                positions = self.general_positions[self.rank_table[rank]]
                items = dict(zip(positions, plan.general))
            else:
                items = dict(enumerate(plan.items))
            self.general[rank] = _GeneralPlan(items)
            for position, item in items.items():
                if item.index.fqn in self.tensors:
                    raise _Irregular
                groups[(item.index.fqn, item.index.offset)].append((rank, position))
        return groups

    def _ranks_of(self, tensor: RegularTensor) -> np.ndarray:
        key = tuple(tensor.tables)
        ranks = self.declared.get(key)
        if ranks is None:
            parts = [np.asarray(self.table_ranks[t], dtype=np.int64) for t in key]
            ranks = self.declared[key] = np.sort(np.concatenate(parts))
        return ranks

    def grid(self, layout: Any) -> Any:
        """The shard grid of ``layout`` (made once); raises :class:`_Irregular` for a layout naming ranks beyond
        the world."""
        grid = self.grids.get(id(layout))
        if grid is None:
            grid = self.grids[id(layout)] = shard_grid(layout, self.world)
            if len(grid.shard_of_rank) > self.world:
                raise _Irregular  # a layout naming ranks beyond the world
        return grid

    # ------------------------------------------------------------------ checks

    def _check_regular(self, tensor: RegularTensor, ranks: np.ndarray) -> None:
        """Every rank of the layout declares the tensor (else chunks would be missing)."""
        if tensor.layout is None or (id(tensor.layout), id(ranks)) in self.regular:
            return
        if len(ranks) != len(tensor.layout.rank_list) or not np.array_equal(
            ranks, np.sort(np.asarray(tensor.layout.rank_list, dtype=np.int64))
        ):
            raise _Irregular
        self.regular.add((id(tensor.layout), id(ranks)))

    def _check_digests(self, digest_rows: dict[int, np.ndarray], ranks_of: dict[str, np.ndarray]) -> None:
        """Replicas of each chunk sent equal digests (compared against the chunk's lowest rank)."""
        by_table: dict[tuple[int, int], list[int]] = defaultdict(list)  # (table, layout id) -> digest columns
        layouts: dict[int, Any] = {}
        for tensor in self.tensors.values():
            ranks = ranks_of[tensor.fqn]
            if not tensor.digest or len(ranks) < 2:
                continue
            if len(tensor.tables) == 1:  # the common case: checked with the table's other columns at once
                by_table[(tensor.tables[0], id(tensor.layout))].append(tensor.columns[0])
                layouts[id(tensor.layout)] = tensor.layout
                continue
            found = np.zeros(self.world, dtype=np.uint64)
            for table, column in zip(tensor.tables, tensor.columns):
                found[self.table_ranks[table]] = digest_rows[table][:, column]
            self._compare(found[ranks], ranks, tensor.layout)
        for (table, layout_id), columns in by_table.items():
            rows = digest_rows[table][:, columns]
            self._compare(rows, np.asarray(self.table_ranks[table], dtype=np.int64), layouts[layout_id])

    def _compare(self, found: np.ndarray, ranks: np.ndarray, layout: Any) -> None:
        """``found[i]``: the digest(s) rank ``ranks[i]`` (increasing) sent; equal within each replica group?"""
        if layout is None:
            first = np.zeros(1, dtype=np.int64)
            row_of = np.zeros(len(ranks), dtype=np.int64)
        else:
            shard = self.grid(layout).shard_of_rank[ranks]
            first = np.zeros(int(shard.max()) + 1, dtype=np.int64)
            first[shard[::-1]] = np.arange(len(ranks) - 1, -1, -1)  # the lowest rank of each shard
            row_of = first[shard]
        if not np.array_equal(found, found[row_of]):
            raise _Irregular

    # ------------------------------------------------------------------ the merge

    def run(self, planner_data: Any) -> tuple[list[bytes], Metadata]:
        """Merge; raises :class:`_Irregular` when the general merge must decide."""
        self._read_tables()
        groups = self._read_general()
        problems: list[str] = []
        for key, holders in groups.items():
            if len(holders) > 1:
                problems.extend(check_replicas_of(key, holders, self.general))
        general_metadata: dict[str, Any] = {}
        by_fqn: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
        for key in groups:
            by_fqn[key[0]].append(key)
        for fqn, keys in by_fqn.items():
            problems.extend(describe_general(fqn, keys, groups, self.general, general_metadata))
        if problems:
            raise _Irregular
        digest_rows = {}
        for table, ranks in enumerate(self.table_ranks):
            joined = b"".join(self.plans[r].digests for r in ranks)
            digest_rows[table] = np.frombuffer(joined, dtype="<u8").reshape(len(ranks), -1)
        ranks_of = {}
        for tensor in self.tensors.values():
            ranks = ranks_of[tensor.fqn] = self._ranks_of(tensor)
            self._check_regular(tensor, ranks)
        self._check_digests(digest_rows, ranks_of)
        writers, general_keep, bytes_per_rank = ChunkWriters(self, groups, ranks_of).choose()
        metadata = Metadata(
            state_dict_metadata=self._describe(general_metadata),
            planner_data=planner_data,
            storage_meta=StorageMeta(world_size=self.world, bytes_per_rank=bytes_per_rank),
        )
        return self._masks(writers, general_keep), metadata

    def _describe(self, general_metadata: dict[str, Any]) -> dict[str, Any]:
        """The tensors' and values' metadata, in the order of first appearance (rank, then position)."""
        out: dict[str, Any] = {}
        seen_tables: set[int] = set()
        for rank, plan in enumerate(self.plans):
            table_id = int(self.rank_table[rank])
            general = self.general.get(rank)
            if table_id >= 0 and table_id not in seen_tables:
                seen_tables.add(table_id)
                for position, entry in enumerate(self.tables[table_id].entries):
                    fqn = entry.fqn if entry is not None else general.items[position].index.fqn
                    if fqn not in out:
                        out[fqn] = self._metadata_of(fqn, general_metadata)
            elif general is not None:
                for item in general.items.values():
                    if item.index.fqn not in out:
                        out[item.index.fqn] = general_metadata[item.index.fqn]
        return out

    def _metadata_of(self, fqn: str, general_metadata: dict[str, Any]) -> Any:
        tensor = self.tensors.get(fqn)
        if tensor is None:
            return general_metadata[fqn]
        properties = TensorProperties(dtype=tensor.dtype)
        if tensor.layout is None or math.prod(tensor.layout.splits_per_dim()) == 1:
            whole = ChunkStorageMetadata(offsets=(0,) * len(tensor.size), sizes=tensor.size)
            return TensorStorageMetadata(properties=properties, size=tensor.size, chunks=(whole,))
        local = tensor.layout.local_shape(tensor.size)
        return TensorStorageMetadata(properties=properties, size=tensor.size, chunks=GridChunks(tensor.size, local))

    def _masks(self, writers: dict[str, np.ndarray], general_keep: dict[int, set[int]]) -> list[bytes]:
        """Per rank, the bitmask of the local items it writes."""
        masks: list[bytes] = [b""] * self.world
        for table_id, table in enumerate(self.tables):
            ranks = np.asarray(self.table_ranks[table_id], dtype=np.int64)
            keep = np.zeros((len(table.entries), len(ranks)), dtype=bool)
            for position, entry in enumerate(table.entries):
                if entry is None:
                    continue
                chosen = writers.get(entry.fqn)
                if chosen is None:  # every holder writes
                    keep[position] = True
                else:
                    keep[position] = chosen[ranks] == ranks
            packed = np.packbits(keep.T, axis=1, bitorder="little") if len(table.entries) else None
            for row, rank in enumerate(self.table_ranks[table_id]):
                mask = packed[row] if packed is not None else np.zeros(0, np.uint8)
                if rank in general_keep:
                    mask = mask.copy()
                    for position in self.general_positions[table_id]:
                        if position in general_keep[rank]:
                            mask[position // 8] |= 1 << (position % 8)
                masks[rank] = mask.tobytes()
        for rank, plan in enumerate(self.plans):
            if isinstance(plan, LayoutSavePlan):
                continue
            mask = bytearray((len(plan.items) + 7) // 8)
            for position in general_keep.get(rank, ()):
                mask[position // 8] |= 1 << (position % 8)
            masks[rank] = bytes(mask)
        return masks
