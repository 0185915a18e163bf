"""Every per-parameter state of MindSpore's optimizers follows its parameter's layout (layout_for_state_key).

A state whose prefix was not known had no layout: under a strategy file its sliced Parameter was refused, or
(not marked sliced) saved as a whole tensor of the slice's shape."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from hyper_parallel import Layout
from hyper_parallel.core.strategy_file import layout_for_state_key

ms.set_device("CPU")

_OPTIMIZERS = {
    "Adam": lambda p: nn.Adam(p), "AdamWeightDecay": lambda p: nn.AdamWeightDecay(p), "Lamb": lambda p: nn.Lamb(p, 0.1),
    "RMSProp": lambda p: nn.RMSProp(p), "SGD": lambda p: nn.SGD(p, momentum=0.9),
    "Momentum": lambda p: nn.Momentum(p, 0.1, 0.9),
    "Adagrad": lambda p: nn.Adagrad(p), "Adadelta": lambda p: nn.Adadelta(p), "Rprop": lambda p: nn.Rprop(p),
    "FTRL": lambda p: nn.FTRL(p), "LARS": lambda p: nn.LARS(nn.Momentum(p, 0.1, 0.9)),
}


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_each_state_of_a_parameter_gets_its_layout(name: str) -> None:
    net = nn.Dense(4, 6)
    params = net.trainable_params()
    optimizer = _OPTIMIZERS[name](params)
    layouts = {p.name: Layout(device_matrix=(2,), tensor_map=(0,) + (-1,) * (p.ndim - 1)) for p in params}
    own = {p.name for p in params}
    shapes = {p.name: tuple(p.shape) for p in params}
    states = [(key, tuple(p.shape)) for key, p in optimizer.parameters_dict().items()
              if key not in own and p.ndim and tuple(p.shape) in shapes.values()]
    assert states, f"{name} holds no per-parameter state"
    for key, shape in states:
        layout = layout_for_state_key(layouts, key)
        assert layout is not None, f"{name}: state {key!r} has no layout"
        parameter = next(n for n in own if key.endswith("." + n))
        assert layout is layouts[parameter] and shapes[parameter] == shape
