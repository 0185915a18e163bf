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


class _Inner(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Dense(2, 2, weight_init="zeros", bias_init="zeros")


class _Wrapper(nn.Cell):
    """Parameters 'model.fc.weight' / 'model.fc.bias' and a head 'fc.weight' / 'fc.bias'."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()
        self.fc = nn.Dense(2, 2, weight_init="zeros", bias_init="zeros")


def test_a_key_matched_by_its_own_name_is_not_given_to_a_second_entry(tmp_path: Path) -> None:
    """'model.fc.weight' is the net's own name, and 'fc.weight' + the prefix 'model.' too: both entries were given
    that one key, only the head received it (one target per key), and the net's 'model.fc.weight', reported loaded
    (and returned as the head's Parameter), silently kept its initial values."""
    hyper_parallel.save_checkpoint({"model.fc.weight": np.full((2, 2), 5.0, np.float32),
                                    "model.fc.bias": np.full(2, 6.0, np.float32)}, tmp_path)
    net = _Wrapper()
    with pytest.raises(dcp.MissingKeyError) as refused:
        hyper_parallel.load_checkpoint(tmp_path, net)
    assert "'fc.weight', 'fc.bias' are not in the checkpoint" in str(refused.value)
    assert not net.model.fc.weight.asnumpy().any() and not net.fc.weight.asnumpy().any()  # nothing landed
    loaded = hyper_parallel.load_checkpoint(tmp_path, net, allow_partial_load=True)
    np.testing.assert_array_equal(net.model.fc.weight.asnumpy(), np.full((2, 2), 5.0, np.float32))
    np.testing.assert_array_equal(net.model.fc.bias.asnumpy(), np.full(2, 6.0, np.float32))
    assert not net.fc.weight.asnumpy().any() and not net.fc.bias.asnumpy().any()
    assert sorted(loaded) == ["model.fc.bias", "model.fc.weight"]
    assert loaded["model.fc.weight"] is net.model.fc.weight
    assert loaded.param_not_load == ["fc.weight", "fc.bias"]


def test_a_key_found_through_one_prefix_is_not_found_again_through_another(tmp_path: Path) -> None:
    """'m.a.w' is 'a.w' under 'm.' and 'w' under 'm.a.': the second entry would take the first one's key."""
    dcp.save({"m": {"a": {"w": np.full(2, 3.0, np.float32)}, "v": np.full(2, 4.0, np.float32)}},
             checkpoint_id=tmp_path)
    net = {"v": np.zeros(2, np.float32), "a.w": np.zeros(2, np.float32), "w": np.zeros(2, np.float32)}
    loaded = hyper_parallel.load_checkpoint(tmp_path, net, allow_partial_load=True)
    np.testing.assert_array_equal(net["a.w"], np.full(2, 3.0, np.float32))
    np.testing.assert_array_equal(net["v"], np.full(2, 4.0, np.float32))
    assert not net["w"].any() and loaded.param_not_load == ["w"]
