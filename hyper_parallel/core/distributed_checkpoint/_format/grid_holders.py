"""Which rank stores each chunk of a grid tensor: a formula of the grid index, or a list.

A tensor cut by a layout into an even grid of chunks is stored one chunk per
holder rank. For the usual device-matrix layouts the holder of grid index
``idx`` is ``base + sum(idx[d] * strides[d])`` (deduplication keeps the same
replica coordinate for every chunk); where no such formula fits, the holders
are listed one per chunk in row-major order of the grid. docs/format.md
section 12.1 specifies the JSON members (``grid.splits``,
``grid.holder_base`` / ``grid.holder_strides`` or ``grid.holders``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = [
    "MAX_GRID_CHUNKS",
    "GridHolders",
    "fit_holders",
    "flat_position",
    "grid_position",
    "holders_from_json",
    "splits_from_json",
]

#: Most chunks one grid tensor may declare (larger is refused as hostile).
MAX_GRID_CHUNKS = 1 << 24


@dataclass(frozen=True, slots=True)
class GridHolders:
    """The holder rank of every chunk of one grid tensor.

    Attributes:
        splits: Chunks along each dim (each >= 1).
        base: Holder of grid index ``(0, ..., 0)`` (formula form).
        strides: Rank step per grid step along each dim (formula form; empty in the list form).
        ranks: Holder of each chunk in row-major grid order (list form; empty in the formula form).
    """

    splits: tuple[int, ...]
    base: int = 0
    strides: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()

    def holder(self, position: Sequence[int]) -> int:
        """The rank holding the chunk at grid index ``position``. Any rank; pure."""
        if self.ranks:
            return self.ranks[flat_position(position, self.splits)]
        return self.base + sum(i * s for i, s in zip(position, self.strides))

    def rank_range(self) -> tuple[int, int]:
        """Smallest and largest holder rank. Any rank; pure."""
        if self.ranks:
            return min(self.ranks), max(self.ranks)
        low = high = self.base
        for count, stride in zip(self.splits, self.strides):
            reach = (count - 1) * stride
            low, high = low + min(0, reach), high + max(0, reach)
        return low, high

    def to_json(self) -> dict[str, Any]:
        """The members of the ``grid`` object beside ``splits``."""
        if self.ranks:
            return {"holders": list(self.ranks)}
        return {"holder_base": self.base, "holder_strides": list(self.strides)}


def flat_position(position: Sequence[int], splits: Sequence[int]) -> int:
    """The row-major number of grid index ``position`` in a grid of ``splits``. Pure."""
    flat = 0
    for index, count in zip(position, splits):
        flat = flat * count + index
    return flat


def grid_position(offsets: Sequence[int], chunk_sizes: Sequence[int], splits: Sequence[int]) -> tuple[int, ...] | None:
    """The grid index of the chunk starting at ``offsets``; ``None`` if no chunk starts there. Pure."""
    if len(offsets) != len(chunk_sizes):
        return None
    position = []
    for offset, size, count in zip(offsets, chunk_sizes, splits):
        index, rest = divmod(offset, size)
        if rest or not 0 <= index < count:
            return None
        position.append(index)
    return tuple(position)


def fit_holders(splits: Sequence[int], ranks: Sequence[int]) -> GridHolders:
    """The formula of ``ranks`` (holders in row-major grid order) if one fits, else the list. Coordinator; pure."""
    splits = tuple(int(s) for s in splits)
    grid = np.asarray(ranks, dtype=np.int64).reshape(splits) if splits else np.asarray(ranks, dtype=np.int64)
    base = int(grid.flat[0])
    strides = []
    for dim, count in enumerate(splits):
        unit = [0] * len(splits)
        unit[dim] = 1 if count > 1 else 0
        strides.append(int(grid[tuple(unit)]) - base if count > 1 else 0)
    expected = np.full(splits, base, dtype=np.int64)
    for dim, stride in enumerate(strides):
        shape = [1] * len(splits)
        shape[dim] = splits[dim]
        expected = expected + (np.arange(splits[dim], dtype=np.int64) * stride).reshape(shape)
    if np.array_equal(expected, grid):
        return GridHolders(splits=splits, base=base, strides=tuple(strides))
    return GridHolders(splits=splits, ranks=tuple(int(r) for r in grid.ravel()))


def holders_from_json(raw: dict, splits: tuple[int, ...], world_size: int, where: str) -> GridHolders:
    """Decode and check the holder members of a ``grid`` object. Any rank; pure.

    Raises:
        CorruptCheckpointError: a member of the wrong type, or a holder outside ``0 .. world_size - 1``.
    """
    if "holders" in raw:
        ranks = raw["holders"]
        # pylint: disable-next=unidiomatic-typecheck
        if type(ranks) is not list or len(ranks) != math.prod(splits) or not all(
                type(r) is int for r in ranks):  # pylint: disable=unidiomatic-typecheck
            raise CorruptCheckpointError(f"{where}: grid.holders must list one rank per chunk ({math.prod(splits)})")
        holders = GridHolders(splits=splits, ranks=tuple(ranks))
    else:
        base, strides = raw.get("holder_base"), raw.get("holder_strides")
        # pylint: disable-next=unidiomatic-typecheck
        if (type(base) is not int or type(strides) is not list or len(strides) != len(splits)
                or not all(type(s) is int for s in strides)):  # pylint: disable=unidiomatic-typecheck
            raise CorruptCheckpointError(
                f"{where}: grid needs holder_base (an integer) and holder_strides (one integer per dim), or holders")
        holders = GridHolders(splits=splits, base=base, strides=tuple(strides))
    low, high = holders.rank_range()
    if low < 0 or high >= world_size:
        raise CorruptCheckpointError(
            f"{where}: grid holders reach rank {low if low < 0 else high}, outside the save's {world_size} ranks")
    return holders


def splits_from_json(raw: Any, size: tuple[int, ...], where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``grid.splits`` checked against the tensor's ``size``: (splits, chunk sizes). Any rank; pure.

    Raises:
        CorruptCheckpointError: not one positive integer per dim dividing it.
        UnsafeCheckpointError: more chunks than :data:`MAX_GRID_CHUNKS`.
    """
    splits = raw.get("splits") if type(raw) is dict else None  # pylint: disable=unidiomatic-typecheck
    if type(splits) is not list or len(splits) != len(size) or not all(  # pylint: disable=unidiomatic-typecheck
            type(s) is int and s >= 1 for s in splits):  # pylint: disable=unidiomatic-typecheck
        raise CorruptCheckpointError(f"{where}: grid.splits must be one integer >= 1 per dim of {list(size)}")
    if math.prod(splits) > MAX_GRID_CHUNKS:
        raise UnsafeCheckpointError(
            f"{where}: grid of {math.prod(splits):,} chunks is over the limit of {MAX_GRID_CHUNKS:,}; refused")
    if any(full % count for full, count in zip(size, splits)):
        raise CorruptCheckpointError(f"{where}: grid.splits {splits} do not divide the shape {list(size)} evenly")
    if any(full == 0 for full in size):
        raise CorruptCheckpointError(f"{where}: a grid tensor cannot have an empty dim ({list(size)})")
    return tuple(splits), tuple(full // count for full, count in zip(size, splits))
