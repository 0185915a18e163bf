"""A target list, tuple or empty dict that would take less than the checkpoint holds under it is refused: the
target's structure says what loads, so the rest was silently dropped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import ShardedTensor


@pytest.fixture(name="saved")
def _saved(tmp_path: Path) -> Path:
    dcp.save({"sched": {"milestones": [10, 20, 30], "gamma": 0.1}, "hist": (1, 2, 3), "w": np.ones(2, np.float32),
              "opt": {"state": {"0": {"m": np.full(2, 5.0)}, "1": {"m": np.full(2, 6.0)}}}}, checkpoint_id=tmp_path)
    return tmp_path


def test_a_shorter_list_or_tuple_is_refused(saved: Path) -> None:
    """[5, 15] loaded [10, 20] (30 dropped), (0,) loaded (1,)."""
    target = {"sched": {"milestones": [5, 15], "gamma": 0.5}, "hist": (0,), "w": np.zeros(2, np.float32)}
    with pytest.raises(dcp.CheckpointValueError) as refused:
        dcp.load(target, checkpoint_id=saved)
    message = str(refused.value)
    assert "key 'sched.milestones': the target list has 2 item(s)" in message and "'sched.milestones.2'" in message
    assert "key 'hist': the target tuple has 1 item(s)" in message and "rank 0" in message
    assert target == {"sched": {"milestones": [5, 15], "gamma": 0.5}, "hist": (0,), "w": target["w"]}
    assert not target["w"].any()
    target = {"sched": {"milestones": [None] * 3, "gamma": 0.5}, "hist": (0, 0, 0), "w": np.zeros(2, np.float32)}
    dcp.load(target, checkpoint_id=saved)
    assert target["sched"] == {"milestones": [10, 20, 30], "gamma": 0.1} and target["hist"] == (1, 2, 3)


def test_an_empty_dict_the_checkpoint_fills_is_refused(saved: Path) -> None:
    """An optimizer state not created yet ({}) loaded none of the stored state."""
    target = {"w": np.zeros(2, np.float32), "opt": {"state": {}}}
    with pytest.raises(dcp.CheckpointValueError,
                       match=r"key 'opt.state': the target is an empty dict.*'opt.state.0.m'"):
        dcp.load(target, checkpoint_id=saved)
    assert not target["w"].any()
    target = {"w": np.zeros(2, np.float32), "opt": {"state": {"0": {"m": None}, "1": {"m": None}}}}
    dcp.load(target, checkpoint_id=saved)
    np.testing.assert_array_equal(target["opt"]["state"]["1"]["m"], [6.0, 6.0])


def test_a_subset_of_the_checkpoint_still_loads(saved: Path) -> None:
    """Leaving keys out (or a whole group) is how a subset is loaded; empty containers nothing is stored under are
    fine."""
    target = {"w": np.zeros(2, np.float32), "extra": {}, "empty": [], "sched": {"gamma": 0.0}}
    dcp.load(target, checkpoint_id=saved)
    assert target["sched"] == {"gamma": 0.1} and target["w"][0] == 1


def test_containers_of_sharded_tensors_are_not_checked(tmp_path: Path) -> None:
    """Global keys need not follow local paths: this stage's list of 2 layers holds layers 2 and 3 of 4."""
    layers = [{"w": ShardedTensor.from_rank_offsets(f"layers.{i}.w", np.full(2, i, np.float32))} for i in range(4)]
    dcp.save({"layers": layers}, checkpoint_id=tmp_path)
    stage = [{"w": ShardedTensor.from_rank_offsets(f"layers.{i}.w", np.zeros(2, np.float32))} for i in (2, 3)]
    dcp.load({"layers": stage}, checkpoint_id=tmp_path)
    assert stage[0]["w"].data[0] == 2 and stage[1]["w"].data[0] == 3
