"""The chunks of a tensor split evenly over a grid, described once.

A tensor sharded over N ranks by a layout has N chunks, all of one shape,
at the offsets of a regular grid. The coordinator's merge describes such a
tensor by its grid instead of building N chunk objects:
:class:`GridChunks` is an immutable sequence of :class:`.ChunkStorageMetadata`
in row-major order of their offsets (the order the merge sorts chunks in),
made on access. It equals the tuple of the same chunks, pickles as its grid
(so metadata sent to every rank stays small), and writes the same JSON.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence, overload

from hyper_parallel.core.distributed_checkpoint.metadata import ChunkStorageMetadata

__all__ = ["GridChunks"]


class GridChunks(Sequence[ChunkStorageMetadata]):
    """The chunks of a tensor of shape ``size`` cut into boxes of ``chunk_sizes``.

    Args:
        size: Global shape; each dim a multiple of its chunk size.
        chunk_sizes: Shape of every chunk (each dim > 0).

    Raises:
        ValueError: A chunk size that is not positive or does not divide its dim.
    """

    __slots__ = ("size", "chunk_sizes", "splits", "_chunks")

    def __init__(self, size: Sequence[int], chunk_sizes: Sequence[int]) -> None:
        self.size = tuple(int(s) for s in size)
        self.chunk_sizes = tuple(int(s) for s in chunk_sizes)
        if len(self.size) != len(self.chunk_sizes) or any(
            c <= 0 or s % c for s, c in zip(self.size, self.chunk_sizes)
        ):
            raise ValueError(f"chunk sizes {self.chunk_sizes} do not split the shape {self.size} evenly")
        self.splits = tuple(s // c for s, c in zip(self.size, self.chunk_sizes))
        self._chunks: tuple[ChunkStorageMetadata, ...] | None = None

    def __len__(self) -> int:
        return math.prod(self.splits)

    def _chunk(self, flat: int) -> ChunkStorageMetadata:
        offsets = [0] * len(self.splits)
        for dim in range(len(self.splits) - 1, -1, -1):
            flat, index = divmod(flat, self.splits[dim])
            offsets[dim] = index * self.chunk_sizes[dim]
        return ChunkStorageMetadata(offsets=tuple(offsets), sizes=self.chunk_sizes)

    def materialize(self) -> tuple[ChunkStorageMetadata, ...]:
        """Every chunk as a tuple (built once, then kept)."""
        if self._chunks is None:
            self._chunks = tuple(self._chunk(flat) for flat in range(len(self)))
        return self._chunks

    @overload
    def __getitem__(self, index: int) -> ChunkStorageMetadata: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[ChunkStorageMetadata, ...]: ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.materialize()[index]
        if self._chunks is not None:
            return self._chunks[index]
        count = len(self)
        position = int(index) + count if int(index) < 0 else int(index)
        if not 0 <= position < count:
            raise IndexError(f"chunk {index} out of range for {count} chunks")
        return self._chunk(position)

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        return iter(self.materialize())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GridChunks):
            return self.size == other.size and self.chunk_sizes == other.chunk_sizes
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and self.materialize() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.materialize())

    def __reduce__(self) -> tuple[Any, ...]:
        return (GridChunks, (self.size, self.chunk_sizes))

    def __repr__(self) -> str:
        return f"GridChunks(size={self.size}, chunk_sizes={self.chunk_sizes})"
