"""A relative checkpoint id or manager root names the directory it named when given, whatever the script's
working directory does afterwards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp


def test_async_save_to_a_relative_id_lands_where_it_was_called(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The background writing ran in the new working directory: the save failed, or landed in (and replaced)
    another checkpoint of that name."""
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    other = np.full(1 << 16, 7, np.float32)
    dcp.save({"x": other}, checkpoint_id=tmp_path / "elsewhere" / "ck")  # another checkpoint named ck
    monkeypatch.chdir(tmp_path / "run")
    state = np.arange(1 << 20, dtype=np.float32)
    handle = dcp.async_save({"x": state}, checkpoint_id="ck")
    monkeypatch.chdir(tmp_path / "elsewhere")
    handle.result()
    target = {"x": np.zeros_like(state)}
    dcp.load(target, checkpoint_id=tmp_path / "run" / "ck")
    np.testing.assert_array_equal(target["x"], state)
    kept = {"x": np.zeros_like(other)}
    dcp.load(kept, checkpoint_id=tmp_path / "elsewhere" / "ck")
    np.testing.assert_array_equal(kept["x"], other)


def test_reader_of_a_relative_id_reads_the_directory_it_was_given(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    dcp.save({"x": np.ones(4, np.float32)}, checkpoint_id=tmp_path / "ck")
    monkeypatch.chdir(tmp_path)
    reader = dcp.FileSystemReader("ck")
    monkeypatch.chdir("/")
    target = {"x": np.zeros(4, np.float32)}
    dcp.load(target, storage_reader=reader)
    np.testing.assert_array_equal(target["x"], np.ones(4, np.float32))


def test_manager_with_a_relative_root_keeps_to_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a chdir the manager listed, resumed from and pruned the steps of another root of that name
    (max_to_keep=1 deleted another project's step)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    state = np.arange(8, dtype=np.float32)
    monkeypatch.chdir(tmp_path / "elsewhere")
    dcp.CheckpointManager("ckpts", max_to_keep=1).save(100, {"x": state})
    monkeypatch.chdir(tmp_path / "run")
    manager = dcp.CheckpointManager("ckpts", max_to_keep=1)
    manager.save(1, {"x": state})
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert manager.all_steps() == [1]
    manager.save(2, {"x": state})
    assert manager.all_steps() == [2]
    assert sorted(p.name for p in (tmp_path / "run" / "ckpts").glob("step_*")) == ["step_00000002"]
    assert sorted(p.name for p in (tmp_path / "elsewhere" / "ckpts").glob("step_*")) == ["step_00000100"]
    assert manager.directory(2) == tmp_path / "run" / "ckpts" / "step_00000002"


def test_a_working_directory_removed_fails_only_relative_local_ids(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process whose working directory was deleted still saves to and loads from an object store URL and an
    absolute directory; a relative local id is refused naming it and the fix (was a bare FileNotFoundError for
    the URL too: the object storage classes resolved a placeholder path against the missing directory)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    state = {"x": np.arange(6, dtype=np.float32)}
    dcp.save(state, storage_writer=dcp.FsspecWriter("memory://review10/ck"))
    target = {"x": np.zeros(6, np.float32)}
    dcp.load(target, storage_reader=dcp.FsspecReader("memory://review10/ck"))
    np.testing.assert_array_equal(target["x"], state["x"])
    dcp.save(state, checkpoint_id=tmp_path / "abs")
    for make in (dcp.FileSystemWriter, dcp.FileSystemReader):
        with pytest.raises(dcp.CheckpointValueError, match="'ck' is relative.*working directory.*absolute"):
            make("ck")
