"""Cross-checks of decoded metadata: its items and storage entries match one to one.

:func:`check_consistency` runs after :func:`.metadata_json.metadata_from_json`
(which checks each field on its own) and before any load plan is made. The
rules are those of docs/format.md ("Consistency").
"""

from __future__ import annotations

import math
from typing import Any

from hyper_parallel.core.distributed_checkpoint._format.checksum import ALGORITHM
from hyper_parallel.core.distributed_checkpoint._format.cover import check_exact_cover
from hyper_parallel.core.distributed_checkpoint._format.deferred_storage import DecodedMetadata
from hyper_parallel.core.distributed_checkpoint._format.entry_checks import (
    check_disjoint_bytes,
    chunk_key,
    entry_of as _entry_of,
)
from hyper_parallel.core.distributed_checkpoint._format.indexed_storage import IndexedStorage
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
)
from hyper_parallel.platform.dtypes import DTYPE_NAMES

__all__ = ["check_consistency", "storage_by_key"]


_UNSEEN = object()


def _whole_chunk(item: TensorStorageMetadata | BytesStorageMetadata) -> tuple[tuple[int, ...], int] | None:
    """For a tensor stored as one whole chunk of a known dtype: its chunk's offsets and byte length; else ``None``."""
    if type(item) is not TensorStorageMetadata or len(item.chunks) != 1:  # pylint: disable=unidiomatic-typecheck
        return None
    chunk = item.chunks[0]
    itemsize = DTYPE_NAMES.get(item.properties.dtype)
    if itemsize is None or chunk.sizes != item.size:
        return None
    return tuple(chunk.offsets), math.prod(chunk.sizes) * itemsize


def storage_by_key(metadata: Metadata) -> dict[tuple[str, tuple[int, ...]], StorageInfo]:
    """``metadata.storage_data`` keyed by plain ``(key, offset)`` tuples (hashing and comparing them is C, a
    :class:`MetadataIndex`'s is Python); for an indexed checkpoint a lazy view with ``get``. Any rank; pure."""
    keyed = metadata.pending_by_key() if isinstance(metadata, DecodedMetadata) else None
    if keyed is not None:  # decoded, its records not asked for: no MetadataIndex made
        return keyed
    if isinstance(metadata.storage_data, IndexedStorage):
        return metadata.storage_data.by_key()  # type: ignore[union-attr,return-value]
    return {(index.fqn, tuple(index.offset)): info for index, info in (metadata.storage_data or {}).items()}


def check_consistency(
    metadata: Metadata,
    *,
    source: str = "metadata",
    by_key: dict[tuple[str, tuple[int, ...]], StorageInfo] | None = None,
    whole: dict[str, tuple[tuple[int, ...], StorageInfo, TensorStorageMetadata]] | None = None,
) -> None:
    """Check that the items and the storage entries of ``metadata`` match one to one.

    Every tensor chunk and every stored value has a storage entry (a chunk's of
    exactly its byte length, with a known checksum algorithm and one digest
    per block), every storage entry belongs to an item, and the chunks of each
    tensor tile its global shape, and no two items share a byte of a data
    file. Loading runs this before planning, so a damaged or hand-made file
    can neither leave part of a target unread nor read one item's bytes into
    another. O(n log n) in the number of entries (see ``check_exact_cover``).

    Args:
        by_key: :func:`storage_by_key` of ``metadata``, when the caller has it already.
        whole: Filled, when given, for every key stored as one whole uncompressed chunk of a known dtype with
            flat checksum blocks (or none), its length checked: ``key -> (chunk offsets, its storage entry,
            the key's item)``. A load looks those facts up by key.

    Raises:
        CorruptCheckpointError: the first mismatch found (names ``source`` and the key).
    """
    if by_key is None:
        by_key = storage_by_key(metadata)
    keyed = metadata.pending_by_key() if isinstance(metadata, DecodedMetadata) else None
    # Decoded and its records not asked for: its entries are those of by_key, each key once (the decoder checked).
    storage: Any = keyed if keyed is not None and by_key is keyed else metadata.storage_data or {}
    grids: dict = {}
    # Grid tensors tile by construction; their entries are checked as their index loads.
    if isinstance(storage, IndexedStorage):
        grids, storage = storage.grids, storage.inline  # type: ignore[union-attr]
    claimed: set[tuple[str, tuple[int, ...]]] = set()
    facts_of: dict[int, tuple[tuple[int, ...], int] | None] = {}  # id(record) -> _whole_chunk (records are shared)
    for fqn, item in metadata.state_dict_metadata.items():
        if fqn in grids:
            continue
        facts = facts_of.get(id(item), _UNSEEN)
        if facts is _UNSEEN:
            facts = facts_of[id(item)] = _whole_chunk(item)
        if facts is not None:
            # Most keys: one whole uncompressed chunk, flat checksum blocks. Anything else (or any doubt)
            # takes the full checks below and their messages. The digest count is checksum.expected_blocks'
            # for flat blocks, inlined (a call costs 13% of this loop).
            key = (fqn, facts[0])
            info = by_key.get(key)
            checksum = info.checksum if info is not None else None
            if (info is not None and not info.compression and info.length == facts[1]
                    and (checksum is None or (
                        checksum.algorithm == ALGORITHM and not checksum.block_shape
                        and len(checksum.digests) == max(1, -(-info.length // checksum.block_bytes))))):
                claimed.add(key)
                if whole is not None:
                    whole[fqn] = (facts[0], info, item)
                continue
        where = f"{source}: key '{fqn}'"
        if not isinstance(item, TensorStorageMetadata):
            for offset in item.shard_offsets:
                _entry_of(by_key, fqn, offset, where, claimed)
            continue
        itemsize = DTYPE_NAMES.get(item.properties.dtype)
        if itemsize is None:
            raise CorruptCheckpointError(f"{where}: unknown dtype {item.properties.dtype!r}")
        for chunk in item.chunks:
            info = _entry_of(by_key, fqn, chunk.offsets, where, claimed, tuple(chunk.sizes))
            length = info.raw_length if info.compression else info.length
            if length != math.prod(chunk.sizes) * itemsize:
                raise CorruptCheckpointError(
                    f"{where}: the chunk at offset {list(chunk.offsets)} stores {length} bytes, but its sizes "
                    f"{list(chunk.sizes)} of {item.properties.dtype} take {math.prod(chunk.sizes) * itemsize}"
                )
        one_chunk = len(item.chunks) == 1 and item.chunks[0].sizes == item.size  # (chunks lie inside size)
        problems = [] if one_chunk else check_exact_cover(fqn, tuple(item.size), item.chunks)
        if problems:
            raise CorruptCheckpointError(f"{where}: the stored chunks do not tile the tensor: {problems[0]}")
    if len(claimed) != len(storage):
        orphan = next((key for key in map(chunk_key, storage) if key not in claimed), None)
        if orphan is None:  # two entries of one chunk (an offset given as a list and as a tuple)
            raise CorruptCheckpointError(f"{source}: storage_data lists a chunk twice")
        raise CorruptCheckpointError(
            f"{source}: storage entry of key '{orphan[0]}' at offset {list(orphan[1])} belongs to no item"
        )
    check_disjoint_bytes(storage, source)
