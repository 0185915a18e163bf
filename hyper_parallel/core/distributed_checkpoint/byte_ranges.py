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

__all__ = ["Runs", "box_runs"]


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
