"""``hp-ckpt import`` checks the crc32 that ``mindspore.save_checkpoint(..., crc_check=True)`` stores.

MindSpore's own ``load_checkpoint(..., crc_check=True)`` is the reference for which files are damaged.
"""

from __future__ import annotations

import binascii
import os
from pathlib import Path

import mindspore
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli import import_checkpoint
from hyper_parallel.cli._ms_crc import crc32_combine
from hyper_parallel.cli._ms_files import open_ms_file
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from tests.strategy_files import ParamStrategy, write_strategy_file


def _tensors(fmt: str = "ckpt") -> dict[str, mindspore.Tensor]:
    rng = np.random.default_rng(11)
    # MindSpore 2.10 cannot take the crc of a bf16 tensor it saves as safetensors (bytes() of an 'E' array)
    e_dtype = mindspore.bfloat16 if fmt == "ckpt" else mindspore.float16
    return {
        "net.w": mindspore.Tensor(rng.standard_normal((48, 40)).astype(np.float32)),
        "net.e": mindspore.Tensor(rng.standard_normal((6, 5)).astype(np.float32)).astype(e_dtype),
        "step": mindspore.Tensor(np.array(9, dtype=np.int64)),
    }


def _save(path: Path, tensors: dict[str, mindspore.Tensor], fmt: str, **extra) -> Path:
    mindspore.save_checkpoint([{"name": k, "data": v} for k, v in tensors.items()], str(path), crc_check=True,
                              format=fmt, **extra)
    return path


def _flipped(path: Path, offset: int, name: str) -> Path:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    bad = path.with_name(name)
    bad.write_bytes(bytes(data))
    return bad


def _refused_by_mindspore(path: Path) -> bool:
    try:
        mindspore.load_checkpoint(str(path), crc_check=True, format=path.suffix[1:])
    except ValueError:
        return True
    return False


def test_crc32_combine_equals_one_crc_of_the_joined_bytes():
    rng = np.random.default_rng(5)
    for first, second in [(0, 0), (1, 0), (0, 7), (13, 1000), (4099, 1 << 20), (3, 123457)]:
        a, b = rng.bytes(first), rng.bytes(second)
        assert crc32_combine(binascii.crc32(a), binascii.crc32(b), second) == binascii.crc32(a + b), (first, second)


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_a_crc_checked_file_imports_bit_exact_and_a_flipped_byte_is_refused(tmp_path, fmt):
    tensors = _tensors(fmt)
    extra = {"append_dict": {"note": "run-7"}} if fmt == "ckpt" else {}
    src = _save(tmp_path / f"net.{fmt}", tensors, fmt, **extra)
    file = open_ms_file(src)
    assert file.crc is not None and not file.crc.complete
    import_checkpoint(src, tmp_path / "good")
    targets = {name: None for name in tensors}
    dcp.load(targets, checkpoint_id=tmp_path / "good", no_dist=True)
    for name, tensor in tensors.items():
        assert targets[name].tobytes() == tensor.asnumpy().tobytes(), name

    # One bit of one tensor's data flipped: MindSpore's own crc check refuses it, and so does the import.
    offset = file.entries["net.w"].segments[0][0] + 1234
    bad = _flipped(src, offset, f"bad.{fmt}")
    assert _refused_by_mindspore(bad) and not _refused_by_mindspore(src)
    with pytest.raises(CorruptCheckpointError, match=rf"bad\.{fmt}: the crc32 MindSpore stored .* copy it again"):
        import_checkpoint(bad, tmp_path / "bad")
    assert not os.path.exists(tmp_path / "bad") or not os.listdir(tmp_path / "bad")  # nothing committed or left


def test_bytes_between_the_contents_and_the_stored_value_are_covered_too(tmp_path):
    src = _save(tmp_path / "net.ckpt", _tensors(), "ckpt", append_dict={"note": "run-7"})
    file = open_ms_file(src)
    first = min(offset for entry in file.entries.values() for offset, _ in entry.segments)
    size = src.stat().st_size
    # a byte of the first value's protobuf fields (its dims), and a byte of the stored crc itself
    for offset, name in [(first - 3, "fields.ckpt"), (size - 1, "trailer.ckpt")]:
        bad = _flipped(src, offset, name)
        assert _refused_by_mindspore(bad), name
        with pytest.raises(CorruptCheckpointError, match=name):
            import_checkpoint(bad, tmp_path / f"out_{name}")


def test_a_file_without_crc_imports_as_before(tmp_path):
    for fmt in ("ckpt", "safetensors"):
        tensors = _tensors(fmt)
        src = tmp_path / f"plain.{fmt}"
        mindspore.save_checkpoint([{"name": k, "data": v} for k, v in tensors.items()], str(src), format=fmt)
        assert open_ms_file(src).crc is None
        import_checkpoint(src, tmp_path / f"out_{fmt}")
        targets = {name: None for name in tensors}
        dcp.load(targets, checkpoint_id=tmp_path / f"out_{fmt}", no_dist=True)
        assert all(targets[n].tobytes() == t.asnumpy().tobytes() for n, t in tensors.items())


