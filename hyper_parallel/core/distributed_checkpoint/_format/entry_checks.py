"""Checks of single storage entries and of byte ranges, shared by the in-line and the indexed metadata forms.

:mod:`.consistency` runs them over ``metadata.json``'s entries, :mod:`.indexed_storage`
over each rank index file as it is loaded (docs/format.md sections 6.2, 11, 12.1).
"""

from __future__ import annotations

import math

from hyper_parallel.core.distributed_checkpoint._format.checksum import ALGORITHM, expected_blocks, flat_count
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex, StorageInfo

__all__ = ["entry_of", "check_chunk_entry", "check_disjoint_bytes", "chunk_key"]


def entry_of(
    storage: dict[tuple[str, tuple[int, ...]], StorageInfo],
    fqn: str,
    offset: tuple[int, ...],
    where: str,
    claimed: set[tuple[str, tuple[int, ...]]],
    sizes: tuple[int, ...] | None = None,
) -> StorageInfo:
    """The entry of chunk ``(fqn, offset)`` in ``storage``, marked ``claimed``, its checksum fitting the chunk. Pure.

    Raises:
        CorruptCheckpointError: no entry, an unknown algorithm, a tile shape or digest count not fitting.
    """
    key = (fqn, tuple(offset))
    info = storage.get(key)
    if info is None:
        raise CorruptCheckpointError(f"{where}: the chunk at offset {list(offset)} has no storage entry")
    claimed.add(key)
    if info.checksum is not None:
        checksum = info.checksum
        if checksum.algorithm != ALGORITHM:
            raise CorruptCheckpointError(f"{where}: unknown checksum algorithm {checksum.algorithm!r}")
        if checksum.block_shape and (
            sizes is None
            or len(sizes) < 2
            or info.compression
            or len(checksum.block_shape) != len(sizes)
            or tuple(checksum.block_shape[1:-1]) != tuple(sizes[1:-1])
        ):
            raise CorruptCheckpointError(
                f"{where}: checksum tile shape {list(checksum.block_shape)} does not fit the chunk at offset "
                f"{list(offset)}"
            )
        blocks = expected_blocks(checksum, sizes, info.length)
        if len(checksum.digests) != blocks:
            raise CorruptCheckpointError(
                f"{where}: {len(checksum.digests)} checksums listed for the {blocks} block(s) of the chunk at "
                f"offset {list(offset)}"
            )
        if checksum.flat_digests and len(checksum.flat_digests) != flat_count(info.length, checksum.block_bytes):
            raise CorruptCheckpointError(
                f"{where}: {len(checksum.flat_digests)} flat_digests listed for the "
                f"{flat_count(info.length, checksum.block_bytes)} flat block(s) of the chunk at offset {list(offset)}"
            )
    return info


def check_chunk_entry(info: StorageInfo, fqn: str, offset: tuple[int, ...], sizes: tuple[int, ...], itemsize: int,
                      where: str) -> None:
    """Check one tensor chunk's storage entry: its checksum fits the chunk, its length is the chunk's. Pure.

    Raises:
        CorruptCheckpointError: the first mismatch (names ``where`` and the offset).
    """
    entry_of({(fqn, offset): info}, fqn, offset, where, set(), sizes)
    length = info.raw_length if info.compression else info.length
    if length != math.prod(sizes) * itemsize:
        raise CorruptCheckpointError(
            f"{where}: the chunk at offset {list(offset)} stores {length} bytes, but its sizes "
            f"{list(sizes)} take {math.prod(sizes) * itemsize}"
        )


def chunk_key(index: MetadataIndex | tuple[str, tuple[int, ...]]) -> tuple[str, tuple[int, ...]]:
    """The plain ``(key, offset)`` of a storage entry's ``MetadataIndex`` (or of the tuple itself). Pure."""
    if type(index) is tuple:  # pylint: disable=unidiomatic-typecheck
        return index
    return index.fqn, tuple(index.offset)  # type: ignore[union-attr]


def check_disjoint_bytes(storage: dict[MetadataIndex, StorageInfo] | dict[tuple[str, tuple[int, ...]], StorageInfo],
                         source: str) -> None:
    """No two stored items share a byte of one file (sorted per file: O(n log n)). ``storage`` keyed by
    ``MetadataIndex`` or by plain ``(key, offset)`` tuples."""
    indexes = list(storage)
    # The position breaks ties (MetadataIndex has no order): plain tuples sort in C, no key function.
    ranges = sorted(
        (info.relative_path, info.offset, info.offset + info.length, position)
        for position, info in enumerate(storage.values())
        if info.length > 0
    )
    for (path, _, end, first), (next_path, begin, _, second) in zip(ranges, ranges[1:]):
        if path == next_path and begin < end:
            first_key, first_offset = chunk_key(indexes[first])
            second_key, second_offset = chunk_key(indexes[second])
            raise CorruptCheckpointError(
                f"{source}: data file {path}: key '{second_key}' at offset {list(second_offset)} starts at byte "
                f"{begin}, inside the bytes of key '{first_key}' at offset {list(first_offset)} (up to {end}); "
                "two items never share bytes: the metadata is damaged or forged"
            )
