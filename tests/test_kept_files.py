"""A load reads the data files its verify pass opened, through the descriptors that pass kept: a file deleted or
replaced by another between the passes is loaded as verified (retention and re-saves during a load:
tests/fault/test_fault_concurrency.py); beyond the cap of kept files (a share of
RLIMIT_NOFILE) a replaced file is refused by name with no target changed; no descriptor outlives the load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint._device_reads import _read_direct
from hyper_parallel.core.distributed_checkpoint._kept_files import MAX_KEPT_FILES, keep_cap
from tile_only import strip_flat_digests

ms.set_device("CPU")

class BetweenPasses(dcp.FileSystemReader):
    """A real reader that runs ``between()`` once after the verify pass, before the read pass.

    The load engine verifies every rank's plan (``verify_data``), then calls ``read_data``: the hook runs at the
    start of ``read_data``, when every data file has been opened and checked once.
    """

    def __init__(self, path: Path, between: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.between: Callable[[], None] | None = between

    def read_data(self, plan, planner):
        between, self.between = self.between, None
        if between is not None:
            between()
        return super().read_data(plan, planner)


def _state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    state: dict[str, Any] = {f"w{i}": ms.Parameter(ms.Tensor(rng.standard_normal((64, 96)).astype(np.float32)),
                                                   name=f"w{i}") for i in range(6)}
    state["half"] = ms.Tensor(rng.standard_normal((128, 33)).astype(np.float16))
    state["tiled"] = ms.Parameter(ms.Tensor(rng.standard_normal((64, 1024)).astype(np.float32)), name="tiled")
    return state


def _values(state: dict[str, Any]) -> dict[str, np.ndarray]:
    return {name: value.asnumpy().copy() for name, value in state.items()}


def _data_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _replace_with_other_file(data_file: Path) -> None:
    """Put another file (same size, other bytes: a later save's) under the name, atomically."""
    other = data_file.with_suffix(".new")
    other.write_bytes(bytes(255 - b for b in data_file.read_bytes()))
    os.replace(other, data_file)


def _open_in(directory: Path) -> list[str]:
    """This process's descriptors open on files under ``directory`` (deleted ones too)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


@pytest.fixture(name="saved")
def _saved(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    state = _state(0)
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=4), no_dist=True)
    assert len(_data_files(path)) == 4
    return path, _values(state)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("change", ["delete", "replace"])
def test_files_deleted_or_replaced_between_the_passes_load_as_verified(saved, verify, change) -> None:
    path, expected = saved

    def between() -> None:
        for data_file in _data_files(path):
            if change == "delete":
                data_file.unlink()
            else:
                _replace_with_other_file(data_file)

    target = _state(1)
    dcp.load(target, storage_reader=BetweenPasses(path, between, verify_checksums=verify), no_dist=True)
    for name, values in _values(target).items():
        assert values.tobytes() == expected[name].tobytes(), name
    assert not _open_in(path)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("change", ["delete", "replace"])
def test_resharded_narrow_rows_of_a_changed_file_load_as_verified(tmp_path, verify, change) -> None:
    """A column shard of 2 KiB rows (1 KiB runs): read without readahead, O_DIRECT where the filesystem allows."""
    full = (np.arange(1024 * 1024, dtype=np.float32) % 2039).reshape(1024, 1024).astype(np.float16)
    path = tmp_path / "ckpt"
    dcp.save({"w": ms.Tensor(full)}, checkpoint_id=path, no_dist=True)
    target = DTensor(ms.Tensor(np.zeros((1024, 512), np.float16)), Layout((2,), (-1, 0)), full.shape, rank=1)
    act = Path.unlink if change == "delete" else _replace_with_other_file
    reader = BetweenPasses(path, lambda: [act(f) for f in _data_files(path)], verify_checksums=verify)
    dcp.load({"w": target}, storage_reader=reader, no_dist=True)
    assert np.array_equal(target.to_local().asnumpy(), full[:, 512:])
    assert not _open_in(path)


def test_o_direct_reads_the_open_file_not_a_file_that_took_its_name(tmp_path) -> None:
    data = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    name = tmp_path / "data.bin"
    name.write_bytes(data.tobytes())
    fd = os.open(name, os.O_RDONLY)
    try:
        name.unlink()
        name.write_bytes(bytes(1 << 20))  # another file under the name
        starts = np.arange(100, 1 << 20, 4096, dtype=np.int64)[:-1]  # 1000-byte runs, one per page
        got = np.zeros((starts.size, 1000), np.uint8)
        if not _read_direct(fd, name, "k", starts, 1000, got):
            pytest.skip("the filesystem of tmp_path refuses O_DIRECT")
        assert np.array_equal(got, data[starts[:, None] + np.arange(1000)])
    finally:
        os.close(fd)


class _FailingPlanner(dcp.StandardLoadPlanner):
    """Fails when the read pass lands its first tensor (a failure after every file was opened)."""

    def apply_tensor(self, item, tensor):
        raise RuntimeError("planner failed on purpose")


def test_no_descriptor_left_after_success_failure_or_a_corrupt_tile(saved) -> None:
    path, expected = saved
    target = _state(1)
    dcp.load(target, storage_reader=dcp.FileSystemReader(path, thread_count=2), no_dist=True)
    assert not _open_in(path)
    with pytest.raises(RuntimeError, match="on purpose"):
        dcp.load(_state(1), storage_reader=dcp.FileSystemReader(path), planner=_FailingPlanner(), no_dist=True)
    assert not _open_in(path)
    entries = json.loads((path / "metadata.json").read_text())["storage_data"]
    entry = next(e for e in entries if e["fqn"] == "tiled")
    assert entry["checksum"]["block_shape"]  # tile checksums
    assert strip_flat_digests(path)  # a whole read verifies by flat blocks when it can: take the tile path here
    data_file = path / entry["file"]
    raw = bytearray(data_file.read_bytes())
    raw[entry["byte_offset"] + entry["length"] - 1] ^= 0x10
    data_file.write_bytes(bytes(raw))
    target = _state(1)
    before = _values(target)
    with pytest.raises(dcp.CorruptCheckpointError, match="key 'tiled' \\(tile"):
        dcp.load(target, storage_reader=dcp.FileSystemReader(path, thread_count=2), no_dist=True)
    assert all(np.array_equal(values, before[name]) for name, values in _values(target).items())
    assert not _open_in(path)


def test_a_reader_used_without_finish_load_closes_its_files_when_dropped(saved) -> None:
    path, _ = saved
    reader = BetweenPasses(path, lambda: None)
    planner = dcp.StandardLoadPlanner()
    target = _state(1)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    planner.configure_planner(target, metadata, rank=0, world_size=1, is_coordinator=True)
    reader.read_data(planner.build_local_plan(), planner).result()
    assert len(_open_in(path)) == 4  # kept until the load ends
    del reader
    assert not _open_in(path)


def test_cap_is_a_share_of_the_open_file_limit() -> None:
    import resource  # pylint: disable=import-outside-toplevel

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    expected = MAX_KEPT_FILES if soft == resource.RLIM_INFINITY else min(MAX_KEPT_FILES, soft // 4)
    assert keep_cap() == expected


_OVER_THE_CAP = r'''
import os, resource, sys
import numpy as np
import mindspore as ms
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._kept_files import keep_cap

ms.set_device("CPU")
path = sys.argv[1]
files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
originals = {name: open(os.path.join(path, name), "rb").read() for name in files}
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
cap = keep_cap()
assert cap == 16 and len(files) == 40, (cap, len(files))


def open_here():
    count = 0
    for n in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{n}").startswith(path)
        except OSError:
            pass
    return count


class BetweenPasses(dcp.FileSystemReader):
    def __init__(self, between, **kwargs):
        super().__init__(path, thread_count=1, **kwargs)  # one thread: files opened in name order
        self.between = between

    def read_data(self, plan, planner):
        between, self.between = self.between, None
        if between is not None:
            between()
        return super().read_data(plan, planner)


def replace(name):
    data = open(os.path.join(path, name), "rb").read()
    with open(os.path.join(path, name + ".new"), "wb") as handle:
        handle.write(bytes(255 - b for b in data))
    os.replace(os.path.join(path, name + ".new"), os.path.join(path, name))


def overwrite_in_place(name):
    with open(os.path.join(path, name), "r+b") as handle:  # the same inode
        handle.seek(-64, os.SEEK_END)
        handle.write(bytes(64))


def restore():
    for name, data in originals.items():
        with open(os.path.join(path, name), "wb") as handle:
            handle.write(data)


def targets():
    return {f"k{i:02d}": ms.Tensor(np.zeros(256, np.float32)) for i in range(40)}


def check(state):
    for i in range(40):
        assert np.array_equal(state[f"k{i:02d}"].asnumpy(), np.full(256, i, np.float32)), i


# Many files under the lowered limit: 16 kept, 24 opened twice by name.
for verify in (True, False):
    state = targets()
    dcp.load(state, storage_reader=dcp.FileSystemReader(path, thread_count=2, verify_checksums=verify), no_dist=True)
    check(state)
    assert open_here() == 0
# A kept file (the 4th opened) replaced between the passes: loaded as verified.
state = targets()
dcp.load(state, storage_reader=BetweenPasses(lambda: replace(files[3])), no_dist=True)
check(state)
restore()
def refused(act, error, needles, label, **kwargs):
    """A load with ``act`` run between its passes fails with ``error`` saying ``needles``; no target changed."""
    state = targets()
    try:
        dcp.load(state, storage_reader=BetweenPasses(act, **kwargs), no_dist=True)
    except error as exc:
        assert all(needle in str(exc) for needle in needles), str(exc)
    else:
        raise AssertionError(f"{label}: not refused")
    assert all(not value.asnumpy().any() for value in state.values()), label
    assert open_here() == 0
    restore()


# A file beyond the cap (the 30th) replaced, or deleted: refused by name, no target changed.
for change in ("replace", "delete"):
    name = files[29]
    act = (lambda: replace(name)) if change == "replace" else (lambda: os.unlink(os.path.join(path, name)))
    refused(act, dcp.CheckpointNotFoundError, (name, "no target was changed", "at most 16 data files"),
            f"{change} beyond the cap", verify_checksums=change == "delete")
# A kept file (the 4th) or one beyond the cap (the 30th) written to in place: refused by name, no target changed.
for name in (files[3], files[29]):
    for f in files:
        os.utime(os.path.join(path, f), ns=(10**18, 10**18))  # an old checkpoint (not written this timestamp tick)
    refused(lambda: overwrite_in_place(name), dcp.CorruptCheckpointError,
            (name, "was written to", "no target was changed"), f"{name} written to in place")
print("OK")
'''


def test_over_the_cap_files_are_reopened_and_checked_under_a_lowered_open_file_limit(tmp_path) -> None:
    path = tmp_path / "ckpt"
    state = {f"k{i:02d}": ms.Tensor(np.full(256, i, np.float32)) for i in range(40)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=40), no_dist=True)
    script = tmp_path / "over_the_cap.py"
    script.write_text(_OVER_THE_CAP)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=600,
                            env=env, check=False)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout + result.stderr


def test_a_file_beyond_the_cap_is_reopened_only_if_it_is_the_one_checked(tmp_path) -> None:
    """KeptFiles with a cap of 0: the first pass's file is noted by identity; the read pass reopens it by name."""
    from hyper_parallel.core.distributed_checkpoint._kept_files import KeptFiles  # pylint: disable=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource  # pylint: disable=import-outside-toplevel

    name = tmp_path / "data.safetensors"
    name.write_bytes(b"a" * 100)
    files = KeptFiles()
    fd = os.open(name, os.O_RDONLY)
    assert not files.keep("data.safetensors", FileSource(fd), name, "w", os.fstat(fd))  # cap 0: noted, not kept
    os.close(fd)
    assert files.get("data.safetensors") is None
    files.check_before_read(tmp_path)
    again = files.reopen("data.safetensors", name, "w", tmp_path)
    assert os.pread(again, 3, 0) == b"aaa"
    os.close(again)
    _replace_with_other_file(name)  # same size, another inode
    with pytest.raises(dcp.CheckpointNotFoundError, match="no target was changed") as checked:
        files.check_before_read(tmp_path)
    assert "data.safetensors (key 'w')" in str(checked.value) and "at most 0 data files" in str(checked.value)
    with pytest.raises(dcp.CheckpointNotFoundError, match="may hold new values"):
        files.reopen("data.safetensors", name, "w", tmp_path)
    name.unlink()
    with pytest.raises(FileNotFoundError, match="deleted or replaced"):
        files.reopen("data.safetensors", name, "w", tmp_path)
    files.close_all()
    with pytest.raises(dcp.CheckpointNotFoundError, match="data.safetensors"):  # not noted: plainly missing
        files.reopen("data.safetensors", name, "w", tmp_path)
    name.write_bytes(b"b" * 100)  # noted anew, then written to in place (same inode, same size)
    os.utime(name, ns=(10**18, 10**18))
    fd = os.open(name, os.O_RDONLY)
    assert not files.keep("data.safetensors", FileSource(fd), name, "w", os.fstat(fd))
    os.close(fd)
    with open(name, "r+b") as handle:
        handle.write(b"c")
    with pytest.raises(dcp.CorruptCheckpointError, match=r"data.safetensors \(key 'w'\) .* was written to .*"
                                                         r"no target was changed"):
        files.check_before_read(tmp_path)
    assert not _open_in(tmp_path)


def _age(path: Path) -> None:
    """Date the data files back, as those of a checkpoint saved a while ago (a write in the timestamp tick of the
    save's own last write would keep the modification time: see _kept_files)."""
    for data_file in _data_files(path):
        os.utime(data_file, ns=(10**18, 10**18))


def _overwrite_in_place(data_file: Path) -> None:
    """Write other bytes over the file's data, through the same inode (as open(name, "r+b") or dd conv=notrunc)."""
    size = data_file.stat().st_size
    with open(data_file, "r+b") as handle:
        handle.seek(size // 2)
        handle.write(bytes(255 - b for b in data_file.read_bytes()[size // 2:]))


@pytest.mark.parametrize("verify", [True, False])
def test_a_file_written_to_in_place_between_the_passes_fails_the_load_with_no_target_changed(saved, verify) -> None:
    """A descriptor keeps a deleted or replaced file's bytes, not those of a file written to through its inode:
    the read pass would land bytes never verified. The size and modification time noted at the first pass's open
    are checked before the read pass."""
    path, _ = saved
    _age(path)
    victim = _data_files(path)[2]
    target = _state(1)
    before = _values(target)
    reader = BetweenPasses(path, lambda: _overwrite_in_place(victim), verify_checksums=verify)
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load(target, storage_reader=reader, no_dist=True)
    text = str(caught.value)
    assert f"data file {victim.name} (key '" in text and f"of checkpoint {path} was written to" in text, text
    assert "no target was changed" in text and "find what writes into the checkpoint" in text, text
    for name, values in _values(target).items():
        assert values.tobytes() == before[name].tobytes(), name
    assert not _open_in(path)


class _WritesWhileReading(dcp.StandardLoadPlanner):
    """Writes into every data file, in place, when the read pass lands its first tensor."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path: Path | None = path

    def apply_tensor(self, read_item, tensor) -> None:
        path, self.path = self.path, None
        if path is not None:
            for data_file in _data_files(path):
                _overwrite_in_place(data_file)
        super().apply_tensor(read_item, tensor)


def test_a_file_written_to_during_the_read_pass_fails_the_load_saying_targets_may_hold_unverified_bytes(
        saved) -> None:
    path, _ = saved
    _age(path)
    target = _state(1)
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path, thread_count=1),
                 planner=_WritesWhileReading(path), no_dist=True)
    text = str(caught.value)
    assert "was written to" in text and "may already hold bytes of it that were never verified" in text, text
    assert not _open_in(path)


def test_a_load_of_an_aged_unchanged_checkpoint_is_not_refused(saved) -> None:
    path, expected = saved
    _age(path)
    target = _state(1)
    dcp.load(target, storage_reader=BetweenPasses(path, lambda: None), no_dist=True)
    for name, values in _values(target).items():
        assert values.tobytes() == expected[name].tobytes(), name
