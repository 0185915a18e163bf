"""A rank's load planning finds the chunks it needs by search, not by scanning every chunk."""

from __future__ import annotations

import itertools

import mindspore as ms
import numpy as np

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint._chunk_search import overlapping_chunks
from hyper_parallel.core.distributed_checkpoint.metadata import ChunkStorageMetadata as Chunk
from sim_ranks import simulate_save


def _grid(rows: int, cols: int, height: int, width: int) -> list[Chunk]:
    """Chunks of a (rows*height, cols*width) tensor cut by hand, sorted as the writer sorts them."""
    return [Chunk((r * height, c * width), (height, width)) for r, c in itertools.product(range(rows), range(cols))]


def _brute(chunks, offsets, sizes):
    return [c for c in chunks
            if all(min(a + s, b + t) > max(a, b) for a, s, b, t in zip(offsets, sizes, c.offsets, c.sizes))]


class _Counting(list):
    """A chunk list that counts how many of its chunks are looked at."""

    touched = 0

    def __getitem__(self, index):
        value = super().__getitem__(index)
        _Counting.touched += len(value) if isinstance(index, slice) else 1
        return value


def test_row_column_and_grid_boxes_find_exactly_the_overlapping_chunks():
    for rows, cols in ((64, 1), (1, 64), (16, 16)):
        chunks = _grid(rows, cols, 8, 8)
        for offsets, sizes in (((0, 0), (8, 8)), ((13, 5), (20, 30)), ((0, 0), (rows * 8, cols * 8)),
                               ((rows * 8 - 1, cols * 8 - 1), (1, 1))):
            sizes = tuple(min(s, full - o) for o, s, full in zip(offsets, sizes, (rows * 8, cols * 8)))
            found = overlapping_chunks(chunks, offsets, sizes)
            assert _brute(found, offsets, sizes) == _brute(chunks, offsets, sizes)


def test_search_touches_few_of_many_chunks():
    chunks = _Counting(_grid(1024, 1, 4, 64))  # a row split over 1024 ranks
    _Counting.touched = 0
    found = overlapping_chunks(chunks, (2000, 0), (8, 64))
    assert [c.offsets for c in found] == [(2000, 0), (2004, 0)]
    assert _Counting.touched < 100  # not 1024
    columns = _Counting(_grid(1, 1024, 64, 4))  # a column split
    _Counting.touched = 0
    assert [c.offsets for c in overlapping_chunks(columns, (0, 8), (64, 4))] == [(0, 8)]
    assert _Counting.touched < 100


def test_unsorted_or_irregular_chunks_fall_back_to_all():
    chunks = list(reversed(_grid(32, 1, 4, 4)))  # not in the writer's order
    found = overlapping_chunks(chunks, (40, 0), (8, 4))
    assert sorted(c.offsets for c in _brute(found, (40, 0), (8, 4))) == [(40, 0), (44, 0)]
    # A tall chunk starting above the box's band: the search misses it, coverage says so, all are scanned.
    tall = [Chunk((0, 0), (64, 2))] + [Chunk((r * 4, 2), (4, 2)) for r in range(16)]
    tall.sort(key=lambda c: c.offsets)
    found = overlapping_chunks(tall, (40, 0), (4, 4))
    assert sorted(c.offsets for c in _brute(found, (40, 0), (4, 4))) == [(0, 0), (40, 2)]


def test_load_of_a_many_rank_checkpoint_into_another_layout(tmp_path):
    full = np.arange(64 * 24, dtype=np.float32).reshape(64, 24)
    states = [{"w": DTensor.from_global(ms.Tensor(full), Layout((32,), (0, -1)), rank=r)} for r in range(32)]
    simulate_save(states, tmp_path)
    for rank in range(3):
        layout = Layout((3,), (-1, 0))
        target = DTensor(ms.Tensor(np.zeros((64, 8), np.float32)), layout, full.shape, rank=rank)
        dcp.load({"w": target}, checkpoint_id=tmp_path, no_dist=True)
        assert np.array_equal(target.to_local().asnumpy(), full[:, rank * 8:(rank + 1) * 8])
