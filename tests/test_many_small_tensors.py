"""Thousands of small tensors: read many per system call, verified, into their own targets."""

from __future__ import annotations

import os

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp


def _state(count: int = 300) -> dict[str, ms.Parameter]:
    rng = np.random.default_rng(3)
    state = {}
    for i in range(count):
        values = rng.standard_normal((i % 7 + 1, 33)).astype(np.float32)
        tensor = ms.Tensor(values, ms.bfloat16) if i % 2 else ms.Tensor(values)
        state[f"p{i}"] = ms.Parameter(tensor, name=f"p{i}")
    state["empty"] = ms.Parameter(ms.Tensor(np.zeros((0, 4), np.float32)), name="empty")
    return state


def _bits(param: ms.Parameter) -> bytes:
    return param.asnumpy().tobytes()


def test_small_tensors_load_in_place_in_few_reads(tmp_path, monkeypatch):
    state = _state()
    expected = {name: _bits(param) for name, param in state.items()}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    for param in state.values():
        param.asnumpy()[...] = 0
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: calls.append(len(buffers)) or real(fd, buffers, offset))
    dcp.load(state, storage_reader=dcp.FileSystemReader(tmp_path, thread_count=1), no_dist=True)
    assert {name: _bits(param) for name, param in state.items()} == expected
    assert len(calls) <= 4 and max(calls) >= 300, calls  # adjacent chunks share one preadv; one header read


def test_damaged_small_tensor_is_named(tmp_path):
    state = _state(50)
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    info = dcp.read_metadata(tmp_path).storage_data[dcp.MetadataIndex("p17", (0, 0))]
    path = tmp_path / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + 5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(dcp.CorruptCheckpointError, match=r"key 'p17'"):
        dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    dcp.load(state, storage_reader=dcp.FileSystemReader(tmp_path, verify_checksums=False), no_dist=True)


def test_small_blocks_and_cast_targets_take_the_general_path(tmp_path):
    values = np.arange(64 * 33, dtype=np.float32).reshape(64, 33)
    writer = dcp.FileSystemWriter(tmp_path, checksum_block_bytes=100)  # several blocks per chunk
    dcp.save({"a": ms.Tensor(values), "b": ms.Tensor(values + 1)}, storage_writer=writer, no_dist=True)
    a = ms.Parameter(ms.Tensor(np.zeros((64, 33), np.float32)), name="a")
    b = ms.Parameter(ms.Tensor(np.zeros((64, 33), np.float16)), name="b")  # stored float32: cast
    dcp.load({"a": a, "b": b}, checkpoint_id=tmp_path, no_dist=True)
    assert np.array_equal(a.asnumpy(), values)
    assert np.array_equal(b.asnumpy(), (values + 1).astype(np.float16))


def test_small_tensors_written_many_per_call_survive_short_writes(tmp_path, monkeypatch):
    state = _state(200)
    expected = {name: _bits(param) for name, param in state.items()}
    calls = []
    real = os.writev

    def short_writev(fd, buffers):  # the kernel may write less than asked: the writer finishes the rest
        calls.append(len(buffers))
        return real(fd, buffers[: max(1, len(buffers) // 2)])

    monkeypatch.setattr(os, "writev", short_writev)
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    monkeypatch.undo()
    assert max(calls) >= 200  # one call for many tensors
    for param in state.values():
        param.asnumpy()[...] = 0
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    assert {name: _bits(param) for name, param in state.items()} == expected


def test_small_tile_checksummed_matrices_are_batched_and_verified(tmp_path):
    values = {f"m{i}": np.arange(16 * 1024, dtype=np.float32).reshape(16, 1024) + i for i in range(20)}  # 4 KiB rows
    dcp.save({k: ms.Tensor(v) for k, v in values.items()}, checkpoint_id=tmp_path, no_dist=True)
    info = dcp.read_metadata(tmp_path).storage_data[dcp.MetadataIndex("m7", (0, 0))]
    assert info.checksum.block_shape  # tiles
    targets = {k: ms.Parameter(ms.Tensor(np.zeros((16, 1024), np.float32)), name=k) for k in values}
    dcp.load(targets, checkpoint_id=tmp_path, no_dist=True)
    assert all(np.array_equal(targets[k].asnumpy(), v) for k, v in values.items())
    path = tmp_path / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + 3 * 4096 + 2048] ^= 0x04  # row 3, third tile column
    path.write_bytes(bytes(data))
    with pytest.raises(dcp.CorruptCheckpointError, match=r"key 'm7'"):
        dcp.load(targets, checkpoint_id=tmp_path, no_dist=True)
