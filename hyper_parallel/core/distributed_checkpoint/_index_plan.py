"""The record-only commit of the indexed form: holders decided at plan time, each rank writing its own index.

In the indexed form (docs/format.md section 12.1) the storage entries of grid
tensors live in one index file per holder rank. Built by the coordinator from
every rank's write results, the commit would receive about 131 bytes and hold
about 2.4 KB per chunk: at 10,240 ranks x 10,000 sharded tensors (1e8
chunks), impossible. Here the coordinator decides at plan time, from the
merged plan, which rank holds each chunk of each grid tensor
(:func:`plan_index`, an :class:`IndexPlan`), and hands each rank, with its
final plan, the little it needs (:class:`RankIndexPlan`: the tensors whose
entries stay in-line, and how many entries its index lists). After its data
is durable each rank writes its index file (also durable) and sends the
coordinator only a :class:`RankIndexSummary`: the index file's name, length
and digest, its entry count, bytes written, its data file names and the few
entries that stay in-line. The coordinator checks every rank's count against
the plan and every index file's length on storage, and commits
``metadata.json`` listing the indexes (:func:`record_only_metadata`). The
files are exactly those the coordinator would have written.

A save that keeps replicas (``remove_redundancy=False``) writes a chunk on
several ranks; its holder is the lowest of them (as the coordinator-built
form keeps the first entry in rank order), and each rank is also told which
of its items it holds (:attr:`RankIndexPlan.held`, one bit per item). The rank
resolves the bits to the keys of its items (:func:`bind_held`) before its
planner's ``finalize_plan`` may reorder or filter them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.checksum import digest
from hyper_parallel.core.distributed_checkpoint._format.grid_holders import (
    GridHolders,
    fit_holders,
    flat_position,
    grid_position,
)
from hyper_parallel.core.distributed_checkpoint._format.rank_index import (
    IndexRecord,
    encode_rank_index,
    index_file_name,
)
from hyper_parallel.core.distributed_checkpoint._grid_chunks import GridChunks
from hyper_parallel.core.distributed_checkpoint._index_form import grid_tensors, indexed_metadata
from hyper_parallel.core.distributed_checkpoint._layout_plan import WHOLE, LayoutSavePlan, decode_table, shard_grid
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError, CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageInfo,
)
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, WriteItemType
from hyper_parallel.core.distributed_checkpoint.storage import WriteResult

__all__ = [
    "IndexPlan",
    "RankIndexPlan",
    "RankIndexSummary",
    "plan_index",
    "summarise_rank",
    "own_index",
    "inline_results",
    "written_files",
    "record_only_metadata",
    "with_rank_plans",
    "bind_held",
    "check_stored_indexes",
    "VERIFY_INDEX_BYTES",
]

#: The commit re-reads and digests the rank index files when together at most this large (else checks lengths).
VERIFY_INDEX_BYTES = 256 << 20


@dataclass(frozen=True)
class RankIndexPlan:
    """What one rank needs to write its index file (sent with its final plan).

    Attributes:
        inline_keys: The tensors whose entries stay in ``metadata.json`` (no even grid); values stay there too.
        entries: The grid chunks this rank holds: its index file lists exactly these.
        held: With replicas kept (``remove_redundancy=False``): a bitmask over the items of this rank's final plan
            (bit ``i`` of byte ``i // 8``) of the grid chunks it holds (it is their lowest writer); the others it
            writes are listed by a lower rank's index. ``None``: it holds every grid chunk it writes.
        held_keys: ``held`` resolved on the rank to the keys (name, offset) of those items (:func:`bind_held`,
            before ``finalize_plan``); never sent. ``None``: not resolved yet.
    """

    inline_keys: frozenset[str]
    entries: int
    held: bytes | None = None
    held_keys: frozenset[tuple[str, tuple[int, ...]]] | None = None


@dataclass(frozen=True)
class IndexPlan:
    """The coordinator's plan-time decision of the indexed form.

    Attributes:
        holders: For each grid tensor (in metadata order), the rank holding each chunk.
        entries: Per rank, the grid chunks it holds.
        inline_keys: As :attr:`RankIndexPlan.inline_keys`.
        held: Per rank, :attr:`RankIndexPlan.held` (``None`` without replicas).
    """

    holders: Mapping[str, GridHolders]
    entries: tuple[int, ...]
    inline_keys: frozenset[str]
    held: tuple[bytes, ...] | None = None

    def for_rank(self, rank: int) -> RankIndexPlan:
        """What rank ``rank`` is told. Coordinator; pure."""
        return RankIndexPlan(inline_keys=self.inline_keys, entries=self.entries[rank],
                             held=None if self.held is None else self.held[rank])


@dataclass(frozen=True)
class RankIndexSummary:
    """What a rank sends the coordinator instead of its write results (a few hundred bytes plus in-line entries).

    Attributes:
        rank: The rank.
        record: Its index file (name, length, xxh3 digest); ``None`` when it holds no grid chunk.
        entries: Entries its index file lists.
        bytes_written: Bytes of every item it wrote.
        files: Its data files of this save.
        inline: Its write results that stay in-line (values, tensors without an even grid).
    """

    rank: int
    record: IndexRecord | None
    entries: int
    bytes_written: int
    files: tuple[str, ...]
    inline: tuple[WriteResult, ...]


class _Irregular(Exception):
    """Internal: the plan gives some grid chunk no writer, or an unexpected one (commit from the results instead)."""


#: Called per group of writes: (key, grid positions, writer ranks, position of each in its rank's final plan).
_Visit = Callable[[str, np.ndarray, np.ndarray, np.ndarray], None]


def _kept(mask: bytes, count: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:count].astype(bool)


def _visit_items(grids: dict[str, GridChunks], items: Any, rank: int, visit: _Visit) -> None:
    """Visit each of ``(final position, write item)`` of ``rank`` that is a chunk of a grid tensor."""
    for final, item in items:
        grid = grids.get(item.index.fqn)
        if grid is None:
            continue
        chunk = item.tensor_data.chunk if item.tensor_data is not None else None
        position = None if chunk is None or tuple(chunk.sizes) != grid.chunk_sizes else grid_position(
            tuple(item.index.offset), grid.chunk_sizes, grid.splits)
        if position is None:
            raise _Irregular
        visit(item.index.fqn, np.asarray([flat_position(position, grid.splits)]), np.asarray([rank]),
              np.asarray([final]))


def _visit_tables(grids: dict[str, GridChunks], plans: Sequence[Any], masks: Sequence[bytes], visit: _Visit) -> None:
    """Visit the writes of the layout-form plans, one table (shared by many ranks) and entry at a time."""
    by_table: dict[bytes, list[int]] = {}
    for rank, plan in enumerate(plans):
        if isinstance(plan, LayoutSavePlan):
            by_table.setdefault(plan.table, []).append(rank)
    world = len(plans)
    for blob, ranks in by_table.items():
        table = decode_table(blob)
        count = len(table.entries)
        if not count:
            continue
        rows = np.asarray(ranks, dtype=np.int64)
        kept = np.stack([_kept(masks[rank], count) for rank in ranks])
        finals = np.cumsum(kept, axis=1) - 1  # each kept item's position in its rank's final plan
        shards: dict[int, np.ndarray] = {}
        for position, entry in enumerate(table.entries):
            if entry is None or entry.fqn not in grids:
                continue
            column = kept[:, position]
            writers, grid = rows[column], grids[entry.fqn]
            if entry.layout == WHOLE:
                if len(grid) != 1:
                    raise _Irregular
                flat = np.zeros(len(writers), dtype=np.int64)
            else:
                layout = table.layouts[entry.layout]
                if tuple(layout.splits_per_dim()) != grid.splits:
                    raise _Irregular
                shard_of_rank = shards.get(entry.layout)
                if shard_of_rank is None:
                    shard_of_rank = shards[entry.layout] = shard_grid(layout, world).shard_of_rank
                flat = shard_of_rank[writers]
            visit(entry.fqn, flat, writers, finals[column, position])
        general_positions = [position for position, entry in enumerate(table.entries) if entry is None]
        for row, rank in enumerate(ranks if general_positions else ()):  # the general items of this table's ranks
            _visit_items(grids, ((int(finals[row, p]), item) for p, item in zip(general_positions, plans[rank].general)
                                 if kept[row, p]), rank, visit)


def _visit(grids: dict[str, GridChunks], plans: Sequence[Any], masks: Sequence[bytes] | None, visit: _Visit) -> None:
    """Visit every write of a grid chunk the final plans make (see :func:`plan_index`)."""
    if masks is None:
        for rank, plan in enumerate(plans):
            _visit_items(grids, enumerate(plan.items), rank, visit)
        return
    _visit_tables(grids, plans, masks, visit)
    for rank, plan in enumerate(plans):
        if isinstance(plan, SavePlan):
            mask = _kept(masks[rank], len(plan.items))
            _visit_items(grids, enumerate(item for item, keep in zip(plan.items, mask) if keep), rank, visit)


def _final_counts(plans: Sequence[Any], masks: Sequence[bytes] | None) -> list[int]:
    """The number of items of each rank's final plan."""
    if masks is None:
        return [len(plan.items) for plan in plans]
    return [int(np.unpackbits(np.frombuffer(mask, dtype=np.uint8)).sum()) for mask in masks]


def plan_index(metadata: Metadata, plans: Sequence[Any], masks: Sequence[bytes] | None = None, *,
               replicas: bool = False) -> IndexPlan | None:
    """Which rank holds each chunk of each grid tensor, from the merged plan. Coordinator; pure.

    Args:
        metadata: The merged metadata.
        plans: Every rank's plan: the final plans (``masks`` ``None``), or the local plans as sent (layout form or
            plain) with ``masks``, each rank's final plan as a bitmask over its local plan.
        masks: See ``plans``.
        replicas: Several ranks may write a chunk (``remove_redundancy=False``): the lowest holds it, and each
            rank is also told which of its items it holds (:attr:`RankIndexPlan.held`). Else a chunk written
            twice declines.

    Returns:
        The plan, or ``None`` when some grid chunk is written by no rank (or, without ``replicas``, by several),
        or the plan is not one this function follows: that save commits from its write results.
    """
    grids, inline = grid_tensors(metadata)
    unset = np.iinfo(np.int64).max
    holders = {fqn: np.full(len(grid), unset, dtype=np.int64) for fqn, grid in grids.items()}

    def assign(fqn: str, flat: np.ndarray, ranks: np.ndarray, _finals: np.ndarray) -> None:
        target = holders[fqn]
        if not replicas and len(flat) and ((target[flat] != unset).any() or len(np.unique(flat)) != len(flat)):
            raise _Irregular
        np.minimum.at(target, flat, ranks)  # the lowest writer holds a chunk

    try:
        _visit(grids, plans, masks, assign)
    except _Irregular:
        return None
    counts = np.zeros(len(plans), dtype=np.int64)
    for ranks in holders.values():
        if len(ranks) and ranks.max() == unset:
            return None
        counts += np.bincount(ranks, minlength=len(plans))[: len(plans)]
    held = None
    if replicas:
        bits = [np.zeros(count, dtype=bool) for count in _final_counts(plans, masks)]

        def mark(fqn: str, flat: np.ndarray, ranks: np.ndarray, finals: np.ndarray) -> None:
            held = holders[fqn][flat] == ranks
            for rank, final in zip(ranks[held].tolist(), finals[held].tolist()):
                bits[rank][final] = True

        _visit(grids, plans, masks, mark)
        held = tuple(np.packbits(b, bitorder="little").tobytes() for b in bits)
    return IndexPlan(holders={fqn: fit_holders(grids[fqn].splits, ranks) for fqn, ranks in holders.items()},
                     entries=tuple(int(c) for c in counts), inline_keys=inline, held=held)


def summarise_rank(plan: SavePlan, results: Sequence[WriteResult], *, rank: int,
                   save_id: str) -> tuple[RankIndexSummary, bytes | None]:
    """Split a rank's write results into its index file (bytes) and the summary it sends. That rank; pure.

    Raises:
        CheckpointValueError: the results hold another number of grid chunks than the plan gave this rank.
    """
    told: RankIndexPlan = plan.storage_data.index
    values = {item.index.fqn for item in plan.items if item.type == WriteItemType.BYTE_IO}
    held = told.held_keys if told.held_keys is not None or told.held is None else _held_keys(plan.items, told.held)
    indexed: list[tuple[MetadataIndex, StorageInfo]] = []
    inline: list[WriteResult] = []
    for result in results:
        fqn, offset = result.index.fqn, tuple(result.index.offset)
        if fqn in told.inline_keys or fqn in values:
            inline.append(result)
        elif held is None or (fqn, offset) in held:  # a replica a lower rank holds is listed by that rank's index
            indexed.append((MetadataIndex(fqn, offset), result.storage_data))
    if len(indexed) != told.entries:
        raise CheckpointValueError(
            f"rank {rank}: wrote {len(indexed)} chunk(s) of grid tensors but the save plan gives it {told.entries}; "
            "nothing was committed. A SavePlanner.finalize_plan (or a writer) that drops or adds items of its final "
            "plan cannot save the indexed form: keep the items (their order may change), or pass "
            "metadata_form='inline' to the writer")
    data, record = (None, None) if not indexed else encode_rank_index(save_id=save_id, rank=rank, entries=indexed)
    summary = RankIndexSummary(
        rank=rank, record=record, entries=len(indexed), bytes_written=sum(r.size_in_bytes for r in results),
        files=tuple(sorted({r.storage_data.relative_path for r in results})), inline=tuple(inline))
    return summary, data


def own_index(writer: Any, plan: SavePlan, results: Sequence[WriteResult]) -> RankIndexSummary | None:
    """When ``plan`` tells this rank to write its own index: write it with ``writer`` (durably; call after the data
    is durable) and return the summary for the commit; else ``None``. Every rank."""
    if getattr(plan.storage_data, "index", None) is None:
        return None
    return writer.write_rank_index(plan, list(results))


def inline_results(results: RankIndexSummary | Sequence[WriteResult]) -> Sequence[WriteResult]:
    """A rank's results that go in-line: all of them, or the summary's in-line ones. Pure."""
    return results.inline if isinstance(results, RankIndexSummary) else results


def written_files(results: Sequence[RankIndexSummary | Sequence[WriteResult]]) -> set[str]:
    """The names of every file the ranks wrote: data files, and index files of summaries. Coordinator; pure."""
    names: set[str] = set()
    for rank_results in results:
        if isinstance(rank_results, RankIndexSummary):
            names.update(rank_results.files)
            if rank_results.record is not None:
                names.add(rank_results.record.file)
        else:
            names.update(result.storage_data.relative_path for result in rank_results)
    return names


def record_only_metadata(committed: Metadata, summaries: Sequence[RankIndexSummary], plan: IndexPlan | None, *,
                         save_id: str) -> Metadata:
    """The indexed metadata from every rank's summary and the plan-time holders. Coordinator; pure.

    Args:
        committed: The metadata with this save's storage meta and the in-line entries as ``storage_data``.
        summaries: Every rank's summary, in rank order.
        plan: The plan every rank was given.
        save_id: This save's id.

    Raises:
        CorruptCheckpointError: a rank's summary disagrees with the plan (names the rank and its index file).
    """
    if plan is None:
        raise CheckpointValueError("rank index summaries reached a commit that planned no indexed form; "
                                   "nothing was committed")
    records = []
    for rank, summary in enumerate(summaries):
        expected = index_file_name(rank, save_id)
        record = summary.record
        if (summary.rank != rank or summary.entries != plan.entries[rank] or (record is None) != (summary.entries == 0)
                or (record is not None and record.file != expected)):
            raise CorruptCheckpointError(
                f"rank {rank}: its index file {expected} is reported with {summary.entries} entries "
                f"({record.file if record is not None else 'no file'}), but the save plan gives the rank "
                f"{plan.entries[rank]} chunk(s) of grid tensors; nothing was committed")
        if record is not None:
            records.append(record)
    inline = {index: info for index, info in (committed.storage_data or {}).items()}
    return indexed_metadata(committed, holders=dict(plan.holders), inline=inline, records=tuple(records),
                            save_id=save_id)


def _held_keys(items: Sequence[Any], held: bytes) -> frozenset[tuple[str, tuple[int, ...]]]:
    """The keys of the items ``held`` marks, by position in ``items``."""
    return frozenset((item.index.fqn, tuple(item.index.offset)) for item, bit in zip(items, _kept(held, len(items)))
                     if bit)


def bind_held(plan: SavePlan) -> SavePlan:
    """``plan`` (this rank's final plan as the coordinator sent it) with :attr:`RankIndexPlan.held` resolved to
    :attr:`RankIndexPlan.held_keys`. That rank, before its planner's ``finalize_plan``; pure.

    The bits mark items by position in the plan sent; a ``finalize_plan`` that reorders or filters the items
    would otherwise make the rank's index list chunks it does not hold.
    """
    told = getattr(plan.storage_data, "index", None)
    if told is None or told.held is None or told.held_keys is not None:
        return plan
    bound = replace(told, held_keys=_held_keys(plan.items, told.held))
    return replace(plan, storage_data=replace(plan.storage_data, index=bound))


def with_rank_plans(plans: Sequence[SavePlan], plan: IndexPlan) -> list[SavePlan]:
    """Each rank's stamped final plan, its storage data also carrying :class:`RankIndexPlan`. Coordinator; pure."""
    return [replace(p, storage_data=replace(p.storage_data, index=plan.for_rank(rank))) for rank, p in enumerate(plans)]


def check_stored_indexes(records: Sequence[IndexRecord], *, size_of: Callable[[str], int],
                         read: Callable[[str], bytes], where: str) -> None:
    """Every index file on storage has the length (and, up to :data:`VERIFY_INDEX_BYTES` in all, the digest) its
    rank reported. Coordinator, before the commit.

    Args:
        records: The index files the ranks reported.
        size_of: The stored size of a file by name (raises ``OSError`` when it is missing).
        read: The stored bytes of a file by name.
        where: The checkpoint, named in errors.

    Raises:
        CorruptCheckpointError: a file missing, or of another length or digest (names the rank and the file).
    """
    verify = sum(record.length for record in records) <= VERIFY_INDEX_BYTES
    for record in records:
        try:
            size = size_of(record.file)
            found = digest(read(record.file)) if verify and size == record.length else record.digest
        except OSError as exc:
            size, found = -1, f"unreadable ({exc})"
        if size != record.length or found != record.digest:
            raise CorruptCheckpointError(
                f"{where}: the index file {record.file} of rank {record.rank} does not match the length and digest "
                f"the rank reported ({record.length} bytes, {record.digest}; stored: {size} bytes, {found}): "
                "another process changed or removed it; nothing was committed, save again")
