"""The indexed form of the metadata, built by the coordinator from every rank's write results.

Small saves keep one ``metadata.json`` listing every storage entry (the
in-line form). A save whose in-line metadata would be large, or whose writer
was told ``metadata_form="indexed"`` (the choice: :mod:`._metadata_form`), is
committed in the indexed form of docs/format.md section 12.1: every tensor whose chunks form an even
grid (one whole chunk included) is written as its ``grid`` and the rank that
holds each chunk (a formula where one fits), and the storage entries of its
chunks go into one index file per holder rank, which the commit writes before
``metadata.json``.
"""

from __future__ import annotations

from typing import Sequence

from hyper_parallel.core.distributed_checkpoint._format.grid_holders import (
    GridHolders,
    fit_holders,
    flat_position,
    grid_position,
)
from hyper_parallel.core.distributed_checkpoint._format.indexed_storage import IndexedStorage
from hyper_parallel.core.distributed_checkpoint._format.rank_index import IndexRecord, encode_rank_index
from hyper_parallel.core.distributed_checkpoint._grid_chunks import GridChunks
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.storage import WriteResult

__all__ = [
    "grid_of",
    "grid_tensors",
    "build_indexed",
    "index_files",
    "indexed_metadata",
]


def grid_of(item: TensorStorageMetadata) -> GridChunks | None:
    """The even grid of ``item``'s chunks (one whole chunk is a grid of one), else ``None``. Pure.

    Scalars and tensors with an empty dim are no grid (they stay in-line).
    """
    chunks = item.chunks
    if not item.size or 0 in item.size or not chunks:
        return None
    if isinstance(chunks, GridChunks):
        return chunks
    sizes = tuple(chunks[0].sizes)
    if len(sizes) != len(item.size) or any(s <= 0 or full % s for s, full in zip(sizes, item.size)):
        return None
    grid = GridChunks(item.size, sizes)
    if len(grid) != len(chunks) or any(tuple(c.sizes) != sizes for c in chunks):
        return None
    offsets = {tuple(c.offsets) for c in chunks}
    if len(offsets) != len(grid) or any(grid_position(o, sizes, grid.splits) is None for o in offsets):
        return None
    return grid


def grid_tensors(metadata: Metadata) -> tuple[dict[str, GridChunks], frozenset[str]]:
    """The grid of every tensor of ``metadata`` whose chunks form one (metadata order), and the tensors that form
    none (:func:`grid_of`). Pure."""
    grids: dict[str, GridChunks] = {}
    inline: set[str] = set()
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            grid = grid_of(item)
            if grid is None:
                inline.add(fqn)
            else:
                grids[fqn] = grid
    return grids, frozenset(inline)


def build_indexed(metadata: Metadata, results: Sequence[Sequence[WriteResult]], *,
                  save_id: str) -> tuple[Metadata, list[tuple[IndexRecord, bytes]]]:
    """The indexed form of a save: its metadata and each holder rank's index file. Coordinator; pure.

    The holder of a chunk is the first rank (in rank order) whose results list it, as the in-line
    form keeps the first entry of each chunk.

    Args:
        metadata: The save's metadata (chunks from the merged plans; storage entries are ignored).
        results: Every rank's write results, index = rank.
        save_id: The save's id (names the index files).

    Returns:
        The metadata (its ``storage_data`` an :class:`.IndexedStorage` holding every entry) and, for each
        rank that holds a grid chunk, its index record and file bytes.
    """
    grids, _ = grid_tensors(metadata)
    holder_lists = {fqn: [-1] * len(grid) for fqn, grid in grids.items()}
    inline: dict[MetadataIndex, StorageInfo] = {}
    per_rank: dict[int, dict[tuple[str, tuple[int, ...]], StorageInfo]] = {}
    for rank, rank_results in enumerate(results):
        for result in rank_results:
            fqn, offset = result.index.fqn, tuple(result.index.offset)
            grid = grids.get(fqn)
            if grid is None:
                inline.setdefault(MetadataIndex(fqn, offset), result.storage_data)
                continue
            flat = flat_position(grid_position(offset, grid.chunk_sizes, grid.splits), grid.splits)
            if holder_lists[fqn][flat] < 0:
                holder_lists[fqn][flat] = rank
                per_rank.setdefault(rank, {})[(fqn, offset)] = result.storage_data
    holders: dict[str, GridHolders] = {}
    for fqn, grid in grids.items():
        ranks = holder_lists[fqn]
        if min(ranks) < 0:
            raise CheckpointValueError(f"key '{fqn}': a chunk of it was written by no rank; nothing committed")
        holders[fqn] = fit_holders(grid.splits, ranks)
    files = index_files(per_rank, save_id=save_id)
    committed = indexed_metadata(metadata, holders=holders, inline=inline,
                                 records=tuple(record for record, _ in files), save_id=save_id)
    committed.storage_data.adopt(per_rank)  # type: ignore[union-attr]
    return committed, files


def index_files(per_rank: dict[int, dict[tuple[str, tuple[int, ...]], StorageInfo]], *,
                save_id: str) -> list[tuple[IndexRecord, bytes]]:
    """Each rank's index file (record and bytes) from its entries by ``(key, offset)``. Coordinator; pure."""
    files = []
    for rank in sorted(per_rank):
        data, record = encode_rank_index(
            save_id=save_id, rank=rank,
            entries=((MetadataIndex(fqn, offset), info) for (fqn, offset), info in per_rank[rank].items()))
        files.append((record, data))
    return files


def indexed_metadata(metadata: Metadata, *, holders: dict[str, GridHolders], inline: dict[MetadataIndex, StorageInfo],
                     records: tuple[IndexRecord, ...], save_id: str) -> Metadata:
    """``metadata`` in the indexed form: the tensors of ``holders`` as grids, ``inline`` and ``records`` listed.

    Coordinator; pure. Each tensor of ``holders`` must form the even grid of its splits.
    """
    items = dict(metadata.state_dict_metadata)
    grids = {}
    for fqn, holder in holders.items():
        item = items[fqn]
        chunks = item.chunks if isinstance(item.chunks, GridChunks) else GridChunks(
            item.size, tuple(full // count for full, count in zip(item.size, holder.splits)))
        items[fqn] = TensorStorageMetadata(item.properties, item.size, chunks)
        grids[fqn] = (items[fqn], holder)
    storage = IndexedStorage(inline=inline, grids=grids, records=records, save_id=save_id, source="metadata.json")
    return metadata.replace(state_dict_metadata=items, storage_data=storage)
