"""I/O modes: threads, bounded in-flight memory, pieces of large tensors."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._format.byte_ranges import split_box


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


def test_zstd_compression_round_trip_verified(tmp_path):
    import mindspore as ms  # pylint: disable=import-outside-toplevel

    state = {"z": np.zeros((256, 256), np.float32), "r": np.arange(1000, dtype=np.int64),
             "h": ms.Tensor(np.linspace(0, 1, 64, dtype=np.float32), ms.bfloat16), "step": 9}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "c", compression="zstd"))
    meta = dcp.read_metadata(tmp_path / "c")
    info = next(v for k, v in meta.storage_data.items() if k.fqn == "z")
    assert info.compression == "zstd" and info.raw_length == 256 * 256 * 4 and info.length < 4096
    target = {"z": np.ones((256, 256), np.float32), "r": np.zeros(1000, np.int64),
              "h": ms.Tensor(np.zeros(64, np.float32), ms.bfloat16), "step": 0}
    dcp.load(target, checkpoint_id=tmp_path / "c")
    assert not target["z"].any() and np.array_equal(target["r"], state["r"]) and target["step"] == 9
    assert np.array_equal(target["h"].asnumpy().view(np.uint16), state["h"].asnumpy().view(np.uint16))
    # a region of a compressed chunk (resharded load) and a corrupted compressed byte
    half = np.zeros(500, np.int64)
    dcp.load({"r": dcp.ShardedTensor.from_rank_offsets("r", half, (0, 1, 2))}, checkpoint_id=tmp_path / "c")
    assert np.array_equal(half, np.arange(500, 1000))
    path = tmp_path / "c" / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(dcp.CorruptCheckpointError, match="'z'"):
        dcp.load({"z": np.ones((256, 256), np.float32)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(dcp.CheckpointValueError, match="compression"):
        dcp.FileSystemWriter(tmp_path / "x", compression="lz4")


def test_many_small_tensors_are_packed_into_few_writes(tmp_path):
    state = {f"s{i}": np.full(10, i, np.int16) for i in range(300)}
    dcp.save(state, checkpoint_id=tmp_path / "c")
    assert len(list((tmp_path / "c").glob("*.safetensors"))) == 1
    target = {f"s{i}": np.zeros(10, np.int16) for i in range(300)}
    dcp.load(target, checkpoint_id=tmp_path / "c")
    assert all(target[f"s{i}"][0] == i for i in range(300))


def test_automatic_thread_count_by_size(tmp_path):
    from hyper_parallel.core.distributed_checkpoint.filesystem_writer import AUTO_THREAD_BYTES

    small = {"a": np.ones(1000, np.float32)}
    dcp.save(small, checkpoint_id=tmp_path / "small")
    assert len(list((tmp_path / "small").glob("*.safetensors"))) == 1
    big = {f"b{i}": np.full(AUTO_THREAD_BYTES // 16, i, np.float32) for i in range(5)}  # 1.25x the threshold
    dcp.save(big, checkpoint_id=tmp_path / "big")
    assert len(list((tmp_path / "big").glob("*.safetensors"))) == 2
    target = {f"b{i}": np.zeros(AUTO_THREAD_BYTES // 16, np.float32) for i in range(5)}
    dcp.load(target, checkpoint_id=tmp_path / "big")
    assert all(np.all(target[f"b{i}"] == i) for i in range(5))
