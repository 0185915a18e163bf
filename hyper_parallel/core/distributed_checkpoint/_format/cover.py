"""The rule every stored tensor obeys: its chunks tile its global shape exactly.

Each chunk lies inside the global shape, no two chunks overlap, and together
they cover every element (docs/format.md, "Chunks"). The coordinator checks it
when it builds the metadata, the reader when it opens one, ``hp-ckpt verify``
when it audits one.
"""

from __future__ import annotations

import math
from typing import Iterable

from hyper_parallel.core.distributed_checkpoint.metadata import ChunkStorageMetadata

__all__ = ["check_exact_cover", "MAX_REPORTED_PROBLEMS"]

#: At most this many problems are spelled out in one validation error.
MAX_REPORTED_PROBLEMS = 50


def check_exact_cover(
    fqn: str, size: tuple[int, ...], chunks: Iterable[ChunkStorageMetadata]
) -> list[str]:
    """Check that ``chunks`` lie inside ``size`` and tile it with no overlap.

    A chunk set that forms a grid is checked in linear time; anything else
    falls back to a sweep over pairs that share a first-dim interval.

    Returns:
        A message per problem (empty when the cover is exact).
    """
    chunks = list(chunks)
    problems: list[str] = []
    total = math.prod(size)
    for chunk in chunks:
        if len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size):
            problems.append(f"'{fqn}': chunk at {chunk.offsets} has rank {len(chunk.sizes)}, tensor has {len(size)}")
            continue
        for dim, (off, ext, full) in enumerate(zip(chunk.offsets, chunk.sizes, size)):
            if off < 0 or ext < 0 or off + ext > full:
                problems.append(
                    f"'{fqn}': chunk at {chunk.offsets} with sizes {chunk.sizes} leaves the global shape "
                    f"{size} in dim {dim}"
                )
                break
    if problems:
        return problems
    volume = sum(math.prod(chunk.sizes) for chunk in chunks)
    if not size:
        return [] if len(chunks) == 1 else [f"'{fqn}': scalar stored {len(chunks)} times"]
    if _is_grid(size, chunks):
        return []
    overlaps = _find_overlaps(chunks)
    for first, second in overlaps[:MAX_REPORTED_PROBLEMS]:
        problems.append(
            f"'{fqn}': shards at offsets {first.offsets} (sizes {first.sizes}) and {second.offsets} "
            f"(sizes {second.sizes}) overlap"
        )
    if not overlaps and volume != total:
        problems.append(
            f"'{fqn}': the saved shards cover {volume} of {total} elements of global shape {size}; "
            "some part of the tensor is held by no rank"
        )
    return problems


def _is_grid(size: tuple[int, ...], chunks: list[ChunkStorageMetadata]) -> bool:
    bounds = []
    for dim, full in enumerate(size):
        cuts = sorted({c.offsets[dim] for c in chunks} | {c.offsets[dim] + c.sizes[dim] for c in chunks})
        if cuts[0] != 0 or cuts[-1] != full:
            return False
        bounds.append({cut: position for position, cut in enumerate(cuts)})
    cells = math.prod(len(b) - 1 for b in bounds)
    if cells != len(chunks):
        return False
    seen = set()
    for chunk in chunks:
        key = []
        for dim, table in enumerate(bounds):
            start = table[chunk.offsets[dim]]
            if table[chunk.offsets[dim] + chunk.sizes[dim]] != start + 1:
                return False
            key.append(start)
        seen.add(tuple(key))
    return len(seen) == len(chunks)


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_
        for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    ) and all(s > 0 for s in a.sizes + b.sizes)


def _find_overlaps(chunks: list[ChunkStorageMetadata]) -> list[tuple[ChunkStorageMetadata, ChunkStorageMetadata]]:
    ordered = sorted(chunks, key=lambda c: c.offsets[0])
    found = []
    active: list[ChunkStorageMetadata] = []
    for chunk in ordered:
        active = [a for a in active if a.offsets[0] + a.sizes[0] > chunk.offsets[0]]
        found.extend((a, chunk) for a in active if _overlap(a, chunk))
        active.append(chunk)
    return found
