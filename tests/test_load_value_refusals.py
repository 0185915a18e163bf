"""A load refused for a stored value it may not or cannot decode changes no target (all or nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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


class Fraction:
    def __init__(self, num: int, den: int) -> None:
        self.num, self.den = num, den


class _StrictFractionHandler(dcp.TypeHandler):
    """Decodes only reduced fractions (a user handler that raises on some stored bytes)."""

    type_string = "test.safety10.fraction"

    def serialize(self, value: Fraction) -> bytes:
        return f"{value.num}/{value.den}".encode()

    def deserialize(self, data: bytes) -> Fraction:
        num, den = map(int, data.decode().split("/"))
        if den % num == 0 and num != 1:
            raise ValueError(f"{num}/{den} is not reduced")
        return Fraction(num, den)


def _saved_with_fraction(path: Path, value: Any) -> dict:
    state = {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32), "big": np.arange(1 << 18, dtype=np.float32),
             "step": 7, "ratio": value}
    dcp.save(state, checkpoint_id=path)
    return state


def test_a_type_handler_failing_to_decode_changes_no_target(tmp_path: Path) -> None:
    """The handler's error came after the tensors had landed: the load raised half-applied (the weights of the
    checkpoint, the step and values of before)."""
    dcp.register_type_handler(Fraction, _StrictFractionHandler(), override=True)
    state = _saved_with_fraction(tmp_path, Fraction(2, 4))
    target = {**_targets(), "ratio": None}
    with pytest.raises(dcp.CorruptCheckpointError, match="'ratio'.*not reduced"):
        dcp.load(target, checkpoint_id=tmp_path)
    _unchanged(target)
    assert target["ratio"] is None
    for single_replica_read in (False, True):
        dcp.save({**state, "ratio": Fraction(1, 3)}, checkpoint_id=tmp_path / "good")
        target = {**_targets(), "ratio": None}
        dcp.load(target, checkpoint_id=tmp_path / "good",
                 planner=StandardLoadPlanner(single_replica_read=single_replica_read))
        np.testing.assert_array_equal(target["w"].asnumpy(), state["w"])
        np.testing.assert_array_equal(target["big"], state["big"])
        assert (target["ratio"].num, target["ratio"].den, target["step"]) == (1, 3, 7)


def test_a_nested_leaf_of_an_unknown_type_changes_no_target(tmp_path: Path) -> None:
    """A ShardedObject's container holding a value whose type string this process does not know: refused only
    when decoded, after the tensors had landed."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    script = _SAVE_WITH_A_HANDLER.replace('"ratio": Fraction(1, 3)}', '"ratio": dcp.ShardedObject(\n'
                                          '    "ratio", {"r": [Fraction(1, 3)]}, (1,), (0,))}')
    assert script != _SAVE_WITH_A_HANDLER
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, check=True, timeout=300)
    target = {**_targets(), "ratio": dcp.ShardedObject("ratio", None, (1,), (0,))}
    with pytest.raises(dcp.UnsupportedFormatError, match="'ratio'.*test.safety9.fraction"):
        dcp.load(target, checkpoint_id=tmp_path)
    _unchanged(target)
    assert target["ratio"].data is None


def test_values_decoded_before_the_tensors_are_read_once(tmp_path: Path) -> None:
    """The values read ahead of the tensors are left out of the read pass: every stored byte is read once, and the
    planner decodes each value once."""
    dcp.save({"w": np.arange(6, dtype=np.float32), "step": 42, "note": "n" * 300}, checkpoint_id=tmp_path)
    stored = sum(info.length for info in dcp.read_metadata(tmp_path).storage_data.values())
    applied: list[str] = []

    class Counting(StandardLoadPlanner):
        def apply_bytes(self, read_item, value):
            applied.append(read_item.dest_index.fqn)
            super().apply_bytes(read_item, value)

    reader = dcp.FileSystemReader(tmp_path)
    target = {"w": np.zeros(6, np.float32), "step": 0, "note": ""}
    dcp.load(target, storage_reader=reader, planner=Counting())
    assert target["step"] == 42 and target["note"] == "n" * 300
    np.testing.assert_array_equal(target["w"], np.arange(6, dtype=np.float32))
    assert sorted(applied) == ["note", "step"]
    assert reader.bytes_read == stored
