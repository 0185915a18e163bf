"""Single-process save and load on the real on-disk format."""

from __future__ import annotations

import json
import os
import re
import struct

import mindspore as ms
import numpy as np
import pytest
from safetensors import safe_open

import hyper_parallel.core.distributed_checkpoint as dcp

def _bf16_tensor(values: np.ndarray) -> ms.Tensor:
    return ms.Tensor(values.astype(np.float32), ms.bfloat16)


DTYPE_CASES = {
    "float32": lambda shape: ms.Tensor(np.random.default_rng(0).standard_normal(shape).astype(np.float32)),
    "float16": lambda shape: ms.Tensor(np.random.default_rng(1).standard_normal(shape).astype(np.float16)),
    "bfloat16": lambda shape: _bf16_tensor(np.random.default_rng(2).standard_normal(shape)),
    "int8": lambda shape: ms.Tensor(np.random.default_rng(3).integers(-128, 127, shape).astype(np.int8)),
    "int32": lambda shape: ms.Tensor(np.random.default_rng(4).integers(-2**31, 2**31 - 1, shape).astype(np.int32)),
    "int64": lambda shape: ms.Tensor(np.random.default_rng(5).integers(-2**62, 2**62, shape).astype(np.int64)),
    "bool": lambda shape: ms.Tensor(np.random.default_rng(6).integers(0, 2, shape).astype(bool)),
}
SHAPES = [(), (7,), (3, 5), (2, 1, 3, 2, 4)]


def _bits(tensor) -> np.ndarray:
    array = tensor.asnumpy() if hasattr(tensor, "asnumpy") else np.asarray(tensor)
    return array.view(np.uint8).copy() if array.ndim else np.array(array).reshape(1).view(np.uint8).copy()


def _zeros_like(tensor: ms.Tensor) -> ms.Parameter:
    array = np.zeros(tensor.shape, dtype=tensor.asnumpy().dtype)
    return ms.Parameter(ms.Tensor(array, tensor.dtype) if tensor.dtype == ms.bfloat16 else ms.Tensor(array), name="p")


@pytest.mark.parametrize("dtype", sorted(DTYPE_CASES))
def test_round_trip_bit_exact_every_dtype_and_rank(tmp_path, dtype):
    state = {f"t{len(shape)}d": DTYPE_CASES[dtype](shape) for shape in SHAPES}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    targets = {key: _zeros_like(value) for key, value in state.items()}
    before = {key: id(value) for key, value in targets.items()}
    dcp.load(targets, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    for key, value in state.items():
        assert id(targets[key]) == before[key], "Parameter identity must be kept"
        assert targets[key].dtype == value.dtype
        assert tuple(targets[key].shape) == tuple(value.shape)
        assert np.array_equal(_bits(targets[key]), _bits(value)), key


def test_parameters_numpy_and_plain_values_in_place(tmp_path):
    weight = ms.Parameter(ms.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4)), name="w")
    state = {
        "w": weight,
        "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
        "step": 12,
        "lr": 0.125,
        "flag": True,
        "none": None,
        "name": "run-α",
        "blob": b"\x00\x01",
        "np_scalar": np.float16(1.5),
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "c"))
    target_w = ms.Parameter(ms.Tensor(np.zeros((3, 4), np.float32)), name="w")
    target_arr = np.zeros((2, 3), np.int16)
    target = {"w": target_w, "arr": target_arr, "step": 0, "lr": 0.0, "flag": False, "none": 1, "name": "",
              "blob": b"", "np_scalar": np.float16(0)}
    dcp.load(target, checkpoint_id=str(tmp_path / "c"))
    assert target["w"] is target_w and np.array_equal(target_w.asnumpy(), weight.asnumpy())
    assert target["arr"] is target_arr and np.array_equal(target_arr, state["arr"])
    assert target["step"] == 12 and type(target["step"]) is int
    assert target["lr"] == 0.125 and target["flag"] is True and target["none"] is None
    assert target["name"] == "run-α" and target["blob"] == b"\x00\x01"
    assert type(target["np_scalar"]) is np.float16 and target["np_scalar"] == np.float16(1.5)


def test_target_dtype_is_kept_and_values_cast(tmp_path):
    source = ms.Tensor(np.array([[1.5, -2.25], [3.0, 4.5]], np.float32))
    dcp.save({"x": source, "y": _bf16_tensor(np.array([1.5, 2.0, -3.0]))}, checkpoint_id=tmp_path / "c")
    half = ms.Parameter(ms.Tensor(np.zeros((2, 2), np.float16)), name="x")
    full = ms.Parameter(ms.Tensor(np.zeros(3, np.float32)), name="y")
    dcp.load({"x": half, "y": full}, checkpoint_id=tmp_path / "c")
    assert half.dtype == ms.float16 and full.dtype == ms.float32
    assert half.asnumpy().tolist() == [[1.5, -2.25], [3.0, 4.5]]
    assert full.asnumpy().tolist() == [1.5, 2.0, -3.0]


