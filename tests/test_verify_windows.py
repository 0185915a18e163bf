"""The verify pass: windows hashed in file order, announced ahead, mapped pages hashed in place."""

from __future__ import annotations

import json

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._verify_reads import lookahead_limits

ms.set_device("CPU")

MIB = 1 << 20


@pytest.mark.parametrize(
    "sizes, lookahead, expected",
    [
        ([], 10, []),
        ([4], 10, [1]),
        ([4, 4, 4, 4, 4], 0, [1, 2, 3, 4, 5]),  # no lookahead: each window when it is hashed
        ([4, 4, 4, 4, 4], 8, [3, 4, 5, 5, 5]),  # two windows of 4 bytes ahead
        ([4, 4, 4, 4, 4], 5, [3, 4, 5, 5, 5]),  # a window starting within the lookahead is announced whole
        ([100, 1, 1, 1], 2, [3, 4, 4, 4]),
    ],
)
def test_lookahead_limits(sizes, lookahead, expected):
    assert lookahead_limits(sizes, lookahead) == expected


def test_lookahead_limits_announce_each_window_once_and_in_time():
    rng = np.random.default_rng(3)
    sizes = [int(s) for s in rng.integers(1, 9 * MIB, size=200)]
    limits = lookahead_limits(sizes, 32 * MIB)
    ends = np.cumsum(sizes)
    assert all(a <= b for a, b in zip(limits, limits[1:]))  # non-decreasing: nothing announced twice
    for position, limit in enumerate(limits):
        assert limit > position  # the window being hashed was announced
        ahead = ends[limit - 1] - ends[position]
        last = sizes[limit - 1] if limit - 1 > position else 0
        assert ahead - last < 32 * MIB  # at most the lookahead, plus the window that crosses it
        if limit < len(sizes):
            assert ahead >= 32 * MIB or limit == len(sizes)


def _state(seed):
    rng = np.random.default_rng(seed)
    state = {
        # 24 MiB of tiled float32: 8 column tiles per slab, 12 slabs (several windows, lookahead spans some)
        "big": ms.Parameter(ms.Tensor(rng.random((1536, 4096), dtype=np.float32)), name="big"),
        # a wide bf16 matrix and a long vector of flat blocks
        "wide": ms.Parameter(ms.Tensor(rng.random((64, 8192), dtype=np.float32), ms.bfloat16), name="wide"),
        "vec": ms.Parameter(ms.Tensor(rng.random((3 * MIB,), dtype=np.float32)), name="vec"),
    }
    for i in range(40):
        state[f"small{i}"] = ms.Parameter(ms.Tensor(rng.random((257,), dtype=np.float32)), name=f"small{i}")
    return state


def _values(state):
    return {name: p.asnumpy().view(np.uint8).copy() for name, p in state.items()}


def _data_file_with(path, key):
    meta = json.loads((path / "metadata.json").read_text())
    entry = next(e for e in meta["storage_data"] if e["fqn"] == key)
    return path / entry["file"], entry


def test_multi_window_load_is_bit_exact_and_hashes_each_byte_once(tmp_path):
    saved = _state(0)
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt", thread_count=2), no_dist=True)
    target = _state(1)
    reader = dcp.FileSystemReader(tmp_path / "ckpt", thread_count=2)
    dcp.load(target, storage_reader=reader, no_dist=True)
    expected = _values(saved)
    for name, values in _values(target).items():
        assert np.array_equal(values, expected[name]), name
    assert reader.bytes_verified == sum(v.nbytes for v in expected.values())


@pytest.mark.parametrize("key, where", [("big", 0.99), ("vec", 0.5), ("wide", 0.9), ("small39", 0.5)])
def test_damage_in_a_later_window_leaves_every_target_unchanged(tmp_path, key, where):
    saved = _state(0)
    path = tmp_path / "ckpt"
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(path, thread_count=1), no_dist=True)
    data_file, entry = _data_file_with(path, key)
    position = entry["byte_offset"] + int(entry["length"] * where)
    raw = bytearray(data_file.read_bytes())
    raw[position] ^= 0x20
    data_file.write_bytes(bytes(raw))
    target = _state(2)
    before = _values(target)
    with pytest.raises(dcp.CorruptCheckpointError) as info:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path, thread_count=2), no_dist=True)
    assert f"key '{key}'" in str(info.value) and data_file.name in str(info.value)
    assert "no target was changed" in str(info.value)
    for name, values in _values(target).items():
        assert np.array_equal(values, before[name]), name
    # with verification off the same bytes load (the damage is only in the data, not the header)
    dcp.load(target, storage_reader=dcp.FileSystemReader(path, verify_checksums=False), no_dist=True)
    assert not np.array_equal(_values(target)[key], _values(saved)[key])
