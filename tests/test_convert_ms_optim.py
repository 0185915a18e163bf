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
from hyper_parallel.cli import KeySelection, main
from hyper_parallel.cli._key_select import optimizer_groups
from hyper_parallel.core import distributed_checkpoint as dcp

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


_GROUPED = {
    "Adam": nn.Adam,
    "Momentum": lambda p: nn.Momentum(p, 0.1, 0.9),
    "RMSProp": lambda p: nn.RMSProp(p, centered=True),
    "FTRL": nn.FTRL,
    "ASGD": nn.ASGD,
    "Lamb": lambda p: nn.Lamb(p, learning_rate=0.1),
}


@pytest.mark.parametrize("name", sorted(_GROUPED))
def test_model_only_convert_of_groups_writes_exactly_the_network_parameters(tmp_path: Path, capsys, name: str) -> None:
    """``dcp.save({"net": net, "opt": opt})`` (any group names): the optimizer's group (opt.moment1.linear.weight,
    opt.moment.linear.weight, opt.beta1_power...) was written as model weights beside net.linear.weight; now the
    network's Parameters alone come out, under their own names, with their values."""
    for net_group, opt_group in (("net", "opt"), ("network", "optimizer"), ("a", "b")):
        ms.set_seed(3)
        net = _Net()
        opt = _GROUPED[name](net.trainable_params())
        for position, param in enumerate(opt.get_parameters()):
            if param.name not in {p.name for p in net.get_parameters()}:
                param.set_data(ms.Tensor(np.full(param.shape, position + 2), param.dtype))  # never a weight's value
        ckpt = tmp_path / f"{net_group}-ckpt"
        dcp.save({net_group: net, opt_group: opt, "step": 7}, checkpoint_id=ckpt)
        stored = set(dcp.read_metadata(ckpt).state_dict_metadata)
        assert f"{net_group}.linear.weight" in stored and any(k.startswith(f"{opt_group}.") for k in stored)
        assert main(["convert", str(ckpt), str(tmp_path / f"{net_group}-out"), "--no-progress"]) == 0
        capsys.readouterr()
        written = load_file(str(tmp_path / f"{net_group}-out" / "model.safetensors"))
        expected = {p.name: p.asnumpy() for p in net.get_parameters()}
        assert sorted(written) == sorted(expected) == [
            "head.bias", "head.weight", "linear.bias", "linear.weight", "moment.weight"], net_group
        for key, value in expected.items():
            np.testing.assert_array_equal(written[key], value, err_msg=key)


def test_groups_are_told_only_by_an_optimizer_state_group() -> None:
    """A group is the optimizer's only when it holds bookkeeping and state alone; the network's group is stripped
    only when the state shadows exactly one group."""
    plain = {"a.linear.weight": (4, 3), "a.linear.bias": (4,), "b.weight": (4, 3), "b.bias": (4,)}
    assert KeySelection().names(plain) == {k: k for k in plain}  # a layer named linear, no optimizer
    two = {"net.w": (2,), "ema.w": (2,), "opt.moment1.w": (2,), "opt.global_step": (1,), "opt.learning_rate": ()}
    assert KeySelection().names(two) == {"ema.w": "ema.w", "net.w": "net.w"}  # which is the network: not told
    mixed = {"net.w": (2,), "opt.moments.w": (2,), "opt.global_step": (1,), "opt.conv.w": (3,)}
    assert KeySelection().names(mixed) == {k: k for k in mixed}  # opt.conv.w is no optimizer state
    assert optimizer_groups({"net.w": (2,), "opt.moments.w": (2,), "opt.global_step": (1,)}) == (
        frozenset({"opt"}), "net")
    assert KeySelection(everything=True).names(two) == {k: k for k in two}
    ungrouped = {"w": (2,), "opt.moments.w": (2,), "opt.global_step": (1,)}
    assert optimizer_groups(ungrouped) == (frozenset({"opt"}), None)  # the state of ungrouped keys: no group to strip
    assert KeySelection().names(ungrouped) == {"w": "w"}
    assert KeySelection().names(["net.w", "opt.moments.w", "opt.global_step", "step"]) == {  # keys alone
        "net.w": "net.w", "step": "step"}
