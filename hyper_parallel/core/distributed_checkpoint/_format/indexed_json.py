"""The JSON members of the indexed metadata form (format 2.1): ``grid`` tensors and ``rank_indexes``.

:mod:`.metadata_json` calls these for a tensor item with a ``grid`` member and
for a document listing ``rank_indexes``; the result is an
:class:`.IndexedStorage` as the metadata's ``storage_data``. docs/format.md
section 12.1 specifies the members.
"""

from __future__ import annotations

from typing import Any, Callable

from hyper_parallel.core.distributed_checkpoint._format.grid_holders import (
    GridHolders,
    holders_from_json,
    splits_from_json,
)
from hyper_parallel.core.distributed_checkpoint._format.indexed_storage import IndexedStorage
from hyper_parallel.core.distributed_checkpoint._format.rank_index import records_from_json, records_to_json
from hyper_parallel.core.distributed_checkpoint._grid_chunks import GridChunks
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import (
    MetadataIndex,
    StorageInfo,
    StorageMeta,
    TensorStorageMetadata,
)

__all__ = ["grid_item_to_json", "grid_item_from_json", "grid_members", "indexed_parts", "indexed_storage_from_json"]


class _GridsKey:
    """The key of the raw ``grid`` objects in a decode's table of shared values (no string or tuple equals it)."""


_GRIDS = _GridsKey()


def indexed_parts(storage: Any) -> tuple[dict[str, tuple[TensorStorageMetadata, GridHolders]],
                                         dict[MetadataIndex, StorageInfo], list[dict[str, Any]]] | None:
    """For an indexed ``storage_data``: its grids, its in-line entries and its ``rank_indexes``; else ``None``."""
    if not isinstance(storage, IndexedStorage):
        return None
    return storage.grids, storage.inline, records_to_json(storage.records[r] for r in sorted(storage.records))


def grid_item_to_json(item: TensorStorageMetadata, holders: GridHolders) -> dict[str, Any]:
    """A grid tensor's ``state_dict_metadata`` member."""
    return {
        "kind": "tensor",
        "dtype": item.properties.dtype,
        "size": list(item.size),
        "grid": {"splits": list(holders.splits), **holders.to_json()},
    }


def grid_item_from_json(fqn: str, raw: dict, where: str, shared: dict,
                        tensor_entry: Callable[[str, dict, str, dict], TensorStorageMetadata]) -> TensorStorageMetadata:
    """Decode and check a tensor member with ``grid`` (its holders are checked by :func:`indexed_storage_from_json`).

    Raises:
        CorruptCheckpointError / UnsafeCheckpointError: a bad dtype or size (``tensor_entry``'s checks), ``chunks``
            beside ``grid``, splits that do not divide the size, too many chunks.
    """
    if "chunks" in raw:
        raise CorruptCheckpointError(f"{where}: a tensor has either chunks or grid, not both")
    plain = tensor_entry(fqn, {"dtype": raw.get("dtype"), "size": raw.get("size"), "chunks": []}, where, shared)
    grid = raw["grid"]
    _, chunk_sizes = splits_from_json(grid, plain.size, where)
    shared.setdefault(_GRIDS, {})[fqn] = grid
    return TensorStorageMetadata(plain.properties, plain.size, GridChunks(plain.size, chunk_sizes))


def grid_members(shared: dict) -> dict[str, dict]:
    """The raw ``grid`` objects a decode met, by key."""
    return shared.get(_GRIDS, {})


def indexed_storage_from_json(items: dict[str, Any], inline: dict[MetadataIndex, StorageInfo],
                              raw_grids: dict[str, dict], raw_records: Any, *, meta: StorageMeta,
                              source: str) -> IndexedStorage:
    """The lazy ``storage_data`` of an indexed checkpoint (an :class:`.IndexedStorage`).

    Raises:
        CorruptCheckpointError: holders outside the world, ``rank_indexes`` missing or malformed, an in-line entry
            of a grid tensor.
    """
    if raw_records is None:
        raise CorruptCheckpointError(f"{source}: grid tensors are listed but rank_indexes is missing")
    records = records_from_json(raw_records, save_id=meta.save_id, world_size=meta.world_size, source=source)
    grids = {}
    for fqn, grid in raw_grids.items():
        item = items[fqn]
        grids[fqn] = (item, holders_from_json(grid, tuple(grid["splits"]), meta.world_size, f"{source}: key '{fqn}'"))
    for index in inline:
        if index.fqn in grids:
            raise CorruptCheckpointError(
                f"{source}: storage_data lists key '{index.fqn}', a grid tensor whose entries are in rank indexes")
    return IndexedStorage(inline=inline, grids=grids, records=records, save_id=meta.save_id, source=source)
