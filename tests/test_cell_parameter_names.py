"""A Cell holding two different Parameters of one name is refused: parameters_dict() (and so
mindspore.save_checkpoint) keeps one of them and the other was silently neither saved nor loaded."""

from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp

ms.set_device("CPU")


class _Sub(nn.Cell):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = Parameter(Tensor(np.full(2, value, np.float32)), name="w")


class _Twins(nn.Cell):
    """Two sub-cells without name prefixes: both Parameters are named 'w' (PyNative trains this fine)."""

    def __init__(self) -> None:
        super().__init__(auto_prefix=False)
        self.a = _Sub(1.0)
        self.b = _Sub(2.0)


def test_save_and_load_refuse_a_cell_with_two_parameters_of_one_name(tmp_path: Path) -> None:
    net = _Twins()
    assert len(net.parameters_dict()) == 1  # what was saved: one of the two
    for save in (lambda: dcp.save({"model": net}, checkpoint_id=tmp_path / "a"),
                 lambda: dcp.async_save({"model": net}, checkpoint_id=tmp_path / "b").result(),
                 lambda: hyper_parallel.save_checkpoint(net, tmp_path / "c"),
                 lambda: hyper_parallel.save_checkpoint({"net": net, "step": 1}, tmp_path / "d")):
        with pytest.raises(dcp.CheckpointValueError) as refused:
            save()
        message = str(refused.value)
        assert "two different Parameters named 'w'" in message and "'a.w' and 'b.w'" in message
    assert not any((tmp_path / name / "metadata.json").exists() for name in "abcd")
    dcp.save({"model": {"w": np.full(2, 5.0, np.float32)}}, checkpoint_id=tmp_path / "e")
    with pytest.raises(dcp.CheckpointValueError, match=r"the Cell at state_dict\['model'\] holds two"):
        dcp.load({"model": net}, checkpoint_id=tmp_path / "e")
    assert net.a.w.asnumpy()[0] == 1 and net.b.w.asnumpy()[0] == 2
    with pytest.raises(dcp.CheckpointValueError, match="two different Parameters named 'w'"):
        hyper_parallel.load_checkpoint(tmp_path / "e", net)


def test_one_parameter_reached_twice_in_a_cell_is_fine(tmp_path: Path) -> None:
    """A shared Parameter (tied weights) is one object: saved once, loaded."""
    net = nn.SequentialCell(nn.Dense(2, 2), nn.Dense(2, 2))
    net[1].weight = net[0].weight
    dcp.save({"model": net}, checkpoint_id=tmp_path)
    target = nn.SequentialCell(nn.Dense(2, 2), nn.Dense(2, 2))
    target[1].weight = target[0].weight
    dcp.load({"model": target}, checkpoint_id=tmp_path)
    np.testing.assert_array_equal(target[0].weight.asnumpy(), net[0].weight.asnumpy())
