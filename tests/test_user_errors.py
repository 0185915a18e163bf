"""Errors a MindSpore user meets name the real cause and the fix."""

from __future__ import annotations

import logging
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout

ms.set_device("CPU")


def test_manager_root_where_a_step_is_expected(tmp_path: Path) -> None:
    manager = dcp.CheckpointManager(tmp_path / "run")
    for step in (4, 8):
        manager.save(step, {"w": np.full(2, step, np.float32)})
    with pytest.raises(dcp.IncompleteCheckpointError) as caught:
        dcp.load({"w": np.zeros(2, np.float32)}, checkpoint_id=tmp_path / "run")
    text = str(caught.value)
    assert "is a CheckpointManager root" in text and str(tmp_path / "run" / "step_00000008") in text
    assert "did not commit" not in text and "CheckpointManager(" in text
    with pytest.raises(dcp.IncompleteCheckpointError, match="step_00000008"):
        dcp.read_metadata(tmp_path / "run")


def test_mindspore_file_passed_to_load_points_at_import(tmp_path: Path) -> None:
    net = ms.nn.Dense(2, 2)
    ms.save_checkpoint(net, str(tmp_path / "net.ckpt"))
    with pytest.raises(dcp.CheckpointValueError) as caught:
        dcp.load({"weight": np.zeros((2, 2), np.float32)}, checkpoint_id=tmp_path / "net.ckpt")
    text = str(caught.value)
    assert "MindSpore .ckpt file" in text and f"hp-ckpt import {tmp_path / 'net.ckpt'} OUT_DIR" in text
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(dcp.CheckpointValueError, match="is a file, not a directory; pass the checkpoint directory"):
        dcp.read_metadata(tmp_path / "notes.txt")


def test_dtensor_saved_without_communication_init_in_a_job(tmp_path: Path, monkeypatch) -> None:
    layout = Layout((2,), (0, -1), rank_list=(0, 1))
    shard = DTensor.from_global(ms.Tensor(np.arange(8, dtype=np.float32).reshape(4, 2)), layout, rank=0)
    monkeypatch.setenv("MS_WORKER_NUM", "2")
    with pytest.raises(dcp.PlanValidationError) as caught:
        dcp.save({"w": shard}, checkpoint_id=tmp_path / "c")
    text = str(caught.value)
    assert text.startswith("MindSpore communication was not initialised")
    assert "MS_WORKER_NUM=2" in text and "mindspore.communication.init()" in text and "'w'" in text
    for option, chosen in (({"use_collectives": False}, "use_collectives=False"), ({"no_dist": True}, "no_dist=True")):
        with pytest.raises(dcp.PlanValidationError) as alone:  # asked to save alone: the option is the cause
            dcp.save({"w": shard}, checkpoint_id=tmp_path / "c", **option)
        assert f"asked to run alone ({chosen})" in str(alone.value) and "not initialised" not in str(alone.value)
        assert "'w'" in str(alone.value)
    monkeypatch.delenv("MS_WORKER_NUM")
    with pytest.raises(dcp.PlanValidationError) as plain:  # a real one-process run: the plan check alone
        dcp.save({"w": shard}, checkpoint_id=tmp_path / "c")
    assert "communication" not in str(plain.value) and "'w'" in str(plain.value)


def test_partial_load_says_what_matched_and_refuses_nothing(tmp_path: Path, caplog) -> None:
    dcp.save({"model": {"a": np.ones(2), "b": np.ones(3)}}, checkpoint_id=tmp_path / "c")
    with pytest.raises(dcp.MissingKeyError) as caught:
        dcp.load({"model": {"a": np.zeros(2), "zz": np.zeros(1)}}, checkpoint_id=tmp_path / "c")
    text = str(caught.value)
    assert "1 of 2 requested key(s)" in text and "'model.zz'" in text and "matched: 'model.a'" in text
    assert "allow_partial_load=True" in text
    other = {"a": np.zeros(2), "b": np.zeros(3)}  # another structure: no key matches
    for planner in (None, dcp.StandardLoadPlanner(allow_partial_load=True)):
        with pytest.raises(dcp.MissingKeyError) as nothing:
            dcp.load(other, checkpoint_id=tmp_path / "c", planner=planner)
        assert "Nothing would load, even with allow_partial_load=True" in str(nothing.value)
        assert "matched: none" in str(nothing.value) and "'model.a'" in str(nothing.value)
    with caplog.at_level(logging.WARNING):
        target = {"model": {"a": np.zeros(2), "zz": np.zeros(1)}}
        dcp.load(target, checkpoint_id=tmp_path / "c", planner=dcp.StandardLoadPlanner(allow_partial_load=True))
    assert target["model"]["a"].tolist() == [1.0, 1.0] and "'model.zz'" in caplog.text


def test_a_directory_of_only_rank_local_saves_names_them_when_metadata_json_is_asked_for(tmp_path: Path) -> None:
    from hyper_parallel.core.distributed_checkpoint._metadata_file import read_committed_metadata  # noqa: PLC0415

    for rank in range(5):
        (tmp_path / f"metadata.rank{rank:05d}.json").write_text("{}")
    with pytest.raises(dcp.IncompleteCheckpointError) as caught:
        read_committed_metadata(tmp_path, "metadata.json")
    text = str(caught.value)
    assert "metadata.rank00000.json, metadata.rank00001.json, metadata.rank00002.json, ..." in text
    assert "use_collectives=False" in text and "did not commit" not in text
    with pytest.raises(dcp.IncompleteCheckpointError) as gone:  # no directory to list: the plain message
        read_committed_metadata(tmp_path / "missing", "metadata.json")
    assert "did not commit" in str(gone.value)
