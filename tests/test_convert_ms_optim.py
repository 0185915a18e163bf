"""``hp-ckpt convert``'s model-only default leaves out the state of every MindSpore optimizer, also where its
prefix (FTRL's ``linear.``, RMSProp's ``moment.``) is an ordinary layer name."""

from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn
from safetensors.numpy import load_file

import hyper_parallel
from hyper_parallel.cli import main

__all__: list[str] = []

ms.set_device("CPU")


class _Net(nn.Cell):
    """A layer named ``linear`` (FTRL's prefix) and one named ``moment`` (RMSProp's)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Dense(3, 4)
        self.moment = nn.Dense(4, 4, has_bias=False)
        self.head = nn.Dense(4, 2)

    def construct(self, x):
        return self.head(self.moment(self.linear(x)))


_OPTIMIZERS = {
    "RMSProp": lambda p: nn.RMSProp(p, centered=True),
    "Lamb": lambda p: nn.Lamb(p, learning_rate=0.1),
    "FTRL": nn.FTRL,
    "Adadelta": nn.Adadelta,
    "Rprop": nn.Rprop,
    "AdaMax": nn.AdaMax,
    "ASGD": nn.ASGD,
    "SGD": lambda p: nn.SGD(p, momentum=0.9),
    "Momentum": lambda p: nn.Momentum(p, 0.1, 0.9),
    "AdamWeightDecay": nn.AdamWeightDecay,
}


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_model_only_convert_writes_exactly_the_network_parameters(tmp_path: Path, capsys, name: str) -> None:
    """The optimizer's per-parameter state (mean_square.linear.weight, lamb_m.head.bias, linear.linear.weight...)
    was written as model weights; now exactly the network's Parameters come out, with their values."""
    ms.set_seed(3)
    net = _Net()
    opt = _OPTIMIZERS[name](net.trainable_params())
    train = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    own = {id(p) for p in net.get_parameters()}
    for position, param in enumerate(p for p in train.get_parameters() if id(p) not in own):
        param.set_data(ms.Tensor(np.full(param.shape, position + 2), param.dtype))  # never a weight's value
    hyper_parallel.save_checkpoint(train, tmp_path / "ckpt")
    code = main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--no-progress"])
    capsys.readouterr()
    assert code == 0
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    expected = {p.name: p.asnumpy() for p in net.get_parameters()}
    assert sorted(written) == sorted(expected) == [
        "head.bias", "head.weight", "linear.bias", "linear.weight", "moment.weight"]
    for key, value in expected.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "all"), "--all", "--no-progress"]) == 0
    assert len(load_file(str(tmp_path / "all" / "model.safetensors"))) > len(expected)
