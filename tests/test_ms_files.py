"""MindSpore ``.ckpt`` / ``.safetensors`` files read and written without MindSpore, checked against MindSpore."""

from __future__ import annotations

import json
from pathlib import Path

import mindspore
import numpy as np
import pytest
from mindspore.train import checkpoint_pb2
from safetensors.numpy import save_file

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli import _ms_files, import_checkpoint
from hyper_parallel.cli._ms_files import MsItem, open_ms_file, string_item, write_ms_file
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)

BF16 = mindspore.bfloat16


def _tensors() -> dict[str, mindspore.Tensor]:
    rng = np.random.default_rng(3)
    return {
        "net.w": mindspore.Tensor(rng.standard_normal((5, 7)).astype(np.float32)),
        "net.e": mindspore.Tensor(rng.standard_normal((4, 2)).astype(np.float32)).astype(BF16),
        "net.mask": mindspore.Tensor(np.array([True, False, True])),
        "step": mindspore.Tensor(np.array(9, dtype=np.int64)),
    }


def _items(tensors: dict[str, mindspore.Tensor]) -> list[MsItem]:
    items = []
    for name, tensor in tensors.items():
        array = tensor.asnumpy()
        dtype = "bfloat16" if tensor.dtype == BF16 else str(array.dtype)
        items.append(MsItem(name, dtype, tuple(array.shape), array.nbytes, lambda a=array: a))
    return items


def test_written_ckpt_is_byte_identical_to_mindspore(tmp_path):
    tensors = _tensors()
    mindspore.save_checkpoint([{"name": k, "data": v} for k, v in tensors.items()], str(tmp_path / "ms.ckpt"),
                              append_dict={"note": "héllo wörld"})
    write_ms_file(tmp_path / "ours.ckpt", _items(tensors) + [string_item("note", "héllo wörld")], fmt="ckpt")
    assert (tmp_path / "ours.ckpt").read_bytes() == (tmp_path / "ms.ckpt").read_bytes()


def test_index_reads_what_mindspore_wrote(tmp_path):
    tensors = _tensors()
    for crc in (False, True):
        path = tmp_path / f"crc{crc}.ckpt"
        mindspore.save_checkpoint([{"name": k, "data": v} for k, v in tensors.items()], str(path), crc_check=crc,
                                  append_dict={"note": "x"})
        file = open_ms_file(path)
        assert list(file.entries) == [*tensors, "note"]
        assert file.entries["step"].shape == () and file.entries["net.e"].dtype == "bfloat16"
        for name, tensor in tensors.items():
            assert file.raw(name).tobytes() == tensor.asnumpy().tobytes(), name
        assert file.text("note") == "x" and "entries" in repr(file)


def test_content_above_the_chunk_size_is_split_and_joined(tmp_path, monkeypatch):
    monkeypatch.setattr(_ms_files, "CKPT_CHUNK_BYTES", 48)  # MindSpore's rule, at 512 MiB
    tensors = _tensors()
    write_ms_file(tmp_path / "split.ckpt", _items(tensors), fmt="ckpt")
    loaded = mindspore.load_checkpoint(str(tmp_path / "split.ckpt"))
    file = open_ms_file(tmp_path / "split.ckpt")
    assert len(file.entries["net.w"].segments) == 3  # 140 bytes in 48-byte values
    for name, tensor in tensors.items():
        assert loaded[name].asnumpy().tobytes() == tensor.asnumpy().tobytes() == file.raw(name).tobytes()


def test_safetensors_written_and_read(tmp_path):
    tensors = _tensors()
    write_ms_file(tmp_path / "ours.safetensors", _items(tensors), fmt="safetensors")
    loaded = mindspore.load_checkpoint(str(tmp_path / "ours.safetensors"), format="safetensors")
    file = open_ms_file(tmp_path / "ours.safetensors")
    assert file.file_metadata == {"format": "ms"}
    for name, tensor in tensors.items():
        assert loaded[name].asnumpy().tobytes() == tensor.asnumpy().tobytes() == file.raw(name).tobytes()


def _raw_ckpt(path: Path, build) -> Path:
    checkpoint = checkpoint_pb2.Checkpoint()
    build(checkpoint)
    path.write_bytes(checkpoint.SerializeToString())
    return path


def _value(checkpoint, tag: str, tensor_type: str, dims, content: bytes) -> None:
    value = checkpoint.value.add()
    value.tag = tag
    value.tensor.dims.extend(dims)
    value.tensor.tensor_type = tensor_type
    value.tensor.tensor_content = content