def test_data_files_are_safetensors_holding_the_values(tmp_path):
    state = {"a": ms.Tensor(np.arange(10, dtype=np.float32)), "b": np.arange(6, dtype=np.int64).reshape(2, 3),
             "h": _bf16_tensor(np.array([1.0, -2.0, 0.5])), "step": 3}
    dcp.save(state, checkpoint_id=tmp_path / "c")
    files = [f for f in os.listdir(tmp_path / "c") if f.endswith(".safetensors")]
    assert files, "no data files written"
    seen = {}
    for name in files:
        with safe_open(str(tmp_path / "c" / name), framework="numpy") as handle:
            for key in handle.keys():
                if handle.get_slice(key).get_dtype() != "BF16":
                    seen[key] = handle.get_tensor(key)
                else:
                    seen[key] = "BF16"
        assert re.fullmatch(r"r\d{5}_\d{3}\.[0-9a-f]{12}\.safetensors", name), "names come from rank and counter"
    assert np.array_equal(seen["a"], np.arange(10, dtype=np.float32))
    assert np.array_equal(seen["b"], state["b"])
    assert seen["h"] == "BF16"
    assert seen["step"].dtype == np.uint8 and bytes(seen["step"]) == b"3"
    # The bf16 bytes are exactly the tensor's bits.
    meta = dcp.read_metadata(tmp_path / "c")
    info = next(v for k, v in meta.storage_data.items() if k.fqn == "h")
    with open(tmp_path / "c" / info.relative_path, "rb") as handle:
        handle.seek(info.offset)
        raw = handle.read(info.length)
    assert raw == state["h"].asnumpy().view(np.uint16).tobytes()


def test_metadata_is_versioned_json_not_pickle(tmp_path):
    dcp.save({"a": np.ones(3, np.float32)}, checkpoint_id=tmp_path / "c")
    raw = (tmp_path / "c" / "metadata.json").read_bytes()
    assert not raw.startswith(b"\x80"), "metadata must not be a pickle"
    document = json.loads(raw)
    assert document["format"] == "hyper_parallel.distributed_checkpoint"
    assert document["version"] == "2.2" and document["backend"] == "filesystem"
    entry = document["storage_data"][0]
    assert set(entry) >= {"fqn", "file", "byte_offset", "length", "checksum"}
    assert entry["checksum"]["algorithm"] == "xxh3_64"
    meta = dcp.read_metadata(tmp_path / "c")
    assert meta.state_dict_metadata["a"].size == (3,)


def test_flipped_byte_is_reported_with_key_and_file(tmp_path):
    dcp.save({"weights": np.arange(1000, dtype=np.float32)}, checkpoint_id=tmp_path / "c")
    meta = dcp.read_metadata(tmp_path / "c")
    info = next(iter(meta.storage_data.values()))
    path = tmp_path / "c" / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + 123] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load({"weights": np.zeros(1000, np.float32)}, checkpoint_id=tmp_path / "c")
    assert "weights" in str(caught.value) and info.relative_path in str(caught.value)
    # Verification can be turned off (then the flipped value is read as is).
    target = np.zeros(1000, np.float32)
    dcp.load({"weights": target}, storage_reader=dcp.FileSystemReader(tmp_path / "c", verify_checksums=False))
    assert not np.array_equal(target, np.arange(1000, dtype=np.float32))


def test_documented_errors(tmp_path):
    dcp.save({"a": np.ones((2, 3), np.float32), "b": 1}, checkpoint_id=tmp_path / "c")
    with pytest.raises(dcp.MissingKeyError, match="'zzz'") as missing:
        dcp.load({"a": np.ones((2, 3), np.float32), "zzz": np.ones(1)}, checkpoint_id=tmp_path / "c")
    assert isinstance(missing.value, KeyError) and "allow_partial_load" in str(missing.value)
    with pytest.raises(dcp.ShapeMismatchError, match=r"'a'.*\[2, 3\].*\[3, 2\]"):
        dcp.load({"a": np.ones((3, 2), np.float32)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(dcp.CheckpointNotFoundError) as not_found:
        dcp.load({"a": np.ones((2, 3), np.float32)}, checkpoint_id=tmp_path / "nope")
    assert isinstance(not_found.value, FileNotFoundError) and "nope" in str(not_found.value)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "r00000_000.0123456789ab.safetensors").write_bytes(b"x" * 16)
    with pytest.raises(dcp.IncompleteCheckpointError, match="no metadata.json"):
        dcp.load({"a": np.ones((2, 3), np.float32)}, checkpoint_id=tmp_path / "half")
    with pytest.raises(dcp.IncompleteCheckpointError):
        dcp.read_metadata(tmp_path / "half")


def test_partial_load_skips_missing_keys(tmp_path):
    dcp.save({"a": np.arange(3, dtype=np.float32)}, checkpoint_id=tmp_path / "c")
    target = {"a": np.zeros(3, np.float32), "extra": np.full(2, 7.0)}
    planner = dcp.StandardLoadPlanner(allow_partial_load=True)
    dcp.load(target, checkpoint_id=tmp_path / "c", planner=planner)
    assert target["a"].tolist() == [0.0, 1.0, 2.0] and target["extra"].tolist() == [7.0, 7.0]
    assert planner.missing_keys == ["extra"]


def test_save_again_keeps_old_until_new_commits_and_cleans_old_files(tmp_path):
    path = tmp_path / "c"
    dcp.save({"a": np.zeros(4, np.float32)}, checkpoint_id=path)
    old_files = {f for f in os.listdir(path) if f.endswith(".safetensors")}
    dcp.save({"a": np.ones(4, np.float32)}, checkpoint_id=path)
    new_files = {f for f in os.listdir(path) if f.endswith(".safetensors")}
    assert not old_files & new_files, "a new save must never overwrite the files of the committed one"
    target = np.zeros(4, np.float32)
    dcp.load({"a": target}, checkpoint_id=path)
    assert target.tolist() == [1.0] * 4


def test_safetensors_header_layout(tmp_path):
    dcp.save({"a": np.arange(3, dtype=np.int32)}, checkpoint_id=tmp_path / "c")
    name = next(f for f in os.listdir(tmp_path / "c") if f.endswith(".safetensors"))
    raw = (tmp_path / "c" / name).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0
    header = json.loads(raw[8 : 8 + length])
    assert header["a"] == {"dtype": "I32", "shape": [3], "data_offsets": [0, 12]}
    assert raw[8 + length :] == np.arange(3, dtype=np.int32).tobytes()
