"""I/O modes: threads, bounded in-flight memory, pieces of large tensors."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint.byte_ranges import split_box


@pytest.mark.parametrize("lengths,itemsize,bound", [((10, 7), 4, 60), ((3, 4, 5), 8, 100), ((1000,), 4, 64),
                                                    ((2, 3), 4, 1), ((), 4, 1), ((4, 4), 4, 10_000)])
def test_split_box_tiles_the_box_within_the_bound(lengths, itemsize, bound):
    boxes = split_box(lengths, itemsize, bound)
    covered = np.zeros(lengths, dtype=np.int32)
    for offsets, sizes in boxes:
        assert int(np.prod(sizes)) * itemsize <= max(bound, itemsize)
        covered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    assert np.all(covered == 1)


@pytest.mark.parametrize("verify", [True, False])
def test_load_memory_is_bounded_by_the_inflight_limit(tmp_path, verify):
    full = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB
    dcp.save({"w": full}, storage_writer=dcp.FileSystemWriter(tmp_path / "c", checksum_block_bytes=16 << 10))
    target = np.zeros((1024, 1024), np.float64)  # a cast: the read needs staging
    reader = dcp.FileSystemReader(tmp_path / "c", verify_checksums=verify, max_inflight_bytes=64 << 10)
    tracemalloc.start()
    try:
        dcp.load({"w": target}, storage_reader=reader, no_dist=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(target, full.astype(np.float64))
    assert peak < 512 << 10, f"peak {peak} bytes for a 4 MiB tensor with a 64 KiB bound"
    assert reader.bytes_read == full.nbytes


def test_threads_write_several_files_and_read_back(tmp_path):
    state = {f"t{i}": np.full((100 + i, 3), i, np.int32) for i in range(20)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "c", thread_count=3))
    files = sorted(p.name for p in (tmp_path / "c").glob("*.safetensors"))
    assert [name[:10] for name in files] == ["r00000_000", "r00000_001", "r00000_002"]
    target = {f"t{i}": np.zeros((100 + i, 3), np.int32) for i in range(20)}
    dcp.load(target, storage_reader=dcp.FileSystemReader(tmp_path / "c", thread_count=3))
    assert all(np.all(target[f"t{i}"] == i) for i in range(20))


def test_scattered_targets_read_directly_and_in_pieces(tmp_path):
    full = np.arange(64 * 48, dtype=np.int64).reshape(64, 48)
    dcp.save({"w": full}, checkpoint_id=tmp_path / "c")
    big = np.zeros((80, 96), np.int64)
    window = big[8:72, 16:64]  # a non-contiguous view as the target
    reader = dcp.FileSystemReader(tmp_path / "c", max_inflight_bytes=1000)
    dcp.load({"w": window}, storage_reader=reader, no_dist=True)
    assert np.array_equal(big[8:72, 16:64], full) and big.sum() == full.sum()
