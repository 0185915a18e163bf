"""The coordinator's choice of metadata form, and the indexed form built from every rank's write results.

Small saves keep one ``metadata.json`` listing every storage entry (the
in-line form). A save whose in-line metadata would be large (an estimate of
:data:`ENTRY_JSON_BYTES` per entry over :data:`AUTO_INDEX_BYTES`), or whose
writer was told ``metadata_form="indexed"``, is committed in the indexed
form of docs/format.md section 12.1: every tensor whose chunks form an even
grid (one whole chunk included) is written as its ``grid`` and the rank that
holds each chunk (a formula where one fits), and the storage entries of its
chunks go into one index file per holder rank, which the commit writes before
``metadata.json``.
"""

from __future__ import annotations

from typing import Any, Sequence

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
    "METADATA_FORMS",
    "AUTO_INDEX_BYTES",
    "ENTRY_JSON_BYTES",
    "DIGEST_JSON_BYTES",
    "check_metadata_form",
    "wants_index_form",
    "extra_digests",
    "grid_of",
    "build_indexed",
    "index_files",
    "indexed_metadata",
]

#: Values of the writers' ``metadata_form`` option.
METADATA_FORMS = ("auto", "inline", "indexed")
#: With ``metadata_form="auto"``, a save whose in-line metadata is estimated above this is indexed.
AUTO_INDEX_BYTES = 64 << 20
#: Estimated JSON bytes per storage entry and chunk box of the in-line form, its first digest included
#: (``scripts/bench_metadata.py``).
ENTRY_JSON_BYTES = 225
#: JSON bytes of each further checksum digest of an entry (16 hex digits, quotes, comma).
DIGEST_JSON_BYTES = 19


def check_metadata_form(form: object) -> str:
    """``form`` if it is one of :data:`METADATA_FORMS`. Any rank.

    Raises:
        CheckpointValueError: anything else (names the choices).
    """
    if form not in METADATA_FORMS:
        raise CheckpointValueError(f"metadata_form must be one of {', '.join(METADATA_FORMS)}; got {form!r}")
    return form  # type: ignore[return-value]


def wants_index_form(form: str, entries: int, extra_digests: int = 0) -> bool:
    """Whether a save of ``entries`` storage entries commits the indexed form. Coordinator; pure.

    ``extra_digests``: the checksum digests of those entries beyond one per entry (a chunk of many checksum
    blocks, e.g. a large tensor at one digest per MiB, weighs more in-line than the entry estimate).
    """
    if form == "auto":
        return entries * ENTRY_JSON_BYTES + extra_digests * DIGEST_JSON_BYTES > AUTO_INDEX_BYTES
    return form == "indexed"


def extra_digests(storage: Any) -> int:
    """The checksum digests of ``storage``'s entries beyond one per entry. Coordinator; pure.

    A tiled chunk's ``flat_digests`` are counted too.
    """
    return sum(len(info.checksum.digests) + len(info.checksum.flat_digests) - 1 for info in storage.values()
               if info.checksum is not None)


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
    grids: dict[str, GridChunks] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            grid = grid_of(item)
            if grid is not None:
                grids[fqn] = grid
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
