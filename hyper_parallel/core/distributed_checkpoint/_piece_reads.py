"""The reads of one target piece: its overlap with each stored chunk, and when a piece is read whole.

Pure helpers of :class:`.StandardLoadPlanner`'s ``build_local_plan`` (all ranks): no file access, no
communication, nothing kept.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from hyper_parallel.core.distributed_checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, ReadItem
from hyper_parallel.core.distributed_checkpoint._chunk_search import overlapping_chunks
from hyper_parallel.core.distributed_checkpoint._state_items import TensorEntry, TensorPiece
from hyper_parallel.platform.dtypes import numpy_dtype

__all__ = ["fitted", "local_shape", "overlap_reads", "whole_dtype"]


def fitted(array: np.ndarray, entry: TensorEntry) -> np.ndarray:
    """A target's array in its local shape (a flat-range target keeps its flat array)."""
    if entry.pieces[0].flat_start is None and tuple(array.shape) != entry.local_shape:
        return array.reshape(entry.local_shape)
    return array


def local_shape(entry: TensorEntry) -> tuple[int, ...] | None:
    """The shape of a plain tensor leaf's tensor, read when its entry was made; ``None`` for other leaves.

    (A plain tensor or array leaf is the entry that may be replicated and has no layout; a DTensor has a
    layout, a ``ShardedTensor`` is never marked replicated.)
    """
    return entry.local_shape if entry.may_be_replicated and entry.layout is None else None


def whole_dtype(pieces: tuple[TensorPiece, ...], stored: TensorStorageMetadata) -> np.dtype | None:
    """The stored numpy dtype when a target of ``pieces`` reads ``stored`` whole: one box, not a flat range, stored
    as one chunk of exactly that box, not empty; else ``None``. Pure."""
    if len(pieces) != 1 or len(stored.chunks) != 1:
        return None
    piece, chunk = pieces[0], stored.chunks[0]
    if piece.flat_start is not None or chunk.offsets != piece.offsets or chunk.sizes != piece.sizes or not math.prod(
            piece.sizes):
        return None
    return numpy_dtype(stored.properties.dtype)


def overlap_reads(fqn: str, piece: TensorPiece, position: int,
                  chunks: Sequence[ChunkStorageMetadata]) -> list[ReadItem]:
    """One read item for each non-empty overlap of ``piece`` (the ``position``-th piece of key ``fqn``'s target)
    with a stored chunk; none for an empty piece. Pure."""
    reads = []
    dest = MetadataIndex(fqn, piece.offsets, index=position)
    for chunk in overlapping_chunks(chunks, piece.offsets, piece.sizes):
        lo = tuple(max(a, b) for a, b in zip(piece.offsets, chunk.offsets))
        hi = tuple(
            min(a + s, b + t) for a, s, b, t in zip(piece.offsets, piece.sizes, chunk.offsets, chunk.sizes)
        )
        if math.prod(piece.sizes) == 0 or any(h <= l for l, h in zip(lo, hi)):
            continue
        reads.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=dest,
                dest_offsets=tuple(l - p for l, p in zip(lo, piece.offsets)),
                storage_index=MetadataIndex(fqn, chunk.offsets),
                storage_offsets=tuple(l - c for l, c in zip(lo, chunk.offsets)),
                lengths=tuple(h - l for l, h in zip(lo, hi)),
            )
        )
    return reads