def test_malformed_and_unsupported_files_are_refused(tmp_path):
    good = tmp_path / "good.ckpt"
    mindspore.save_checkpoint([{"name": "w", "data": mindspore.Tensor(np.ones((64, 64), np.float32))}], str(good))
    data = good.read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="cut.ckpt"):
        open_ms_file(tmp_path / "cut.ckpt")
    (tmp_path / "noise.ckpt").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(CorruptCheckpointError, match="noise.ckpt"):
        open_ms_file(tmp_path / "noise.ckpt")
    with pytest.raises(CheckpointNotFoundError):
        open_ms_file(tmp_path / "absent.ckpt")
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(UnsupportedFormatError, match="not a regular file"):
        open_ms_file(tmp_path / "dir.ckpt")
    with pytest.raises(UnsupportedFormatError, match=".ckpt or .safetensors"):
        open_ms_file(tmp_path / "weights.bin")
    int4 = _raw_ckpt(tmp_path / "int4.ckpt", lambda c: _value(c, "q", "Int4", [4], b"\x00\x00"))
    with pytest.raises(UnsupportedFormatError, match="'q'.*Int4"):
        open_ms_file(int4)
    twice = _raw_ckpt(tmp_path / "twice.ckpt", lambda c: (_value(c, "a", "Int8", [1], b"\x01"),
                                                          _value(c, "b", "Int8", [1], b"\x02"),
                                                          _value(c, "a", "Int8", [1], b"\x03")))
    with pytest.raises(CorruptCheckpointError, match="'a' appears twice"):
        open_ms_file(twice)
    lying = _raw_ckpt(tmp_path / "lying.ckpt", lambda c: _value(c, "a", "Float32", [3], b"\x00" * 8))
    with pytest.raises(CorruptCheckpointError, match="'a' holds 8 bytes"):
        open_ms_file(lying)

    def map_tensor(checkpoint):
        value = checkpoint.value.add()
        value.tag = "table"
        tensor = value.maptensor.tensor.add()
        tensor.tensor_type, tensor.tensor_content = "Int32", b"\x00" * 4

    with pytest.raises(UnsupportedFormatError, match="MapParameter"):
        open_ms_file(_raw_ckpt(tmp_path / "map.ckpt", map_tensor))


def test_single_ckpt_import_keeps_strings_and_refuses_a_committed_output(tmp_path):
    tensors = _tensors()
    src = tmp_path / "net.ckpt"
    mindspore.save_checkpoint([{"name": k, "data": v} for k, v in tensors.items()], str(src),
                              append_dict={"note": "run-7"})
    import_checkpoint(src, tmp_path / "ckpt")
    targets = {name: None for name in [*tensors, "note"]}
    dcp.load(targets, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert targets["note"] == "run-7"
    for name, tensor in tensors.items():
        assert targets[name].tobytes() == tensor.asnumpy().tobytes(), name
    with pytest.raises(dcp.CheckpointExistsError, match="committed checkpoint"):
        import_checkpoint(src, tmp_path / "ckpt")


def test_malformed_value_list_in_metadata_is_reported(tmp_path):
    src = tmp_path / "model.safetensors"
    save_file({"w": np.zeros(2, np.float32)}, str(src),
              metadata={"hyper_parallel.value_types": json.dumps({"step": "int"})})  # 'step' text missing
    with pytest.raises(CorruptCheckpointError, match="hyper_parallel.value_types"):
        import_checkpoint(src, tmp_path / "out")


class _AdviceLog(_ms_files.mmap.mmap):
    """The real ``mmap.mmap``, keeping the ``madvise`` calls made on it (class attribute: one log per test)."""

    calls: list[tuple[int, int, int]] = []

    def madvise(self, option, start=0, length=None):  # noqa: D401 - same signature as mmap.madvise
        type(self).calls.append((option, start, length))
        return super().madvise(option, start) if length is None else super().madvise(option, start, length)


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_import_streams_each_tensor_with_readahead_and_stays_bit_exact(tmp_path, monkeypatch, fmt):
    """No content is announced whole (``MADV_WILLNEED`` filled the cache with 4 KiB pages: 3.5-4x slower).

    Every tensor's byte range is marked sequential (read ahead as the writer streams it), the
    import is bit-exact against what MindSpore saved, and MindSpore loads the same values.
    """
    rng = np.random.default_rng(11)
    tensors = {
        "big.w": mindspore.Tensor(rng.standard_normal((512, 300)).astype(np.float32)),  # > 64 KiB: several pages
        "big.e": mindspore.Tensor(rng.standard_normal((256, 130)).astype(np.float32)).astype(BF16),
        "small.b": mindspore.Tensor(rng.standard_normal(7).astype(np.float16)),
        "step": mindspore.Tensor(np.array(3, dtype=np.int64)),
    }
    src = tmp_path / f"net.{fmt}"
    mindspore.save_checkpoint([{"name": k, "data": v} for k, v in tensors.items()], str(src), format=fmt)
    _AdviceLog.calls = []
    monkeypatch.setattr(_ms_files.mmap, "mmap", _AdviceLog)
    import_checkpoint(src, tmp_path / "ckpt")
    monkeypatch.undo()
    advice = _AdviceLog.calls
    assert advice and all(option != _ms_files.mmap.MADV_WILLNEED for option, _, _ in advice), advice
    sequential = [(start, length) for option, start, length in advice if option == _ms_files.mmap.MADV_SEQUENTIAL]
    for name, entry in open_ms_file(src).entries.items():  # every tensor's bytes lie in a sequential range
        for offset, length in entry.segments:
            assert any(s <= offset and offset + length <= s + n for s, n in sequential), (name, offset, sequential)
    targets = {name: None for name in tensors}
    dcp.load(targets, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    reference = mindspore.load_checkpoint(str(src), format=fmt)
    for name, tensor in tensors.items():
        assert targets[name].tobytes() == tensor.asnumpy().tobytes(), name
        assert targets[name].tobytes() == reference[name].asnumpy().tobytes(), name
