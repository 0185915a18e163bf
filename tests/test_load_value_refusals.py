"""A load refused for a stored value it may not or cannot decode changes no target (all or nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import StandardLoadPlanner, StandardSavePlanner

ms.set_device("CPU")


class Schedule:
    def __init__(self, milestones: list[int]) -> None:
        self.milestones = milestones


def _targets() -> dict:
    return {"w": Parameter(Tensor(np.zeros((64, 32), np.float32)), name="w"),
            "big": np.zeros(1 << 18, np.float32), "step": 0}


def _unchanged(target: dict) -> None:
    assert not target["w"].asnumpy().any() and not target["big"].any() and target["step"] == 0


def test_pickled_value_refused_before_any_tensor_lands(tmp_path: Path) -> None:
    state = {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32), "big": np.arange(1 << 18, dtype=np.float32),
             "step": 7, "sched": Schedule([10, 20])}
    dcp.save(state, checkpoint_id=tmp_path, planner=StandardSavePlanner(allow_pickle=True))
    target = {**_targets(), "sched": None}
    with pytest.raises(dcp.UnsafeCheckpointError) as refused:
        dcp.load(target, checkpoint_id=tmp_path)
    _unchanged(target)
    assert "'sched'" in str(refused.value) and "no target was changed" in str(refused.value)
    assert target["sched"] is None
    with pytest.raises(dcp.UnsafeCheckpointError, match="'sched'"):  # the one-liner the same way
        hyper_parallel.load_checkpoint(tmp_path, {"w": target["w"], "sched": None})
    assert not target["w"].asnumpy().any()
    dcp.load(target, checkpoint_id=tmp_path, planner=StandardLoadPlanner(allow_pickle=True))
    np.testing.assert_array_equal(target["w"].asnumpy(), state["w"])
    assert target["sched"].milestones == [10, 20] and target["step"] == 7


_SAVE_WITH_A_HANDLER = """
import sys
import numpy as np
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint.type_handlers import TypeHandler

class Fraction:
    def __init__(self, num, den):
        self.num, self.den = num, den

class FractionHandler(TypeHandler):
    type_string = "test.safety9.fraction"
    def serialize(self, value):
        return f"{value.num}/{value.den}".encode()
    def deserialize(self, data):
        return Fraction(*map(int, data.decode().split("/")))

dcp.register_type_handler(Fraction, FractionHandler())
dcp.save({"w": np.ones((64, 32), np.float32), "big": np.ones(1 << 18, np.float32), "step": 3,
          "ratio": Fraction(1, 3)}, checkpoint_id=sys.argv[1])
"""


def test_value_of_an_unregistered_type_refused_before_any_tensor_lands(tmp_path: Path) -> None:
    """Saved by a process that registered a handler, loaded by one that did not."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    subprocess.run([sys.executable, "-c", _SAVE_WITH_A_HANDLER, str(tmp_path)], env=env, check=True, timeout=300)
    target = {**_targets(), "ratio": None}
    with pytest.raises(dcp.UnsupportedFormatError) as refused:
        dcp.load(target, checkpoint_id=tmp_path)
    _unchanged(target)
    message = str(refused.value)
    assert "'ratio'" in message and "test.safety9.fraction" in message and "no target was changed" in message
    assert target["ratio"] is None
