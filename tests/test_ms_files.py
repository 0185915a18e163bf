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
from hyper_parallel.cli import _ms_files, _ms_write, import_checkpoint
from hyper_parallel.cli._ms_files import open_ms_file
from hyper_parallel.cli._ms_write import MsItem, string_item, write_ms_file
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
    monkeypatch.setattr(_ms_write, "CKPT_CHUNK_BYTES", 48)  # MindSpore's rule, at 512 MiB
    tensors = _tensors()
    write_ms_file(tmp_path / "split.ckpt", _items(tensors), fmt="ckpt")
    loaded = mindspore.load_checkpoint(str(tmp_path / "split.ckpt"))
    file = open_ms_file(tmp_path / "split.ckpt")
    assert len(file.entries["net.w"].segments) == 3  # 140 bytes in 48-byte values
    for name, tensor in tensors.items():
        assert loaded[name].asnumpy().tobytes() == tensor.asnumpy().tobytes() == file.raw(name).tobytes()
    # Sample windows of the content (the import's replica samples), across the values' boundaries.
    whole = tensors["net.w"].asnumpy().tobytes()
    assert file.peek("net.w", (0, 40, 90, 130), 10) == whole[0:10] + whole[40:50] + whole[90:100] + whole[130:140]


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


def _pages(offset: int, length: int) -> tuple[int, int]:
    """The page-aligned range holding ``[offset, offset + length)``."""
    page = _ms_files.mmap.PAGESIZE
    return offset - offset % page, -(-(offset + length) // page) * page


def _covered(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether ``(start, length)`` ranges cover ``[start, end)`` without a hole."""
    for s, n in sorted(ranges):
        if s <= start < s + n:
            start = s + n
    return start >= end


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_import_announces_each_tensor_exactly_in_bounded_ranges_and_stays_bit_exact(tmp_path, monkeypatch, fmt):
    """Every tensor's pages are announced (``MADV_WILLNEED``), nothing else, one read-ahead window at most per call.

    One call for a whole tensor made the kernel read only its first window (at most max(read-ahead
    window, device's largest request)) and fault the rest in one 4 KiB page at a time: 6-8x slower.
    Readahead (``MADV_SEQUENTIAL``) reads past a tensor's end: not used while the budget lasts. The
    import is bit-exact against what MindSpore saved, and MindSpore loads the same values.
    """
    rng = np.random.default_rng(11)
    tensors = {
        "big.w": mindspore.Tensor(rng.standard_normal((512, 300)).astype(np.float32)),  # 600 KiB: 5 windows
        "big.e": mindspore.Tensor(rng.standard_normal((256, 130)).astype(np.float32)).astype(BF16),
        "small.b": mindspore.Tensor(rng.standard_normal(7).astype(np.float16)),
        "step": mindspore.Tensor(np.array(3, dtype=np.int64)),
    }
    src = tmp_path / f"net.{fmt}"
    mindspore.save_checkpoint([{"name": k, "data": v} for k, v in tensors.items()], str(src), format=fmt)
    window = 128 * 1024
    _AdviceLog.calls = []
    monkeypatch.setattr(_ms_files, "read_ahead_window", lambda device: window)
    monkeypatch.setattr(_ms_files.mmap, "mmap", _AdviceLog)
    import_checkpoint(src, tmp_path / "ckpt")
    monkeypatch.undo()
    advice = _AdviceLog.calls
    announced = [(start, length) for option, start, length in advice if option == _ms_files.mmap.MADV_WILLNEED]
    assert announced and all(option in (_ms_files.mmap.MADV_WILLNEED, _ms_files.mmap.MADV_RANDOM)
                             for option, _, _ in advice), advice  # no readahead past an end
    assert max(length for _, length in announced) == window, announced  # big.w took several calls
    contents = [seg for entry in open_ms_file(src).entries.values() for seg in entry.segments]
    for start, length in announced:  # nothing announced outside the tensors' pages
        assert any(lo <= start and start + length <= hi for lo, hi in map(_pages, *zip(*contents))), (start, length)
    for offset, length in contents:  # every tensor's bytes announced
        assert _covered(announced, offset, offset + length), (offset, length, announced)
    targets = {name: None for name in tensors}
    dcp.load(targets, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    reference = mindspore.load_checkpoint(str(src), format=fmt)
    for name, tensor in tensors.items():
        assert targets[name].tobytes() == tensor.asnumpy().tobytes(), name
        assert targets[name].tobytes() == reference[name].asnumpy().tobytes(), name


def test_past_the_budget_a_tensor_streams_and_only_its_last_two_windows_are_announced(tmp_path, monkeypatch):
    """Past the budget: readahead for the body, the last two windows announced (no readahead past the end)."""
    window = 64 * 1024
    data = np.arange(300_000, dtype=np.float32)  # 1.2 MiB
    path = tmp_path / "net.safetensors"
    save_file({"a": data, "b": data[:1000] + 1}, str(path), metadata={"format": "ms"})
    monkeypatch.setattr(_ms_files, "read_ahead_window", lambda device: window)
    monkeypatch.setattr(_ms_files.mmap, "mmap", _AdviceLog)
    file = open_ms_file(path)
    monkeypatch.undo()
    ((offset, length),) = file.entries["a"].segments
    lo, end = offset - offset % 4096, offset + length
    cut = (end - 2 * window) // 4096 * 4096  # the page at or before two windows from the end
    for budget_bytes, body_end in ((end - cut, cut), (end - cut - 1, end)):  # the tail fits / does not
        _AdviceLog.calls = []
        budget = _ms_files.ReadBudget(budget_bytes)
        assert file.raw("a", budget=budget).tobytes() == data.tobytes()
        assert budget.left == (0 if body_end == cut else budget_bytes)
        calls = _AdviceLog.calls
        seq = [(start, n) for option, start, n in calls if option == _ms_files.mmap.MADV_SEQUENTIAL]
        will = [(start, n) for option, start, n in calls if option == _ms_files.mmap.MADV_WILLNEED]
        assert seq == [(lo, body_end - lo)], calls
        if body_end == cut:  # the last two windows announced, in calls of at most the step
            assert _covered(will, cut, end) and min(s for s, _ in will) == cut, calls
            assert all(n <= 2 * window and s + n <= end for s, n in will), calls
        else:  # past the budget even for the tail: read ahead (may read a window past the end)
            assert not will, calls
    assert file.raw("b", budget=_ms_files.ReadBudget(1 << 20)).tobytes() == (data[:1000] + 1).tobytes()


def _io_read_bytes() -> int:
    with open("/proc/self/io", encoding="ascii") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("read_bytes:"))


@pytest.mark.parametrize("budget", ["memory", "tails"])
def test_the_device_reads_the_tensors_asked_for_once_and_nothing_else(tmp_path, budget):
    """Real reads (``/proc/self/io``), cold: every other tensor asked for, each 2 read-ahead windows + 1 MiB.

    Readahead past each end read the next (unneeded) tensor: device bytes 1.37x the model bytes in the
    4-rank benchmark at its smoke size. Here the device must read the tensors' own bytes, within 64 KiB.
    """
    path = tmp_path / "net.safetensors"
    probe = path.parent / "probe"
    probe.write_bytes(b"x")
    window = _ms_files.read_ahead_window(probe.stat().st_dev)
    if window is None or not 0 < window <= 16 << 20:
        pytest.skip(f"read-ahead window {window} of {tmp_path}: unknown, none or too large for a small test")
    count = (2 * window + (1 << 20)) // 4
    arrays = {f"t{i}": np.full(count, i, dtype=np.float32) for i in range(6)}
    save_file(arrays, str(path), metadata={"format": "ms"})
    with open(path, "rb") as handle:
        _ms_files.os.fsync(handle.fileno())
        _ms_files.os.posix_fadvise(handle.fileno(), 0, 0, _ms_files.os.POSIX_FADV_DONTNEED)
    before = _io_read_bytes()
    file = open_ms_file(path)
    wanted = [name for name in sorted(file.entries, key=lambda n: file.entries[n].segments[0][0])][::2]
    shared = _ms_files.ReadBudget.of_memory()
    views = [file.raw(name, budget=shared if budget == "memory" else _ms_files.ReadBudget(2 * window + 4096))
             for name in wanted]
    for name, view in zip(wanted, views):
        assert view.tobytes() == arrays[name].tobytes(), name
    read = _io_read_bytes() - before
    if read == 0:
        pytest.skip(f"{tmp_path}: no device reads accounted (tmpfs?)")
    needed = sum(file.entries[name].nbytes for name in wanted)
    assert needed <= read <= needed + (64 << 10), (read, needed, window)
