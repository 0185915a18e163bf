"""Which bytes of a stored chunk hold a box of it.

A chunk is stored row-major. A box inside it is a set of equally long runs of
consecutive bytes: the trailing dims the box covers fully are contiguous, the
rest repeat. Reading exactly these runs is what keeps resharded loads from
reading bytes they do not need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Runs", "box_runs", "split_box"]


@dataclass(frozen=True)
class Runs:
    """Byte runs of a box inside a chunk.

    Attributes:
        starts: Start of each run, relative to the chunk's first byte, increasing.
        length: Length of every run in bytes.
    """

    starts: np.ndarray
    length: int

    @property
    def total(self) -> int:
        """Bytes in all runs together."""
        return int(self.starts.size) * self.length


def box_runs(chunk_sizes: tuple[int, ...], itemsize: int, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Runs:
    """Return the byte runs of the box ``offsets``/``lengths`` of a row-major chunk.

    Runs come in the box's own row-major order, so run ``i`` fills bytes
    ``[i * length, (i + 1) * length)`` of the box stored contiguously.
    """
    ndim = len(chunk_sizes)
    if ndim == 0:
        return Runs(starts=np.zeros(1, dtype=np.int64), length=itemsize)
    if math.prod(lengths) == 0:
        return Runs(starts=np.zeros(0, dtype=np.int64), length=0)
    strides = [itemsize] * ndim
    for dim in range(ndim - 2, -1, -1):
        strides[dim] = strides[dim + 1] * chunk_sizes[dim + 1]
    # The last dim that the box does not fully cover; dims after it are contiguous.
    split = 0
    for dim in range(ndim - 1, -1, -1):
        if lengths[dim] != chunk_sizes[dim]:
            split = dim
            break
    length = lengths[split] * strides[split]
    starts = np.array([offsets[split] * strides[split] + sum(o * s for o, s in zip(offsets[:split], strides[:split]))],
                      dtype=np.int64)
    for dim in range(split - 1, -1, -1):
        steps = np.arange(lengths[dim], dtype=np.int64) * strides[dim]
        starts = (steps[:, None] + starts[None, :]).reshape(-1)
    return Runs(starts=starts, length=int(length))


def split_box(lengths: tuple[int, ...], itemsize: int, max_bytes: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Cut a box into sub-boxes of at most ``max_bytes`` each (one element minimum).

    The cut is along the outermost dims: sub-boxes are slabs of whole inner
    rows where possible, so each stays a few long runs.

    Returns:
        ``(offsets, lengths)`` of each sub-box, relative to the box, in row-major order.
    """
    total = math.prod(lengths) * itemsize
    if total <= max_bytes or not lengths:
        return [((0,) * len(lengths), tuple(lengths))]
    # First dim whose inner block (dims after it) fits the bound.
    dim = 0
    while dim < len(lengths) - 1 and math.prod(lengths[dim + 1 :]) * itemsize > max_bytes:
        dim += 1
    inner = math.prod(lengths[dim + 1 :]) * itemsize
    step = max(1, max_bytes // inner)
    boxes = []
    for outer in np.ndindex(*lengths[:dim]):
        for start in range(0, lengths[dim], step):
            extent = min(step, lengths[dim] - start)
            offsets = tuple(outer) + (start,) + (0,) * (len(lengths) - dim - 1)
            sizes = (1,) * dim + (extent,) + tuple(lengths[dim + 1 :])
            boxes.append((offsets, sizes))
    return boxes