def test_a_damaged_replica_the_import_never_stores_is_still_refused(tmp_path):
    """Rank 1's copy of a replicated parameter is not stored; its bytes are read once, for the crc."""
    rng = np.random.default_rng(2)
    full = {"w": rng.standard_normal((8, 6)).astype(np.float32), "s": rng.standard_normal((8, 6)).astype(np.float32)}
    strategy = write_strategy_file(tmp_path / "strategy.ckpt", (
        ParamStrategy("w", dev_matrix=(2,), tensor_map=(-1, -1)),
        ParamStrategy("s", dev_matrix=(2,), tensor_map=(0, -1)),
    ))
    src = tmp_path / "job"
    for rank in range(2):
        (src / f"rank_{rank}").mkdir(parents=True)
        pieces = {"w": mindspore.Tensor(full["w"]), "s": mindspore.Tensor(full["s"][rank * 4:(rank + 1) * 4])}
        _save(src / f"rank_{rank}" / f"checkpoint_{rank}.ckpt", pieces, "ckpt")
    import_checkpoint(src, tmp_path / "good", strategy_files=[strategy])
    targets = {"w": None, "s": None}
    dcp.load(targets, checkpoint_id=tmp_path / "good", no_dist=True)
    assert all(np.array_equal(targets[name], full[name]) for name in full)

    rank1 = src / "rank_1" / "checkpoint_1.ckpt"
    offset = open_ms_file(rank1).entries["w"].segments[0][0] + 5
    _flipped(rank1, offset, "checkpoint_1.ckpt.bad").replace(rank1)
    assert _refused_by_mindspore(rank1)
    with pytest.raises(CorruptCheckpointError, match=r"rank_1/checkpoint_1\.ckpt: the crc32"):
        import_checkpoint(src, tmp_path / "bad", strategy_files=[strategy])
    assert not os.path.exists(tmp_path / "bad") or not os.listdir(tmp_path / "bad")


def test_a_tensor_mindspore_split_into_several_values_is_checked_across_them(tmp_path, monkeypatch):
    """MindSpore splits a tensor above SLICE_SIZE KiB into values with the same tag (512 MiB; 2 KiB here)."""
    from mindspore.train import serialization  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(serialization, "SLICE_SIZE", 2)
    tensors = _tensors()
    src = _save(tmp_path / "split.ckpt", tensors, "ckpt")
    file = open_ms_file(src)
    segments = file.entries["net.w"].segments
    assert len(segments) == 4  # 7680 bytes in 2 KiB values
    import_checkpoint(src, tmp_path / "good")
    targets = {name: None for name in tensors}
    dcp.load(targets, checkpoint_id=tmp_path / "good", no_dist=True)
    assert all(targets[n].tobytes() == t.asnumpy().tobytes() for n, t in tensors.items())
    bad = _flipped(src, segments[2][0] + 7, "split_bad.ckpt")  # inside the third value's content
    assert _refused_by_mindspore(bad)
    with pytest.raises(CorruptCheckpointError, match=r"split_bad\.ckpt: the crc32"):
        import_checkpoint(bad, tmp_path / "bad")


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_every_value_kind_mindspore_checks_imports(tmp_path, fmt):
    """Files MindSpore's own crc check accepts are accepted: 0-d integers of each width (counted by bytes()), 0-d
    bool and floats, empty tensors, bf16 (.ckpt; MindSpore 2.10 cannot save it as crc'd safetensors), a non-ASCII
    name, values appended as str/int/float/bool (.ckpt); tensors MindSpore's load returns load bit-exact."""
    kinds = {
        "i64": np.array(1 << 20, np.int64), "i32": np.array(0, np.int32), "u8": np.array(200, np.uint8),
        "i8": np.array(5, np.int8), "b0": np.array(True), "f0": np.array(1.5, np.float32),
        "h0": np.array(-2.5, np.float16), "empty": np.zeros((0, 5), np.float32), "bools": np.array([True, False]),
        "u64": np.array([1, 2], np.uint64), "é.w": np.arange(6, dtype=np.float32).reshape(2, 3),
    }
    tensors = {name: mindspore.Tensor(value) for name, value in kinds.items()}
    if fmt == "ckpt":
        tensors["bf"] = mindspore.Tensor(np.ones((3, 4), np.float32)).astype(mindspore.bfloat16)
        tensors["bf0"] = mindspore.Tensor(np.array(1.5, np.float32)).astype(mindspore.bfloat16)
    extra = {"append_dict": {"note": "run-7", "epoch": 3, "lr": 0.5, "flag": True}} if fmt == "ckpt" else {}
    src = tmp_path / "src"
    src.mkdir()
    halves = [dict(list(tensors.items())[::2]), dict(list(tensors.items())[1::2])]
    for i, half in enumerate(halves):
        path = _save(src / f"part{i}.{fmt}", half, fmt, **extra)
        assert open_ms_file(path).crc is not None and not _refused_by_mindspore(path)
        import_checkpoint(path, tmp_path / f"one{i}")
        kept = mindspore.load_checkpoint(str(path), crc_check=True, format=fmt)  # .ckpt drops empty tensors
        targets = {name: None for name in half if name in kept}
        assert len(targets) >= len(half) - 1
        dcp.load(targets, checkpoint_id=tmp_path / f"one{i}", no_dist=True)
        for name in targets:
            assert targets[name].tobytes() == half[name].asnumpy().tobytes(), name
