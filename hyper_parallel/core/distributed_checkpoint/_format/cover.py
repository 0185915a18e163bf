"""The rule every stored tensor obeys: its chunks tile its global shape exactly.

Each chunk lies inside the global shape, no two chunks overlap, and together
they cover every element (docs/format.md, "Chunks"). The coordinator checks it
when it builds the metadata, the reader when it opens one, ``hp-ckpt verify``
when it audits one.
"""

from __future__ import annotations

import bisect
import math
from typing import Iterable

from hyper_parallel.core.distributed_checkpoint.metadata import ChunkStorageMetadata

__all__ = ["check_exact_cover", "MAX_REPORTED_PROBLEMS", "MAX_PAIR_CHECKS"]

#: At most this many problems are spelled out in one validation error.
MAX_REPORTED_PROBLEMS = 50


def check_exact_cover(
    fqn: str, size: tuple[int, ...], chunks: Iterable[ChunkStorageMetadata]
) -> list[str]:
    """Check that ``chunks`` lie inside ``size`` and tile it with no overlap.

    A chunk set that forms a grid is checked in linear time; anything else
    by a sweep, O(n log n) when the chunks differ in at most two dims (see
    :func:`_find_overlaps`).

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
    if overlaps is None:
        return [
            f"'{fqn}': {len(chunks)} chunks form a layout too irregular (in 3 or more dims) to check for "
            f"overlaps within {MAX_PAIR_CHECKS} comparisons; refused"
        ]
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


Pair = tuple[ChunkStorageMetadata, ChunkStorageMetadata]
#: Most chunk-pair comparisons the overlap check spends on a layout irregular in 3 or more dims.
MAX_PAIR_CHECKS = 1_000_000


def _find_overlaps(chunks: list[ChunkStorageMetadata]) -> list[Pair] | None:
    """Pairs of overlapping chunks (at most :data:`MAX_REPORTED_PROBLEMS`); ``None``: too irregular to check.

    Dims that every chunk spans the same way are dropped first. With at most
    two dims left this is a sweep along the first (ends before starts) over
    the sorted, disjoint intervals the active chunks hold in the second: a new
    chunk is compared with its two neighbours only, O(n log n) in all. With
    more dims left a new chunk is compared with every active chunk that starts
    before it ends in the second dim, within :data:`MAX_PAIR_CHECKS`
    comparisons in all.
    """
    chunks = [c for c in chunks if all(s > 0 for s in c.sizes)]  # empty chunks overlap nothing
    if len(chunks) < 2:
        return []
    varying = [d for d in range(len(chunks[0].sizes)) if len({(c.offsets[d], c.sizes[d]) for c in chunks}) > 1]
    if not varying:  # every chunk is the same box
        return [(chunks[0], chunks[1])]
    first = varying[0]
    second = varying[1] if len(varying) > 1 else None
    few_dims = len(varying) <= 2

    def span(position: int) -> tuple[int, int]:
        if second is None:
            return 0, 1
        return chunks[position].offsets[second], chunks[position].offsets[second] + chunks[position].sizes[second]

    events = []
    for position, chunk in enumerate(chunks):
        events.append((chunk.offsets[first] + chunk.sizes[first], 0, position))  # ends sort before starts
        events.append((chunk.offsets[first], 1, position))
    events.sort()
    starts: list[tuple[int, int]] = []  # (start in `second`, chunk position) of the active chunks, sorted
    active: set[int] = set()
    found: list[Pair] = []
    budget = MAX_PAIR_CHECKS
    for _, is_start, position in events:
        if not is_start:
            if position in active:
                active.discard(position)
                del starts[bisect.bisect_left(starts, (span(position)[0], position))]
            continue
        low, high = span(position)
        index = bisect.bisect_left(starts, (low, position))
        if few_dims:  # the active intervals are disjoint: only the neighbours can meet this one
            neighbours = [starts[i][1] for i in (index - 1, index) if 0 <= i < len(starts)]
            clash = [o for o in neighbours if span(o)[1] > low and span(o)[0] < high]
        else:
            candidates = starts[: bisect.bisect_left(starts, (high, -1))]
            budget -= len(candidates)
            if budget < 0:
                return None
            clash = [o for _, o in candidates if _overlap(chunks[o], chunks[position])]
        if clash:
            found.extend((chunks[other], chunks[position]) for other in clash)
            if len(found) >= MAX_REPORTED_PROBLEMS:
                break
            continue  # not made active, so the active chunks stay disjoint
        starts.insert(index, (low, position))
        active.add(position)
    return found[:MAX_REPORTED_PROBLEMS]
