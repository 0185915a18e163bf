"""hyper_parallel.load_checkpoint(path, net) without strict_load finds a network's names under one prefix the
checkpoint adds; two prefixes that both hold them (a model and its EMA copy) are refused, not picked by length."""

from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp

ms.set_device("CPU")


def _weights(value: float) -> dict[str, np.ndarray]:
    return {"weight": np.full((2, 3), value, np.float32), "bias": np.full(2, value, np.float32)}


def test_two_copies_under_prefixes_of_one_depth_are_refused(tmp_path: Path) -> None:
    """{'model': ..., 'ema': ...}: the network silently got the EMA weights ('ema.' is shorter than 'model.')."""
    dcp.save({"model": _weights(1.0), "ema": _weights(2.0)}, checkpoint_id=tmp_path)
    net = nn.Dense(3, 2)
    before = net.weight.asnumpy().copy()
    with pytest.raises(dcp.CheckpointValueError) as refused:
        hyper_parallel.load_checkpoint(tmp_path, net)
    message = str(refused.value)
    assert "'ema.weight'" in message and "'model.weight'" in message and "specify_prefix" in message
    np.testing.assert_array_equal(net.weight.asnumpy(), before)
    hyper_parallel.load_checkpoint(tmp_path, net, specify_prefix="model.")
    assert net.weight.asnumpy()[0, 0] == 1.0 and net.bias.asnumpy()[0] == 1.0
    hyper_parallel.load_checkpoint(tmp_path, net, filter_prefix="model.")
    assert net.weight.asnumpy()[0, 0] == 2.0


def test_the_network_prefix_wins_over_a_deeper_optimizer_one(tmp_path: Path) -> None:
    """The moments of an optimizer ('optimizer.moment1.weight') end with the network's names too: one dot more."""
    dcp.save({"model": _weights(1.0), "optimizer": {"moment1": _weights(5.0), "moment2": _weights(6.0)}},
             checkpoint_id=tmp_path)
    net = nn.Dense(3, 2)
    hyper_parallel.load_checkpoint(tmp_path, net)
    assert net.weight.asnumpy()[0, 0] == 1.0 and net.bias.asnumpy()[0] == 1.0
