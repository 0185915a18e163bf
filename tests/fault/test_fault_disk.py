"""Disk full, I/O errors and read-only storage: a clear error, nothing committed, earlier checkpoints intact.

Real conditions where the machine allows it (a small or read-only tmpfs
mounted for the test; skipped with the reason otherwise), and injected
``ENOSPC`` / ``EIO`` at every I/O step of a save everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _async_engine
from hyper_parallel.core.distributed_checkpoint._file_ops import FileOps

from fault_common import (
    SCRIPTS_DIR,
    assert_only_committed_files,
    assert_same_state,
    files_of,
    load_into_blank,
    make_state,
    mounted_tmpfs,
)


def _small(seed: int) -> dict[str, Any]:
    return {"w": np.arange(1000, dtype=np.float32) * seed, "step": seed, "tag": f"small-{seed}"}


@contextlib.contextmanager
def _tmpfs_or_skip(path: Path, options: str) -> Iterator[Path]:
    stack = contextlib.ExitStack()
    try:
        disk = stack.enter_context(mounted_tmpfs(path, options))
    except OSError as exc:
        pytest.skip(f"{exc}: a real small or read-only filesystem needs root and mount permission")
    with stack:
        yield disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs: holds a small checkpoint, not a 1.2 MB one."""
    with _tmpfs_or_skip(tmp_path / "disk", "size=512k") as disk:
        yield disk


def _assert_io_error(caught: pytest.ExceptionInfo, path: Path, reason: str) -> None:
    error = caught.value
    assert isinstance(error, dcp.CheckpointIOError) and isinstance(error, OSError), repr(error)
    assert reason in str(error) and str(path) in str(error), str(error)


def _assert_not_committed(path: Path) -> None:
    with pytest.raises(dcp.IncompleteCheckpointError, match="did not commit"):
        load_into_blank(path, _small(1))
    assert not [n for n in os.listdir(path) if n.endswith(".partial")]


def test_disk_full_gives_a_clear_error_and_keeps_earlier_checkpoints(small_disk: Path) -> None:
    dcp.save(_small(1), checkpoint_id=small_disk / "A", no_dist=True)
    files_a = files_of(small_disk / "A")
    big = make_state(2)

    with pytest.raises(dcp.CheckpointError) as caught:
        dcp.save(big, checkpoint_id=small_disk / "B", no_dist=True)
    _assert_io_error(caught, small_disk / "B", "No space left on device")
    assert "rank 0" in str(caught.value)
    _assert_not_committed(small_disk / "B")
    assert files_of(small_disk / "B") == [], "a failed write must not leave its data files behind"

    with pytest.raises(dcp.CheckpointIOError, match="No space left on device"):
        dcp.save(big, checkpoint_id=small_disk / "A", no_dist=True)  # over the earlier checkpoint
    assert files_of(small_disk / "A") == files_a
    handle = dcp.async_save(big, checkpoint_id=small_disk / "C", no_dist=True, staging="copy")
    with pytest.raises(dcp.CheckpointIOError, match="No space left on device"):
        handle.result(timeout=60)
    _assert_not_committed(small_disk / "C")
    # The default's first call of a process forks a writer (staging="auto"): the same error, nothing committed,
    # no data file left (the forked writer's empty directory is removed with it).
    _async_engine._POOL.release()  # pylint: disable=protected-access
    handle = dcp.async_save(big, checkpoint_id=small_disk / "D", no_dist=True)
    with pytest.raises(dcp.CheckpointIOError, match="No space left on device"):
        handle.result(timeout=60)
    assert not (small_disk / "D").exists() or files_of(small_disk / "D") == []

    assert_same_state(load_into_blank(small_disk / "A", _small(1)), _small(1))
    dcp.save(_small(3), checkpoint_id=small_disk / "B", no_dist=True)  # the space was given back
    assert_same_state(load_into_blank(small_disk / "B", _small(3)), _small(3))


