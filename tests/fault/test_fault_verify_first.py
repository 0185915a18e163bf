"""Verify before a byte lands: a load that fails on corruption changes no target.

A checkpoint of several keys gets one byte of its 2nd key flipped (or of a
value, a compressed item, a resharded region). The load must raise
``CorruptCheckpointError`` and every target (numpy arrays, MindSpore
Parameters, plain values in the dict) must hold exactly what it held before,
including the keys read before the corrupt one and those after it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mindspore
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp

KEYS = ("a", "b", "c", "d")


def _state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "a": rng.standard_normal(3000).astype(np.float32),
        "b": rng.standard_normal((64, 4096)).astype(np.float32),  # 2-D and wide: tile checksums
        "c": rng.integers(0, 1000, (50, 7)),
        "d": rng.standard_normal((8, 8)).astype(np.float16),
        "step": 42,
        "name": "run",
    }


def _flip(path: Path, key: str, at: int = 100) -> None:
    info = next(v for k, v in dcp.read_metadata(path).storage_data.items() if k.fqn == key)
    file = path / info.relative_path
    raw = bytearray(file.read_bytes())
    raw[info.offset + min(at, info.length - 1)] ^= 0x40
    file.write_bytes(bytes(raw))


def _sentinel() -> dict[str, Any]:
    return {"a": np.full(3000, 7, np.float32), "b": np.full((64, 4096), 7, np.float32),
            "c": np.full((50, 7), 7, np.int64), "d": np.full((8, 8), 7, np.float16), "step": "keep", "name": "keep"}


def _assert_untouched(target: dict[str, Any]) -> None:
    for key in KEYS:
        value = target[key]
        array = value.asnumpy() if isinstance(value, mindspore.Tensor) else value
        assert np.all(array == 7), f"target {key!r} was changed by a load that failed"
    assert target["step"] == "keep" and target["name"] == "keep"


@pytest.mark.parametrize("writer_options", [{}, {"tile_checksums": False}, {"compression": "zstd"}],
                         ids=["tiles", "flat", "zstd"])
@pytest.mark.parametrize("corrupt", ["b", "step", "d"])
def test_corrupt_key_leaves_every_target_unchanged(tmp_path: Path, writer_options: dict, corrupt: str) -> None:
    path = tmp_path / "ckpt"
    dcp.save(_state(1), storage_writer=dcp.FileSystemWriter(path, **writer_options), no_dist=True)
    _flip(path, corrupt, at=5 if corrupt == "step" else 100)
    target = _sentinel()
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load(target, checkpoint_id=path, no_dist=True)
    message = str(caught.value)
    assert f"'{corrupt}'" in message and "no target was changed" in message, message
    _assert_untouched(target)
    if corrupt == "b" and not writer_options:  # verification off lets the damage through, as documented
        dcp.load(target, storage_reader=dcp.FileSystemReader(path, verify_checksums=False), no_dist=True)
        assert np.array_equal(target["a"], _state(1)["a"]) and not np.array_equal(target["b"], _state(1)["b"])


def test_mindspore_parameters_stay_as_they_were(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    dcp.save(_state(1), checkpoint_id=path, no_dist=True)
    _flip(path, "b")
    target = _sentinel()
    for key in KEYS:
        target[key] = mindspore.Parameter(mindspore.Tensor(target[key]), name=key)
    with pytest.raises(dcp.CorruptCheckpointError, match="'b'"):
        dcp.load(target, checkpoint_id=path, no_dist=True)
    _assert_untouched(target)


def test_resharded_region_of_a_corrupt_chunk(tmp_path: Path) -> None:
    """A column shard of ``b`` whose tile is damaged: the load fails, the other shard's load works."""
    path = tmp_path / "ckpt"
    dcp.save(_state(1), checkpoint_id=path, no_dist=True)
    _flip(path, "b", at=10)  # row 0, first columns
    left = np.full((64, 2048), 7, np.float32)
    with pytest.raises(dcp.CorruptCheckpointError, match="tile 0,0"):
        dcp.load({"b": dcp.ShardedTensor.from_rank_offsets("b", left, (1, 0, 2)), "a": np.full(3000, 7, np.float32)},
                 checkpoint_id=path, no_dist=True)
    assert np.all(left == 7)
    right = np.zeros((64, 2048), np.float32)
    reader = dcp.FileSystemReader(path)
    dcp.load({"b": dcp.ShardedTensor.from_rank_offsets("b", right, (1, 1, 2))}, storage_reader=reader, no_dist=True)
    assert np.array_equal(right, _state(1)["b"][:, 2048:])
    assert reader.bytes_verified == right.nbytes  # exactly the tiles of the columns read


def test_truncated_file_changes_no_target(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    dcp.save(_state(1), storage_writer=dcp.FileSystemWriter(path, thread_count=1), no_dist=True)
    info = next(v for k, v in dcp.read_metadata(path).storage_data.items() if k.fqn == "b")
    file = path / info.relative_path
    file.write_bytes(file.read_bytes()[: info.offset + 10])
    target = _sentinel()
    with pytest.raises(dcp.CorruptCheckpointError, match="truncated"):
        dcp.load(target, checkpoint_id=path, no_dist=True)
    _assert_untouched(target)
