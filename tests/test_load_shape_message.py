"""A load into a network of another configuration names the key, both shapes and the fix; nothing is loaded."""

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp

ms.set_device("CPU")


def test_a_net_of_another_configuration_is_refused_naming_the_fix(tmp_path):
    hyper_parallel.save_checkpoint(ms.nn.Dense(2, 2), tmp_path / "c")
    wider = ms.nn.Dense(3, 2)
    before = {name: p.asnumpy().copy() for name, p in wider.parameters_dict().items()}
    with pytest.raises(dcp.ShapeMismatchError) as info:
        hyper_parallel.load_checkpoint(tmp_path / "c", wider)
    assert str(info.value) == (
        "key 'weight': checkpoint global shape [2, 2] differs from the target's global shape [2, 3]: the checkpoint "
        "is of a model of another configuration, or the key names another tensor; build the target with the saved "
        "shape, or leave the key out (load_checkpoint: filter_prefix= or choice_func=); nothing was loaded")
    for name, param in wider.parameters_dict().items():
        assert np.array_equal(param.asnumpy(), before[name]), name  # not even the bias, whose shape fits
    loaded = hyper_parallel.load_checkpoint(tmp_path / "c", wider, filter_prefix="weight", allow_partial_load=True)
    assert loaded.param_not_load == ["weight"]  # the fix named works
