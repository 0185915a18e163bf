"""Finding the stored chunks of a tensor that a box overlaps, without scanning them all.

A tensor saved by N ranks has N chunks; a rank loading its own piece needs
a few of them. The coordinator's merge lists a tensor's chunks sorted by
their offsets (row-major order of the offset tuples), so the chunks sharing
the leading offsets form consecutive runs: :func:`overlapping_chunks` narrows
dim by dim with binary searches and touches only the chunks in the bands the
box crosses, about log N steps per band instead of N.

A found set is used only when the overlaps it yields add up to the whole
box (the chunks of a valid checkpoint tile the tensor without overlapping):
for chunks not sorted that way (metadata written by hand, or irregular
tilings where a tall chunk starts above the box's band) the search falls
back to every chunk, so it never misses one. The chunks of an even grid
(:class:`.GridChunks`) are found by division per dim, without any search.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from itertools import product
from typing import Sequence

from hyper_parallel.core.distributed_checkpoint._grid_chunks import GridChunks
from hyper_parallel.core.distributed_checkpoint.metadata import ChunkStorageMetadata

__all__ = ["SEARCH_FROM_CHUNKS", "overlapping_chunks"]

#: Tensors with fewer chunks are scanned (a search costs more than a short scan).
SEARCH_FROM_CHUNKS = 16


def _overlap_volume(chunk: ChunkStorageMetadata, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    volume = 1
    for a, s, b, t in zip(offsets, sizes, chunk.offsets, chunk.sizes):
        extent = min(a + s, b + t) - max(a, b)
        if extent <= 0:
            return 0
        volume *= extent
    return volume


def _search(chunks: Sequence[ChunkStorageMetadata], lo: int, hi: int, dim: int, offsets: tuple[int, ...],
            sizes: tuple[int, ...], out: list[ChunkStorageMetadata]) -> None:
    """Collect the chunks of ``chunks[lo:hi]`` (equal offsets before ``dim``) whose band may overlap the box."""
    if dim == len(offsets):
        out.extend(chunks[lo:hi])
        return

    def key(chunk: ChunkStorageMetadata) -> int:
        return chunk.offsets[dim]

    # The band that starts at or before the box's start may reach into it; later bands up to its end do.
    first = bisect_right(chunks, offsets[dim], lo, hi, key=key) - 1
    start = bisect_left(chunks, key(chunks[first]), lo, hi, key=key) if first >= lo else lo
    end = bisect_left(chunks, offsets[dim] + sizes[dim], start, hi, key=key)
    position = start
    while position < end:
        band_end = bisect_right(chunks, key(chunks[position]), position, end, key=key)
        _search(chunks, position, band_end, dim + 1, offsets, sizes, out)
        position = band_end


def _grid_overlaps(grid: GridChunks, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[ChunkStorageMetadata]:
    """The chunks of an even grid that the box overlaps: per dim, a range of grid indexes by division."""
    ranges = []
    for offset, size, chunk, count in zip(offsets, sizes, grid.chunk_sizes, grid.splits):
        first, last = offset // chunk, min(count, -(-(offset + size) // chunk))
        ranges.append(range(max(0, first), last))
    return [ChunkStorageMetadata(tuple(i * c for i, c in zip(position, grid.chunk_sizes)), grid.chunk_sizes)
            for position in product(*ranges)]


def overlapping_chunks(
    chunks: Sequence[ChunkStorageMetadata], offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> Sequence[ChunkStorageMetadata]:
    """Chunks that may overlap the box ``offsets``/``sizes``: a few found by search, or all of them.

    The caller still intersects each chunk with the box.
    """
    if isinstance(chunks, GridChunks) and offsets and math.prod(sizes):
        return _grid_overlaps(chunks, tuple(offsets), tuple(sizes))
    if len(chunks) < SEARCH_FROM_CHUNKS or not offsets or math.prod(sizes) == 0:
        return chunks
    found: list[ChunkStorageMetadata] = []
    _search(chunks, 0, len(chunks), 0, tuple(offsets), tuple(sizes), found)
    if sum(_overlap_volume(chunk, offsets, sizes) for chunk in found) != math.prod(sizes):
        return chunks  # not sorted as the writer sorts, or an irregular tiling: scan them all
    return found