def test_disk_full_at_the_commit(small_disk: Path) -> None:
    """The data fits exactly, the metadata does not: nothing committed, no temporary file left."""
    dcp.save(_small(1), checkpoint_id=small_disk / "A", no_dist=True)
    (small_disk / "B").mkdir()
    state = {"w": np.arange(5000, dtype=np.float32)}
    dcp.save(state, checkpoint_id=small_disk.parent / "probe", no_dist=True)
    stat = os.statvfs(small_disk)
    page = stat.f_frsize
    data_pages = sum(-(-p.stat().st_size // page) for p in (small_disk.parent / "probe").glob("*.safetensors"))
    data_pages += 1  # the save lease (a few bytes) takes a page too
    (small_disk / "filler").write_bytes(bytes((stat.f_bavail - data_pages) * page))
    with pytest.raises(dcp.CheckpointIOError) as caught:
        dcp.save(state, checkpoint_id=small_disk / "B", no_dist=True)
    _assert_io_error(caught, small_disk / "B", "No space left on device")
    assert "committing" in str(caught.value)
    _assert_not_committed(small_disk / "B")
    assert_same_state(load_into_blank(small_disk / "A", _small(1)), _small(1))
    (small_disk / "filler").unlink()
    dcp.save(state, checkpoint_id=small_disk / "B", no_dist=True)  # the next save sweeps the stale data files
    assert_only_committed_files(small_disk / "B")


@contextlib.contextmanager
def _file_size_limit(nbytes: int) -> Iterator[None]:
    """No file of this process grows past ``nbytes`` (writes beyond fail with EFBIG, one past it is cut short)."""
    import resource  # pylint: disable=import-outside-toplevel
    import signal  # pylint: disable=import-outside-toplevel

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_lease_cut_short_is_not_left_behind(tmp_path: Path) -> None:
    """A file size limit cut the save lease short (os.write wrote part of it, no error): the save failed on its
    data, and its release() could not parse its own torn lease, so never removed it. Every later save to this id
    was refused as 'being saved by another save' until the lease aged out (300 s)."""
    dcp.save(_small(1), checkpoint_id=tmp_path / "A", no_dist=True)
    with _file_size_limit(100):  # the lease is ~250 bytes
        with pytest.raises(dcp.CheckpointIOError, match="File too large"):
            dcp.save(_small(2), checkpoint_id=tmp_path / "A", no_dist=True)
    assert not [name for name in os.listdir(tmp_path / "A") if name.endswith(".lease")]
    assert_same_state(load_into_blank(tmp_path / "A", _small(1)), _small(1))
    dcp.save(_small(3), checkpoint_id=tmp_path / "A", no_dist=True)
    assert_same_state(load_into_blank(tmp_path / "A", _small(3)), _small(3))


def test_read_only_directory(tmp_path: Path) -> None:
    with _tmpfs_or_skip(tmp_path / "ro", "size=1m") as disk:
        dcp.save(_small(1), checkpoint_id=disk / "A", no_dist=True)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, check=False)
        if os.access(disk, os.W_OK):
            pytest.skip("cannot remount the test tmpfs read-only")
        with pytest.raises(dcp.CheckpointIOError, match="is not writable") as caught:
            dcp.save(_small(2), checkpoint_id=disk / "A", no_dist=True)
        assert str(disk / "A") in str(caught.value)
        with pytest.raises(dcp.CheckpointIOError, match="cannot create checkpoint directory") as caught:
            dcp.save(_small(2), checkpoint_id=disk / "new", no_dist=True)
        assert "Read-only file system" in str(caught.value)
        assert_same_state(load_into_blank(disk / "A", _small(1)), _small(1))  # loading needs no write access


# ------------------------------------------------------------------ injected errors


class _FailingOps(FileOps):
    """The writer's file operations, except that one call fails with ``err``.

    ``where`` is ``"<op>#<n>"`` (the n-th call of a data-phase operation),
    ``"commit:<op>"`` (the first call of ``op`` while writing the metadata's
    temporary file), ``"metadata.write"`` (same as ``commit:write``) or
    ``"fsync_directory#<n>"`` (the n-th fsync of the checkpoint directory).
    """

    def __init__(self, where: str, err: int, directory: Path) -> None:
        self.err, self.directory = err, directory
        name, _, nth = where.replace("metadata.write", "commit:write").partition("#")
        self.commit_only = name.startswith("commit:")
        self.name = name.split(":")[-1].removeprefix("os.")
        self.nth, self.calls, self.in_commit = int(nth or 1), 0, False

    def _maybe_fail(self, name: str, counted: bool = True) -> None:
        if name != self.name or not counted or (self.commit_only and not self.in_commit):
            return
        self.calls += 1
        if self.calls == self.nth:
            raise OSError(self.err, os.strerror(self.err))

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        self.in_commit = str(Path(path).name).endswith(".partial")
        self._maybe_fail("open")
        return super().open(path, flags, mode)

    def write(self, fd: int, data: Any) -> int:
        self._maybe_fail("write")
        return super().write(fd, data)

    def writev(self, fd: int, buffers: list) -> int:
        return self.write(fd, b"".join(buffers))  # one write, as counted by ``where``

    def fsync(self, fd: int) -> None:
        self._maybe_fail("fsync")
        super().fsync(fd)

    def replace(self, source: Path, target: Path) -> None:
        self._maybe_fail("replace")
        super().replace(source, target)

    def fsync_directory(self, path: Path) -> None:
        self._maybe_fail("fsync_directory", counted=Path(path) == self.directory)
        super().fsync_directory(path)


# (where, errno, phase): a data-phase failure removes the save's data files; after the
# rename the commit happened, and the error says syncing it failed.
INJECTED = [
    ("os.write#1", errno.EIO, "data"),  # the data files' writes, in whatever order the
    ("os.write#2", errno.ENOSPC, "data"),  # writer threads issue them (headers, a big
    ("os.write#3", errno.EIO, "data"),  # tensor, small items packed together)
    ("os.fsync#1", errno.EIO, "data"),
    ("fsync_directory#1", errno.EIO, "data"),
    ("metadata.write", errno.ENOSPC, "commit"),
    ("commit:os.fsync", errno.EIO, "commit"),  # the metadata's temporary file
    ("commit:os.replace", errno.EIO, "commit"),
    ("fsync_directory#2", errno.EIO, "committed"),  # the rename is done; its directory sync failed
]


@pytest.mark.parametrize("target", ["new", "resave", "async"])
@pytest.mark.parametrize("where,err,phase", INJECTED, ids=[f"{w}-{errno.errorcode[e]}" for w, e, _ in INJECTED])
def test_injected_io_error(tmp_path: Path, where: str, err: int, phase: str, target: str) -> None:
    old, new = make_state(1), make_state(2)
    dcp.save(old, checkpoint_id=tmp_path / "A", no_dist=True)
    files_a = files_of(tmp_path / "A")
    path = tmp_path / ("A" if target == "resave" else "B")
    writer = dcp.FileSystemWriter(path, file_ops=_FailingOps(where, err, path))
    with pytest.raises(dcp.CheckpointError) as caught:
        if target == "async":
            dcp.async_save(new, storage_writer=writer, no_dist=True).result(timeout=60)
        else:
            dcp.save(new, storage_writer=writer, no_dist=True)
    _assert_io_error(caught, path, os.strerror(err))
    assert not [n for n in os.listdir(path) if n.endswith(".partial")]
    if phase == "committed":
        assert_same_state(load_into_blank(path, new), new)
    elif target == "resave":
        assert_same_state(load_into_blank(path, old), old)
    else:
        _assert_not_committed(path)
    if phase == "data":
        assert files_of(path) == (files_a if target == "resave" else [])
    if target != "resave":
        assert_same_state(load_into_blank(tmp_path / "A", old), old)
    dcp.save(make_state(3), checkpoint_id=path, no_dist=True)  # the next save works and sweeps leftovers
    assert_same_state(load_into_blank(path, make_state(3)), make_state(3))
    assert_only_committed_files(path)


# ------------------------------------------------------------------ every rank, under msrun


@pytest.mark.msrun
def test_disk_full_under_msrun_fails_on_every_rank(tmp_path: Path) -> None:
    from msrun_harness import scenario_values  # pylint: disable=import-outside-toplevel
    from msrun_harness import run_workers  # pylint: disable=import-outside-toplevel

    with _tmpfs_or_skip(tmp_path / "disk", "size=256k") as disk:
        results = run_workers(SCRIPTS_DIR / "disk_full_worker.py", workers=2, tmp_path=tmp_path / "launch",
                              args=[str(disk)], timeout=300)
        values = scenario_values(results, "disk_full")
    for rank, value in enumerate(values):
        assert "CheckpointIOError" in value["classes"] and "CollectiveStepError" in value["classes"], (rank, value)
        assert "No space left on device" in value["message"] and value["failed_ranks"], (rank, value)
        assert not value["b_committed"] and value["a_intact"], (rank, value)
    assert values[0]["message"] == values[1]["message"], "every rank raises the same error"
